"""Slice views of multi-channel 3D volumes with label overlays.

Two pictures of one case, both for volumes in RAS voxel order (x → Right, y → Anterior, z → Superior),
shape (x, y, z, C), as `tfmis.data.records.read_record` returns them:

* `plot_orthogonal_planes`: a figure with one row per channel and the sagittal, coronal and axial
  planes through a point (default the volume centre) as columns;
* `write_slice_sweep_gif`: an animated GIF stepping through the slices along one axis, every
  channel side by side.

Display convention: in every panel both in-plane axes increase rightwards and upwards, so the
patient's right is on the screen's right (neurological convention), anterior is up in axial views
and right in sagittal views. Letters at the panel edges (R/L, A/P, S/I) say so on the picture.
Panels are drawn in millimetres, so the voxel spacing gives them their physical aspect ratio.

The label is a translucent fill, one colour per class, background transparent; an optional
`prediction` is drawn as one-voxel outlines in the same class colours, so both can be compared on
one picture.

Figures are built on matplotlib's Agg canvas directly (no pyplot): nothing needs a display, and
no global backend is switched under a caller's feet.

Example:
```python
fig = plot_orthogonal_planes(image, label, spacing=(1.5, 1.5, 2.0), channel_names=["T1w", "T2w"],
                             class_names=["background", "grey matter", "white matter"], title="demo_000")
fig.savefig("demo_000.png")
write_slice_sweep_gif("demo_000.gif", image, label, spacing=(1.5, 1.5, 2.0), axis=2)
```
"""

from __future__ import annotations

import dataclasses

import numpy as np
from matplotlib import patheffects
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from PIL import Image

from tfmis.errors import DataError, UsageError
from tfmis.utils.io import atomic_writer

OVERLAY_ALPHA = 0.4
# Saturated colours that are easy to tell apart (after Sasha Trubetskoy's list); none is grey, so
# no class can vanish into the image. Class k > 0 gets CLASS_COLORS[(k - 1) % len(CLASS_COLORS)].
CLASS_COLORS = (
    "#e6194b",
    "#3cb44b",
    "#ffe119",
    "#4363d8",
    "#f58231",
    "#42d4f4",
    "#f032e6",
    "#911eb4",
    "#bfef45",
    "#fabed4",
    "#469990",
    "#9a6324",
)
PNG_PANEL_INCHES = 2.8  # height of one row of the orthogonal-planes figure
PNG_DPI = 100
GIF_PANEL_INCHES = 2.6
GIF_DPI = 80  # GIFs are 256-colour and LZW-compressed: small frames keep them a few MB at most
_WINDOW_SAMPLE = 2_000_000  # voxels used for the intensity percentiles of a large volume


@dataclasses.dataclass(frozen=True)
class Plane:
    """One of the three orthogonal views of a RAS volume.

    Attributes:
        name: `sagittal`, `coronal` or `axial`.
        axis: the RAS axis held fixed (0 = x, 1 = y, 2 = z).
        horizontal, vertical: the RAS axes drawn left→right and bottom→top.
        edge_letters: the anatomical direction at the (left, right, bottom, top) edges of the panel.
    """

    name: str
    axis: int
    horizontal: int
    vertical: int
    edge_letters: tuple[str, str, str, str]


PLANES = (
    Plane("sagittal", 0, 1, 2, ("P", "A", "I", "S")),
    Plane("coronal", 1, 0, 2, ("L", "R", "I", "S")),
    Plane("axial", 2, 0, 1, ("L", "R", "P", "A")),
)


def class_color(value: int) -> tuple[float, float, float]:
    """The RGB colour (0..1) of label value `value` (> 0) in every picture.

    Example:
        >>> class_color(1) == class_color(1 + len(CLASS_COLORS))
        True
    """
    return to_rgb(CLASS_COLORS[(int(value) - 1) % len(CLASS_COLORS)])


