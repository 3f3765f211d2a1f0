"""Command line of `tfmis-visualize`: a picture of one converted record or of an image file.

Two sources:
* `--dataset-dir OUT --sample N [--split train]`: record N of a split of a converted dataset (read
  by its byte offset; no other record is parsed), shown on its preprocessed grid;
* `--image x.nii.gz [--label y.nii.gz] [--prediction p.nii.gz]`: a raw image file (NIfTI; NRRD, MetaImage with
  `tfmis[formats]`; 3D, or 4D with channels last; a channel file of an nnU-Net v2 case brings its other channels),
  reoriented to RAS for display, spacing from its affine. The ground truth is drawn as
  a translucent fill, a prediction (a label map written by a segmentation tool on the image's grid)
  as one-voxel outlines in the same class colours, so both can be compared on one picture.

Two pictures: by default a PNG of the sagittal, coronal and axial mid-planes; with `--no-screen`
an animated GIF sweeping through the slices. The path written is printed on stdout.

Example:
```
tfmis-visualize --dataset-dir data/demo_tfr --sample 0  # → data/demo_tfr/visualize/train_000_demo_003.png
tfmis-visualize --image ct.nii.gz --label seg.nii.gz --class-names background,liver,tumour --no-screen
tfmis-visualize --image ct.nii.gz --label seg.nii.gz --prediction pred.nii.gz  # → ./ct_prediction.png
```
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import numpy as np

from tfmis.data.sources.cases import case_id_from_path
from tfmis.errors import DataError
from tfmis.utils.cli import command, writing

PLANE_AXES = {"sagittal": 0, "coronal": 1, "axial": 2}


class VisualizeError(DataError):
    """A problem with the arguments or the files, reported as one line and exit status 1."""


@dataclasses.dataclass
class CaseView:
    """Everything needed to draw one case.

    Attributes:
        name: the case id, used in the default output file name.
        image: (x, y, z, C) in RAS voxel order.
        label: (x, y, z) class map or None (drawn as a translucent fill).
        spacing: mm along x, y, z.
        channel_names, class_names: lists of names (index = channel / label value) or None.
        title: first line of the picture's title.
        default_stem: the default output path without its suffix.
        prediction: (x, y, z) class map or None (drawn as outlines).
    """

    name: str
    image: np.ndarray
    label: np.ndarray | None
    spacing: tuple
    channel_names: list | None
    class_names: list | None
    title: str
    default_stem: Path
    prediction: np.ndarray | None = None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tfmis-visualize",
        description="Draw one case: a record of a converted TFRecord dataset (--dataset-dir, --sample) or an image "
        "file (--image), optionally with its ground truth (--label, a translucent fill) and a "
        "model's prediction (--prediction, one-voxel outlines in the same class colours). Writes a "
        "PNG of the sagittal, coronal and axial mid-planes (one row per channel, one colour per "
        "class, orientation letters at the panel edges, patient's right on the screen's right), or "
        "with --no-screen an animated GIF sweeping through the slices. Prints the path written.",
        epilog="Exit status: 0 written; 1 a file, split or sample is missing or unreadable, or a label or "
        "prediction does not match the image's grid; 2 bad arguments. Examples: tfmis-visualize --dataset-dir "
        "data/demo/tfrecords --sample 0 --split val; tfmis-visualize --image ct.nii.gz --label seg.nii.gz "
        "--prediction pred.nii.gz",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--dataset-dir",
        metavar="OUT",
        help="converted dataset folder (the --target-dir of tfmis-convert, holding index.json)",
    )
    source.add_argument(
        "--image",
        metavar="FILE",
        help="image file (.nii.gz, .nii; .nrrd, .mha, .mhd with tfmis[formats]; 3D, or 4D with channels last); a "
        "channel file of an nnU-Net v2 raw dataset (imagesTr/<case>_0000.nii.gz) draws every channel of the case",
    )
    p.add_argument(
        "--sample",
        type=int,
        metavar="N",
        help="with --dataset-dir: record number within the split, 0-based, in storage order",
    )
    p.add_argument(
        "--split",
        default=None,
        help="with --dataset-dir: split to read, or several joined by + (fold0+fold1) (default: train, or the "
        "first split when there is no train split, e.g. fold0)",
    )
    p.add_argument(
        "--label",
        metavar="FILE",
        help="with --image: NIfTI ground-truth label map on the same grid as the image, drawn as a translucent fill",
    )
    p.add_argument(
        "--prediction",
        metavar="FILE",
        help="with --image: NIfTI label map predicted by a segmentation model (e.g. uint8, class "
        "values 0, 1, 2, ...) on the same grid as the image, drawn as one-voxel outlines in the "
        "class colours; with --label both are drawn, to compare them",
    )
    p.add_argument(
        "--class-names",
        metavar="NAMES",
        help="with --image: comma-separated names of label values 0, 1, 2, ..., e.g. "
        "background,liver,tumour (default: the 'labels' of a dataset.json next to imagesTr/, "
        "else 'class 1', 'class 2', ...)",
    )
    p.add_argument(
        "--channel-names",
        metavar="NAMES",
        help="with --image: comma-separated channel names, e.g. T1w,T2w (default: the 'modality' of "
        "a dataset.json next to imagesTr/, else 'channel 0', ...)",
    )
    p.add_argument(
        "--no-screen",
        action="store_true",
        help="write an animated GIF sweeping through the slices instead of the PNG of the mid-planes",
    )
    p.add_argument(
        "--axis",
        choices=sorted(PLANE_AXES),
        default="axial",
        help="with --no-screen: the direction swept (default axial)",
    )
    p.add_argument("--fps", type=float, default=8.0, help="with --no-screen: frames per second (default 8)")
    p.add_argument(
        "--max-frames",
        type=int,
        default=96,
        help="with --no-screen: at most this many frames; longer sweeps skip evenly (default 96)",
    )
    p.add_argument(
        "--output",
        metavar="PATH",
        help="file to write (default: OUT/visualize/{split}_{sample:03d}_{case_id}.png|.gif with "
        "--dataset-dir, ./{case}.png|.gif with --image, ./{case}_prediction.png|.gif with "
        "--image and --prediction)",
    )
    return p


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_argument_combinations(parser, args)
    case = (
        dataset_case(args.dataset_dir, args.split, args.sample)
        if args.dataset_dir
        else nifti_case(
            args.image,
            args.label,
            _names(args.class_names),
            _names(args.channel_names),
            prediction_path=args.prediction,
        )
    )
    suffix = ".gif" if args.no_screen else ".png"
    # appended, not with_suffix: case ids may contain dots
    path = Path(args.output) if args.output else case.default_stem.with_name(case.default_stem.name + suffix)
    writing(path)
    draw(case, path, sweep=args.no_screen, axis=PLANE_AXES[args.axis], fps=args.fps, max_frames=args.max_frames)
    print(path)
    return 0


def draw(case: CaseView, path: Path, sweep: bool = False, axis: int = 2, fps: float = 8, max_frames: int = 96) -> Path:
    """Writes the PNG of the mid-planes of `case`, or with `sweep` the GIF of its slices along `axis`.

    Example:
        draw(dataset_case("OUT", "train", 0), Path("case.png"))
    """
    from tfmis.utils.io import atomic_writer
    from tfmis.viz.slices import write_slice_sweep_gif

    if sweep:
        write_slice_sweep_gif(path, case.image, axis=axis, fps=fps, max_frames=max_frames, **_drawing_args(case))
    else:
        fig = orthogonal_figure(case)
        with atomic_writer(path, "wb") as f:
            fig.savefig(f, format="png")
    return path


def orthogonal_figure(case: CaseView):
    """The figure of the mid-planes of `case` that `draw` saves as PNG (a matplotlib Figure)."""
    from tfmis.viz.slices import plot_orthogonal_planes

    return plot_orthogonal_planes(case.image, **_drawing_args(case))


def _drawing_args(case: CaseView) -> dict:
    return dict(
        label=case.label,
        prediction=case.prediction,
        spacing=case.spacing,
        channel_names=case.channel_names,
        class_names=case.class_names,
        title=case.title,
    )


def dataset_case(dataset_dir: str | Path, split: str | None, sample: int) -> CaseView:
    """Record `sample` of `split` of a converted dataset, reading only that record.

    The split and the record number are checked against index.json first, so mistakes are
    reported without starting TensorFlow.
    """
    from tfmis.data.records import load_index, split_cases, split_parts

    index = load_index(dataset_dir)
    splits = list(index["splits"])
    split = split or ("train" if "train" in splits or not splits else splits[0])
    try:
        split_parts(index, split)  # one split, or several joined: fold0+fold1
    except KeyError:
        raise VisualizeError(
            f"split {split!r} is not in {dataset_dir}; available splits: {', '.join(splits)}"
        ) from None
    except ValueError as e:  # a split joined twice
        raise VisualizeError(f"{e} ({dataset_dir})") from None
    cases = split_cases(index, split)
    if not 0 <= sample < len(cases):
        valid = f"0..{len(cases) - 1}" if cases else "none"
        raise VisualizeError(
            f"sample {sample} is out of range: split {split!r} of {dataset_dir} has "
            f"{len(cases)} record{'' if len(cases) == 1 else 's'} (valid --sample: {valid})"
        )
    record = _read_record(dataset_dir, split, sample, cases[sample])
    meta = record["metadata"]
    name = record["case_id"]
    return CaseView(
        name=name,
        image=record["image"],
        label=record["label"],
        spacing=tuple(meta["geometry"]["spacing"]),
        channel_names=meta.get("modalities"),
        class_names=meta.get("labels"),
        title=f"{name}  ({index['source'].get('name', '')} {split} record {sample})",
        default_stem=Path(dataset_dir) / "visualize" / f"{split}_{sample:03d}_{name}",
    )


def nifti_case(
    image_path: str | Path, label_path=None, class_names=None, channel_names=None, prediction_path=None
) -> CaseView:
    """An image file (and label, and prediction) reoriented to RAS, with spacing from the affine.

    The label and the prediction are label maps on the image's grid (each reoriented with its own
    affine); their shapes are checked against the image's. Names not given are taken from a
    dataset.json in the folder above the file's (MSD or nnU-Net v2 layout), if any; a channel file of an nnU-Net v2
    case brings the case's other channels with it.
    """
    from tfmis.data.preprocess import reorient_to_ras, spacing_of

    dataset, case = _dataset_near(Path(image_path))
    if case is not None and len(case.image_files) > 1:
        image, affine = _load_channels(dataset, case)
    else:
        image, affine = _load_file(image_path, "--image")
    if image.ndim not in (3, 4):
        raise VisualizeError(
            f"--image {image_path}: expected a 3D or 4D (channels last) image, got shape {image.shape}"
        )
    image, ras_affine = reorient_to_ras(image.astype(np.float32, copy=False), affine)
    label = _class_map(label_path, "--label", image.shape[:3]) if label_path is not None else None
    prediction = _class_map(prediction_path, "--prediction", image.shape[:3]) if prediction_path is not None else None
    msd_channels, msd_classes = (dataset.modalities, dataset.labels) if dataset is not None else (None, None)
    name = case.case_id if case is not None else case_id_from_path(str(image_path))
    title = f"{name}  ({Path(image_path).name}, stored {''.join(_axcodes(affine))})"
    if prediction is not None:
        title += "\n" + ("label (fill) vs prediction (outline)" if label is not None else "prediction (outline)")
    return CaseView(
        name=name,
        image=image,
        label=label,
        prediction=prediction,
        spacing=tuple(float(s) for s in spacing_of(ras_affine)),
        channel_names=channel_names or msd_channels,
        class_names=class_names or msd_classes,
        title=title,
        default_stem=Path(".") / (name + ("_prediction" if prediction is not None else "")),
    )


def _class_map(path, flag: str, image_shape: tuple) -> np.ndarray:
    """The label map NIfTI `path` (given as `flag`) in RAS order, checked to lie on the image's grid."""
    from tfmis.data.preprocess import reorient_to_ras

    data, affine = _load_file(path, flag)
    if data.ndim > 3 and all(n == 1 for n in data.shape[3:]):
        data = data.reshape(data.shape[:3])  # some tools write (x, y, z, 1)
    if data.ndim != 3:
        raise VisualizeError(f"{flag} {path}: expected a 3D label map, got shape {data.shape}")
    data, _ = reorient_to_ras(data, affine)
    if data.shape != tuple(image_shape):
        raise VisualizeError(
            f"{flag} {path}: shape {data.shape} (in RAS order) does not match the image's "
            f"{tuple(image_shape)}; it must be on the same voxel grid as --image"
        )
    return np.rint(data).astype(np.int32) if not np.issubdtype(data.dtype, np.integer) else data


