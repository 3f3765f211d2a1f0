"""The machine as a whole: `Hardware` (its GPUs, CPU, RAM and oneDNN choice; or a machine to plan for that is
not this one, `Hardware.target`), `detect_hardware` (this machine, no GPU initialised) and how this machine falls
short of the one a plan was made for (`planned_hardware_mismatch`)."""

from __future__ import annotations

import dataclasses
import functools

from tfmis.hardware.cpu import BF16_CPU_FLAGS, cpu_flags, cpu_isa, usable_cpu_count
from tfmis.hardware.gpu import GPU_MODELS, gpu_model, physical_gpus
from tfmis.hardware.memory import format_gb, host_memory
from tfmis.hardware.nvml import accelerators
from tfmis.hardware.onednn import current_onednn


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The devices a training run on this machine would use.

    Args:
        gpus: one dict per GPU TensorFlow sees: name, compute_capability (major, minor) or None,
            memory_mb (NVML's total, or None).
        cpu_name: the CPU model name.
        cpu_count: logical cores this process may use (`usable_cpu_count`: affinity and cgroup CPU quota).
        cpu_flags: the bfloat16-related instruction-set flags of the CPU (amx_bf16, avx512_bf16).
        host_memory_mb, host_available_mb: total and available RAM (a container's limit applied).
        cpu_isa: the CPU's instruction-set flags that decide TensorFlow's kernels (`cpu_isa`).
        onednn: this process's oneDNN choice with its reason (`OneDNNChoice.describe`), or "".
        target_given: "" for this machine as detected; for a machine to plan for that is not this one
            (`Hardware.target`), how it was given (e.g. "--gpus/--gpu-memory").
        planned_on: with `target_given`, the machine that made the plan, in a few words (`short`).
    """

    gpus: tuple[dict, ...] = ()
    cpu_name: str = "cpu"
    cpu_count: int = 1
    cpu_flags: tuple[str, ...] = ()
    host_memory_mb: float = 0.0
    host_available_mb: float = 0.0
    cpu_isa: tuple[str, ...] = ()
    onednn: str = ""
    target_given: str = ""
    planned_on: str = ""

    @classmethod
    def target(
        cls,
        *,
        gpus: int,
        gpu_memory_mb: float | None = None,
        name: str | None = None,
        cpus: int | None = None,
        host_memory_mb: float | None = None,
        here: Hardware | None = None,
        given: str = "a target description",
    ) -> Hardware:
        """A machine to plan for that is not this one (nnU-Net's `-gpu_memory_target`, for the whole machine).

        Args:
            gpus: how many GPUs (0: a CPU-only machine).
            gpu_memory_mb: each GPU's memory (default: the named model's, `GPU_MODELS`).
            name: a model of `GPU_MODELS` (its memory and compute capability, which decides the precision), or
                None: a GPU of `gpu_memory_mb` and unknown compute capability (planned in float32).
            cpus, host_memory_mb: the target's cores and RAM (default: this machine's; RAM given is taken as
                available).
            here: the machine that plans (default `detect_hardware()`): its CPU and RAM unless given.
            given: how the target was given, for the plan's header (e.g. "--gpus/--gpu-memory").

        Raises:
            ValueError: an unknown `name`, GPUs without memory, or a count or size below 1.

        Example:
            >>> here = Hardware(cpu_name="AMD EPYC", cpu_count=2, host_memory_mb=24000, host_available_mb=20000)
            >>> h100 = Hardware.target(gpus=8, name="H100-80GB", here=here, given="--gpus/--gpu")
            >>> h100.gpu_memory_mb, h100.compute_capability, h100.cpu_count
            (81920, (9, 0), 2)
            >>> h100.planned_for()
            {'gpus': 8, 'gpu_memory_mb': 81920, 'name': 'H100-80GB', 'source': 'target'}
        """
        here = here or detect_hardware()
        model = None
        if name is not None:
            known = gpu_model(name)
            if known is None:
                raise ValueError(f"unknown GPU {name!r}: one of {', '.join(GPU_MODELS)}")
            name, model = known
        if gpus < 0:
            raise ValueError(f"a GPU count is >= 0, got {gpus}")
        memory = gpu_memory_mb if gpu_memory_mb is not None else (model or {}).get("memory_mb")
        if gpus and not memory:
            raise ValueError("GPUs to plan for need their memory (or a named model)")
        gpu = {
            "name": name,  # None: a GPU given by its memory alone
            "compute_capability": model["compute_capability"] if model else None,
            "memory_mb": memory,
        }
        if cpus is not None and cpus < 1:
            raise ValueError(f"a CPU count is >= 1, got {cpus}")
        if host_memory_mb is not None and host_memory_mb <= 0:
            raise ValueError(f"host memory is > 0 MB, got {host_memory_mb}")
        cpu = {} if cpus is None else {"cpu_name": "cpu", "cpu_count": cpus, "cpu_flags": (), "cpu_isa": ()}
        ram = {} if host_memory_mb is None else {"host_memory_mb": host_memory_mb, "host_available_mb": host_memory_mb}
        return dataclasses.replace(here, gpus=(gpu,) * gpus, **cpu, **ram, target_given=given, planned_on=here.short())

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        """The lowest compute capability among the GPUs (every replica must run the plan)."""
        caps = [tuple(g["compute_capability"]) for g in self.gpus if g.get("compute_capability")]
        return min(caps) if caps else None

    @property
    def gpu_memory_mb(self) -> float | None:
        """The smallest GPU's memory (one replica's plan must fit on every GPU)."""
        sizes = [g["memory_mb"] for g in self.gpus if g.get("memory_mb")]
        return min(sizes) if sizes else None

    @property
    def cpu_bf16(self) -> bool:
        return any(flag in self.cpu_flags for flag in BF16_CPU_FLAGS)

    def short(self) -> str:
        """A few words: "2-core AMD EPYC, no GPU", "64-core AMD EPYC, 8 x NVIDIA H100 80GB HBM3 (80 GB)"."""
        cpu = f"{self.cpu_count}-core {self.cpu_name}" if self.cpu_name != "cpu" else f"{self.cpu_count} cores"
        return f"{cpu}, {self._gpus_text() if self.gpus else 'no GPU'}"

    def _gpus_text(self) -> str:
        memory = f" ({format_gb(self.gpu_memory_mb)} GB)" if self.gpu_memory_mb else ""
        return f"{len(self.gpus)} x {self.gpus[0]['name'] or 'GPU'}{memory}"

    def planned_for(self) -> dict:
        """What a plan made for this hardware records (`planning.planned_for`, the plan summary's `planned_for`):
        {"gpus", "gpu_memory_mb" (the smallest GPU's, whole MB, or None), "name" (the first GPU's, or None),
        "source": "detected" (this machine) | "target" (`Hardware.target`)}."""
        return {
            "gpus": len(self.gpus),
            "gpu_memory_mb": round(self.gpu_memory_mb) if self.gpu_memory_mb else None,
            "name": self.gpus[0]["name"] if self.gpus else None,
            "source": "target" if self.target_given else "detected",
        }

    def planned_for_text(self) -> str:
        """The plan header's "Planned for:" line: "8 x H100-80GB (80 GB) (target given with --gpus/--gpu-memory;
        this machine: 2-core AMD EPYC, no GPU)", or "this machine, 2-core AMD EPYC, no GPU"."""
        if not self.target_given:
            return f"this machine, {self.short()}"
        what = self._gpus_text() if self.gpus else f"CPU only, {self.cpu_count} cores"
        return f"{what} (target given with {self.target_given}; this machine: {self.planned_on})"

    def describe(self) -> str:
        """One line: the GPUs (or "CPU only"), the usable cores with the CPU's model and instruction sets, the RAM,
        and the oneDNN choice with its reason."""
        flags = ", ".join(self.cpu_isa or self.cpu_flags)
        cpu = f"{self.cpu_count} cores" + (f" of {self.cpu_name}" if self.cpu_name != "cpu" else "")
        cpu += (f" ({flags})" if flags else "") + f", {self.host_memory_mb / 1024:.1f} GB RAM"
        if self.onednn:
            cpu += f"; {self.onednn}"
        if not self.gpus:
            return f"CPU only: {cpu}"
        name = self.gpus[0]["name"] or "GPU"
        cc = self.compute_capability
        memory = f", {self.gpu_memory_mb / 1024:.0f} GB" if self.gpu_memory_mb else ""
        return (
            f"{len(self.gpus)} x {name} (compute capability {cc[0]}.{cc[1]}{memory})"
            if cc
            else f"{len(self.gpus)} x {name}{memory}"
        ) + f"; host: {cpu}"


