"""Planning for a target machine that is not this one (`tfmis-plan --gpus 8 --gpu-memory 80GB`, `--gpu NAME`), and
training's one warning line when its machine has less than the plan was made for.

The real planner runs on real fingerprints (a first pass over the demo brain, and a BraTS-size fingerprint built as
tests/test_plan.py builds its synthetic ones); the commands run through their `main(argv)` (as
tests/test_command_edge.py does) or in a real subprocess; a target is a `Hardware` value, as the planner takes it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tfmis import plan, train
from tfmis.cli_arguments import target_hardware
from tfmis.config import PlannedFor, load_config
from tfmis.hardware import GPU_RESERVED_MB, Hardware, detect_hardware, parse_memory_mb
from tfmis.planning import DatasetFingerprint, make_plan
from tfmis.planning.planner import ExperimentPlanner
from tfmis.planning.rules import INITIAL_PATCH_VOXELS, pool_and_conv_props, training_memory_mb
from tfmis.run_plans import plan_source
from tfmis.stage_runner import planned_for_warning

REPO = Path(__file__).resolve().parents[1]
GPU_SHARE = 0.85  # the patch and the batch fill 85% of the GPU's memory after GPU_RESERVED_MB (the reasons say so)
HERE = detect_hardware()
NO_GPU_HERE = pytest.mark.skipif(HERE.has_gpu, reason="the warning checked is the one of a machine without GPUs")


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}


def outcome(main, argv, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a command's `main(argv)`; argparse's SystemExit counts as its status."""
    try:
        status = main([str(a) for a in argv])
    except SystemExit as e:
        status = e.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def brats_fingerprint(cases: int = 300) -> DatasetFingerprint:
    """BraTS at its size (MSD Task01): 4 MRI channels at 1 mm, foreground crops of ~140x172x137 voxels, 4 classes."""
    rng = np.random.default_rng(0)
    crops = np.column_stack(
        [rng.integers(130, 150, cases), rng.integers(160, 185, cases), rng.integers(125, 150, cases)]
    )
    return DatasetFingerprint(
        name="Task01_BrainTumour",
        modalities=["FLAIR", "T1w", "t1gd", "T2w"],
        labels=["background", "edema", "non-enhancing tumor", "enhancing tumour"],
        case_ids=[f"BRATS_{i:03d}" for i in range(cases)],
        spacings=np.ones((cases, 3)),
        crop_shapes=crops.astype(float),
        class_voxels=[cases * 3_000_000, cases * 60_000, cases * 20_000, cases * 25_000],
        ct_window=None,
        intensity=[],
        cases_without_foreground=[],
        skipped={},
        source="test",
        source_dir="/data/Task01_BrainTumour",
    )


@pytest.fixture(scope="module")
def demo_brain(tmp_path_factory):
    from tfmis.data.demos.brain import make_demo_dataset

    return make_demo_dataset(tmp_path_factory.mktemp("demo") / "Task00_DemoBrain", num_training=12, num_test=0)


@pytest.fixture(scope="module")
def planned_for_8_gpus(demo_brain, tmp_path_factory):
    """tfmis-plan --gpus 8 --gpu-memory 80GB on the demo brain, run on this machine: (status, stdout, plan path)."""
    out = tmp_path_factory.mktemp("plan80") / "plan.yaml"
    argv = ["--source-dir", demo_brain, "--output", out, "--output-dir", out.parent / "run", "--quiet"]
    status = plan.main([str(a) for a in [*argv, "--gpus", "8", "--gpu-memory", "80GB"]])
    return status, out


