"""The options of a conversion: `ConversionOptions`, the one definition behind the `data.conversion` config section
and the `tfmis-convert` flags, and `ConversionConfig` (the options plus where from and to), with the parameters that
decide a conversion's output (`ConversionConfig.requested`)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Literal

from tfmis.data.folds import DEFAULT_SPLIT, read_splits_file
from tfmis.data.records import COMPRESSIONS, SCHEMA_VERSION
from tfmis.errors import ConfigError
from tfmis.hardware import case_workers


def _option(
    default, help: str, flag: str | None = None, lengths: tuple[int, ...] | None = None, group: str | None = None
):
    """A conversion option: its default and how `tfmis-convert` offers it (help, flag, value count)."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "lengths": lengths, "group": group})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConversionOptions:
    """How a dataset is converted: the one definition behind the `data.conversion` config section, the
    `tfmis-convert` flags and `ConversionConfig`.

    Args:
        split: fractions for train/val/test (1 to 3 values); the default 0.7,0.15,0.15 unless `folds` is set.
        folds: K for K-fold splits `fold0..fold{K-1}` instead of `split`, stratified by the classes each case
            holds (`assign_splits`).
        spacing: target spacing (mm, RAS order); None = the dataset's median spacing.
        reshape: fixed output shape instead of resampling to a spacing.
        shards: shards per split (at most one per case).
        compression: GZIP, ZLIB or NONE.
        workers: parallel preprocessing processes at most (1 = in this process unless memory is tight; None =
            `hardware.case_workers()`: the usable CPUs, at most 8); fewer when the usable memory holds fewer cases
            (`tfmis.data.case_pool.CasePool`).
        seed: seed of the split.
        image_dtype: float16 or float32.
        ct_window: (low, high) HU window for CT channels; None = the 0.5/99.5 percentiles of the
            labelled foreground, measured in a first pass (as nnU-Net does).
        ct_normalization: CT channels after clipping to `ct_window`: "scale" to [0, 1], or "zscore": minus
            the mean, over the standard deviation, of the labelled foreground intensities of all training
            cases (nnU-Net's CTNormalization; measured in the same first pass).
        crop_foreground, crop_margin: crop to the non-background bounding box (+ margin voxels).
        crop_to_label_mm: crop to the labelled voxels' box + this many mm instead (a cascade's fine stage).
    """

    split: tuple[float, ...] | None = _option(
        None,
        "fractions of the labelled cases for train,val,test (default 0.7,0.15,0.15); normalised to sum 1",
        lengths=(1, 2, 3),
        group="split",
    )
    folds: int | None = _option(
        None, "K: write K folds (splits fold0..foldK-1) instead of train/val/test", group="split"
    )
    spacing: tuple[float, float, float] | None = _option(
        None,
        "target voxel spacing in mm along R,A,S, e.g. 1.5,1.5,2.0 (default: the dataset's median spacing)",
        group="grid",
    )
    reshape: tuple[int, int, int] | None = _option(
        None, "fixed output shape X,Y,Z after cropping, e.g. 120,120,96 (instead of resampling)", group="grid"
    )
    shards: int = _option(4, "shards per split (at most one per case; default 4)")
    compression: Literal["GZIP", "ZLIB", "NONE"] = _option("GZIP", "TFRecord compression (default GZIP)")
    workers: int | None = _option(
        None,
        "parallel preprocessing processes at most (default: the usable CPUs, at most 8), fewer when the usable memory "
        "(a cgroup limit) holds fewer cases; 1 = no subprocess unless memory is tight",
    )
    seed: int = _option(0, "seed of the split (default 0)")
    image_dtype: Literal["float16", "float32"] = _option(
        "float16", "storage dtype of the normalised images (default float16, half the bytes)"
    )
    ct_window: tuple[float, float] | None = _option(
        None,
        "LOW,HIGH Hounsfield window for CT channels, e.g. -57,164 (default: 0.5/99.5 percentiles of the "
        "labelled foreground)",
    )
    ct_normalization: Literal["scale", "zscore"] = _option(
        "scale",
        "CT channels after clipping to the window: scale to [0, 1] (default) or zscore with the mean and "
        "std of the labelled foreground over the training cases (nnU-Net)",
    )
    crop_foreground: bool = _option(True, "do not crop to the foreground bounding box", flag="--no-crop")
    crop_margin: int = _option(0, "voxels kept around the foreground box (default 0)")
    crop_to_label_mm: float | None = _option(
        None,
        "crop each case to its labelled voxels' box grown by MM millimetres instead of the foreground box (the "
        "region a cascade's fine stage sees; cases without labelled voxels keep the foreground crop)",
    )

    def __post_init__(self):
        if self.split is not None and self.folds is not None:
            raise ConfigError(f"set only one of split {list(self.split)} and folds {self.folds}")
        if self.split is None and self.folds is None:
            object.__setattr__(self, "split", DEFAULT_SPLIT)
        for name in ("split", "spacing", "reshape", "ct_window"):  # YAML and JSON give lists
            value = getattr(self, name)
            object.__setattr__(self, name, tuple(value) if value is not None else None)
        if self.split is not None:
            if not 1 <= len(self.split) <= 3 or min(self.split) < 0 or sum(self.split) <= 0:
                raise ConfigError(f"split must be 1 to 3 non-negative fractions (train,val,test), got {self.split}")
        if self.folds is not None and self.folds < 2:
            raise ConfigError(f"folds must be at least 2, got {self.folds}")
        if self.ct_normalization not in ("scale", "zscore"):
            raise ConfigError(f"ct_normalization must be scale or zscore, got {self.ct_normalization!r}")
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"compression must be one of {sorted(COMPRESSIONS)}, got {self.compression!r}")
        if self.shards < 1 or (self.workers is not None and self.workers < 1):
            raise ConfigError("shards and workers must be at least 1")
        if self.crop_margin < 0:
            raise ConfigError(f"crop_margin must be >= 0, got {self.crop_margin}")
        if self.crop_to_label_mm is not None and self.crop_to_label_mm < 0:
            raise ConfigError(f"crop_to_label_mm must be >= 0 mm (or null), got {self.crop_to_label_mm}")

    @property
    def num_workers(self) -> int:
        return self.workers or case_workers()