@functools.lru_cache(maxsize=1)
def detect_hardware() -> Hardware:
    """The `Hardware` of this machine, without initialising any GPU (cached for the process)."""
    import tensorflow as tf

    gpus = []
    physical = physical_gpus()
    nvml = accelerators() if physical else []
    for i, device in enumerate(physical):
        try:
            details = tf.config.experimental.get_device_details(device)
        except Exception:  # noqa: BLE001 - details are optional (e.g. non-CUDA builds)
            details = {}
        cc = details.get("compute_capability")
        gpus.append(
            {
                "name": details.get("device_name") or (nvml[i]["name"] if i < len(nvml) else device.name),
                "compute_capability": tuple(int(c) for c in cc) if cc else None,
                "memory_mb": nvml[i]["total_mb"] if i < len(nvml) else None,
            }
        )
    host = host_memory()
    return Hardware(
        gpus=tuple(gpus),
        cpu_name=host.get("cpu_name") or "cpu",
        cpu_count=usable_cpu_count(),
        cpu_flags=cpu_flags(),
        host_memory_mb=host["total_mb"],
        host_available_mb=host["available_mb"],
        cpu_isa=cpu_isa(),
        onednn=current_onednn().describe(),
    )


PLANNED_MEMORY_SLACK = 0.95  # a GPU with less than 95% of the planned memory is smaller (nvidia-smi shows ~0.5% less)