def _check_argument_combinations(parser: argparse.ArgumentParser, args) -> None:
    if args.dataset_dir is not None:
        if args.sample is None:
            parser.error("--dataset-dir needs --sample N (the record number within the split)")
        if args.prediction is not None:
            parser.error(
                "--prediction goes with --image: it is a NIfTI label map on the grid of that NIfTI image, "
                "not of a converted record (draw it with --image scan.nii.gz --prediction FILE)"
            )
        for flag in ("label", "class_names", "channel_names"):
            if getattr(args, flag) is not None:
                parser.error(f"--{flag.replace('_', '-')} goes with --image; a converted record carries its own")
    elif args.sample is not None or args.split is not None:
        parser.error("--sample and --split go with --dataset-dir")
    if args.fps <= 0 or args.max_frames < 1:
        parser.error("--fps must be positive and --max-frames at least 1")


def _read_record(dataset_dir, split: str, sample: int, entry: dict) -> dict:
    import tensorflow as tf

    from tfmis.data.records import read_record

    try:
        return read_record(dataset_dir, split, sample)
    except (ValueError, tf.errors.OpError) as e:
        reason = _plain_tf_message(getattr(e, "message", None) or str(e))
        raise VisualizeError(
            f"record {sample} of split {split!r} (case {entry['case_id']}, {entry['file']} at byte "
            f"{entry['offset']}) could not be decoded; the shard is damaged or does not match "
            f"index.json: {reason}"
        ) from e


