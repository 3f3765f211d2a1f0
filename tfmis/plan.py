"""Plan a training config for a dataset (MSD or nnU-Net v2 raw): `python -m tfmis.plan --source-dir DIR [--output
plan.yaml]` (`tfmis-plan`).

Fingerprints the dataset (from its conversion when `--target-dir` holds one, else a first pass over
the dataset folder), detects the hardware (or takes the machine the training will run on: `--gpus 8 --gpu-memory
80GB`, `--gpu H100-80GB`), applies nnU-Net v2's rules and writes the plan as a normal
tfmis config with a comment on every planned value saying why: the recommended configuration at `--output`,
every candidate (full resolution; low resolution and a cascade where they pay) in `<output-dir>/candidates.yaml`
for `tfmis-crossval --config`; then prints a short table (`tfmis.planning.plan_dataset_stages` does the work). Train
with `python -m tfmis.train --config PLAN` (or plan, convert and train in one go with
`python -m tfmis.train --source-dir DIR`).

Exit status: 0 plan written, 1 the dataset is unusable, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tfmis.cli_arguments import add_configuration_argument, add_target_arguments, target_hardware
from tfmis.planning.inputs import cpu_patch_voxels
from tfmis.utils.cli import command, writing


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tfmis-plan",
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 plan written; 1 the dataset is unusable or an output cannot be written; 2 bad "
        "arguments. All codes: docs/exit-codes.md.",
    )
    p.add_argument(
        "--source-dir", required=True, help="dataset folder with dataset.json: MSD or nnU-Net v2 raw (DatasetNNN_Name)"
    )
    p.add_argument(
        "--target-dir",
        default=None,
        help="where the conversion goes (default: <source>_tfrecords next to it); when it holds a "
        "finished conversion, its fingerprint is used",
    )
    p.add_argument("--output-dir", default=None, help="the run folder the plan trains into (default runs/<folder>)")
    p.add_argument("--output", default=None, help="the plan file (default: <output-dir>/plan.yaml)")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes reading cases (default: the CPUs this process may use (affinity, cgroup quota), at most 8)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="a training budget in minutes, shared by the stages (training.max_minutes of each)",
    )
    add_configuration_argument(p)
    add_target_arguments(p)
    return p


@command
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from tfmis.data.sources.errors import DatasetNotFound
    from tfmis.planning import plan_dataset_stages
    from tfmis.utils.io import atomic_write_json

    source = Path(args.source_dir)
    if not (source / "dataset.json").is_file():
        raise DatasetNotFound(
            f"--source-dir {source}: no dataset.json there; give the dataset folder (MSD or nnU-Net v2 raw) that "
            "holds dataset.json, imagesTr and labelsTr"
        )
    hardware = target_hardware(args)  # a bad value stops here, before the dataset is read
    writing(args.output)
    staged, fingerprint = plan_dataset_stages(
        source,
        args.target_dir,
        args.output_dir,
        args.workers,
        progress=not args.quiet,
        max_minutes=args.max_minutes,
        configuration=args.configuration,
        hardware=hardware,
        cpu_patch_voxels=cpu_patch_voxels(args.cpu_patch),
    )
    output = staged.write(args.output)
    atomic_write_json(
        output.with_name(output.stem + "_fingerprint.json"), {**fingerprint.to_dict(), "plan": staged.summary()}
    )
    print(f"Plan for {fingerprint.name} ({staged.final.summary['hardware']}):")
    if hardware is not None:
        print(f"  Planned for: {hardware.planned_for_text()}")
    print(staged.table())
    print(
        f"Written to {output} (the recommended {staged.recommended}, every value with its reason). Train with:\n"
        f"  python -m tfmis.train --config {output}"
    )
    if not staged.single:
        print(
            f"Every candidate ({', '.join(staged.candidates)}) in {staged.candidates_path()}; compare them with:\n"
            f"  tfmis-crossval --config {staged.candidates_path()} --output <cv folder>"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
