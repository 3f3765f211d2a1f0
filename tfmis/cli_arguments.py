"""The command-line options several commands share (`tfmis-plan`, `tfmis-train --source-dir`, `tfmis-auto`): the
configuration to force and the CPU patch target (`add_configuration_argument`), the machine to plan for when it
is not this one (`add_target_arguments`, read by `target_hardware`), and the GPU-fit search's options
(`tfmis-tune fit`, `tfmis-train --gpu-customization`: `add_search_arguments`, read by `search_specs` and
`run_search`). The commands' layer: nothing below imports it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tfmis.errors import UsageError


def add_configuration_argument(parser, when: str = "") -> None:
    """The `--configuration fullres|lowres|cascade` option of the commands that plan (`tfmis-plan`, `tfmis-train
    --source-dir`); `when` prefixes its help (e.g. "with --source-dir: ")."""
    parser.add_argument(
        "--configuration",
        choices=("fullres", "lowres", "cascade"),
        default=None,
        help=f"{when}force one stage at full resolution, one at low resolution, or a coarse-to-fine cascade "
        "(default: chosen from the fingerprint and the affordable patch; refused when it makes no sense for the "
        "dataset; docs/planning.md)",
    )
    parser.add_argument(
        "--cpu-patch",
        type=int,
        default=None,
        metavar="EDGE",
        help=f"{when}a CPU plan's patch voxel target as a cube's edge (default 48: 48^3 voxels; 64 plans larger "
        "patches; a GPU plan's patch comes from the GPU's memory)",
    )


TARGET_FLAGS = ("gpus", "gpu_memory", "gpu", "cpus", "host_memory")


def add_target_arguments(parser, when: str = "") -> None:
    """The options of the commands that plan (`tfmis-plan`, `tfmis-train --source-dir`) that describe the machine
    the training will run on when it is not this one (`target_hardware` reads them); `when` prefixes the group's
    description."""
    from tfmis.hardware import GPU_MODELS

    g = parser.add_argument_group(
        "target machine",
        f"{when}plan for the machine the training will run on instead of this one, e.g. on a CPU login node for "
        "8 x 80 GB GPU nodes: --gpus 8 --gpu-memory 80GB, or --gpus 8 --gpu H100-80GB (the plan's header names the "
        "target; training on a machine with less warns in one line). The host's cores and RAM stay this "
        "machine's unless --cpus / --host-memory are given",
    )
    g.add_argument("--gpus", metavar="N", default=None, help="GPUs per machine (default 1 with --gpu or --gpu-memory)")
    g.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        default=None,
        help="each GPU's memory: 80GB, 80G, 81920MB or 81920 (MB); default: the --gpu model's",
    )
    g.add_argument(
        "--gpu",
        metavar="NAME",
        default=None,
        help=f"the GPU model, for its memory and precision: {', '.join(GPU_MODELS)} (without it: float32, as for "
        "a GPU of unknown compute capability)",
    )
    g.add_argument(
        "--cpus", metavar="N", default=None, help="the target's CPU cores (optional; default this machine's)"
    )
    g.add_argument(
        "--host-memory",
        metavar="SIZE",
        default=None,
        help="the target's RAM, e.g. 512GB (optional; default this machine's)",
    )


def target_hardware(args, here=None):
    """The `Hardware` to plan for from `add_target_arguments`' options (`Hardware.target`), or None when none is
    given (plan for this machine).

    Raises:
        UsageError: a bad value (one line naming the option and an example).
    """
    from tfmis.hardware import GPU_MODELS, Hardware, gpu_model, parse_memory_mb

    given = {name: getattr(args, name, None) for name in TARGET_FLAGS}
    if all(value is None for value in given.values()):
        return None

    def count(flag: str, text: str, least: int, example: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise UsageError(f"{flag} {text}: a whole number >= {least}, e.g. {flag} {example}")
        return value

    def memory(flag: str, text: str, example: str, least_mb: float) -> float:
        try:
            mb = parse_memory_mb(text)
        except ValueError:
            raise UsageError(
                f"{flag} {text}: not a memory size; give e.g. {flag} {example} (or {example[:-1]}, "
                f"{int(parse_memory_mb(example))}MB, or plain MB)"
            ) from None
        if mb < least_mb:
            number = text.strip()
            if number.replace(".", "", 1).isdigit():  # a plain number is MB: likely meant as GB
                raise UsageError(f"{flag} {text}: that is {mb:g} MB; did you mean {flag} {number}GB?")
            raise UsageError(
                f"{flag} {text}: {mb:g} MB is less than the {least_mb / 1024:g} GB a target needs to be planned for; "
                f"give at least {flag} {least_mb / 1024:g}GB"
            )
        return mb

    if given["gpu"] is not None and gpu_model(given["gpu"]) is None:
        raise UsageError(
            f"--gpu {given['gpu']}: not a GPU tfmis knows ({', '.join(GPU_MODELS)}); for another, give its memory, "
            "e.g. --gpu-memory 80GB"
        )
    gpu_memory = None if given["gpu_memory"] is None else memory("--gpu-memory", given["gpu_memory"], "80GB", 1024)
    host_memory = None if given["host_memory"] is None else memory("--host-memory", given["host_memory"], "512GB", 1024)
    cpus = None if given["cpus"] is None else count("--cpus", given["cpus"], 1, "64")
    described = given["gpu"] is not None or gpu_memory is not None
    gpus = (1 if described else 0) if given["gpus"] is None else count("--gpus", given["gpus"], 0, "8")
    if gpus and not described:
        raise UsageError(
            f"--gpus {gpus}: give the GPUs' memory too, e.g. --gpu-memory 80GB, or their model, e.g. --gpu H100-80GB"
        )
    if not gpus and described:
        raise UsageError(
            "--gpus 0 plans for a machine without GPUs: drop --gpu / --gpu-memory, or give --gpus 1 or more"
        )
    flags = "/".join(f"--{name.replace('_', '-')}" for name, value in given.items() if value is not None)
    return Hardware.target(
        gpus=gpus,
        gpu_memory_mb=gpu_memory,
        name=given["gpu"],
        cpus=cpus,
        host_memory_mb=host_memory,
        here=here,
        given=flags,
    )


def add_search_arguments(parser: argparse.ArgumentParser, prefix: str) -> None:
    """The search's flags; `prefix` names them for tfmis.train (`--gpu-customization-specs`...)."""
    parser.add_argument(
        f"--{prefix}specs",
        default=None,
        metavar="S.yaml",
        help="specs in Auto3DSeg's shape: {universal: {num_trials, range_num_images_per_batch, "
        "range_num_sw_batch_size, ...}} (YAML or JSON)",
    )
    parser.add_argument(f"--{prefix}num-trials", type=int, default=None, help="trials to measure (specs: 20)")
    parser.add_argument(
        f"--{prefix}memory-budget-mb",
        type=float,
        default=None,
        help="memory budget (default: the GPU's total memory less 1 GB for the CUDA context; without a GPU, the "
        "available RAM)",
    )
    parser.add_argument(
        f"--{prefix}strategy",
        choices=["bayesian", "grid"],
        default="bayesian",
        help="Bayesian optimisation (default) or an exhaustive grid over the ranges",
    )
    parser.add_argument(
        f"--{prefix}cache-dir",
        default=None,
        help="cache folder (default: $TFMIS_CACHE_DIR/gpu_fit or ~/.cache/tfmis/gpu_fit)",
    )
    parser.add_argument(f"--{prefix}no-cache", action="store_true", help="measure again even if a cached search fits")


def search_specs(args, prefix: str):
    """The search's specs from parsed arguments (file and flags); a `ConfigError` naming the file or key. Cheap:
    callers check it before converting or training anything."""
    from tfmis.tuning.fit import load_specs

    attr = prefix.replace("-", "_")
    return load_specs(getattr(args, f"{attr}specs"), num_trials=getattr(args, f"{attr}num_trials"))


def run_search(config, args, prefix: str, output_dir: Path, specs=None):
    """Runs the search from parsed arguments (`specs`: from `search_specs`, read here when None); returns
    (fitted config, report)."""
    from tfmis.tuning.fit import fit_config

    attr = prefix.replace("-", "_")
    specs = search_specs(args, prefix) if specs is None else specs
    return fit_config(
        config,
        specs,
        output_dir,
        memory_budget_mb=getattr(args, f"{attr}memory_budget_mb"),
        strategy=getattr(args, f"{attr}strategy"),
        cache_dir=getattr(args, f"{attr}cache_dir"),
        use_cache=not getattr(args, f"{attr}no_cache"),
        progress=config.output.progress,
    )