def class_name(value: int, class_names=None) -> str:
    """`class_names[value]`, or `class {value}` when the name is not known."""
    if class_names is not None and 0 <= value < len(class_names) and class_names[value]:
        return str(class_names[value])
    return f"class {value}"


def intensity_window(channel: np.ndarray, percentiles=(1.0, 99.0)) -> tuple[float, float]:
    """(low, high) display window of one channel: robust percentiles of its nonzero voxels.

    Zero is left out because it is the background outside the body (and the padding of cropped or
    normalised volumes); including it would pull the window towards black.

    Args:
        channel: (x, y, z) intensities.
        percentiles: lower and upper percentile.

    Example:
        >>> intensity_window(np.arange(102.0))   # 0 is background: the window is over 1..101
        (2.0, 100.0)
    """
    values = np.asarray(channel).ravel()
    values = values[values != 0]
    if values.size > _WINDOW_SAMPLE:
        values = values[:: values.size // _WINDOW_SAMPLE]  # a regular subsample: same result, faster
    if values.size == 0:
        return 0.0, 1.0
    low, high = np.percentile(values.astype(np.float32), percentiles)
    if not high > low:
        high = low + 1.0  # a flat channel: any nonzero width shows it as one grey
    return float(low), float(high)


def plane_slice(volume: np.ndarray, plane: Plane, index: int) -> np.ndarray:
    """The 2D section of a (x, y, z) `volume` at `index` along `plane.axis`, as (vertical, horizontal)
    rows for `imshow(..., origin="lower")`.

    Example:
        >>> plane_slice(np.zeros((4, 5, 6)), PLANES[2], 3).shape   # axial: rows = y, columns = x
        (5, 4)
    """
    section = np.take(volume, index, axis=plane.axis)  # remaining axes: (horizontal, vertical)
    return np.swapaxes(section, 0, 1)


def plane_extent(shape, spacing, plane: Plane) -> tuple[float, float, float, float]:
    """(left, right, bottom, top) of a panel in millimetres, which gives it its physical aspect ratio."""
    return (
        0.0,
        shape[plane.horizontal] * spacing[plane.horizontal],
        0.0,
        shape[plane.vertical] * spacing[plane.vertical],
    )


def outline(label2d: np.ndarray) -> np.ndarray:
    """Boolean mask of the labelled pixels that touch a pixel of another value (4-neighbourhood).

    Example:
        >>> int(outline(np.pad(np.ones((3, 3), int), 1)).sum())   # a 3x3 square: all but its centre
        8
    """
    padded = np.pad(label2d, 1)
    centre = padded[1:-1, 1:-1]
    differs = (
        (centre != padded[:-2, 1:-1])
        | (centre != padded[2:, 1:-1])
        | (centre != padded[1:-1, :-2])
        | (centre != padded[1:-1, 2:])
    )
    return differs & (centre != 0)


def render_rgb(fig: Figure) -> np.ndarray:
    """Draws `fig` and returns its pixels as a (height, width, 3) uint8 array.

    Example:
        >>> render_rgb(plot_orthogonal_planes(np.ones((8, 8, 8)))).dtype
        dtype('uint8')
    """
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def plot_orthogonal_planes(
    image,
    label=None,
    spacing=(1.0, 1.0, 1.0),
    channel_names=None,
    class_names=None,
    title=None,
    center=None,
    prediction=None,
) -> Figure:
    """Sagittal, coronal and axial planes through `center`, one row per channel, label overlaid.

    Args:
        image: (x, y, z, C) or (x, y, z) intensities in RAS voxel order (any float or int dtype).
        label: (x, y, z) integer class map, or None. Drawn as a translucent fill per class.
        spacing: voxel size in mm along x, y, z (gives the panels their physical aspect ratio).
        channel_names: one name per channel (row labels); default `channel 0`, `channel 1`, ...
        class_names: name of each label value (index = value), e.g. `["background", "liver"]`.
        title: first line of the figure title, e.g. the case id.
        center: (x, y, z) voxel the three planes go through; default the centre of the volume.
        prediction: (x, y, z) integer class map drawn as outlines in the class colours, or None.

    Returns:
        A matplotlib `Figure` (Agg canvas): `fig.savefig(path)` or `render_rgb(fig)`. The legend
        lists the classes present anywhere in the label (or prediction), not all declared ones, so
        it describes what is in this case.

    Example:
        >>> fig = plot_orthogonal_planes(np.ones((8, 9, 10, 2)), np.ones((8, 9, 10), np.uint8),
        ...                              class_names=["background", "organ"])
        >>> len(fig.axes), [t.get_text() for t in fig.legends[0].get_texts()]
        (6, ['organ'])
    """
    volume, label, prediction, spacing = _checked_inputs(image, label, prediction, spacing)
    shape = volume.shape[:3]
    center = _checked_center(center, shape)
    num_channels = volume.shape[3]
    widths = [plane_extent(shape, spacing, p)[1] for p in PLANES]
    tallest = max(plane_extent(shape, spacing, p)[3] for p in PLANES)
    width_inches = max(PNG_PANEL_INCHES * sum(widths) / tallest + 1.0, 6.0)
    fig = _new_figure((width_inches, PNG_PANEL_INCHES * num_channels + 1.5), PNG_DPI)
    grid = fig.add_gridspec(num_channels, len(PLANES), width_ratios=widths)
    colors = _ClassColors.for_maps(label, prediction)
    for c in range(num_channels):
        window = intensity_window(volume[..., c])
        for col, plane in enumerate(PLANES):
            ax = fig.add_subplot(grid[c, col])
            panel = _Panel.create(ax, plane, shape, spacing, window, label is not None, prediction is not None)
            panel.show(center[plane.axis], volume[..., c], label, prediction, colors)
            if c == 0:
                ax.set_title(f"{plane.name}  {'xyz'[plane.axis]} = {center[plane.axis]}", fontsize=10)
            if col == 0:
                ax.set_ylabel(_channel_name(c, channel_names), fontsize=11)
    fig.suptitle(_title_text(title, shape, spacing), fontsize=11)
    _add_legend(fig, label, prediction, class_names)
    return fig


def write_slice_sweep_gif(
    path,
    image,
    label=None,
    spacing=(1.0, 1.0, 1.0),
    channel_names=None,
    class_names=None,
    title=None,
    axis: int = 2,
    fps: float = 8,
    max_frames: int = 96,
    prediction=None,
) -> int:
    """Writes an animated GIF that steps through the slices along `axis`, all channels side by side.

    Args:
        path: the .gif file to write (written atomically; parent folders are created).
        image, label, spacing, channel_names, class_names, title, prediction: as in `plot_orthogonal_planes`.
        axis: RAS axis swept: 0 sagittal, 1 coronal, 2 axial (default).
        fps: frames per second.
        max_frames: at most this many frames; longer sweeps use evenly spaced slices (first and
            last included), which keeps the file small.

    Returns:
        The number of frames written: `min(slices along axis, max_frames)`.

    Example:
        `write_slice_sweep_gif("case.gif", np.random.rand(16, 16, 12, 2), axis=2)` writes 12 frames
        and returns 12.
    """
    if axis not in (0, 1, 2):
        raise UsageError(f"axis must be 0 (sagittal), 1 (coronal) or 2 (axial), got {axis!r}")
    if fps <= 0 or max_frames < 1:
        raise UsageError(f"fps must be positive and max_frames at least 1, got fps={fps}, max_frames={max_frames}")
    volume, label, prediction, spacing = _checked_inputs(image, label, prediction, spacing)
    shape, plane = volume.shape[:3], PLANES[axis]
    num_channels, num_slices = volume.shape[3], volume.shape[axis]
    indices = sweep_indices(num_slices, max_frames)

    left, right, bottom, top = plane_extent(shape, spacing, plane)
    panel_width = GIF_PANEL_INCHES * (right - left) / (top - bottom)
    fig = _new_figure((max(panel_width * num_channels + 0.6, 4.0), GIF_PANEL_INCHES + 1.3), GIF_DPI)
    grid = fig.add_gridspec(1, num_channels)
    colors = _ClassColors.for_maps(label, prediction)
    panels = []
    for c in range(num_channels):
        ax = fig.add_subplot(grid[0, c])
        ax.set_title(_channel_name(c, channel_names), fontsize=10)
        panels.append(
            _Panel.create(
                ax, plane, shape, spacing, intensity_window(volume[..., c]), label is not None, prediction is not None
            )
        )
    caption = fig.suptitle("", fontsize=10)
    _add_legend(fig, label, prediction, class_names)

    frames = []
    for frame, index in enumerate(indices):
        for c, panel in enumerate(panels):
            panel.show(index, volume[..., c], label, prediction, colors)
        caption.set_text("\n".join(filter(None, [title, f"{plane.name} slice {index + 1}/{num_slices}"])))
        frames.append(Image.fromarray(render_rgb(fig)))
        if frame == 0:
            fig.set_layout_engine("none")  # freeze the layout: every frame gets the same geometry
    with atomic_writer(path, "wb") as f:
        frames[0].save(
            f, format="GIF", save_all=True, append_images=frames[1:], duration=max(int(round(1000 / fps)), 20), loop=0
        )
    return len(frames)


def sweep_indices(num_slices: int, max_frames: int) -> list[int]:
    """Slices shown by a sweep: all of them, or `max_frames` evenly spaced ones (ends included).

    Example:
        >>> sweep_indices(5, 96), sweep_indices(9, 3)
        ([0, 1, 2, 3, 4], [0, 4, 8])
    """
    if num_slices <= max_frames:
        return list(range(num_slices))
    return [int(i) for i in np.linspace(0, num_slices - 1, max_frames).round()]


@dataclasses.dataclass
class _ClassColors:
    """Lookup tables label value → RGBA, for the translucent fill and for the opaque outlines."""

    fill: np.ndarray
    line: np.ndarray

    @classmethod
    def for_maps(cls, *maps) -> _ClassColors:
        largest = max([int(m.max()) for m in maps if m is not None and m.size] + [0])
        fill = np.zeros((largest + 1, 4), np.float32)
        for value in range(1, largest + 1):
            fill[value] = (*class_color(value), OVERLAY_ALPHA)
        line = fill.copy()
        line[1:, 3] = 1.0
        return cls(fill, line)


@dataclasses.dataclass
class _Panel:
    """The artists of one panel, kept so that a sweep swaps the data instead of redrawing the axes."""

    plane: Plane
    image: object
    fill: object
    line: object

    @classmethod
    def create(cls, ax, plane: Plane, shape, spacing, window, with_label: bool, with_prediction: bool) -> _Panel:
        extent = plane_extent(shape, spacing, plane)
        rows_cols = (shape[plane.vertical], shape[plane.horizontal])
        common = dict(origin="lower", extent=extent, interpolation="nearest")
        image = ax.imshow(np.zeros(rows_cols, np.float32), cmap="gray", vmin=window[0], vmax=window[1], **common)
        fill = ax.imshow(np.zeros(rows_cols + (4,), np.float32), **common) if with_label else None
        line = ax.imshow(np.zeros(rows_cols + (4,), np.float32), **common) if with_prediction else None
        ax.set_facecolor("black")
        ax.set_xticks([])
        ax.set_yticks([])
        _add_edge_letters(ax, plane)
        return cls(plane, image, fill, line)

    def show(self, index: int, channel: np.ndarray, label, prediction, colors: _ClassColors) -> None:
        """Puts slice `index` of `channel` (and of the label / prediction) into the panel."""
        self.image.set_data(plane_slice(channel, self.plane, index))
        if self.fill is not None:
            self.fill.set_data(colors.fill[plane_slice(label, self.plane, index)])
        if self.line is not None:
            section = plane_slice(prediction, self.plane, index)
            self.line.set_data(colors.line[np.where(outline(section), section, 0)])


def _new_figure(figsize, dpi) -> Figure:
    fig = Figure(figsize=figsize, dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)  # attaches itself as fig.canvas
    return fig


def _checked_inputs(image, label, prediction, spacing):
    volume = np.asarray(image)
    if volume.ndim == 3:
        volume = volume[..., None]
    if volume.ndim != 4 or min(volume.shape) < 1:
        raise DataError(f"image must be (x, y, z) or (x, y, z, C), got shape {volume.shape}")
    volume = volume.astype(np.float32, copy=False)  # float16 records: percentiles and imshow want float32
    maps = [_checked_class_map(m, name, volume.shape[:3]) for m, name in ((label, "label"), (prediction, "prediction"))]
    spacing = np.asarray(spacing, dtype=float)
    if spacing.shape != (3,) or not (spacing > 0).all():
        raise DataError(f"spacing must be three positive sizes in mm, got {spacing.tolist()}")
    return volume, maps[0], maps[1], spacing


def _checked_class_map(array, name: str, shape):
    if array is None:
        return None
    array = np.asarray(array)
    if array.shape != tuple(shape):
        raise DataError(f"{name} shape {array.shape} does not match the image's spatial shape {tuple(shape)}")
    if not np.issubdtype(array.dtype, np.integer):
        array = np.rint(array).astype(np.int32)  # label files are often stored as floats
    if array.size and array.min() < 0:
        raise DataError(f"{name} has negative values; expected class indices 0, 1, 2, ...")
    return array


def _checked_center(center, shape) -> tuple[int, int, int]:
    if center is None:
        return tuple(s // 2 for s in shape)
    center = tuple(int(c) for c in center)
    if len(center) != 3 or any(not 0 <= c < s for c, s in zip(center, shape)):
        raise UsageError(f"center {center} is not a voxel of a volume of shape {tuple(shape)}")
    return center


def _channel_name(channel: int, channel_names) -> str:
    if channel_names is not None and channel < len(channel_names) and channel_names[channel]:
        return str(channel_names[channel])
    return f"channel {channel}"


def _title_text(title, shape, spacing) -> str:
    grid = f"{' × '.join(str(s) for s in shape)} voxels, spacing {' × '.join(f'{s:g}' for s in spacing)} mm (RAS)"
    return f"{title}\n{grid}" if title else grid


def _present_classes(*maps) -> list[int]:
    present = set()
    for m in maps:
        if m is not None and m.size:
            present.update(int(v) for v in np.flatnonzero(np.bincount(m.ravel())))
    return sorted(present - {0})


def _add_legend(fig: Figure, label, prediction, class_names) -> None:
    handles = [
        Patch(facecolor=class_color(v), edgecolor="black", label=class_name(v, class_names))
        for v in _present_classes(label, prediction)
    ]
    if prediction is not None:
        handles.append(Line2D([], [], color="black", linewidth=1.5, label="prediction: outlines"))
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 4), frameon=False, fontsize=10)


def _add_edge_letters(ax, plane: Plane) -> None:
    style = dict(
        transform=ax.transAxes,
        color="white",
        fontsize=9,
        fontweight="bold",
        path_effects=[patheffects.withStroke(linewidth=2, foreground="black")],
    )
    left, right, bottom, top = plane.edge_letters
    ax.text(0.02, 0.5, left, ha="left", va="center", **style)
    ax.text(0.98, 0.5, right, ha="right", va="center", **style)
    ax.text(0.5, 0.02, bottom, ha="center", va="bottom", **style)
    ax.text(0.5, 0.98, top, ha="center", va="top", **style)


__all__ = [
    "PLANES",
    "Plane",
    "class_color",
    "class_name",
    "intensity_window",
    "outline",
    "plane_extent",
    "plane_slice",
    "plot_orthogonal_planes",
    "render_rgb",
    "sweep_indices",
    "write_slice_sweep_gif",
]
