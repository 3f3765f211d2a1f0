"""The one place that knows the machine: GPUs (NVML, TensorFlow, nvidia-smi), host memory, CPU, processes
(/proc), precision.

Everything above this package asks it instead of probing for itself: the trainer and the predictor
(the device to run on, the precision, a case's peak memory), the GPU-fit search (which GPU, how much
memory, a trial's RSS), the hyperparameter search and `tfmis.launch` (which GPUs to share out, which
cores), the resource monitor (NVML's GPUs, a process tree's CPU time and RSS, how much RAM), the
conversion and the planner (how many workers, what this machine runs well). Every default worker and
thread count comes from `usable_cpu_count` (affinity mask and cgroup CPU quota; `os.cpu_count()` sees
neither). `lint-imports` holds the rest of tfmis to this: no other module imports pynvml, reads /proc
or /sys, or counts CPUs (pyproject.toml's `machine-nvml` and `machine-files` contracts).

Callers import from `tfmis.hardware`, which re-exports every public name of its modules, one concept each
(each imports only the ones listed before it):

- `cpu`: the cores this process may use (affinity mask, cgroup CPU quota), worker counts, the CPU's name and flags;
- `memory`: memory sizes in MB, the host's RAM and a cgroup's memory limit;
- `processes`: what a process holds and may use (/proc): RSS and its peak, allowed cores, a process tree's
  usage, open files;
- `gpu`: TensorFlow's GPU devices, the driver, nvidia-smi, the GPU models a plan can be made for by name;
- `nvml`: NVML (the only module that imports pynvml): the GPUs this process may use, a GPU's memory, `NvmlGpus`;
- `onednn`: the oneDNN decision, made before TensorFlow is imported;
- `workers`: how many case workers fit in the usable CPUs and memory (`size_case_workers`);
- `threads`: TensorFlow's and tf.data's thread counts from the usable CPUs, set before TensorFlow is imported;
- `machine`: `Hardware` and `detect_hardware` (the machine as a whole, or one to plan for), a plan's mismatch;
- `precision`: the precision this machine trains in (`recommended_precision`, `resolve_precision`);
- `advice`: the settings this machine runs badly (`hardware_warnings`).

Nothing here initialises a GPU: TensorFlow is asked only for its *physical* devices
(`tf.config.list_physical_devices`, `get_device_details`), which allocates no device memory, and is
imported only inside the functions that need it, so a process that must never touch a GPU (the
GPU-fit search's parent, the HPO chief) can import this package. The one exception is
`accelerator_device`, which lists the *logical* devices of a process that is about to compute.

On a CPU, `auto` precision is float32 (`recommended_precision` says why), and `hardware_warnings` names the
settings a CPU runs badly: mixed_float16 (CPUs have no float16 arithmetic: every op is emulated) and
`jit_compile: true` (XLA on a CPU is slower than plain TensorFlow). The measurements behind these choices are in
docs/benchmarks.md ("Per CPU kind"; "First epoch, precision and other costs").

Example:
```python
from tfmis.hardware import detect_hardware, hardware_warnings, resolve_precision

hardware = detect_hardware()
print(hardware.describe())  # "CPU only: 2 cores of AMD EPYC (avx, avx2, fma, ...), 23.5 GB RAM; oneDNN on (...)"
keras.mixed_precision.set_global_policy(resolve_precision("auto"))
for line in hardware_warnings(config.training, hardware):
    print("warning:", line)
```
"""

from tfmis.hardware.advice import hardware_warnings
from tfmis.hardware.cpu import (
    BF16_CPU_FLAGS,
    CGROUP_ROOT,
    ISA_FLAGS,
    MAX_CASE_WORKERS,
    case_workers,
    cgroup_cpu_quota,
    cpu_flags,
    cpu_isa,
    cpu_name,
    runnable_tasks,
    usable_cpu_count,
    usable_cpus,
    worker_cpus,
)
from tfmis.hardware.gpu import (
    CPU,
    GPU_MODELS,
    GPU_RESERVED_MB,
    accelerator_device,
    gpu_model,
    model_parallel_devices,
    nvidia_driver_present,
    nvidia_smi_available,
    physical_gpus,
    visible_gpu_ids,
)
from tfmis.hardware.machine import PLANNED_MEMORY_SLACK, Hardware, detect_hardware, planned_hardware_mismatch
from tfmis.hardware.memory import MB, cgroup_memory, host_memory, parse_memory_mb
from tfmis.hardware.nvml import NvmlGpus, NvmlUnavailable, accelerators, nvml_device, visible_nvml_handles
from tfmis.hardware.onednn import (
    ONEDNN_ENV,
    ONEDNN_MEASURED,
    ONEDNN_SETTINGS,
    OneDNNChoice,
    apply_onednn,
    current_onednn,
    onednn_choice,
    onednn_running,
)
from tfmis.hardware.precision import PRECISIONS, recommended_precision, resolve_precision
from tfmis.hardware.processes import (
    allowed_cpus,
    open_files,
    parse_cpus,
    peak_rss_mb,
    prefer_oom_kill,
    process_status_mb,
    process_tree_usage,
    reset_peak_rss,
)
from tfmis.hardware.threads import THREAD_ENVS, apply_cpu_threads, data_threads, set_thread_env, threads_set_by_user
from tfmis.hardware.workers import WorkerSizing, size_case_workers

__all__ = [
    # cpu
    "BF16_CPU_FLAGS",
    "CGROUP_ROOT",
    "ISA_FLAGS",
    "MAX_CASE_WORKERS",
    "case_workers",
    "cgroup_cpu_quota",
    "cpu_flags",
    "cpu_isa",
    "cpu_name",
    "runnable_tasks",
    "usable_cpu_count",
    "usable_cpus",
    "worker_cpus",
    # memory
    "MB",
    "cgroup_memory",
    "host_memory",
    "parse_memory_mb",
    # processes
    "allowed_cpus",
    "open_files",
    "parse_cpus",
    "peak_rss_mb",
    "prefer_oom_kill",
    "process_status_mb",
    "process_tree_usage",
    "reset_peak_rss",
    # gpu
    "CPU",
    "GPU_MODELS",
    "GPU_RESERVED_MB",
    "accelerator_device",
    "gpu_model",
    "model_parallel_devices",
    "nvidia_driver_present",
    "nvidia_smi_available",
    "physical_gpus",
    "visible_gpu_ids",
    # nvml
    "NvmlGpus",
    "NvmlUnavailable",
    "accelerators",
    "nvml_device",
    "visible_nvml_handles",
    # onednn
    "ONEDNN_ENV",
    "ONEDNN_MEASURED",
    "ONEDNN_SETTINGS",
    "OneDNNChoice",
    "apply_onednn",
    "current_onednn",
    "onednn_choice",
    "onednn_running",
    # workers
    "WorkerSizing",
    "size_case_workers",
    # threads
    "THREAD_ENVS",
    "apply_cpu_threads",
    "data_threads",
    "set_thread_env",
    "threads_set_by_user",
    # machine
    "PLANNED_MEMORY_SLACK",
    "Hardware",
    "detect_hardware",
    "planned_hardware_mismatch",
    # precision
    "PRECISIONS",
    "recommended_precision",
    "resolve_precision",
    # advice
    "hardware_warnings",
]
