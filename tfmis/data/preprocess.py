"""Deterministic preprocessing, done once at conversion time.

Order: reorient to RAS → crop to the foreground bounding box → resample to the target spacing
(linear for images, nearest for labels) or to a fixed shape (`reshape`) → normalise intensities per
channel → cast (image float16/float32, label uint8).

Every step is a voxel→voxel affine map, so the whole chain is summarised by one 4x4 matrix: the
affine of the preprocessed grid. `Geometry` records it together with the original shape and affine,
and `restore_geometry` maps a prediction back onto the original voxel grid in one resampling.

Example:
```python
config = PreprocessConfig(spacing=(1.5, 1.5, 2.0), normalization=("ct",), ct_window=(-57, 164))
image, label, geometry = preprocess(loaded.image, loaded.label, loaded.affine, config)
original_label = restore_geometry(label, geometry)   # same shape/orientation as the input file
```
"""

from __future__ import annotations

import dataclasses

import nibabel as nib
import numpy as np
from scipy import ndimage

from tfmis.errors import ConfigError
from tfmis.metrics.boxes import label_box, mask_bounds

NORMALIZATIONS = ("zscore", "ct", "ct_zscore", "none")
NORMALIZE_SLICES = 16  # slices per step of the voxel-wise normalisation (bounds its temporaries)
CT_NORMALIZATIONS = ("ct", "ct_zscore")