def test_plan_command_for_8_gpus_of_80gb_plans_nnunets_gpu_settings_and_names_the_target(planned_for_8_gpus):
    """tfmis-plan --gpus 8 --gpu-memory 80GB on this machine: the demo brain gets nnU-Net's GPU plan (filters 32
    doubling to at most 320, two residual units, SGD with Nesterov momentum 0.99, 250 x 1000 steps, a patch whose
    estimated training peak at batch 2 is within 85% of the 80 GB GPU after its reserved 1 GB, the batch size and
    sliding-window batch estimated for the GPU, half-window overlap, no model parallelism: one GPU holds the
    patch), float32 (the GPU is given without a model, so its compute capability is unknown) with the hint to name
    it; the header says `Planned for: 8 x GPU (80 GB) (target given with --gpus/--gpu-memory; this machine: <this
    machine>)` and planning.planned_for records the target."""
    status, path = planned_for_8_gpus
    assert status == 0
    config = load_config(path)
    levels = len(config.model.strides)
    assert config.model.filters == tuple(min(32 * 2**i, 320) for i in range(levels)) and config.model.num_res_units == 2
    assert config.optimizer.name == "sgd" and config.optimizer.momentum == 0.99 and config.optimizer.nesterov
    assert config.training.steps_per_epoch == 250 and config.training.epochs == 1000
    patch = config.pipeline.patch_size
    peak = training_memory_mb(patch, config.model.strides, config.model.filters, 2, 2, 4, 2, "float32")["total_mb"]
    assert peak <= GPU_SHARE * (80 * 1024 - GPU_RESERVED_MB) and config.runtime.model_parallel.mode == "none"
    assert config.validation.overlap == 0.5 and config.validation.validation_data_device == "auto"
    text = path.read_text()
    flat = " ".join(line.strip().lstrip("#").strip() for line in text.splitlines())  # comments are wrapped
    assert "fits" in flat and "in 85% of the GPU" in flat  # the batch size: the GPU estimate
    assert "per window within a quarter of the GPU" in flat  # the sliding-window batch: the GPU estimate
    assert config.training.precision == "float32" and "name the target's GPU with --gpu" in flat
    header = f"Planned for: 8 x GPU (80 GB) (target given with --gpus/--gpu-memory; this machine: {HERE.short()})."
    assert header in flat
    assert config.planning.planned_for == PlannedFor(gpus=8, gpu_memory_mb=81920, name=None, source="target")


def test_a_named_gpu_plans_its_memory_and_precision():
    """Hardware.target(gpus=8, name="H100-80GB") (what --gpus 8 --gpu H100-80GB builds) on the BraTS fingerprint:
    80 GB per GPU and mixed_float16 (compute capability 9.0 has tensor cores), the summary's planned_for names it;
    a V100-32GB plans mixed_float16 too (7.0), and this machine's CPU and RAM are kept for the host."""
    h100 = Hardware.target(gpus=8, name="H100-80GB", here=HERE, given="--gpus/--gpu")
    result = make_plan(brats_fingerprint(), h100)
    assert result.values["training.precision"] == "mixed_float16"
    assert result.summary["planned_for"] == {"gpus": 8, "gpu_memory_mb": 81920, "name": "H100-80GB", "source": "target"}
    assert h100.cpu_count == HERE.cpu_count and h100.host_available_mb == HERE.host_available_mb
    v100 = Hardware.target(gpus=1, name="v100 32gb", here=HERE)
    assert v100.gpu_memory_mb == 32 * 1024 and make_plan(brats_fingerprint(), v100).values["training.precision"] == (
        "mixed_float16"
    )


@pytest.fixture(scope="module")
def brats_by_target():
    """The BraTS-size fingerprint planned for one GPU of 8, 16 and 80 GB (given by memory, as --gpu-memory 8GB):
    {GB: plan}."""
    fp = brats_fingerprint()
    return {
        gb: make_plan(fp, Hardware.target(gpus=1, gpu_memory_mb=parse_memory_mb(f"{gb}GB"), here=HERE))
        for gb in (8, 16, 80)
    }


def _estimate_mb(result, batch: int) -> dict:
    """The planner's own memory model (`training_memory_mb`) of the planned network and patch at `batch`."""
    v = result.values
    channels, classes = 4, 4  # the BraTS fingerprint's modalities and labels
    network = (v["model.strides"], v["model.filters"], v["model.num_res_units"], channels, classes)
    return training_memory_mb(v["pipeline.patch_size"], *network, batch, v["training.precision"])


