"""Start N local worker processes with the right TF_CONFIG: the `torchrun` of tfmis (`python -m tfmis.launch`).

`launch(["python", "-m", "tfmis.train", "--config", "X.yaml"], nproc=2)` runs the command N times,
worker k with `TF_CONFIG = {"cluster": {"worker": [127.0.0.1:p0, ...]}, "task": {"type": "worker",
"index": k}}` on free ports, addressed through loopback, so that `runtime.distribution: auto` (or
`multiworker`) trains one model with MultiWorkerMirroredStrategy over them. The workers talk over
loopback, but TensorFlow's gRPC server listens on each port on all network interfaces (it cannot
bind one address), without authentication: `launch` says so, with the ports, when it starts them.
Each worker gets its share of the CPU threads (`TF_NUM_INTRAOP_THREADS`, unless set) and, with GPUs,
its own GPU (`CUDA_VISIBLE_DEVICES`) unless `--gpus-per-worker 0`. Worker 0 (the chief) prints the
log; the others' output gets a `[worker k]` prefix. When a worker fails, the others get
`--grace-seconds` to notice and end by themselves (they report the lost worker), then they are
stopped; the exit status is the first failure's.

For several machines, use SLURM (`srun`), `mpirun` or a TF_CONFIG per machine instead (README).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from tfmis.engine.cluster import free_ports
from tfmis.errors import UsageError
from tfmis.hardware import set_thread_env, threads_set_by_user, usable_cpu_count, visible_gpu_ids


def worker_environments(
    nproc: int, host: str = "127.0.0.1", base_env=None, gpus_per_worker: int | None = None, cpu_count: int | None = None
) -> list[dict]:
    """The environment of each of `nproc` local workers (TF_CONFIG, threads, GPUs)."""
    base_env = dict(os.environ if base_env is None else base_env)
    workers = [f"{host}:{port}" for port in free_ports(nproc, host)]
    cpus = cpu_count or usable_cpu_count()
    user_threads = threads_set_by_user(base_env)
    gpus = visible_gpu_ids(base_env)
    envs = []
    for k in range(nproc):
        env = dict(base_env)
        env["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": k}})
        if not user_threads:  # the user's counts stand; tfmis's own (from this process's CPUs) are re-shared
            set_thread_env(env, max(1, cpus // nproc), max(1, min(2, cpus // nproc)))
        per = len(gpus) // nproc if gpus_per_worker is None else gpus_per_worker
        if gpus and per > 0:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[k * per : (k + 1) * per])
        envs.append(env)
    return envs


def exposure_note(workers: list[str]) -> str:
    """The line `launch` prints first: which ports its workers' TensorFlow gRPC servers use, and where they listen."""
    return (
        f"tfmis.launch: {len(workers)} workers: TensorFlow gRPC servers on {', '.join(workers)} (the addresses the "
        "workers use to reach each other). TensorFlow listens on these ports on ALL network interfaces, without "
        "authentication (it has no option to bind loopback only); while training runs, keep them unreachable from "
        "other machines (a firewall) if this machine is on a network you do not trust "
        "(docs/scale-out.md#network-exposure)"
    )


def _prefix_output(stream, prefix: str, sink) -> None:
    for line in iter(stream.readline, ""):
        sink.write(prefix + line)
        sink.flush()


def launch(command: list[str], nproc: int, grace_seconds: float = 60.0, gpus_per_worker: int | None = None) -> int:
    """Runs `command` as `nproc` workers of one cluster; returns 0 if all succeed, else the first failure's code."""
    if nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {nproc}")
    procs = []
    threads = []
    environments = worker_environments(nproc, gpus_per_worker=gpus_per_worker)
    if nproc > 1:
        print(exposure_note(json.loads(environments[0]["TF_CONFIG"])["cluster"]["worker"]), file=sys.stderr)
    for k, env in enumerate(environments):
        quiet = k > 0
        proc = subprocess.Popen(
            command,
            env=env,
            start_new_session=True,
            text=True,
            stdout=subprocess.PIPE if quiet else None,
            stderr=subprocess.STDOUT if quiet else None,
        )
        if quiet:
            thread = threading.Thread(
                target=_prefix_output, args=(proc.stdout, f"[worker {k}] ", sys.stderr), daemon=True
            )
            thread.start()
            threads.append(thread)
        procs.append(proc)

    def stop(signum, frame):
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        first_failure, deadline = None, None
        while any(p.poll() is None for p in procs):
            for k, p in enumerate(procs):
                code = p.poll()
                if code not in (None, 0) and first_failure is None:
                    first_failure = (k, code)
                    deadline = time.monotonic() + grace_seconds
                    print(
                        f"tfmis.launch: worker {k} exited with status {code}; giving the others {grace_seconds:.0f} s "
                        "to stop",
                        file=sys.stderr,
                    )
            if deadline is not None and time.monotonic() > deadline:
                for k, p in enumerate(procs):
                    if p.poll() is None:
                        print(f"tfmis.launch: stopping worker {k}", file=sys.stderr)
                        os.killpg(p.pid, signal.SIGTERM)
                time.sleep(5)
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                deadline = None
            time.sleep(0.2)
        for thread in threads:
            thread.join(timeout=5)
        if first_failure is None:
            failed = [(k, p.returncode) for k, p in enumerate(procs) if p.returncode != 0]
            first_failure = failed[0] if failed else None
        return 0 if first_failure is None else (first_failure[1] if first_failure[1] > 0 else 1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
