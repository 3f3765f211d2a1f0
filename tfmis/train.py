"""Train a 3D segmentation model: `python -m tfmis.train --config configs/demo.yaml [--set key=value ...]`
(`tfmis-train`).

Converts the data first when the config names an MSD source folder, trains with the one custom loop (one
device, MirroredStrategy, MultiWorkerMirroredStrategy or Horovod; `runtime:`), validates with sliding-window
inference, and writes the run folder: config.yaml, checkpoints/, best.weights.h5, history.jsonl/.csv,
training_curves.png, validation_preview.png, summary.json, tensorboard/.

With `--source-dir DIR` instead of `--config`, the config is planned for that MSD folder on this machine first
(`python -m tfmis.plan`: nnU-Net's rules, every value commented with its reason) and written to
`<output.dir>/plan.yaml`, which a later run can edit and pass as `--config` (`--gpus 8 --gpu-memory 80GB` plans
for another machine instead). A config planned for more GPUs, larger ones, or GPUs where this machine has none
gets one warning line at the start. The stages are trained by
`tfmis.stage_runner.StageRunner`; this module holds the command line.
"""

from __future__ import annotations

import time

# the command's start (its imports included), from which a plan's time budget counts (tfmis.run_plans.PlanBudget)
STARTED = time.time()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from tfmis.cli_arguments import (  # noqa: E402
    add_configuration_argument,
    add_search_arguments,
    add_target_arguments,
    run_search,
    search_specs,
)
from tfmis.crossvalidation.pilot import PILOT_SHARE, check_pilot  # noqa: E402
from tfmis.utils.cli import add_set_argument, command, writing  # noqa: E402

