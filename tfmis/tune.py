"""`tfmis-tune fit|hpo` (also `python -m tfmis.tune`): the GPU-fit search and the hyperparameter search
(`tfmis.tuning`).

`fit --config X.yaml [--specs S.yaml] [--num-trials N] [--memory-budget-mb M] [--strategy bayesian|grid]
[--output DIR]`: the GPU-fit search. Writes DIR/fit.yaml (the config with the chosen values),
DIR/fit_report.json (every trial) and DIR/memory.png, and prints the trial table. Exit status: 0 a
configuration was chosen, 1 none fits in the memory budget (or the data is missing), 2 bad arguments.

`hpo --config X.yaml --space space.yaml --workers N [--num-trials M] [--output DIR]
[--objective best_mean_dice|time_to_dice:0.9] [--strategy grid|random|bayesian] [--resume]`: the
hyperparameter search, N trials at once (`tfmis.tuning.hpo`). Writes DIR/hpo_report.json,
DIR/hpo_dice.png, DIR/best.yaml and DIR/trials/<id>/ (each trial's run folder), and prints the trial
table. Exit status: 0 a trial finished, 1 none did (or a search process died), 2 bad arguments,
config or space.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tfmis.cli_arguments import add_search_arguments, run_search, search_specs
from tfmis.utils.cli import EXIT_INTERRUPTED, add_set_argument, command, writing


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tfmis-tune",
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 done (fit: a configuration chosen; hpo: a trial finished); 1 nothing fits or finished, "
        "or the data is missing; 2 bad arguments, config or space; 130 interrupted (see `tfmis-tune fit --help`, "
        "`tfmis-tune hpo --help`).",
    )
    sub = p.add_subparsers(dest="command", required=True)
    fit_help = (
        "choose batch size, sliding-window batch size and placement from measured memory and speed (Auto3DSeg's "
        "GPU customization)"
    )
    fit = sub.add_parser(
        "fit",
        help=fit_help,
        description=f"{fit_help[0].upper()}{fit_help[1:]}: trials of real training steps and validations, each "
        "in its own process, within a memory budget; a cached choice that fits is reused (--no-cache measures again).",
        epilog="Exit status: 0 a configuration was chosen; 1 none fits the memory budget (or the data is missing, "
        "or an output cannot be written); 2 bad arguments, config or specs. All codes: docs/exit-codes.md.",
    )
    fit.add_argument("--config", required=True, help="training config, e.g. configs/demo.yaml")
    add_set_argument(fit)
    add_search_arguments(fit, prefix="")
    fit.add_argument("--output", default=None, help="output folder (default: <output.dir>/gpu_fit)")

    hpo_help = (
        "hyperparameter search with N trials at once, each a tfmis.train process pinned to its devices (Keras "
        "Tuner's distributed mode on one machine)"
    )
    hpo = sub.add_parser(
        "hpo",
        help=hpo_help,
        description=f"{hpo_help[0].upper()}{hpo_help[1:]}: the space is dotted config keys to choices or ranges; "
        "results, the best config and plots go to --output; --resume continues a search.",
        epilog="Exit status: 0 a trial finished; 1 none did (or a search process died, or an output cannot be "
        "written); 2 bad arguments, config or space; 130 interrupted (rerun with --resume). All codes: "
        "docs/exit-codes.md.",
    )
    hpo.add_argument("--config", required=True, help="training config, e.g. configs/demo.yaml")
    add_set_argument(hpo, "--set training.epochs=3 (every trial)")
    hpo.add_argument(
        "--space",
        required=True,
        metavar="SPACE.yaml",
        help="dotted config keys to choices, e.g. 'optimizer.learning_rate: {values: [0.001, 0.0003]}' "
        "or ranges '{min: 0.0001, max: 0.01, sampling: log}' (see configs/hpo_space.yaml)",
    )
    hpo.add_argument(
        "--workers",
        type=int,
        default=1,
        help="trials run at once, each on its share of the GPUs or CPU cores (default 1)",
    )
    hpo.add_argument(
        "--num-trials",
        type=int,
        default=None,
        help="trials in all (default: the whole grid; 10 for random and bayesian)",
    )
    hpo.add_argument(
        "--output",
        default=None,
        help="search folder (default: <output.dir>/hpo); rerunning the same command there resumes the search",
    )
    hpo.add_argument(
        "--objective",
        default="best_mean_dice",
        help="best_mean_dice (maximised, default) or time_to_dice:<target> (training seconds until "
        "the validation mean Dice reached the target, minimised)",
    )
    hpo.add_argument(
        "--strategy",
        choices=["grid", "random", "bayesian"],
        default=None,
        help="default: grid when every key has finitely many values, else bayesian",
    )
    hpo.add_argument(
        "--resume",
        action="store_true",
        help="continue the search in --output (an error if there is none); trials that were running are rerun",
    )
    return p


def fit_command(args) -> int:
    """`tfmis-tune fit` from parsed arguments. Exit status: 0 a configuration was chosen; else `tfmis.errors`'
    (2 bad arguments, config or specs: checked before the dataset is converted; 1 none fits)."""
    from tfmis.config import load_config
    from tfmis.data.prepare import prepare_dataset
    from tfmis.tuning.fit.candidates import check_model_parallel_range
    from tfmis.tuning.fit.report import CONFIG_FILE, PLOT_FILE, REPORT_FILE

    config = load_config(args.config, args.overrides)
    specs = search_specs(args, "")  # every input checked before the dataset is converted (minutes to hours)
    check_model_parallel_range(config, specs)
    output = Path(args.output or Path(config.output.dir) / "gpu_fit")
    writing(output)
    prepare_dataset(config.data, progress=config.output.progress)
    run_search(config, args, "", output, specs)
    print(
        f"Results in {output}: {CONFIG_FILE} (train with it: python -m tfmis.train --config {output / CONFIG_FILE}), "
        f"{REPORT_FILE}, {PLOT_FILE}"
    )
    return 0


def hpo_command(args) -> int:
    """`tfmis-tune hpo` from parsed arguments. Exit status: 0 a trial finished; else `tfmis.errors`' (2 bad
    arguments, config or space; 1 no trial finished or a search process died)."""
    from tfmis.config import load_config
    from tfmis.data.prepare import prepare_dataset
    from tfmis.errors import TrainingFailed
    from tfmis.tuning.hpo import BEST_FILE, PLOT_FILE, REPORT_FILE, TRIALS_DIR, HpoSearch, Objective, load_space

    config = load_config(args.config, args.overrides)
    space = load_space(args.space, config)
    objective = Objective.parse(args.objective)
    output = Path(args.output or Path(config.output.dir) / "hpo")
    search = HpoSearch(
        config,
        space,
        output,
        workers=args.workers,
        num_trials=args.num_trials,
        objective=objective,
        strategy=args.strategy,
        resume=args.resume,
        progress=config.output.progress,
        space_file=str(args.space),
    )
    writing(output, "rerun the same command (it resumes)")
    output.mkdir(parents=True, exist_ok=True)
    prepare_dataset(config.data, progress=config.output.progress)
    try:
        report = search.run()
    except KeyboardInterrupt:
        print(f"\ninterrupted: rerun the same command to resume the search in {output}", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(
        f"Results in {output}: {REPORT_FILE}, {PLOT_FILE}"
        + (
            f", {BEST_FILE} (train with it: python -m tfmis.train --config {output / BEST_FILE})"
            if report["best"]
            else ""
        )
        + f", {TRIALS_DIR}/<trial id>/"
    )
    if not report["best"]:
        raise TrainingFailed(f"no trial finished: see {output / REPORT_FILE} and the trials' logs")
    return 0


@command
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return hpo_command(args) if args.command == "hpo" else fit_command(args)


if __name__ == "__main__":
    sys.exit(main())
