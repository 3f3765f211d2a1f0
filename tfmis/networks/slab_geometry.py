"""Spatial model parallelism's arithmetic, without TensorFlow: the slabs a patch side is cut into (`slab_bounds`),
the axis to cut (`slab_axis`), and why a patch cannot be cut into N slabs (`spatial_slab_problem`), which the
config's checks (`tfmis.config.checks.check_model_parallel`), the predict command and the GPU-fit search use to
refuse or skip a setting before anything is built.

Every slab's side is a multiple of the product of the network's strides along the cut axis (so every level's slabs
line up), and each device holds at least one such unit.
"""

from __future__ import annotations

from collections.abc import Sequence

from tfmis.errors import ConfigError


def slab_bounds(length: int, unit: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of `parts` slabs covering `length` voxels, each a multiple of `unit` long, as equal as can be.

    Raises:
        ConfigError: `length` is not a multiple of `unit`, or holds fewer than `parts` units.

    Example:
        >>> slab_bounds(80, 16, 2)
        [(0, 48), (48, 80)]
    """
    units = length // unit
    if length % unit or units < parts:
        raise ConfigError(
            f"a side of {length} voxels cannot be cut into {parts} slabs whose sizes are multiples of {unit} (the "
            f"product of the network's strides along it): make that side a multiple of {unit} of at least "
            f"{unit * parts} voxels, or use fewer devices"
        )
    base, extra = divmod(units, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + (base + (i < extra)) * unit
        bounds.append((start, stop))
        start = stop
    return bounds


def most_slabs(patch_size: Sequence[int], divisor: Sequence[int], axis: int | None = None) -> tuple[int, int]:
    """(the most slabs the patch can be cut into, along which axis): along `axis`, or the best axis when None. A side
    that is not a multiple of its divisor gives 0.

    Example:
        >>> most_slabs((48, 32, 16), (8, 8, 8)), most_slabs((48, 32, 16), (8, 8, 8), axis=2)
        ((6, 0), (2, 2))
    """
    axes = range(3) if axis is None else [axis]
    counts = {a: (patch_size[a] // divisor[a] if patch_size[a] % divisor[a] == 0 else 0) for a in axes}
    best = max(counts, key=lambda a: (counts[a], -a))
    return counts[best], best


def spatial_slab_problem(patch_size: Sequence[int], divisor: Sequence[int], parts: int, axis: int | None) -> str | None:
    """Why `patch_size` cannot be cut into `parts` slabs aligned to `divisor` (the strides' product per axis), along
    `axis` or along any axis when None, as a phrase ending in how many would fit; None when it can.

    Example:
        >>> print(spatial_slab_problem((48, 48, 48), (8, 8, 8), 16, None))  # doctest: +ELLIPSIS
        no side of the patch (48, 48, 48) can be cut into 16 slabs ...: at most 6 fit (along axis 0)
        >>> spatial_slab_problem((48, 48, 48), (8, 8, 8), 2, 1) is None
        True
    """
    patch = tuple(int(p) for p in patch_size)
    divisor = tuple(int(d) for d in divisor)
    fits, best = most_slabs(patch, divisor, axis)
    if fits >= parts:
        return None
    where = "no side of the patch" if axis is None else f"the side along axis {axis} of the patch"
    return (
        f"{where} {patch} can be cut into {parts} slabs whose sizes are multiples of the strides' product "
        f"{divisor}: at most {fits} fit (along axis {best})"
    )


def slab_axis(patch_size, axis: int | None, divisor, parts: int) -> int:
    """The patch axis (0, 1, 2) to cut into `parts` slabs aligned to `divisor` (the strides' product per axis): the
    named one (checked), else the longest that fits.

    Raises:
        ConfigError: an axis that is not 0, 1 or 2, or a patch that cannot be cut so (naming the setting).

    Example:
        >>> slab_axis((48, 32, 16), None, (4, 4, 2), 2), slab_axis((48, 32, 16), 2, (4, 4, 2), 2)
        (0, 2)
    """
    if axis is not None and axis not in (0, 1, 2):
        raise ConfigError(f"runtime.model_parallel.axis must be 0, 1, 2 or null, got {axis}")
    if patch_size is None:
        return int(axis)
    problem = spatial_slab_problem(patch_size, divisor, parts, axis)
    if problem:
        raise ConfigError(
            f"runtime.model_parallel.devices={parts} (spatial): {problem}; use fewer devices or a larger patch"
        )
    if axis is not None:
        return int(axis)
    fits = [a for a in range(3) if patch_size[a] % divisor[a] == 0 and patch_size[a] // divisor[a] >= parts]
    return max(fits, key=lambda a: (patch_size[a], -a))