def test_the_target_gpus_memory_sets_the_patch_and_the_batch_fills_what_is_left(brats_by_target):
    """The BraTS-size fingerprint on one GPU of 8, 16 and 80 GB (GPU plans: SGD, filters from 32, whatever this
    machine has): the patch has strictly more voxels on each larger GPU; on 8 and 16 GB it is shrunk from the one the
    median image wants and the batch is nnU-Net's 2 (the patch took the budget), on 80 GB it is the median image's
    (not shrunk) and the batch grows. For each, the planner's memory estimate of the chosen patch and batch is within
    85% of the GPU after the reserved 1 GB and less than one image's estimate below it: one more image would not
    fit."""
    for result in brats_by_target.values():
        assert result.values["optimizer.name"] == "sgd" and result.values["model.filters"][0] == 32
    voxels = {gb: int(np.prod(r.values["pipeline.patch_size"])) for gb, r in brats_by_target.items()}
    batch = {gb: r.values["pipeline.num_images_per_batch"] for gb, r in brats_by_target.items()}
    assert voxels[8] < voxels[16] < voxels[80], voxels
    assert batch[8] == batch[16] == 2 < batch[80], batch
    for gb in (8, 16):
        assert voxels[gb] < np.prod(brats_by_target[gb].summary["initial_patch"])
        assert "shrunk" in brats_by_target[gb].reasons["pipeline.patch_size"]
    large = brats_by_target[80]
    wanted = pool_and_conv_props([1.0, 1.0, 1.0], large.summary["initial_patch"])[2]  # padded to the divisors
    assert large.values["pipeline.patch_size"] == wanted and "shrunk 0 step(s)" in large.reasons["pipeline.patch_size"]
    for gb, result in brats_by_target.items():
        budget = GPU_SHARE * (gb * 1024 - GPU_RESERVED_MB)
        memory = _estimate_mb(result, batch[gb])
        assert "in 85% of the GPU" in result.reasons["pipeline.num_images_per_batch"]
        assert f"{budget / 1024:.1f} GB at batch 2" in result.reasons["pipeline.patch_size"]
        assert budget - memory["per_image_mb"] < memory["total_mb"] <= budget, (gb, memory, budget)


def test_a_much_larger_target_gpu_gets_a_larger_patch_when_the_dataset_wants_one(brats_by_target):
    """The BraTS-size fingerprint, whose patch on a 16 GB GPU is shrunk from the one its median image wants: on an
    80 GB GPU the patch has strictly more voxels, its estimate at batch 2 within 85% of the 80 GB after the
    reserved 1 GB."""
    middle, large = brats_by_target[16], brats_by_target[80]
    assert np.prod(large.values["pipeline.patch_size"]) > np.prod(middle.values["pipeline.patch_size"])
    assert _estimate_mb(large, 2)["total_mb"] <= GPU_SHARE * (80 * 1024 - GPU_RESERVED_MB)


def _named(gb: int, gpus: int = 1) -> Hardware:
    """`gpus` GPUs of `gb` GB with an A100's compute capability (8.0: mixed_float16, as nnU-Net trains)."""
    return Hardware.target(gpus=gpus, name="A100-80GB", gpu_memory_mb=gb * 1024, here=HERE)


def test_the_patch_grows_with_the_gpu_until_the_median_image_as_nnunets_memory_target():
    """The BraTS-size fingerprint in mixed precision on one GPU of 11, 24, 40 and 80 GB (nnU-Net's
    `-gpu_memory_target` 11 / 24 / 40 / 80 plans, with tfmis's memory model): the patch never has fewer voxels on a
    larger GPU, the 24 GB one strictly more than the 11 GB one, and from 40 GB on it is the median image's (nnU-Net's
    initial patch clipped to the median shape, padded to the divisors) and stops growing: the extra memory goes to
    the batch, which is 2 while the patch is shrunk and larger on 80 GB than on 40 GB."""
    fp = brats_fingerprint()
    plans = {gb: make_plan(fp, _named(gb)) for gb in (11, 24, 40, 80)}
    voxels = [int(np.prod(p.values["pipeline.patch_size"])) for p in plans.values()]
    assert voxels == sorted(voxels) and voxels[0] < voxels[1], voxels
    assert all(p.values["training.precision"] == "mixed_float16" for p in plans.values())
    for gb in (40, 80):
        wanted = pool_and_conv_props([1.0, 1.0, 1.0], plans[gb].summary["initial_patch"])[2]
        assert plans[gb].values["pipeline.patch_size"] == wanted
    assert plans[11].values["pipeline.num_images_per_batch"] == 2
    assert plans[80].values["pipeline.num_images_per_batch"] > plans[40].values["pipeline.num_images_per_batch"]


