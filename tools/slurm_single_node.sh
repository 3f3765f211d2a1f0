#!/usr/bin/env bash
# A real one-node SLURM on this machine, for the srun test (tests/test_mpirun.py) and for trying `srun` by hand:
# Debian's slurm-wlm and munge, a slurm.conf with this host as controller and only node (its CPUs and memory from
# `slurmd -C`), then munged, slurmctld and slurmd started. Needs root and apt-get. About 25 s (apt-get install 20 s).
#   bash tools/slurm_single_node.sh && srun -n 2 hostname
set -euo pipefail
if [ "$(id -u)" != 0 ]; then echo "tools/slurm_single_node.sh: needs root (apt-get, daemons)"; exit 1; fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null; }
fi
if sinfo -h -o %T 2>/dev/null | grep -q .; then echo "SLURM already answers: $(sinfo -h -o '%P %T %N' | head -1)"; exit 0; fi
host=$(hostname -s)
node=$(slurmd -C | head -1 | sed 's/ RealMemory=[0-9]*//')
memory=$(( $(slurmd -C | head -1 | sed 's/.*RealMemory=\([0-9]*\).*/\1/') * 9 / 10 ))
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=tfmis
SlurmctldHost=$host
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmdSpoolDir=/var/spool/slurmd
StateSaveLocation=/var/spool/slurmctld
SlurmUser=root
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
$node RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
[ -s /etc/munge/munge.key ] || { dd if=/dev/urandom of=/etc/munge/munge.key bs=1k count=1 2>/dev/null; chmod 400 /etc/munge/munge.key; }
chown munge:munge /run/munge /etc/munge/munge.key 2>/dev/null || true
pgrep -x munged >/dev/null || munged --force
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 30); do
  if sinfo -h -o %T 2>/dev/null | grep -qE "idle|mixed|allocated"; then
    echo "SLURM up: $(sinfo -h -o '%P %T %N %c CPUs' | head -1)"; exit 0
  fi
  sleep 1
done
echo "SLURM did not come up: see /var/log/slurm/slurmctld.log and slurmd.log"; exit 1