def _plain_tf_message(message: str) -> str:
    """TF's error text without its `{{function_node ...}}` prefix and `[Op:...]` suffix."""
    message = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", message.strip().splitlines()[0])
    return re.sub(r"\s*\[Op:\w+\]$", "", message)


def _load_file(path, flag: str):
    """(array, affine) of an image file in any format `tfmis.data.sources.image_io` reads; one VisualizeError line."""
    from tfmis.data.sources.errors import UnreadableImage
    from tfmis.data.sources.image_io import read_image

    path = Path(path)
    if not path.is_file():
        raise VisualizeError(f"{flag} {path}: file not found")
    try:
        img = read_image(path)
    except UnreadableImage as e:
        raise VisualizeError(f"{flag} {e}") from e
    return img.array, img.affine


def _dataset_near(image_path: Path):
    """(dataset, case) of the dataset.json above `imagesTr/` or `imagesTs/` (MSD or nnU-Net v2 layout) and the case
    whose image file `image_path` is; (dataset, None) for a file it does not list, (None, None) without one."""
    from tfmis.data.sources.errors import DatasetError
    from tfmis.data.sources.layouts import open_dataset

    path = image_path.resolve()
    if path.parent.name not in ("imagesTr", "imagesTs"):
        return None, None
    try:
        dataset = open_dataset(path.parent.parent)
    except DatasetError:  # names are a nicety here: an unusable dataset.json just means none
        return None, None
    for case in dataset.training + dataset.test:
        if any(Path(f).name == path.name for f in case.image_files) and not case.problem:
            return dataset, case
    return dataset, None


def _load_channels(dataset, case):
    """(X, Y, Z, C) image and affine of an nnU-Net v2 case's channel files; one VisualizeError line."""
    from tfmis.data.sources.errors import CaseError
    from tfmis.data.sources.image_io import load_image

    try:
        image, affine, _ = load_image(dataset.resolve_image(case), dataset.num_channels, case.case_id)
    except CaseError as e:
        raise VisualizeError(f"--image: {e}") from e
    return image, affine


def _axcodes(affine) -> tuple:
    import nibabel as nib

    return nib.orientations.aff2axcodes(affine)


def _names(text: str | None) -> list | None:
    return [n.strip() for n in text.split(",")] if text else None