def planned_hardware_mismatch(planned_for: dict | None, hardware: Hardware | None = None) -> str | None:
    """How `hardware` (default: this machine) falls short of the hardware a plan was made for, or None.

    Args:
        planned_for: a plan's `planning.planned_for` ({"gpus", "gpu_memory_mb", "name", "source"}), or None (a
            config not made by the planner, or made before plans recorded it: nothing to compare).

    Returns:
        "was planned for <that>; this machine has <this>" when this machine has no GPU, fewer GPUs, GPUs with less
        than `PLANNED_MEMORY_SLACK` of the planned memory, or GPUs for a plan made for a CPU; None when it has at
        least what was planned.

    Example:
        >>> planned = {"gpus": 8, "gpu_memory_mb": 81920, "name": "H100-80GB", "source": "target"}
        >>> planned_hardware_mismatch(planned, Hardware())
        'was planned for 8 x 80 GB GPUs (H100-80GB); this machine has no GPU'
        >>> planned_hardware_mismatch({**planned, "gpus": 0, "gpu_memory_mb": None}, Hardware()) is None
        True
    """
    if not planned_for:
        return None
    hardware = hardware or detect_hardware()
    gpus, memory, name = planned_for.get("gpus") or 0, planned_for.get("gpu_memory_mb"), planned_for.get("name")
    if gpus:
        size = f"{format_gb(memory)} GB " if memory else ""
        planned = f"{gpus} x {size}GPU{'s' if gpus > 1 else ''}" + (f" ({name})" if name else "")
    else:
        planned = "a CPU-only machine"
    here_memory = hardware.gpu_memory_mb
    if not hardware.has_gpu:
        here = "no GPU" if gpus else None
    elif not gpus:
        here = hardware._gpus_text()
    elif len(hardware.gpus) < gpus or (memory and here_memory and here_memory < PLANNED_MEMORY_SLACK * memory):
        here = hardware._gpus_text()
    else:
        here = None
    return None if here is None else f"was planned for {planned}; this machine has {here}"
