"""NVML (nvidia-ml-py, imported as `pynvml` inside the functions, never at import): the GPUs this process may use
(`CUDA_VISIBLE_DEVICES` read as CUDA reads it), one GPU's memory, and NVML kept open for the resource monitor's
repeated samples (`NvmlGpus`). The only module of tfmis that imports pynvml (pyproject.toml's `machine-nvml`)."""

from __future__ import annotations

import os

from tfmis.errors import UsageError
from tfmis.hardware.gpu import nvidia_driver_present, physical_gpus
from tfmis.hardware.memory import MB


def visible_nvml_handles(pynvml, count: int, visible: str | None = None) -> list[tuple[int, object]]:
    """(NVML index, handle) of the GPUs `CUDA_VISIBLE_DEVICES` shows (all when unset), in its order.

    As CUDA reads it: entries are NVML indices (with `CUDA_DEVICE_ORDER=PCI_BUS_ID`, nvidia-smi's numbers)
    or GPU UUIDs (`GPU-...`, a unique prefix is enough), and the list ends at the first entry that names
    no GPU ("-1" hides them all).

    Args:
        pynvml: the initialised NVML module.
        count: `pynvml.nvmlDeviceGetCount()`.
        visible: the variable's value (default: this process's environment).
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is None:
        return [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
    uuids = None
    handles = []
    for entry in (e.strip() for e in visible.split(",")):
        try:
            if entry.lstrip("-").isdigit():
                index = int(entry)
                if not 0 <= index < count:
                    break
            elif entry.startswith("GPU-"):
                if uuids is None:
                    uuids = [
                        _text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)
                    ]
                matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(entry)]
                if len(matches) != 1:
                    break
                index = matches[0]
            else:
                break
            handles.append((index, pynvml.nvmlDeviceGetHandleByIndex(index)))
        except pynvml.NVMLError:  # a GPU NVML cannot reach ends the list, as it would for CUDA
            break
    return handles


def accelerators() -> list[dict]:
    """The GPUs this process may use: [{"index", "name", "total_mb", "uuid"}], NVML index per GPU.

    Empty without an NVIDIA driver (checked first, without importing TensorFlow), when TensorFlow sees no
    GPU (TensorFlow built without CUDA: `tf.config.list_physical_devices("GPU")`, which allocates no device
    memory) or when NVML is missing.
    `CUDA_VISIBLE_DEVICES` restricts the list (`visible_nvml_handles`). No GPU is initialised.
    """
    if not nvidia_driver_present():  # checked before TensorFlow is imported
        return []
    try:
        if not physical_gpus():
            return []
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no TensorFlow, no NVML library or no driver: no usable GPU
        return []
    try:
        devices = []
        for index, handle in visible_nvml_handles(pynvml, pynvml.nvmlDeviceGetCount()):
            devices.append(
                {
                    "index": index,
                    "name": _text(pynvml.nvmlDeviceGetName(handle)),
                    "total_mb": pynvml.nvmlDeviceGetMemoryInfo(handle).total / MB,
                    "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
                }
            )
    except pynvml.NVMLError:
        return []
    finally:
        pynvml.nvmlShutdown()
    return sorted(devices, key=lambda d: d["index"])


def nvml_device(index: int) -> dict | None:
    """{"name", "total_mb", "used_mb", "uuid"} of the GPU with this NVML index; None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return {
                "name": _text(pynvml.nvmlDeviceGetName(handle)),
                "total_mb": memory.total / MB,
                "used_mb": memory.used / MB,
                "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
            }
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no library, no driver, no such GPU
        return None


class NvmlUnavailable(Exception):
    """NVML cannot be used here (no nvidia-ml-py, no driver, no visible GPU); the message says which."""


class NvmlGpus:
    """NVML kept open on a set of GPUs for repeated reads (the resource monitor's samples); `close()` ends it.

    Args:
        gpus: NVML indices (as nvidia-smi numbers them). Default: the GPUs `CUDA_VISIBLE_DEVICES` shows
            (`visible_nvml_handles`), all when it is unset.

    Raises:
        NvmlUnavailable: no nvidia-ml-py, NVML cannot start, it sees no GPU, or `CUDA_VISIBLE_DEVICES` hides all.
        ValueError: an index of `gpus` that NVML does not know (the message names the indices it knows).

    Attributes:
        devices: [{"index", "name", "total_mb"}], one per GPU, in the order of `gpus`.

    Example:
    ```python
    try:
        nvml = NvmlGpus()
    except NvmlUnavailable as e:
        print("no GPU to sample:", e)
    else:
        print(nvml.read())  # [{"index": 0, "utilization_percent": 12.0, "used_mb": 812.0, "total_mb": 81559.0, ...}]
        nvml.close()
    ```
    """

    def __init__(self, gpus: list[int] | None = None):
        try:
            import pynvml
        except ImportError:
            raise NvmlUnavailable("nvidia-ml-py is not installed: pip install nvidia-ml-py") from None
        try:
            pynvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            raise NvmlUnavailable(f"NVML could not start: {e}") from None
        self._nvml = pynvml
        try:
            count = pynvml.nvmlDeviceGetCount()
            if count == 0:
                raise NvmlUnavailable("NVML sees no GPU")
            if gpus is not None:
                chosen = [int(g) for g in gpus]
                missing = [g for g in chosen if not 0 <= g < count]
                if missing:
                    raise UsageError(
                        f"gpus {missing} not found: NVML sees {count} GPU(s), indices 0-{count - 1} "
                        "(nvidia-smi -L lists them)"
                    )
                self._handles = [(g, pynvml.nvmlDeviceGetHandleByIndex(g)) for g in chosen]
            else:
                self._handles = visible_nvml_handles(pynvml, count)
                if not self._handles:
                    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                    raise NvmlUnavailable(f"CUDA_VISIBLE_DEVICES={visible!r} hides all GPUs")
            self.devices = [
                {
                    "index": index,
                    "name": _text(pynvml.nvmlDeviceGetName(handle)),
                    "total_mb": pynvml.nvmlDeviceGetMemoryInfo(handle).total / MB,
                }
                for index, handle in self._handles
            ]
        except BaseException:
            pynvml.nvmlShutdown()
            raise

    def read(self) -> list[dict]:
        """Each GPU's state now: [{"index", "utilization_percent", "used_mb", "total_mb", "utilization_error"}].

        `utilization_percent` is NaN where NVML cannot say (e.g. on MIG instances); `utilization_error` is then
        NVML's exception, else None."""
        readings = []
        for index, handle in self._handles:
            error = None
            try:
                utilization = float(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except self._nvml.NVMLError as e:
                utilization, error = float("nan"), e
            memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            readings.append(
                {
                    "index": index,
                    "utilization_percent": utilization,
                    "used_mb": memory.used / MB,
                    "total_mb": memory.total / MB,
                    "utilization_error": error,
                }
            )
        return readings

    def close(self) -> None:
        """Shuts NVML down (once; later calls do nothing)."""
        nvml, self._nvml = self._nvml, None
        if nvml is not None:
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError:
                pass


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