def test_a_gpu_whose_budget_holds_nnunets_initial_patch_grows_it_towards_the_median_image():
    """A 512x512x400 CT at 1 mm on one H200 (141 GB, mixed precision): nnU-Net's initial patch (256^3 voxels, which
    fits that budget whole) is grown towards the median image before it is shrunk to the budget, so the patch has
    more voxels than 256^3, its estimate at batch 2 within 85% of the GPU after the reserved 1 GB; the patch's reason
    says it grew. On a 24 GB GPU the same dataset keeps nnU-Net's initial patch and shrinks it."""
    from test_plan import _fingerprint

    ct = _fingerprint([[1.0, 1.0, 1.0]] * 10, [[512, 512, 400]] * 10)
    big = make_plan(ct, Hardware.target(gpus=1, name="H200-141GB", here=HERE))
    v = big.values
    patch = v["pipeline.patch_size"]
    assert (
        np.prod(patch) > INITIAL_PATCH_VOXELS
        and "doubling(s) towards the median image" in (big.reasons["pipeline.patch_size"])
    ), patch
    budget = GPU_SHARE * (big.summary["planned_for"]["gpu_memory_mb"] - GPU_RESERVED_MB)
    memory = training_memory_mb(patch, v["model.strides"], v["model.filters"], 2, 1, 3, 2, v["training.precision"])
    assert memory["total_mb"] <= budget
    small = make_plan(ct, _named(24))
    assert np.prod(small.summary["initial_patch"]) <= INITIAL_PATCH_VOXELS * 1.01
    assert "grown" not in small.reasons["pipeline.patch_size"]


