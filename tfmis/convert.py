"""Convert a dataset folder (Medical Segmentation Decathlon or nnU-Net v2 raw layout; NIfTI, NRRD or MetaImage files)
to preprocessed TFRecord shards: `tfmis-convert` or `python -m tfmis.convert` (`--help` lists the options; the
conversion itself is `tfmis.data.convert.convert`).

Example:
    tfmis-convert --source-dir Task09_Spleen --target-dir data/spleen \\
        --split 0.7,0.15,0.15 --spacing 1.5,1.5,2.0 --ct-window -57,164 --shards 4 --workers 2

Exit status: 0 all cases converted; 3 converted, but some cases were skipped (listed in index.json under
'skipped'); 1 the dataset or target is unusable, another conversion is writing the target, no case could be
converted, or the disk is full (one line naming the file; the half-written shard is removed, and rerunning
resumes); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Literal

from tfmis.data.conversion_options import ConversionConfig, ConversionOptions
from tfmis.data.convert import convert, summary_text
from tfmis.errors import PartialFailure
from tfmis.utils.cli import command, writing


def _tuple_of(kind, length: int | tuple[int, ...], name: str):
    lengths = (length,) if isinstance(length, int) else length

    def parse(text: str):
        try:
            values = tuple(kind(v) for v in text.replace(" ", "").split(",") if v != "")
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name}: {text!r} is not a comma-separated list of {kind.__name__}s"
            ) from None
        if len(values) not in lengths:
            raise argparse.ArgumentTypeError(
                f"{name}: expected {' or '.join(map(str, lengths))} comma-separated "
                f"values, got {len(values)} in {text!r}"
            )
        return values

    return parse


def _add_option_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `ConversionOptions` field (`crop_margin` → `--crop-margin`), typed from the field."""
    import types
    import typing

    hints = typing.get_type_hints(ConversionOptions)
    groups = {}
    for field in dataclasses.fields(ConversionOptions):
        meta, tp = field.metadata, hints[field.name]
        flag = meta["flag"] or "--" + field.name.replace("_", "-")
        target = parser
        if meta["group"]:  # e.g. --split or --folds
            if meta["group"] not in groups:
                groups[meta["group"]] = parser.add_mutually_exclusive_group()
            target = groups[meta["group"]]
        kwargs = dict(dest=field.name, default=field.default, help=meta["help"])
        optional = typing.get_origin(tp) in (typing.Union, types.UnionType)
        kind = next(a for a in typing.get_args(tp) if a is not type(None)) if optional else tp
        if kind is bool:  # a flag that turns the default off
            target.add_argument(flag, action="store_false" if field.default else "store_true", **kwargs)
        elif typing.get_origin(kind) is Literal:
            target.add_argument(flag, choices=typing.get_args(kind), **kwargs)
        elif typing.get_origin(kind) is tuple:
            items = typing.get_args(kind)
            lengths = meta["lengths"] or ((len(items),) if items[-1] is not Ellipsis else (1, 2, 3))
            target.add_argument(flag, type=_tuple_of(items[0], lengths, flag), **kwargs)
        else:
            target.add_argument(flag, type=kind, **kwargs)


class _Parser(argparse.ArgumentParser):
    """argparse reads `--ct-window -57,164` as two flags: join a negative comma list to its flag first."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        joined = []
        for arg in args:
            if (
                joined
                and joined[-1].startswith("--")
                and "=" not in joined[-1]
                and arg[:1] == "-"
                and arg[1:2].isdigit()
                and "," in arg
            ):
                joined[-1] = f"{joined[-1]}={arg}"
            else:
                joined.append(arg)
        return super().parse_known_args(joined, namespace)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="tfmis-convert",
        description="Convert a dataset folder (Medical Segmentation Decathlon or nnU-Net v2 raw layout, told apart "
        "by its dataset.json; NIfTI, NRRD or MetaImage images) into preprocessed TFRecord shards with an "
        "index.json and a fingerprint.json. Preprocessing: reorient to RAS, crop to "
        "the foreground, resample (linear images / nearest labels) or reshape, normalise per "
        "channel (z-score over the foreground for MRI, clip-and-scale window for CT).",
        epilog="Exit status: 0 all cases converted; 3 converted, but some cases were skipped (listed in "
        "index.json under 'skipped'); 1 the dataset or target is unusable, another conversion holds the target, "
        "no case could be converted, or the disk is full; 2 bad arguments. "
        "Rerunning with the same arguments resumes an interrupted conversion.",
    )
    p.add_argument(
        "--source-dir",
        required=True,
        help="dataset folder holding dataset.json: MSD (Task04_Hippocampus) or nnU-Net v2 raw "
        "(Dataset004_Hippocampus), told apart by its dataset.json",
    )
    p.add_argument("--target-dir", required=True, help="output folder for shards, index.json, fingerprint.json")
    _add_option_flags(p)
    p.add_argument(
        "--splits-file",
        default=None,
        metavar="JSON",
        help='a splits_final.json in nnU-Net v2\'s format (a list of {"train": [case ids], "val": [case ids]}, '
        "one per fold): its val lists become the folds fold0..foldK-1, K from the file (instead of --split or "
        "--folds; case ids are the image file names without their suffix and, in nnU-Net v2's layout, without "
        "the _0000 channel index)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="rebuild when --target-dir holds a conversion made with other parameters",
    )
    p.add_argument(
        "--patch-layout",
        action="store_true",
        help="also write the labelled cases as memory-mapped arrays (<target>/arrays) for training with "
        "pipeline.cache=patches (datasets larger than memory; otherwise written at training start)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


RERUN = "rerun the same command (it resumes)"


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.splits_file and not Path(args.splits_file).is_file():  # a bad argument (2), as crossval and the config
        parser.error(
            f"--splits-file {args.splits_file} does not exist: give a splits_final.json (nnU-Net v2's format: a "
            'list of {"train": [case ids], "val": [case ids]}, one per fold)'
        )
    config = ConversionConfig.from_args(args)
    writing(args.target_dir, RERUN)
    index = convert(config)
    print(summary_text(index))
    if args.patch_layout:
        from tfmis.config import PipelineConfig, TrainingConfig
        from tfmis.data.patch_layout import write_patch_layout

        labelled = [c["case_id"] for c in index["cases"].values() if c.get("label")]
        done = write_patch_layout(
            args.target_dir,
            labelled,
            len(index["source"]["labels"]),
            PipelineConfig().max_foreground_indices,  # the defaults a training samples with
            TrainingConfig().seed,
            progress=not args.quiet,
        )
        print(
            f"Patch-read arrays: {done['cases']} cases, {done['bytes'] / 2**30:.2f} GB in {args.target_dir}/arrays "
            f"({done['written']} written, {done['shared']} shared with another conversion, {done['seconds']:.0f} s)"
        )
    if index["skipped"]:
        raise PartialFailure(
            f"{len(index['skipped'])} case(s) skipped (listed above and in {args.target_dir}/index.json 'skipped')"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
