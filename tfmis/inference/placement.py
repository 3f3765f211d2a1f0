"""Where sliding-window inference keeps a whole volume, and what it does when memory runs out.

One policy for training's validation (`validation.validation_data_device`) and for `tfmis.predict`
(`--device`), like MONAI's `SlidingWindowInfererAdapt`: the windows always run on the accelerator,
and the whole volume with its blending buffers (about X·Y·Z·(K+1) floats) lives

- `accelerator`: on the accelerator; running out of memory is an error that names the fix;
- `cpu`: in host memory;
- `auto`: on the accelerator first, with a fallback ladder on an out-of-memory error:
  (1) the volume and buffers in host memory, same sliding-window batch;
  (2) then the sliding-window batch halved, down to 1 window per forward pass.

`cpu` also takes step (2). What failed is remembered: volumes at least as large as the smallest
that did not fit on the accelerator go to the CPU straight away, and a reduced sliding-window
batch is used straight away for volumes at least as large as the one that needed it. `auto` can
be seeded with that size (`validation.cpu_from_voxels`). On a machine without an accelerator the
"accelerator" is the CPU itself: step (1) frees nothing there, the halving does.

Example:
```python
placement = VolumePlacement("auto", sw_batch_size=4)
logits, where = placement.run(
    lambda device, sw_batch: sliding_window_inference(volume, roi, sw_batch, model, sw_device=placement.accelerator,
                                                      device=device).numpy(),
    voxels=int(np.prod(volume.shape[1:4])), case_id="case_007")
print(where)               # "gpu:0", or e.g. "cpu, sw batch 2 (fallback after out-of-memory)"
print(placement.events)    # what failed for which case, and what worked
```
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Literal, TypeVar

import tensorflow as tf

from tfmis.errors import ConfigError, ResourceError
from tfmis.hardware import CPU, accelerator_device
from tfmis.utils.out_of_memory import error_line, is_out_of_memory

PLACEMENT_MODES = ("accelerator", "cpu", "auto")
# Why a volume did not get the first-choice placement (the accelerator, or the CPU in `cpu` mode,
# with the configured sliding-window batch). Part of `Placement`'s description.
AFTER_OUT_OF_MEMORY = "fallback after out-of-memory"
KNOWN_NOT_TO_FIT = "size known not to fit"
OVER_BUDGET = "over the accelerator memory budget"
T = TypeVar("T")


class VolumeOutOfMemory(tf.errors.ResourceExhaustedError, ResourceError):
    """A volume did not fit where the policy allows it to go; the message names the case and the fix."""

    def __init__(self, message: str):
        super().__init__(None, None, message)


def aggregation_bytes(
    spatial_shape, channels: int, num_classes: int, buffer_dtype="float32", volume_dtype="float32"
) -> int:
    """Bytes the whole-volume tensors need where the volume is aggregated: the volume (C channels of
    `volume_dtype`), the running mean (K classes of `buffer_dtype`) and the float32 weight sum (1).

    Example:
        >>> aggregation_bytes((10, 10, 10), 1, 4), aggregation_bytes((10, 10, 10), 1, 4, "float16", "float16")
        (24000, 14000)
    """
    voxels = 1
    for size in spatial_shape:
        voxels *= int(size)
    return voxels * (channels * tf.as_dtype(volume_dtype).size + num_classes * tf.as_dtype(buffer_dtype).size + 4)


def device_name(device: str) -> str:
    """ "/GPU:0" → "gpu:0", as the predictions table and the logs write it."""
    return device.strip("/").lower()


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one volume was aggregated, and why there.

    `str(placement)` is the short description: "gpu:0" for the first choice, else e.g.
    "cpu, sw batch 2 (fallback after out-of-memory)".
    """

    device: str
    sw_batch_size: int
    configured_sw_batch_size: int
    reason: str = ""  # "" = the first choice; else AFTER_OUT_OF_MEMORY, KNOWN_NOT_TO_FIT or OVER_BUDGET

    @property
    def is_fallback(self) -> bool:
        return bool(self.reason)

    def __str__(self) -> str:
        if not self.reason:
            return device_name(self.device)
        batch = f", sw batch {self.sw_batch_size}" if self.sw_batch_size != self.configured_sw_batch_size else ""
        return f"{device_name(self.device).split(':')[0]}{batch} ({self.reason})"