def test_model_parallelism_only_when_one_gpu_cannot_hold_nnunets_default_target_patch():
    """The smallest sensible patch is nnU-Net's at its default 8 GB target (`smallest_sensible_patch`): 8 H100s of
    80 GB plan the BraTS-size fingerprint on one GPU each (the reason names that patch and says one GPU holds it,
    the patch being larger); 4 GPUs of 8 GB (85% of 7 GB) split that very patch over the fewest of them whose busiest
    holds its slab, the other GPUs data-parallel groups; one 8 GB GPU shrinks it instead and says several would
    split it."""
    fp = brats_fingerprint()
    h100 = make_plan(fp, Hardware.target(gpus=8, name="H100-80GB", here=HERE))
    planner = ExperimentPlanner(fp, _named(8, gpus=4))
    sensible, _, _ = planner.topology.smallest_sensible_patch(planner.determine_data())
    sensible_text = "x".join(map(str, sensible))
    reason = h100.reasons["runtime.model_parallel.mode"]
    assert h100.values["runtime.model_parallel.mode"] == "none" and "holds the patch" in reason
    assert f"default 8 GB target ({sensible_text}" in reason
    assert np.prod(h100.values["pipeline.patch_size"]) > np.prod(sensible)
    split = make_plan(fp, _named(8, gpus=4))
    v = split.values
    assert v["runtime.model_parallel.mode"] == "spatial" and v["pipeline.patch_size"] == sensible
    n = v["runtime.model_parallel.devices"]
    assert n in (2, 4) and v.get("runtime.model_parallel.data", 1) == 4 // n
    assert v["pipeline.num_images_per_batch"] == 2 * (4 // n)
    budget = GPU_SHARE * (8 * 1024 - GPU_RESERVED_MB)
    strides = [tuple(s) if isinstance(s, list) else (s,) * 3 for s in v["model.strides"]]
    assert (
        planner.topology.spatial_mb(sensible, strides, n)[0]
        <= budget
        < planner.topology.spatial_mb(sensible, strides, 1)[0]
    )
    if n > 2:
        assert planner.topology.spatial_mb(sensible, strides, n // 2)[0] > budget
    one = make_plan(fp, _named(8))
    assert one.values["runtime.model_parallel.mode"] == "none"
    assert "with several such GPUs the plan splits it" in one.reasons["runtime.model_parallel.mode"]
    assert np.prod(one.values["pipeline.patch_size"]) < np.prod(sensible)


def test_a_plan_for_this_machine_as_detected_records_source_detected():
    """make_plan on this machine's detected hardware: planning.planned_for's source is "detected"."""
    assert make_plan(brats_fingerprint(), HERE).summary["planned_for"]["source"] == "detected"


@pytest.mark.parametrize("value", ["80GB", "80G", "80 gb", "81920MB", "81920", "80GiB"])
def test_gpu_memory_is_taken_in_gb_g_mb_or_plain_mb(value):
    """--gpu-memory 80GB, 80G, 80 gb, 81920MB, 81920 (plain MB) and 80GiB all mean 81920 MB (GB = 1024 MB, as
    nvidia-smi counts), read by tfmis-plan's own parser; --gpus defaults to 1."""
    args = plan.build_parser().parse_args(["--source-dir", "x", "--gpu-memory", value])
    target = target_hardware(args, here=HERE)
    assert target.gpu_memory_mb == 81920 and len(target.gpus) == 1 and target.target_given == "--gpu-memory"


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--gpus", "8", "--gpu-memory", "80XB"], "--gpu-memory 80XB: not a memory size; give e.g. --gpu-memory 80GB"),
        (
            ["--gpus", "8", "--gpu-memory", "eighty"],
            "--gpu-memory eighty: not a memory size; give e.g. --gpu-memory 80GB",
        ),
        (["--gpus", "8", "--gpu-memory=-5GB"], "--gpu-memory -5GB: not a memory size; give e.g. --gpu-memory 80GB"),
        (["--gpus", "8", "--gpu-memory", "80"], "--gpu-memory 80: that is 80 MB; did you mean --gpu-memory 80GB?"),
        (
            ["--host-memory", "300MB"],
            "--host-memory 300MB: 300 MB is less than the 1 GB a target needs to be planned for; give at least "
            "--host-memory 1GB",
        ),
        (["--gpus", "8"], "--gpus 8: give the GPUs' memory too, e.g. --gpu-memory 80GB"),
        (["--gpu", "A100"], "--gpu A100: not a GPU tfmis knows (V100-16GB"),
    ],
    ids=["unit", "word", "negative", "plain-80-is-MB", "small-with-unit", "no-memory", "ambiguous-name"],
)
@pytest.mark.parametrize("command", ["plan", "train --source-dir"])
def test_a_bad_target_is_exit_2_and_one_line_naming_the_flag_and_an_example(
    demo_brain, tmp_path, capsys, command, flags, named
):
    """A bad --gpu-memory (or --gpus without a memory, an ambiguous --gpu, a --host-memory below 1 GB) in tfmis-plan
    and tfmis-train --source-dir: exit 2 and one `error:` line naming the flag, the value and an example, no
    traceback; nothing is planned or written."""
    main, argv = (plan.main, ["--source-dir", demo_brain, "--output", tmp_path / "plan.yaml"])
    if command != "plan":
        main, argv = (train.main, ["--source-dir", demo_brain, "--set", f"output.dir={tmp_path / 'run'}"])
    status, _, err = outcome(main, [*argv, *flags], capsys)
    assert status == 2 and err.strip().splitlines() == [err.strip()], err
    assert err.startswith(f"error: {named}") and "Traceback" not in err
    assert not any(tmp_path.iterdir())


def test_target_flags_with_config_are_exit_2_naming_source_dir(tmp_path, capsys):
    """tfmis-train --config X --gpus 8 --gpu-memory 80GB: the flags describe a machine to plan for, so with a
    config (already planned) they are one error line pointing to --source-dir or tfmis-plan, exit 2."""
    argv = ["--config", REPO / "configs" / "demo.yaml", "--gpus", "8", "--gpu-memory", "80GB"]
    status, _, err = outcome(train.main, argv, capsys)
    assert status == 2 and len(err.strip().splitlines()) == 1 and "with --source-dir (or tfmis-plan)" in err


def test_train_source_dir_passes_the_target_to_the_plan(demo_brain, tmp_path):
    """plan_source (what tfmis-train --source-dir runs before converting) with the target of --gpus 2 --gpu
    A100-40GB: the written plan.yaml records that target in planning.planned_for and names it in its header."""
    args = train.build_parser().parse_args(["--source-dir", str(demo_brain), "--gpus", "2", "--gpu", "A100-40GB"])
    stages, planned = plan_source(
        demo_brain, [f"output.dir={tmp_path / 'run'}"], hardware=target_hardware(args, here=HERE), log=lambda _: None
    )
    assert stages[0].config.planning.planned_for == PlannedFor(2, 40960, "A100-40GB", "target")
    assert "Planned for: 2 x A100-40GB (40 GB) (target given with --gpus/--gpu;" in planned.path.read_text()