@dataclasses.dataclass(frozen=True)
class ConversionConfig(ConversionOptions):
    """What `convert` does: the options plus where from and to. See `tfmis-convert --help`.

    Args:
        source_dir: MSD dataset folder (with dataset.json).
        target_dir: output folder for shards, index.json and fingerprint.json.
        overwrite: rebuild when the target holds a conversion with other parameters.
        progress: show a progress bar.
        splits_file: a splits_final.json (nnU-Net v2's format, `read_splits_file`) whose val lists are the folds;
            sets `folds` to its number of folds. Its content, not its path, is a parameter of the conversion.
        **options: the `ConversionOptions`.
    """

    source_dir: str
    target_dir: str
    overwrite: bool = False
    progress: bool = True
    splits_file: str | None = None

    def __post_init__(self):
        if self.splits_file is not None:
            if self.split is not None:
                raise ConfigError(f"set only one of split {list(self.split)} and splits_file {self.splits_file}")
            folds = len(read_splits_file(self.splits_file))
            if self.folds is not None and self.folds != folds:
                raise ConfigError(
                    f"folds is {self.folds} but splits_file {self.splits_file} holds {folds} folds: leave folds "
                    "unset (the file sets it)"
                )
            object.__setattr__(self, "folds", folds)
        super().__post_init__()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ConversionConfig:
        """From `build_parser()`'s arguments."""
        options = {f.name: getattr(args, f.name) for f in dataclasses.fields(ConversionOptions)}
        return cls(
            source_dir=args.source_dir,
            target_dir=args.target_dir,
            overwrite=args.overwrite,
            progress=not args.quiet,
            splits_file=args.splits_file,
            **options,
        )

    def requested(self, dataset_json_sha256: str, splits_sha256: str | None = None) -> dict:
        """The parameters that decide the output (not workers/progress/overwrite, nor where a splits file is).

        Args:
            splits_sha256: `splits_sha256` of the splits file's folds, when folds come from one.
        """
        keep = {f.name for f in dataclasses.fields(ConversionOptions)} - {"workers"}
        d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items() if k in keep}
        d["dataset_json_sha256"] = dataset_json_sha256
        d["schema_version"] = SCHEMA_VERSION
        if self.folds is not None:  # how the folds were made (absent for fractions: older conversions stay valid)
            d["fold_assignment"] = "splits_file" if splits_sha256 else "stratified"
            if splits_sha256:
                d["splits_file_sha256"] = splits_sha256
        if self.crop_to_label_mm is not None:
            # a fine stage's crop normalised by its own box before the statistics became the whole image's: a
            # conversion without this key was normalised otherwise than cascade prediction does, so it is refused
            d["label_crop_statistics"] = "whole_image"
        return d
