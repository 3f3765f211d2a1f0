"""Who am I in a multi-process launch: rank, size and peers from TF_CONFIG, SLURM, MPI or horovodrun.

Nothing here touches TensorFlow's devices, so it can run before a backend is chosen. Each launcher
leaves its own environment variables; `detect_launch()` reads them in this order:

- `horovodrun` / Horovod under Gloo: `HOROVOD_RANK`, `HOROVOD_SIZE`, `HOROVOD_LOCAL_RANK`;
- `TF_CONFIG` (written by hand, by `python -m tfmis.launch`, or by a cluster manager);
- SLURM (`srun`): `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_STEP_NODELIST`;
- MPI (`mpirun` / `mpiexec`): Open MPI's `OMPI_COMM_WORLD_*`, MPICH / Intel MPI's `PMI_*`, PMIx's
  `PMIX_RANK`. MPI says nothing about the peers' hosts, so `mpi_tf_config` has every rank write its
  host and port into a shared folder and read the others' (a file rendezvous).

Example:
```python
launch = detect_launch()          # Launch(kind='mpi', rank=1, size=4, local_rank=1, job_id='...')
if launch.kind == "mpi":
    os.environ["TF_CONFIG"] = json.dumps(mpi_tf_config(launch, "runs/x/.rendezvous", port=23456))
```
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import socket
import time
from pathlib import Path

from tfmis.errors import UsageError
from tfmis.utils.io import atomic_write_json


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process was started: `kind` is single, horovod, tf_config, slurm or mpi; `local_rank` of
    `local_size` processes of the launch on this machine (what shares its cores and GPUs out)."""

    kind: str
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    job_id: str = ""
    local_size: int = 1


def _int(env, *names):
    for name in names:
        if env.get(name, "").strip().lstrip("-").isdigit():
            return int(env[name])
    return None


def _leading_int(text: str) -> int | None:
    """SLURM's tasks per node, e.g. "2(x3),1": the first count (this node's when the nodes are alike)."""
    digits = ""
    for ch in text:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else None


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def detect_launch(env=None) -> Launch:
    """The launch this process belongs to, from its environment (see the module docstring)."""
    env = os.environ if env is None else env
    if _int(env, "HOROVOD_RANK") is not None:
        return Launch(
            "horovod",
            _int(env, "HOROVOD_RANK"),
            _int(env, "HOROVOD_SIZE") or 1,
            _int(env, "HOROVOD_LOCAL_RANK") or 0,
            local_size=_int(env, "HOROVOD_LOCAL_SIZE") or 1,
        )
    if env.get("TF_CONFIG"):
        try:
            tf_config = json.loads(env["TF_CONFIG"])
            cluster, task = tf_config.get("cluster", {}), tf_config.get("task", {})
        except (ValueError, AttributeError) as e:
            raise UsageError(
                f"TF_CONFIG is not valid JSON with 'cluster' and 'task' ({e}): {env['TF_CONFIG']!r}"
            ) from None
        size = len(cluster.get("chief", [])) + len(cluster.get("worker", []))
        index = int(task.get("index", 0))
        rank = index if task.get("type") == "chief" else index + len(cluster.get("chief", []))
        addresses = [a for role in ("chief", "worker") for a in cluster.get(role, [])]
        job = ",".join(addresses)  # the ports differ from one launch to the next
        if addresses and all(_is_loopback(a.rsplit(":", 1)[0]) for a in addresses):  # tfmis.launch: one machine
            return Launch("tf_config", rank, max(size, 1), rank, job, max(size, 1))
        return Launch("tf_config", rank, max(size, 1), 0, job)
    slurm_size = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if slurm_size and slurm_size > 1 and _int(env, "SLURM_PROCID") is not None:
        return Launch(
            "slurm",
            _int(env, "SLURM_PROCID"),
            slurm_size,
            _int(env, "SLURM_LOCALID") or 0,
            f"{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}",
            _leading_int(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "") or 1,
        )
    mpi_size = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_WORLDSIZE")
    if mpi_size and mpi_size > 1:
        rank = _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MPI_WORLDRANK")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "PALS_LOCAL_RANKID")
        job = next(
            (env[k] for k in ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "PMI_JOBID", "SLURM_JOB_ID") if env.get(k)),
            "mpi",
        )
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", "PALS_LOCAL_SIZE")
        return Launch("mpi", rank or 0, mpi_size, local or 0, job, local_size or 1)
    return Launch("single")