def test_the_warning_says_what_this_machine_lacks_and_stays_quiet_when_it_has_enough(planned_for_8_gpus):
    """planned_for_warning on the plan made for 8 x 80 GB, against machines given as `Hardware` values: none, 2 GPUs
    of 80 GB and 8 of 24 GB each get one line naming the plan, what it was planned for, what this machine has and
    the patch and batch; 8 GPUs showing 81559 MB (an H100 80GB in nvidia-smi) and 16 x 80 GB get none; a plan made
    for a CPU trained on GPUs gets the line saying they are left idle; a config with no planning.planned_for none."""
    _, path = planned_for_8_gpus
    config = load_config(path)
    patch = "x".join(str(p) for p in config.pipeline.patch_size)
    batch = config.pipeline.num_images_per_batch

    def gpus(n, mb):
        return Hardware(gpus=({"name": "NVIDIA H100 80GB HBM3", "compute_capability": (9, 0), "memory_mb": mb},) * n)

    for hardware, has in [
        (Hardware(), "no GPU"),
        (gpus(2, 81559), "2 x NVIDIA H100 80GB HBM3 (80 GB)"),
        (gpus(8, 24 * 1024), "8 x NVIDIA H100 80GB HBM3 (24 GB)"),
    ]:
        line = planned_for_warning(config, path, hardware)
        assert line == (
            f"{path} was planned for 8 x 80 GB GPUs; this machine has {has}: the patch {patch} and batch {batch} may "
            "not fit or may be slow (plan again here, or give tfmis-plan this machine's --gpus/--gpu-memory)"
        )
    assert planned_for_warning(config, path, gpus(8, 81559)) is None
    assert planned_for_warning(config, path, gpus(16, 81920)) is None
    cpu_plan = load_config(path, ["planning.planned_for={gpus: 0, source: detected}"])
    assert "was planned for a CPU-only machine; this machine has 8 x" in planned_for_warning(cpu_plan, path, gpus(8, 1))
    assert "leave the GPUs mostly idle" in planned_for_warning(cpu_plan, path, gpus(8, 1))
    assert planned_for_warning(load_config(REPO / "configs" / "demo.yaml"), path, Hardware()) is None


def _train_until_the_missing_dataset(config: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """python -m tfmis.train --config CONFIG with a dataset folder that does not exist: the warnings come first, then
    the run stops with exit 1 before converting or training anything."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tfmis.train",
            "--config",
            str(config),
            "--set",
            "data.source_dir=null",
            "--set",
            f"data.dataset_dir={tmp_path / 'missing'}",
            "--set",
            f"output.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        cwd=tmp_path,
    )


@pytest.mark.slow
@NO_GPU_HERE
def test_training_a_plan_for_8_gpus_here_warns_in_one_line_and_a_plan_for_here_does_not(
    planned_for_8_gpus, demo_brain, tmp_path
):
    """python -m tfmis.train --config <plan for 8 x 80 GB> on this machine without GPUs prints one line
    `warning: <plan> was planned for 8 x 80 GB GPUs; this machine has no GPU: the patch ... and batch ...` before
    anything else happens (the missing dataset then stops it); a plan made here for this machine prints no such
    line."""
    _, path = planned_for_8_gpus
    result = _train_until_the_missing_dataset(path, tmp_path)
    assert result.returncode == 1 and "holds no converted dataset" in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "was planned for" in line]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"warning: {path} was planned for 8 x 80 GB GPUs; this machine has no GPU: the patch ")
    assert "may not fit or may be slow" in lines[0]

    here = tmp_path / "here.yaml"
    argv = ["--source-dir", demo_brain, "--output", here, "--output-dir", tmp_path / "run_here", "--quiet"]
    assert plan.main([str(a) for a in argv]) == 0
    assert load_config(here).planning.planned_for == PlannedFor(0, None, None, "detected")
    result = _train_until_the_missing_dataset(here, tmp_path)
    assert result.returncode == 1 and "holds no converted dataset" in result.stderr, result.stderr[-3000:]
    assert "was planned for" not in result.stderr and "warning:" not in result.stderr