RERUN = "rerun with --resume (it continues from the last committed epoch)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tfmis-train",
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 finished; 1 an error stopped training (data, divergence, out of memory, a lost "
        "worker, an existing run without --resume; the message says which); 2 a config error or bad arguments; "
        "130 interrupted (rerun with --resume). All codes: docs/exit-codes.md.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="YAML config (or a plan of stages), e.g. configs/demo.yaml")
    source.add_argument(
        "--source-dir",
        help="a dataset folder (MSD or nnU-Net v2 raw, with dataset.json): plan a config for it on this machine, "
        "or for the target machine below (written to <output.dir>/plan.yaml), convert it and train",
    )
    add_set_argument(p, "--set training.epochs=3 --set pipeline.patch_size=[48,48,48]")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the last checkpoint in output.dir (with --source-dir: the plan written there, "
        "stage by stage: finished stages are skipped)",
    )
    add_configuration_argument(p, "with --source-dir: ")
    p.add_argument(
        "--pilot",
        nargs="?",
        type=float,
        const=PILOT_SHARE,
        default=None,
        metavar="SHARE",
        help="with --source-dir and --set training.max_minutes=M: before training, compare the planner's candidates "
        "(full / low resolution; on a CPU a 48^3 and a 64^3 patch target) by short trainings scored on the "
        f"validation cases (successive halving in SHARE of M, default {PILOT_SHARE:g}) and train the best with the "
        "time left; the pilot's table goes into plan.yaml (not yet measured against the planner's rules on the "
        "zoo: docs/planning.md)",
    )
    add_target_arguments(p, "With --source-dir: ")
    g = p.add_argument_group(
        "GPU customization",
        "choose pipeline.num_images_per_batch, validation.num_sw_batch_size "
        "and validation.validation_data_device from measured memory and speed first (the search "
        "of python -m tfmis.tune fit, or its cache), then train with them",
    )
    g.add_argument("--gpu-customization", action="store_true", help="run the GPU-fit search before training")
    add_search_arguments(g, prefix="gpu-customization-")
    return p


@command
def main(argv=None) -> int:
    started = STARTED if argv is None else time.time()  # the process's command, or a call from Python
    args = build_parser().parse_args(argv)
    if args.gpu_customization:  # this process must not hold GPU memory while the search's trials measure it
        os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    from tfmis.cli_arguments import target_hardware
    from tfmis.errors import UsageError
    from tfmis.run_plans import load_stages, plan_source
    from tfmis.stage_runner import StageRunner

    planned = None
    hardware = target_hardware(args)
    if args.pilot is not None:
        check_pilot_arguments(args)
    if args.source_dir is not None:
        resume_plan = args.resume
        if args.pilot is not None and args.resume:  # a pilot interrupted before it chose goes on: plan again
            from tfmis.crossvalidation.pilot import pilot_choice
            from tfmis.run_plans import planned_output_dir

            resume_plan = pilot_choice(planned_output_dir(args.source_dir, args.overrides)) is not None
        stages, planned = plan_source(
            args.source_dir,
            args.overrides,
            resume=resume_plan,
            configuration=args.configuration,
            hardware=hardware,
            cpu_patch=args.cpu_patch,
        )
    else:
        if hardware is not None:
            raise UsageError(
                "--gpus, --gpu-memory, --gpu, --cpus and --host-memory describe the machine to plan for: use them "
                "with --source-dir (or tfmis-plan), not with --config"
            )
        stages = load_stages(args.config, args.overrides)
        from tfmis.data.prepare import check_data_source

        for stage in stages:  # a missing dataset is one line before TensorFlow starts (6 s and its log lines)
            if stage.config.data.source_dir is not None:
                check_data_source(stage.config.data)
    fit_devices, customize = 1, None
    if args.gpu_customization:  # the specs too, before anything is converted or trained
        if len(stages) > 1:
            raise UsageError("--gpu-customization measures one config: run it on a stage's plan.yaml")
        specs = search_specs(args, "gpu-customization-")
        customize = lambda config: _gpu_customization(config, args, specs)  # noqa: E731
        from tfmis.tuning.fit.candidates import check_model_parallel_range
        from tfmis.tuning.fit.specs import parse_model_parallel

        check_model_parallel_range(stages[0].config, specs)

        # the devices the chosen model-parallel setting may need exist before TensorFlow starts
        fit_devices = max([parse_model_parallel(e)[1] for e in specs.range_model_parallel or ()] + [1])
    backend = _backend(stages[0].config, fit_devices)
    if args.pilot is not None:
        from tfmis.crossvalidation.pilot import run_pilot

        stages, planned = run_pilot(planned, StageRunner(backend, gpu_fit=None), share=args.pilot)
    writing(stages[-1].config.output.dir, RERUN)
    runner = StageRunner(backend, resume=args.resume, customize=customize, on_stage_end=_report, started=started)
    runner.run(stages, planned)
    return 0


def check_pilot_arguments(args) -> None:
    """`--pilot` needs `--source-dir` (its candidates), a budget to take its time from, and one process's search."""
    from tfmis.errors import UsageError
    from tfmis.run_plans import split_overrides

    if args.source_dir is None or args.gpu_customization:
        raise UsageError("--pilot plans and compares the candidates of --source-dir: use it with --source-dir only")
    check_pilot(args.pilot, (split_overrides(args.overrides)[0].get("training") or {}).get("max_minutes"))


def _backend(config, fit_devices: int):
    """The distribution backend, made before TensorFlow touches a device (the multi-worker strategies set the
    devices up themselves), with this machine's oneDNN choice applied."""
    from tfmis.hardware import apply_onednn, model_parallel_devices, physical_gpus

    apply_onednn(config.runtime.onednn)  # before TensorFlow's import (by the backend below)
    from tfmis.engine.distribution import make_backend

    backend = make_backend(config.runtime, output_dir=config.output.dir)
    if fit_devices > 1 and not physical_gpus():  # on GPUs the search skips settings needing more of them
        model_parallel_devices(fit_devices)
    return backend


def _report(trainer, summary: dict) -> None:
    from tfmis.engine.bookkeeping import summary_table

    out = Path(trainer.config.output.dir)
    split = trainer.config.data.split  # a fold training: its validation is the held-out fold
    trainer.preview(out / "validation_preview.png", "final" if split is not None else "best")
    print(summary_table(summary))
    if split is not None:
        final = summary.get("final_mean_dice")
        final = f"{final:.4f}" if isinstance(final, float) else "-"
        print(
            f"Fold {split.fold} of {split.folds}: the Dice above is measured on the held-out fold, so its best epoch "
            f"is optimistic there, not a selection; the fold's model is final.weights.h5 (held-out mean Dice {final} "
            "at the last epoch), what tfmis-predict and tfmis-export use for this folder and cross-validation scores"
        )
    print(
        f"Results in {out}: training_curves.png, validation_preview.png, history.csv, summary.json, "
        "best.weights.h5, final.weights.h5, tensorboard/"
    )


def _gpu_customization(config, args, specs):
    """The config with the GPU-fit search's choice (BundleGen's gpu_customization=True)."""
    output = Path(config.output.dir) / "gpu_fit"
    fitted, report = run_search(config, args, "gpu-customization-", output, specs=specs)
    chosen = ", ".join(f"{key} {value}" for key, value in report["fitted"].items())
    print(f"GPU customization: {chosen} (details in {output})", file=sys.stderr)
    return fitted


if __name__ == "__main__":
    sys.exit(main())