@dataclasses.dataclass(frozen=True)
class FallbackEvent:
    """One case that did not run on its first-choice placement: what failed and what worked."""

    case_id: str
    voxels: int
    failed: tuple[str, ...]  # e.g. "gpu:0, sw batch 4: ResourceExhaustedError: OOM when allocating ..."
    succeeded: str  # the Placement description

    def __str__(self) -> str:
        return f"case {self.case_id or '?'} ({self.voxels:,} voxels): {'; '.join(self.failed)}; ran on {self.succeeded}"


class VolumePlacement:
    """The memory policy of sliding-window inference on whole volumes (see the module docstring).

    Keep one object for the life of a trainer or predictor: what it learns about sizes that do
    not fit is reused for every later volume.

    Args:
        mode: `accelerator`, `cpu` or `auto`.
        sw_batch_size: the configured windows per forward pass; only ever lowered, never raised.
        accelerator: the device tried first (default: the first GPU, else the CPU).
        cpu_from_voxels: `auto`: volumes with at least this many voxels go to the CPU straight
            away (what a measurement found not to fit); None = learn it from the first OOM.
        accelerator_memory_mb: `auto`/`accelerator`: a budget checked before allocating; a volume
            whose `buffer_bytes` exceed it is not tried on the accelerator (a pre-check, no
            allocation fails).
        device_setting: the name of the setting the error messages tell the user to change.
    """

    def __init__(
        self,
        mode: Literal["accelerator", "cpu", "auto"] = "auto",
        sw_batch_size: int = 4,
        accelerator: str | None = None,
        cpu_from_voxels: int | None = None,
        accelerator_memory_mb: float | None = None,
        device_setting: str = "validation.validation_data_device",
    ):
        if mode not in PLACEMENT_MODES:
            raise ConfigError(f"{device_setting} must be one of {PLACEMENT_MODES}, got {mode!r}")
        if sw_batch_size < 1:
            raise ConfigError(f"sw_batch_size must be >= 1, got {sw_batch_size}")
        self.mode = mode
        self.sw_batch_size = int(sw_batch_size)
        self.accelerator = accelerator or accelerator_device()
        self.cpu_from_voxels = cpu_from_voxels
        self.memory_budget = accelerator_memory_mb * 2**20 if accelerator_memory_mb else None
        self.device_setting = device_setting
        self.reduced_sw_batch: dict[int, int] = {}  # voxels of a volume → the sw batch that fitted it on the CPU
        self.events: list[FallbackEvent] = []

    @classmethod
    def for_validation(cls, validation) -> VolumePlacement:
        """The policy of a training config's `validation` section (a `ValidationConfig`)."""
        return cls(
            validation.validation_data_device, validation.num_sw_batch_size, cpu_from_voxels=validation.cpu_from_voxels
        )

    def start_sw_batch(self, voxels: int) -> int:
        """The sliding-window batch a volume of `voxels` starts with: the configured one, or what a
        volume at most this large needed."""
        return min((b for v, b in self.reduced_sw_batch.items() if voxels >= v), default=self.sw_batch_size)

    def run(
        self, infer: Callable[[str, int], T], voxels: int, case_id: str = "", buffer_bytes: int | None = None
    ) -> tuple[T, Placement]:
        """Runs `infer(device, sw_batch_size)` where the policy says, down the ladder on out-of-memory.

        Args:
            infer: aggregates the volume on `device` with `sw_batch_size` windows per forward pass.
                It must finish the computation (return numpy, not a pending tensor) so that an
                out-of-memory error surfaces inside the attempt.
            voxels: the volume's size (X·Y·Z): the key of what the policy remembers.
            case_id: named in the events and errors.
            buffer_bytes: what the whole-volume tensors need (`aggregation_bytes`), for the
                `accelerator_memory_mb` pre-check.

        Returns:
            (what `infer` returned, the `Placement` it ran with).

        Raises:
            VolumeOutOfMemory: `accelerator` mode and the accelerator ran out of memory, or even
                one window per forward pass with the volume on the CPU did not fit.
            Any other error of `infer`, unchanged.
        """
        voxels = int(voxels)
        batch = self.start_sw_batch(voxels)
        failed: list[str] = []
        reason = KNOWN_NOT_TO_FIT if batch < self.sw_batch_size else ""
        if self.mode != "cpu":
            over_budget = (
                self.memory_budget is not None and buffer_bytes is not None and buffer_bytes > self.memory_budget
            )
            known = self.mode == "auto" and self.cpu_from_voxels is not None and voxels >= self.cpu_from_voxels
            if over_budget:
                failed.append(
                    f"pre-check: the whole-volume buffers need {buffer_bytes / 2**20:.1f} MiB, over the "
                    f"accelerator budget of {self.memory_budget / 2**20:.1f} MiB (nothing was allocated)"
                )
                if self.mode == "accelerator":
                    raise VolumeOutOfMemory(self._accelerator_advice(case_id, voxels, failed[-1]))
                reason = OVER_BUDGET
            elif known:
                reason = KNOWN_NOT_TO_FIT
            else:
                outcome, error = self._attempt(infer, self.accelerator, batch)
                if error is None:
                    return outcome, Placement(self.accelerator, batch, self.sw_batch_size, reason)
                if self.mode == "accelerator":
                    raise VolumeOutOfMemory(self._accelerator_advice(case_id, voxels, error)) from outcome
                failed.append(f"{device_name(self.accelerator)}, sw batch {batch}: {error}")
                self.cpu_from_voxels = voxels if self.cpu_from_voxels is None else min(self.cpu_from_voxels, voxels)
                reason = AFTER_OUT_OF_MEMORY
        while True:
            outcome, error = self._attempt(infer, CPU, batch)
            if error is None:
                break
            failed.append(f"cpu, sw batch {batch}: {error}")
            reason = AFTER_OUT_OF_MEMORY
            if batch == 1:
                raise VolumeOutOfMemory(
                    f"case {case_id or '?'} ({voxels:,} voxels) does not fit in memory even with its volume on the "
                    f"CPU and one window per forward pass ({'; '.join(failed)}). Free memory, or use a smaller "
                    "validation.roi_size"
                ) from outcome
            batch = max(1, batch // 2)
        if batch < self.start_sw_batch(voxels):
            self.reduced_sw_batch[voxels] = batch
        placement = Placement(CPU, batch, self.sw_batch_size, reason)
        if failed:
            self.events.append(FallbackEvent(case_id, voxels, tuple(failed), str(placement)))
        return outcome, placement

    def _attempt(self, infer, device: str, batch: int):
        """(result, None), or (the error, its one-line summary) for an out-of-memory error."""
        try:
            return infer(device, batch), None
        except Exception as e:  # noqa: BLE001 - anything but an out-of-memory error is re-raised
            if not is_out_of_memory(e):
                raise
            error, summary = e, _summary(e)
            # without tracebacks the error no longer holds the failed attempt's frames and the tensors
            # in them: they are freed before the next attempt
            chained = error
            while chained is not None:
                chained.__traceback__, chained = None, chained.__context__
        gc.collect()
        return error, summary

    def _accelerator_advice(self, case_id: str, voxels: int, what: str) -> str:
        return (
            f"case {case_id or '?'} ({voxels:,} voxels): out of memory with the volume and its blending buffers "
            f"on {device_name(self.accelerator)} ({self.device_setting}: accelerator, sw batch "
            f"{self.start_sw_batch(voxels)}): {what}. Set {self.device_setting}: auto (falls back to the CPU and "
            f"smaller sliding-window batches when memory runs out) or cpu (volumes always in host memory)"
        )


def _summary(error: BaseException) -> str:
    """'ResourceExhaustedError: OOM when allocating tensor with shape[...] ...', one line, no op prefix."""
    return f"{type(error).__name__}: {error_line(str(error), limit=300)}"