@dataclasses.dataclass(frozen=True)
class PreprocessConfig:
    """Parameters of the deterministic preprocessing.

    Args:
        spacing: target voxel spacing in mm (RAS axis order). Ignored when `reshape` is set.
            Must be resolved (e.g. to the dataset's median spacing) before calling `preprocess`.
        reshape: fixed output shape (X, Y, Z) instead of resampling to a spacing (as in DistMIS).
        normalization: one entry per channel: `zscore` (over the foreground mask, MRI),
            `ct` (clip to `ct_window`, scale to [0, 1]), `ct_zscore` (clip to `ct_window`, then
            subtract `ct_mean_std[0]` and divide by `ct_mean_std[1]`: nnU-Net's CTNormalization)
            or `none`.
        ct_window: (low, high) Hounsfield window for `ct` and `ct_zscore` channels.
        ct_mean_std: (mean, std) of the dataset's foreground intensities, for `ct_zscore` channels.
        crop_foreground: crop to the bounding box of the non-background region (and the label).
        crop_margin: voxels kept around that bounding box.
        crop_to_label_mm: crop to the bounding box of the labelled voxels grown by this many mm per side instead
            (the fine stage of a cascade trains on the region the coarse stage will cut; a case without a label
            or without labelled voxels keeps the foreground crop). Normalisation statistics come from the whole image
            (`image_statistics`), whatever the crop.
        image_dtype: `float16` or `float32` storage of the normalised image.
    """

    spacing: tuple[float, float, float] | None = None
    reshape: tuple[int, int, int] | None = None
    normalization: tuple[str, ...] = ("zscore",)
    ct_window: tuple[float, float] | None = None
    ct_mean_std: tuple[float, float] | None = None
    crop_foreground: bool = True
    crop_margin: int = 0
    crop_to_label_mm: float | None = None
    image_dtype: str = "float16"

    def __post_init__(self):
        for n in self.normalization:
            if n not in NORMALIZATIONS:
                raise ConfigError(f"normalization {n!r} is not one of {NORMALIZATIONS}")
        if any(n in CT_NORMALIZATIONS for n in self.normalization) and self.ct_window is None:
            raise ConfigError("normalization 'ct' / 'ct_zscore' needs ct_window=(low, high)")
        if "ct_zscore" in self.normalization and (self.ct_mean_std is None or not self.ct_mean_std[1] > 0):
            raise ConfigError(f"normalization 'ct_zscore' needs ct_mean_std=(mean, std > 0), got {self.ct_mean_std}")
        if self.ct_window is not None and not self.ct_window[0] < self.ct_window[1]:
            raise ConfigError(f"ct_window low must be below high, got {self.ct_window}")
        if self.image_dtype not in ("float16", "float32"):
            raise ConfigError(f"image_dtype must be float16 or float32, got {self.image_dtype!r}")
        if self.reshape is None and self.spacing is None:
            raise ConfigError("set spacing (mm) or reshape (voxels)")
        if self.reshape is not None and (len(self.reshape) != 3 or min(self.reshape) < 1):
            raise ConfigError(f"reshape must be three positive sizes, got {self.reshape}")
        if self.spacing is not None and (len(self.spacing) != 3 or min(self.spacing) <= 0):
            raise ConfigError(f"spacing must be three positive values, got {self.spacing}")
        if self.crop_to_label_mm is not None and self.crop_to_label_mm < 0:
            raise ConfigError(f"crop_to_label_mm must be >= 0 mm (or None), got {self.crop_to_label_mm}")

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> PreprocessConfig:
        """From `to_dict()` output, e.g. `index["preprocessing"]` of a converted dataset (extra keys ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names})


@dataclasses.dataclass
class Geometry:
    """What is needed to put a prediction back into the original file's geometry.

    Attributes:
        original_shape: spatial shape of the input file (its own voxel order).
        original_affine: 4x4 affine of the input file.
        original_axcodes: orientation of the input file, e.g. `LPS`.
        ras_shape: spatial shape after reorientation to RAS.
        crop_start, crop_stop: foreground box on the RAS grid (voxels, stop exclusive).
        shape, spacing, affine: the preprocessed grid.
    """

    original_shape: list
    original_affine: list
    original_axcodes: str
    ras_shape: list
    crop_start: list
    crop_stop: list
    shape: list
    spacing: list
    affine: list

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Geometry:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


def spacing_of(affine: np.ndarray) -> np.ndarray:
    """Voxel sizes (mm) along the array axes of a 4x4 affine."""
    return np.sqrt((np.asarray(affine)[:3, :3] ** 2).sum(axis=0))


def ras_spacing(affine: np.ndarray) -> np.ndarray:
    """Voxel sizes along R, A, S after reorientation to RAS (for the dataset's median spacing)."""
    ornt = nib.orientations.io_orientation(affine)
    spacing = spacing_of(affine)
    out = np.empty(3)
    for axis, (ras_axis, _) in enumerate(ornt):
        out[int(ras_axis)] = spacing[axis]
    return out


def reorient_to_ras(array: np.ndarray, affine: np.ndarray, copy: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Permutes/flips the first three axes of `array` to RAS; returns (array, new affine).

    With `copy=False` the array is a view of `array` (flipped/transposed strides, no memory).
    """
    ornt = nib.orientations.io_orientation(affine)
    transform = nib.orientations.ornt_transform(ornt, nib.orientations.axcodes2ornt("RAS"))
    out = nib.orientations.apply_orientation(array, transform)
    new_affine = affine @ nib.orientations.inv_ornt_aff(transform, array.shape[:3])
    return (np.ascontiguousarray(out) if copy else out), new_affine


def border_constant(channel: np.ndarray):
    """The value that more than half of the voxels on the 6 faces of the 3-D `channel` hold (a numpy scalar of its
    dtype), or None when no value does (a noisy border). A z-scored scan's background (e.g. -3.6) holds all of the
    border, or nearly all where the body touches a face. Reads the faces only (face-sized copies, never the volume).

    Example:
        >>> x = np.full((6, 6, 6), -3.6, np.float32); x[1:5, 1:5, 2:] = 1.0   # the body touches the top face
        >>> float(border_constant(x)) == float(np.float32(-3.6))
        True
        >>> border_constant(np.random.default_rng(0).normal(size=(6, 6, 6))) is None
        True
    """
    faces = np.concatenate(
        [channel[(slice(None),) * axis + (end,)].ravel() for axis in range(channel.ndim) for end in (0, -1)]
    )
    for candidate in (faces[0], None):  # a corner first (cheap); else the value that sorts to the middle
        if candidate is None:  # a value held by more than half of the faces' voxels covers their median
            candidate = np.partition(faces, faces.size // 2)[faces.size // 2]
        if 2 * np.count_nonzero(faces == candidate) > faces.size:
            return candidate
    return None


def channel_background(channel: np.ndarray):
    """The background value of an MRI-like 3-D `channel`: its border constant (`border_constant`, the value most of
    the 6 faces hold) when it is not 0 (a z-scored scan, e.g. BraTS-style data whose air is -3.6), else 0 (the rule
    for scanner units: zero outside the body). A numpy scalar of the channel's dtype, so comparisons are exact."""
    value = border_constant(channel)
    return value if value is not None and value != 0 else channel.dtype.type(0)


def channel_backgrounds(image: np.ndarray, normalization: tuple[str, ...]) -> list:
    """Per channel of `image` (X, Y, Z, C): `channel_background`, or None for a CT channel (whose background is
    everything at or below the CT window's low end, whatever the border holds). Reads the 6 faces only."""
    return [
        None if norm in CT_NORMALIZATIONS else channel_background(image[..., c])
        for c, norm in enumerate(_per_channel(normalization, image.shape[-1]))
    ]


def foreground_mask(
    image: np.ndarray, normalization: tuple[str, ...], ct_window, channels=None, backgrounds=None
) -> np.ndarray:
    """Non-background voxels of `image` (X, Y, Z, C): where any channel differs from its background. A CT channel's
    foreground is above the window's low end (`ct_window[0]`); any other channel's is where it differs from
    `channel_background`: the border constant when most of the volume's 6 faces hold one value that is not 0 (a
    z-scored scan), else 0. Each case finds its own border constant (conversion, fingerprint and prediction alike).

    The one definition of the foreground: the crop, the z-score's `use_mask_for_norm` region and the fingerprint
    (crop shapes, the intensity sample of an unlabelled case) all come from here.

    Args:
        channels: the channel indices to look at (default all); e.g. the non-CT ones.
        backgrounds: per channel, the background value to use instead of this image's own (`channel_backgrounds`
            of the image a box was cut from: `ImageStatistics.backgrounds`), so a box's foreground is the image's.
    """
    norms = _per_channel(normalization, image.shape[-1])
    mask = None
    for c in range(image.shape[-1]) if channels is None else channels:
        x = image[..., c]
        if norms[c] in CT_NORMALIZATIONS:
            channel = x > ct_window[0]
        else:
            channel = x != (channel_background(x) if backgrounds is None else backgrounds[c])
        mask = channel if mask is None else np.logical_or(mask, channel, out=mask)
    return mask if mask is not None else np.zeros(image.shape[:3], dtype=bool)


@dataclasses.dataclass(frozen=True)
class ImageStatistics:
    """What normalises one image, taken once over the whole image, before any crop or box is cut from it.

    Attributes:
        backgrounds: per channel, its background value (`channel_backgrounds`; None for a CT channel).
        zscore: per channel, the (mean, std) of a `zscore` channel over the foreground (`foreground_mask`; over
            every voxel when the foreground is empty or the whole image); None for other channels.
        masked: whether a `zscore` channel is 0 outside the foreground (the foreground is neither empty nor the
            whole image), nnU-Net's use_mask_for_norm; False without `zscore` channels.

    Every crop of the image (the foreground crop, a cascade's training crop around the labels) and every box cut
    from it (a cascade's region at prediction) is normalised with these: a voxel gets the same value whichever
    crop or box holds it. nnU-Net likewise takes the z-score's statistics over the image cropped to its nonzero
    region, before patches are cut.
    """

    backgrounds: tuple
    zscore: tuple
    masked: bool


def image_statistics(image: np.ndarray, normalization: tuple[str, ...], ct_window, mask=None) -> ImageStatistics:
    """The `ImageStatistics` of `image` (X, Y, Z, C; float32 or integers, any voxel order): its backgrounds (its 6
    faces), its foreground (`mask`, when the caller has it: `foreground_mask(image, normalization, ct_window)`)
    and each `zscore` channel's mean and std there (accumulated in float64, so the voxel order does not matter).

    Example:
        >>> x = np.zeros((6, 6, 6, 1), np.float32); x[1:5, 1:5, 1:5] = np.arange(64).reshape(4, 4, 4, 1)
        >>> s = image_statistics(x, ("zscore",), None)
        >>> s.masked, [round(v, 3) for v in s.zscore[0]]
        (True, [32.0, 18.184])
    """
    norms = _per_channel(normalization, image.shape[-1])
    backgrounds = tuple(channel_backgrounds(image, norms))
    if "zscore" not in norms:  # nothing to measure (a CT's statistics are the dataset's): no whole-image mask
        return ImageStatistics(backgrounds, (None,) * len(norms), False)
    if mask is None:
        mask = foreground_mask(image, norms, ct_window, backgrounds=backgrounds)
    masked = bool(mask.any() and not mask.all())
    zscore = []
    for c, norm in enumerate(norms):
        if norm != "zscore":
            zscore.append(None)
            continue
        values = _float32(image[..., c][mask] if masked else image[..., c])
        zscore.append((float(values.mean(dtype=np.float64)), float(values.std(dtype=np.float64))))
        del values
    return ImageStatistics(backgrounds, tuple(zscore), masked)


def resample(array: np.ndarray, scale: np.ndarray, out_shape, order: int, dtype=None) -> np.ndarray:
    """Resamples the first three axes: output voxel j reads input coordinate (j + .5) * scale - .5.

    That convention keeps the volume's centre and extent; the identity scale copies exactly.
    `dtype`: the result's dtype (default: the input's); the same values as `resample(...).astype(dtype)`,
    but each channel is cast into the result as soon as it is interpolated, so no second full-size copy.
    """
    scale = np.asarray(scale, dtype=np.float64)
    out_shape = tuple(int(s) for s in out_shape)
    dtype = np.dtype(dtype or array.dtype)
    if np.all(scale == 1) and out_shape == array.shape[:3]:
        return array.astype(dtype)  # always a copy
    offset = 0.5 * scale - 0.5
    if array.ndim == 3:
        out = ndimage.affine_transform(array, scale, offset, output_shape=out_shape, order=order, mode="nearest")
        return out.astype(dtype, copy=False)
    out = np.empty((*out_shape, array.shape[-1]), dtype=dtype)
    for c in range(array.shape[-1]):
        out[..., c] = resample(array[..., c], scale, out_shape, order)
    return out


def normalize(
    image: np.ndarray,
    mask: np.ndarray,
    normalization: tuple[str, ...],
    ct_window,
    ct_mean_std=None,
    out=None,
    statistics: ImageStatistics | None = None,
) -> np.ndarray:
    """Per-channel intensity normalisation (float32 out); see `PreprocessConfig.normalization`. The image may also
    hold integers (a CT's int16 read as it is stored): each slab is made float32 before any arithmetic, so the values
    are those of the float32 image.

    `mask`: the case's `foreground_mask` (as `preprocess` passes it). A `zscore` channel takes its mean and std over
    it and is 0 outside it (nnU-Net's use_mask_for_norm), unless the mask is empty or the whole grid; so a scan
    z-scored before it reached tfmis (background a constant such as -3.6) is normalised over its body, as its raw
    version would be, not over the air around it.

    The voxel-wise formulas run `NORMALIZE_SLICES` slices at a time (same values, temporaries of a slab
    instead of the volume), so a real-size CT needs only its output beside its input. `out`: a float32 array
    of `image`'s shape to write into, which may be `image` itself (each channel's statistics are taken
    before that channel is written).

    `statistics`: the `ImageStatistics` of the whole image `image` was cut from (`preprocess` passes them): its
    z-score means and stds, and whether the z-score is 0 outside `mask`; None: those of `image` and `mask`.
    """
    out = np.empty(image.shape, dtype=np.float32) if out is None else out
    masked = statistics.masked if statistics is not None else bool(mask.any() and not mask.all())
    use = mask if masked else None
    slabs = [slice(z, z + NORMALIZE_SLICES) for z in range(0, image.shape[2], NORMALIZE_SLICES)]
    for c, norm in enumerate(_per_channel(normalization, image.shape[-1])):
        x = image[..., c]
        if norm == "ct":  # in place in the output: no whole-volume temporaries
            lo, hi = ct_window
            for z in slabs:
                out[:, :, z, c] = (np.clip(_float32(x[:, :, z]), lo, hi) - lo) / (hi - lo)
        elif norm == "ct_zscore":  # the dataset's foreground statistics, not the case's (as nnU-Net)
            mean, std = ct_mean_std
            for z in slabs:
                out[:, :, z, c] = (np.clip(_float32(x[:, :, z]), *ct_window) - mean) / max(std, 1e-8)
        elif norm == "zscore":
            if statistics is not None:
                mean, std = statistics.zscore[c]
            else:
                values = _float32(x[use] if use is not None else x)
                mean, std = float(values.mean(dtype=np.float64)), float(values.std(dtype=np.float64))
                del values
            for z in slabs:
                y = (_float32(x[:, :, z]) - mean) / max(std, 1e-8)
                out[:, :, z, c] = np.where(use[:, :, z], y, 0.0) if use is not None else y
        elif out is not image:
            out[..., c] = x
    return out


def _float32(array: np.ndarray) -> np.ndarray:
    return array.astype(np.float32, copy=False)


def preprocess(
    image: np.ndarray,
    label: np.ndarray | None,
    affine: np.ndarray,
    config: PreprocessConfig,
    overwrite_image: bool = False,
    statistics: ImageStatistics | None = None,
):
    """Runs the whole deterministic chain on one case.

    The normalisation's statistics (`image_statistics`: each channel's background, a z-score's mean and std) are
    the whole image's, taken before the crop, whichever crop is cut (foreground, or `crop_to_label_mm`'s box around
    the labels); a box cut from a larger image passes that image's (`statistics`), so its voxels get the values they
    get in the larger image's preprocessing (a cascade's regions: `tfmis.inference.cascade`).

    Args:
        image: float32 (X, Y, Z, C) in file voxel order, or integers (`load_image(..., integers=True)`: the same
            results from a half or a quarter of the memory).
        label: uint8 (X, Y, Z) or None.
        affine: the file's 4x4 affine.
        config: a `PreprocessConfig` with `spacing` or `reshape` set.
        overwrite_image: normalise in `image`'s own memory (it is left holding the normalised values in its
            foreground box) instead of a new array: the same results with one volume less at the peak, for a
            caller that is done with `image` (the conversion worker).
        statistics: the `ImageStatistics` of the image `image` was cut from; None: `image`'s own.

    Returns:
        (image (x, y, z, C) in `config.image_dtype`, label (x, y, z) uint8 or None, `Geometry`).
    """
    affine = np.asarray(affine, dtype=np.float64)
    original_shape = image.shape[:3]
    # views, not copies: the flips/permutation cost nothing until the normalised copy is made
    ras_image, ras_affine = reorient_to_ras(image, affine, copy=False)
    ras_label = reorient_to_ras(label, affine, copy=False)[0] if label is not None else None

    ras_shape = [int(n) for n in ras_image.shape[:3]]
    # on the file's memory order (a contiguous read, many times faster on a CT than through the flipped view;
    # docs/benchmarks.md, "A region per structure, at real anatomy"), then a view
    backgrounds = statistics.backgrounds if statistics is not None else None
    mask = foreground_mask(image, config.normalization, config.ct_window, backgrounds=backgrounds)
    if statistics is None:  # the whole image's, before the crop (the same file-order read)
        statistics = image_statistics(image, config.normalization, config.ct_window, mask=mask)
    mask = reorient_to_ras(mask, affine, copy=False)[0]
    if config.crop_to_label_mm is not None and ras_label is not None and ras_label.any():
        start, stop = label_box(ras_label > 0, spacing_of(ras_affine), config.crop_to_label_mm)
    elif config.crop_foreground:
        start, stop = mask_bounds(mask | (ras_label > 0) if ras_label is not None else mask, config.crop_margin)
    else:
        start, stop = np.zeros(3, dtype=int), np.array(ras_image.shape[:3])
    crop = tuple(slice(a, b) for a, b in zip(start, stop))
    ras_image, mask = ras_image[crop], mask[crop]
    ras_label = ras_label[crop] if ras_label is not None else None
    crop_affine = ras_affine.copy()
    crop_affine[:3, 3] = ras_affine[:3, :3] @ start + ras_affine[:3, 3]

    in_shape = np.array(ras_image.shape[:3])
    in_spacing = spacing_of(crop_affine)
    if config.reshape is not None:
        out_shape = np.array(config.reshape)
        scale = in_shape / out_shape
    else:
        out_shape = np.maximum(np.round(in_shape * in_spacing / np.array(config.spacing)), 1).astype(int)
        scale = np.array(config.spacing) / in_spacing
        scale = np.where(out_shape == in_shape, np.where(np.isclose(scale, 1, atol=1e-3), 1.0, scale), scale)
    if overwrite_image and image.dtype != np.float32:
        raise ValueError(f"overwrite_image needs a float32 image, got {image.dtype}")
    normalized = normalize(
        ras_image,
        mask,
        config.normalization,
        config.ct_window,
        config.ct_mean_std,
        out=ras_image if overwrite_image else None,
        statistics=statistics,
    )
    del mask
    out_image = resample(normalized, scale, out_shape, order=1, dtype=config.image_dtype)
    del normalized
    out_label = resample(ras_label, scale, out_shape, order=0, dtype=np.uint8) if ras_label is not None else None

    step = np.eye(4)
    step[:3, :3] = np.diag(scale)
    step[:3, 3] = 0.5 * scale - 0.5
    out_affine = crop_affine @ step
    geometry = Geometry(
        original_shape=[int(s) for s in original_shape],
        original_affine=affine.tolist(),
        original_axcodes="".join(nib.aff2axcodes(affine)),
        ras_shape=ras_shape,
        crop_start=[int(s) for s in start],
        crop_stop=[int(s) for s in stop],
        shape=[int(s) for s in out_shape],
        spacing=[float(s) for s in spacing_of(out_affine)],
        affine=out_affine.tolist(),
    )
    return out_image, out_label, geometry


def restore_geometry(array: np.ndarray, geometry: Geometry | dict, order: int = 0, cval: float = 0.0) -> np.ndarray:
    """Maps an array on the preprocessed grid back onto the original file's voxel grid.

    Original voxels inside the crop box take the value interpolated at their position on the
    preprocessed grid; where that position lies beyond the outermost preprocessed voxel centres (up
    to half a coarse voxel, more when the resampled shape was rounded down), the nearest edge value
    is used, so a structure touching the box faces keeps its outer slices. Voxels outside the crop
    box were cropped away as background and get `cval`.

    Args:
        array: (x, y, z) or (x, y, z, C) on the preprocessed grid (e.g. a predicted label map).
        geometry: the case's `Geometry` (or its dict from the TFRecord index).
        order: 0 (nearest) for label maps, 1 for probabilities.
        cval: value outside the crop box (background).

    Returns:
        An array with the original file's spatial shape and voxel order.

    Example:
    ```python
    label_map = restore_geometry(predicted_labels, geometry)            # uint8, original grid
    foreground = restore_geometry(probabilities[..., 1], geometry, order=1)
    ```
    """
    g = Geometry.from_dict(geometry) if isinstance(geometry, dict) else geometry
    if array.ndim == 4:
        return np.stack([restore_geometry(array[..., c], g, order, cval) for c in range(array.shape[-1])], axis=-1)
    # original voxel → world → preprocessed voxel, as one homogeneous matrix
    matrix = np.linalg.inv(np.array(g.affine)) @ np.array(g.original_affine)
    matrix = np.round(matrix, 9)  # pure permutations/flips stay exact integers
    start, stop = crop_box_in_original_voxels(g)
    # only the crop box is interpolated; "nearest" clamps positions beyond the grid's edge voxels
    block = ndimage.affine_transform(
        array,
        matrix[:3, :3],
        matrix[:3, :3] @ start + matrix[:3, 3],
        output_shape=tuple(int(n) for n in stop - start),
        order=order,
        mode="nearest",
    )
    out = np.full(tuple(g.original_shape), cval, dtype=block.dtype)
    out[tuple(slice(a, b) for a, b in zip(start, stop))] = block
    return out


def crop_box_in_original_voxels(g: Geometry) -> tuple[np.ndarray, np.ndarray]:
    """(start, stop) of the RAS crop box in the original file's voxel order (a permutation/flip of RAS)."""
    ornt = nib.orientations.io_orientation(np.array(g.original_affine))
    transform = nib.orientations.ornt_transform(ornt, nib.orientations.axcodes2ornt("RAS"))
    ras_to_original = nib.orientations.inv_ornt_aff(transform, tuple(g.original_shape))
    corners = np.array([[*g.crop_start, 1.0], [*(np.array(g.crop_stop) - 1), 1.0]]) @ ras_to_original.T
    corners = np.rint(corners[:, :3]).astype(int)
    return corners.min(axis=0), corners.max(axis=0) + 1


def _per_channel(normalization: tuple[str, ...], channels: int) -> tuple[str, ...]:
    if len(normalization) == 1:
        return tuple(normalization) * channels
    if len(normalization) != channels:
        raise ConfigError(f"normalization lists {len(normalization)} entries for {channels} channels")
    return tuple(normalization)
