"""Train a 3D segmentation model: `python -m tfmis.train --config configs/demo.yaml [--set key=value ...]`
(`tfmis-train`).

Converts the data first when the config names an MSD source folder, trains with the one custom
loop (one device, MirroredStrategy, MultiWorkerMirroredStrategy or Horovod; `runtime:`), validates with
sliding-window inference, and writes the run folder: config.yaml, checkpoints/, best.weights.h5,
history.jsonl/.csv, training_curves.png, validation_preview.png, summary.json, tensorboard/.

With `--source-dir DIR` instead of `--config`, the config is planned for that MSD folder on this
machine first (`python -m tfmis.plan`: nnU-Net's rules, every value commented with its reason) and
written to `<output.dir>/plan.yaml`, which a later run can edit and pass as `--config`.

`training.precision: auto` becomes this machine's best precision (`tfmis.hardware.resolve_precision`);
a setting this machine runs badly (mixed_float16 or jit_compile on a CPU) gets one warning naming the
faster choice.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tfmis.tune.cli import add_search_arguments, run_search, search_specs
from tfmis.utils.cli import is_disk_full, os_error_line, remove_temp_files


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tfmis.train", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="YAML config, e.g. configs/demo.yaml")
    source.add_argument(
        "--source-dir",
        help="an MSD dataset folder: plan a config for it on this machine (written to "
        "<output.dir>/plan.yaml), convert it and train",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set training.epochs=3 --set pipeline.patch_size=[48,48,48]",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the last checkpoint in output.dir (with --source-dir: the plan written there, "
        "stage by stage: finished stages are skipped)",
    )
    p.add_argument(
        "--configuration",
        choices=("fullres", "lowres", "cascade"),
        default=None,
        help="with --source-dir: force one stage at full resolution, one at low resolution, or a coarse-to-fine "
        "cascade (default: chosen from the fingerprint and the affordable patch; docs/planning.md)",
    )
    g = p.add_argument_group(
        "GPU customization",
        "choose pipeline.num_images_per_batch, validation.num_sw_batch_size "
        "and validation.validation_data_device from measured memory and speed first (the search "
        "of python -m tfmis.tune fit, or its cache), then train with them",
    )
    g.add_argument("--gpu-customization", action="store_true", help="run the GPU-fit search before training")
    add_search_arguments(g, prefix="gpu-customization-")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.gpu_customization:  # this process must not hold GPU memory while the search's trials measure it
        os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    from tfmis.config import ConfigError, load_config, load_stages

    planned = None
    try:
        if args.source_dir is not None:
            planned = _plan(args)
            if planned is None:
                return 1
            stages = planned["stages"]
        else:
            stages = load_stages(args.config) or [("", Path(args.config))]
        overrides = args.overrides if len(stages) == 1 else _stage_overrides(args.overrides)[1]
        configs = [(name, load_config(path, overrides)) for name, path in stages]
        fit_devices = 1
        if args.gpu_customization:  # the specs too, before anything is converted or trained
            specs = search_specs(args, "gpu-customization-")
            from tfmis.tune.fit.specs import parse_model_parallel

            # the devices the chosen model-parallel setting may need exist before TensorFlow starts
            fit_devices = max([parse_model_parallel(e)[1] for e in specs.range_model_parallel or ()] + [1])
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if len(configs) > 1 and args.gpu_customization:
        print("error: --gpu-customization measures one config: run it on a stage's plan.yaml", file=sys.stderr)
        return 2
    from tfmis.hardware import apply_onednn

    apply_onednn(configs[0][1].runtime.onednn)  # before TensorFlow's import (by the backend below)
    from tfmis.engine.distribution import make_backend

    try:  # first: MultiWorkerMirroredStrategy and Horovod must set up the devices themselves
        backend = make_backend(configs[0][1].runtime, output_dir=configs[0][1].output.dir)
        from tfmis.hardware import model_parallel_devices, physical_gpus

        if fit_devices > 1 and not physical_gpus():  # on GPUs the search skips settings needing more of them
            model_parallel_devices(fit_devices)
    except (ValueError, RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for i, (name, config) in enumerate(configs):
        if len(configs) > 1:
            done = Path(config.output.dir) / "summary.json"
            if args.resume and done.is_file():
                if backend.is_chief:
                    print(f"Stage {i + 1}/{len(configs)} ({name}): finished earlier ({done}), skipped", file=sys.stderr)
                continue
            if backend.is_chief:
                print(f"Stage {i + 1}/{len(configs)} ({name}): {config.output.dir}", file=sys.stderr)
        status = _train(config, backend, args, planned if len(configs) == 1 else None)
        if status != 0:
            return status
    import tensorflow as tf

    try:
        backend.finish(exit_status=0)  # several workers: all done, the others end, then the chief (a quiet end)
    except tf.errors.OpError as e:  # a worker ended before the final barrier (it failed after training)
        print(
            f"error: worker {backend.rank}: another worker ended before the end of the run ({type(e).__name__})",
            file=sys.stderr,
        )
        return 1
    return 0


def _train(config, backend, args, planned: dict | None) -> int:
    """Converts (on the chief), trains and reports one run, holding its run folder's lock on the chief (the other
    workers do not touch it); the exit status (1 with one line naming the holder when another run has it)."""
    from tfmis.engine.trainer import run_folder_lock
    from tfmis.utils.lock import FolderLocked

    try:
        with run_folder_lock(backend, config.output.dir):
            return _run(config, backend, args, planned)
    except FolderLocked as e:
        # one write: the other workers' lines share this stream, and print() writes the newline apart when unbuffered
        sys.stderr.write(f"error: {e}\n")
        sys.stderr.flush()
        return 1


def _run(config, backend, args, planned: dict | None) -> int:
    """Converts (on the chief), trains and reports one run; the exit status."""
    import tensorflow as tf

    from tfmis.hardware import detect_hardware, hardware_warnings, resolve_precision

    if backend.is_chief:
        for line in hardware_warnings(config.training):
            print(f"warning: {line}", file=sys.stderr)
    config.training.precision = resolve_precision(config.training.precision)  # "auto": this machine's best

    from tfmis.data.convert import ParametersChanged
    from tfmis.data.prepare import prepare_dataset
    from tfmis.engine.trainer import RunExists, Trainer, TrainingDiverged, summary_table
    from tfmis.inference.placement import VolumeOutOfMemory
    from tfmis.tune.fit import NoConfigurationFits

    expected = (
        RunExists,
        TrainingDiverged,
        NoConfigurationFits,
        VolumeOutOfMemory,
        ParametersChanged,
        FileNotFoundError,
        KeyError,
        ValueError,
    )
    try:
        if not _prepare_on_chief(backend, lambda: prepare_dataset(config.data, progress=config.output.progress)):
            return 1
        if args.gpu_customization:
            if backend.size > 1:
                raise ValueError(
                    "--gpu-customization runs one search per machine: run python -m tfmis.tune fit "
                    "first, then launch the workers with its fit.yaml"
                )
            config = _gpu_customization(config, args)
        elif planned is not None and backend.size == 1:
            config = _cached_gpu_fit(config, planned, args)
        trainer = Trainer(config, backend=backend)
        if backend.is_chief:  # here, not earlier: a config or data error before it stays one line
            print(f"Hardware: {detect_hardware().describe()}", file=sys.stderr)
            lr = (
                ""
                if config.optimizer.lr_scaling == "none"
                else (f", learning rate {trainer.learning_rate:.3g} ({config.optimizer.lr_scaling} scaling)")
            )
            print(
                f"Training {trainer.model.count_params():,} parameters on {backend.num_replicas} replica(s) "
                f"({backend.name}, {backend.size} worker process(es)), global batch {trainer.global_batch}, "
                f"{trainer.steps_per_epoch} steps/epoch, precision {config.training.precision}{lr}; "
                f"results in {config.output.dir}",
                file=sys.stderr,
            )
            if trainer.parallel is not None:
                print(f"Model parallel: {trainer.parallel.describe()}", file=sys.stderr)
        summary = trainer.fit(resume=args.resume)
    except expected as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk, an unwritable output folder: one line, no half-written file left
        left = _remove_temp_files(config)
        print(f"error: {os_error_line(e, left[0] if left else config.output.dir, RERUN)}", file=sys.stderr)
        return 1
    except (RuntimeError, tf.errors.ResourceExhaustedError) as e:  # how h5py and TensorFlow report a full disk
        if not is_disk_full(e):
            raise
        left = _remove_temp_files(config)
        print(
            f"error: disk full writing {left[0] if left else config.output.dir}: free space and {RERUN}",
            file=sys.stderr,
        )
        return 1
    except (
        tf.errors.UnavailableError,
        tf.errors.CancelledError,
        tf.errors.DeadlineExceededError,
        tf.errors.AbortedError,
        tf.errors.InternalError,
    ) as e:
        if backend.size == 1:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(
            f"error: worker {backend.rank} lost contact with the other workers ({type(e).__name__}: {first[:300]}). "
            f"A worker died or the network failed; training stopped. The last committed epoch is in "
            f"{Path(config.output.dir) / 'checkpoints'}: restart all workers with --resume.",
            file=sys.stderr,
        )
        return 1
    if not backend.is_chief:
        return 0
    trainer.preview(Path(config.output.dir) / "validation_preview.png")
    print(summary_table(summary))
    print(
        f"Results in {config.output.dir}: training_curves.png, validation_preview.png, history.csv, "
        "summary.json, best.weights.h5, tensorboard/"
    )
    return 0


RERUN = "rerun with --resume (it continues from the last committed epoch)"


def _remove_temp_files(config) -> list:
    """The half-written files an error left in the run folder and its checkpoints, removed."""
    out, data = Path(config.output.dir), Path(config.data.dataset_dir)
    from tfmis.data.convert import PROGRESS_DIR

    return remove_temp_files(data, data / PROGRESS_DIR, out, out / "checkpoints")


STAGE_PLAN_KEYS = ("data.dataset_dir", "output.dir", "training.max_minutes")


def _stage_overrides(overrides) -> tuple[dict, list[str]]:
    """(the overrides the planner takes for the whole plan, as a nested dict; the rest, for every stage): the
    dataset folder and run folder are where the stages go, and a time budget is shared by the stages."""
    from tfmis.config import apply_override

    given: dict = {}
    rest = []
    for override in overrides:
        if override.split("=", 1)[0].strip() in STAGE_PLAN_KEYS:
            apply_override(given, override)
        else:
            rest.append(override)
    return given, rest


def _plan(args) -> dict | None:
    """Plans `--source-dir` on this machine (one stage, or a low-resolution stage and a cascade) and writes the
    stage plans (`<output.dir>/plan.yaml`; for a cascade also `<output.dir>/<stage>/plan.yaml`). With
    `--resume` and a plan there, that plan is kept (the run continues as it was planned).

    The overrides' `data.dataset_dir`, `output.dir` and `training.max_minutes` (a budget the stages share) are
    the plan's. Returns {"stages": [(name, path)], "path", "plan", "fingerprint", "target", "output"}, or None
    after an error line.
    """
    from tfmis.config import load_stages
    from tfmis.data.msd import DatasetError
    from tfmis.planning import default_output_dir, plan_dataset_stages

    source = Path(args.source_dir)
    if not (source / "dataset.json").is_file():
        print(
            f"error: --source-dir {source}: no dataset.json there; give the MSD folder that holds dataset.json, "
            "imagesTr and labelsTr",
            file=sys.stderr,
        )
        return None
    given, _ = _stage_overrides(args.overrides)
    target = (given.get("data") or {}).get("dataset_dir")
    output = (given.get("output") or {}).get("dir")
    minutes = (given.get("training") or {}).get("max_minutes")
    existing = Path(output or default_output_dir(source)) / "plan.yaml"
    if args.resume and existing.is_file():
        print(f"Resuming with the plan in {existing}", file=sys.stderr)
        stages = load_stages(existing) or [("", existing)]
        return {
            "stages": stages,
            "path": existing,
            "plan": None,
            "fingerprint": None,
            "target": target,
            "output": output,
        }
    try:
        staged, fingerprint = plan_dataset_stages(
            source, target, output, max_minutes=minutes, configuration=args.configuration
        )
    except (DatasetError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    for _, plan in staged.stages:
        plan.config(args.overrides if len(staged.stages) == 1 else _stage_overrides(args.overrides)[1])
    path = staged.write()
    print(f"Plan for {fingerprint.name} ({staged.final.summary['hardware']}):\n{staged.table()}", file=sys.stderr)
    print(
        f"Plan written to {path} (every value with its reason): edit it and rerun with --config {path}", file=sys.stderr
    )
    stages = staged.stage_paths() if len(staged.stages) > 1 else [("", path)]
    return {
        "stages": stages,
        "path": path,
        "plan": staged.final,
        "fingerprint": fingerprint,
        "target": target,
        "output": output,
    }


def _cached_gpu_fit(config, planned: dict, args):
    """With a GPU: the GPU-fit search's cached batch size, sw batch size and placement for the planned config
    (the plan file is rewritten with them); the config unchanged without a GPU or a cached search."""
    from tfmis.config import load_config
    from tfmis.hardware import detect_hardware
    from tfmis.planning import plan_with_cached_gpu_fit

    hardware = detect_hardware()
    if not hardware.has_gpu or planned["fingerprint"] is None:  # resumed with its plan: kept as it is
        return config
    measured = plan_with_cached_gpu_fit(
        planned["fingerprint"],
        hardware,
        config,
        source_dir=str(args.source_dir),
        dataset_dir=config.data.dataset_dir,
        output_dir=planned["output"],
    )
    if measured is None:
        print(
            "GPU-fit search: no cached result for this plan; batch sizes are estimates (add --gpu-customization "
            "to measure them; later plans reuse the measurement)",
            file=sys.stderr,
        )
        return config
    plan, fitted = measured
    plan.write(planned["path"])
    print(
        f"GPU-fit search ({fitted['source']}): batch {fitted['num_images_per_batch']}, sw batch "
        f"{fitted['num_sw_batch_size']}, validation on {fitted['validation_data_device']}; plan updated",
        file=sys.stderr,
    )
    updated = load_config(planned["path"], args.overrides)
    updated.training.precision = config.training.precision
    return updated


def _prepare_on_chief(backend, prepare) -> bool:
    """The chief converts the data while the other workers wait; False (after an error line) if it failed."""
    from tfmis.utils.lock import FolderLocked

    ok = 1.0
    if backend.is_chief:
        try:
            prepare()
        except (FileNotFoundError, KeyError, ValueError, FolderLocked) as e:
            if backend.size == 1:
                raise
            print(f"error: {e}", file=sys.stderr)
            ok = 0.0
    if backend.size > 1 and not backend.broadcast([ok])[0]:  # the barrier: every worker waits for the chief
        if not backend.is_chief:
            print(f"error: worker {backend.rank}: the chief could not prepare the data (see its log)", file=sys.stderr)
        return False
    return True


def _gpu_customization(config, args):
    """The config with the GPU-fit search's choice (BundleGen's gpu_customization=True)."""
    output = Path(config.output.dir) / "gpu_fit"
    fitted, report = run_search(config, args, "gpu-customization-", output)
    chosen = ", ".join(f"{key} {value}" for key, value in report["fitted"].items())
    print(f"GPU customization: {chosen} (details in {output})", file=sys.stderr)
    return fitted


if __name__ == "__main__":
    sys.exit(main())