def bound_by_launcher(env=None) -> bool:
    """Whether the launcher pinned this process to its own cores: Open MPI's default binding (`orte_bound_at_launch`
    unless `--bind-to none`), SLURM's `--cpu-bind` (any but none). Such a rank keeps the cores it has; an unbound one
    takes its local rank's share of the cores it sees."""
    env = os.environ if env is None else env
    if env.get("OMPI_MCA_orte_bound_at_launch") == "1" and env.get("OMPI_MCA_hwloc_base_binding_policy") != "none":
        return True
    bind = env.get("SLURM_CPU_BIND_TYPE", "")
    return bool(bind) and not bind.startswith("none")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """N distinct ports that are free on `host` right now (held open together so they differ)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _free_port(host: str, preferred: int) -> int:
    """`preferred` if it can be bound on `host`, else a free port the system picks."""
    for port in (preferred, 0):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host if host != "localhost" else "127.0.0.1", port))
                return s.getsockname()[1]
            except OSError:
                continue
    raise OSError(f"no free port on {host}")


def mpi_tf_config(launch: Launch, rendezvous_dir: str | Path, port: int = 23456, timeout_s: float = 300.0) -> dict:
    """The TF_CONFIG of an MPI-launched worker: every rank publishes `host:port`, then reads all of them.

    Args:
        launch: from `detect_launch()` (kind `mpi`).
        rendezvous_dir: a folder every rank can read and write (on several nodes: a shared file system).
        port: the preferred port (plus the local rank); a busy one is replaced by a free one.
        timeout_s: how long to wait for the other ranks before giving up with an error naming the missing ones.
    """
    folder = rendezvous_folder(launch, rendezvous_dir)
    folder.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    address = f"{host}:{_free_port(host, port + launch.local_rank)}"
    atomic_write_json(folder / f"rank{launch.rank}.json", {"address": address, "time": time.time()})
    deadline = time.monotonic() + timeout_s
    while True:
        found = {r: folder / f"rank{r}.json" for r in range(launch.size)}
        missing = [r for r, path in found.items() if not path.is_file()]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"MPI rendezvous in {folder}: ranks {missing} did not publish their address within "
                f"{timeout_s:.0f} s (is runtime.rendezvous_dir on a file system all nodes share?)"
            )
        time.sleep(0.2)
    workers = [json.loads(found[r].read_text())["address"] for r in range(launch.size)]
    return {"cluster": {"worker": workers}, "task": {"type": "worker", "index": launch.rank}}


def rendezvous_folder(launch: Launch, rendezvous_dir: str | Path) -> Path:
    """Where `mpi_tf_config` exchanges this job's addresses; the chief removes it once the cluster is up,
    so that a later job with the same id does not read stale addresses."""
    return Path(rendezvous_dir) / ("job-" + (launch.job_id or "mpi").replace("/", "_"))


def is_loopback(address: str) -> bool:
    """Whether `host:port` (or `host`) names this machine's loopback interface (127.0.0.0/8, ::1, or a name that
    resolves there, such as Debian's 127.0.1.1 for the host name); an unresolvable name is not."""
    if address.startswith("["):  # [v6]:port
        host = address[1 : address.index("]")]
    else:
        host = address.split(":")[0] if address.count(":") == 1 else address  # host:port, host or a bare v6
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False


def _listening(address: str, timeout_s: float = 1.0) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except OSError:  # refused: nobody listens there any more (or the host is gone)
        return False


def wait_until_closed(addresses: list[str], timeout_s: float = 60.0, poll_s: float = 0.2) -> list[str]:
    """Waits until nothing accepts connections on any of `addresses` (`host:port`: the other workers' servers,
    which close only when their processes end); returns those still open after `timeout_s` (empty: all closed)."""
    deadline = time.monotonic() + timeout_s
    open_ = list(addresses)
    while open_:
        open_ = [a for a in open_ if _listening(a)]
        if not open_ or time.monotonic() > deadline:
            break
        time.sleep(poll_s)
    return open_
