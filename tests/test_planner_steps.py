"""The planner's steps as values (tfmis.planning.planner, tfmis.planning.stages): each `determine_*` step returns its
decision and leaves nothing on the planner, a subclass overriding one step changes that decision and keeps the
others, the low-resolution stage's patch comes from the pure steps (checked against the rules, recomputed here), and
forced stages or time budgets that would plan a degenerate stage are refused with one line."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from conftest import make_msd_dataset
from test_cascade import CPU, fingerprint
from test_plan import GPU_80, _env, _fingerprint

from tfmis.errors import UsageError
from tfmis.planning import ExperimentPlanner, fingerprint_msd, make_plan
from tfmis.planning.rules import (
    initial_patch_size,
    lowres_spacing,
    patch_coverage,
    shrink_patch,
    square_in_plane,
    training_memory_mb,
)
from tfmis.planning.stages import plan_stages

BRATS_LIKE = fingerprint([1.0] * 3, [140, 172, 140], [3e6, 6e4, 2.5e4, 1.5e4], [70, 80, 60])  # one lowres stage
CT_LIKE = fingerprint([0.8, 0.8, 2.5], [480, 360, 240], [5e7, 3e6, 2e3], [120, 90, 80])  # a cascade
# a 24 GB GPU: CT_LIKE's full-resolution patch there covers under 25% of its median image, so it plans a cascade
# (on an 80 GB GPU the patch covers more and full resolution is the only candidate)
GPU_24 = dataclasses.replace(GPU_80, gpus=({**GPU_80.gpus[0], "memory_mb": 24 * 1024},))


def _identities(planner) -> dict:
    return {name: id(value) for name, value in vars(planner).items()}


def _without(plan, *keys) -> tuple[dict, dict]:
    return (
        {k: v for k, v in plan.values.items() if k not in keys},
        {k: v for k, v in plan.reasons.items() if k not in keys},
    )


def test_steps_return_their_decisions_and_leave_nothing_on_the_planner():
    """Each step called alone returns the values the plan records (spacing, median shape, patch, strides, filters,
    batch, epochs); neither the steps nor plan() add or replace an attribute of the planner, and planning twice
    gives the same values, reasons and summary."""
    planner = ExperimentPlanner(_fingerprint([[0.8, 0.8, 2.5]] * 10, [[400, 300, 100]] * 10), CPU)
    before = _identities(planner)
    data = planner.determine_data()
    patch = planner.determine_patch(data)
    network = planner.determine_network(patch)
    parallel = planner.determine_model_parallel(data, patch)
    batch = planner.determine_batch(data, patch, network, parallel)
    schedule = planner.determine_schedule(data, batch)
    plan = planner.plan()
    assert _identities(planner) == before
    assert data.spacing == plan.values["data.conversion.spacing"] == [0.8, 0.8, 2.5]
    assert plan.summary["median_shape"] == [float(s) for s in data.median_shape] == [400.0, 300.0, 100.0]
    assert [int(p) for p in patch.patch] == plan.values["pipeline.patch_size"] == plan.values["validation.roi_size"]
    assert parallel.model_parallel is None and parallel.patch is patch  # a CPU: no split
    assert network.filters == plan.values["model.filters"] and len(patch.strides) == len(network.filters)
    assert batch.batch == plan.values["pipeline.num_images_per_batch"] and batch.memory == plan.summary["memory_mb"]
    assert schedule.epochs == plan.values["training.epochs"]
    assert schedule.steps_per_epoch == plan.summary["steps_per_epoch"] == int(np.ceil(data.n_train * 4 / batch.batch))
    again = planner.plan(planner.decide())
    assert (again.values, again.reasons, again.notes, again.summary) == (
        plan.values,
        plan.reasons,
        plan.notes,
        plan.summary,
    )
    assert _identities(planner) == before


def test_a_subclass_overriding_one_step_changes_that_decision_and_keeps_the_others():
    """Overriding the validation step (no later step reads it) changes only its key; overriding the patch step gives
    the later steps its patch (the validation window, the strides and the memory estimate follow it) while the data
    decisions stay."""
    fp = _fingerprint([[1.0, 1.0, 1.0]] * 4, [[120, 90, 100]] * 4)

    class HalfOverlap(ExperimentPlanner):
        def determine_validation(self, data, patch, network, schedule):
            decision = super().determine_validation(data, patch, network, schedule)
            settings = [
                s if s[0] != "validation.overlap" else (s[0], 0.5, "half-window steps") for s in decision.settings
            ]
            return dataclasses.replace(decision, settings=tuple(settings))

    class QuarterMedianPatch(ExperimentPlanner):
        def determine_patch(self, data):
            return super().determine_patch(dataclasses.replace(data, median_shape=data.median_shape / 4))

    base = make_plan(fp, CPU)
    half = HalfOverlap(fp, CPU).plan()
    assert half.values["validation.overlap"] == 0.5 and base.values["validation.overlap"] == 0.25
    assert half.reasons["validation.overlap"] == "half-window steps"
    assert _without(half, "validation.overlap") == _without(base, "validation.overlap")
    assert half.summary == base.summary

    small = QuarterMedianPatch(fp, CPU).plan()
    patch = small.values["pipeline.patch_size"]
    assert np.prod(patch) < np.prod(base.values["pipeline.patch_size"])
    assert small.values["validation.roi_size"] == patch and small.summary["memory_mb"] != base.summary["memory_mb"]
    assert small.values["model.strides"] != base.values["model.strides"]  # a smaller patch pools fewer times
    data_keys = [k for k in base.values if k.startswith("data.")]
    assert [small.values[k] for k in data_keys] == [base.values[k] for k in data_keys]


def _cpu_patch(fp, spacing) -> list[int]:
    """The CPU patch at `spacing`, from the rules: the median shape there (square in-plane when close), nnU-Net's
    initial patch, shrunk until it has at most 48^3 voxels and its training estimate fits half the free RAM."""
    spacing = [float(round(s, 4)) for s in spacing]
    median = fp.median_shape_at(spacing)
    square = square_in_plane(spacing, median)
    shape = np.array(median, dtype=np.float64)
    if square:
        shape[:2] = np.sqrt(median[0] * median[1])
    classes, channels = len(fp.labels), len(fp.modalities)

    def fits(patch, strides):
        filters = [min(8 * 2**i, 128) for i in range(len(strides))]
        memory = training_memory_mb(patch, strides, filters, 1, channels, classes, 2, "float32")["total_mb"]
        return int(np.prod(patch)) <= 48**3 and memory <= 0.5 * CPU.host_available_mb

    patch = shrink_patch(spacing, median, initial_patch_size(spacing, shape), fits, square=square)[0]
    return [int(p) for p in patch]


@pytest.mark.parametrize("fp", [BRATS_LIKE, CT_LIKE], ids=["lowres", "cascade-coarse"])
def test_the_low_resolution_patch_comes_from_the_pure_steps_and_equals_the_rules(fp):
    """The low-resolution spacing and patch of a staged plan (a BraTS-sized lowres stage, the coarse stage of a CT
    cascade) equal nnU-Net's loop over the CPU patch recomputed here from the rules, and the planner's
    `determine_patch(determine_data())` at that spacing returns that patch."""
    staged = plan_stages(fp, CPU)
    name, coarse = staged.stages[0]
    full_spacing = [float(s) for s in np.median(fp.spacings, axis=0)]  # identical cases: the target spacing
    spacing, _, patch, steps = lowres_spacing(
        full_spacing, fp.median_shape_at(full_spacing), lambda at, _median: _cpu_patch(fp, at)
    )
    spacing = [float(round(s, 4)) for s in spacing]
    assert name == "lowres" and steps > 0 and coarse.values["data.conversion.spacing"] == spacing
    assert coarse.values["pipeline.patch_size"] == _cpu_patch(fp, spacing) == [int(p) for p in patch]
    planner = ExperimentPlanner(fp, CPU, spacing=(spacing, "lowres"))
    assert [int(p) for p in planner.determine_patch(planner.determine_data()).patch] == _cpu_patch(fp, spacing)
    assert patch_coverage(patch, fp.median_shape_at(spacing)) >= 0.25


@pytest.mark.slow
@pytest.mark.parametrize("configuration", ["lowres", pytest.param("cascade", marks=pytest.mark.slow)])
def test_a_forced_low_resolution_stage_is_refused_when_the_full_resolution_patch_covers_the_image(
    tmp_path, configuration
):
    """A tiny dataset (median 16x18x14 at 1.5x1.5x2 mm) whose full-resolution patch covers all of it: forcing lowres
    or a cascade is one error naming the option, the coverage in numbers and the fix, through the API and through
    `python -m tfmis.plan` (exit 2, one line, no plan written); fullres is still planned."""
    source = make_msd_dataset(tmp_path / "Task99_Tiny")
    fp = fingerprint_msd(source, workers=1, progress=False)
    full = make_plan(fp, CPU)
    patch, spacing = full.values["pipeline.patch_size"], full.values["data.conversion.spacing"]
    median = fp.median_shape_at(spacing)
    assert list(median) == [16, 18, 14] and np.prod(patch) >= np.prod(median)
    expected = (
        f"--configuration {configuration}: the full-resolution patch {'x'.join(map(str, patch))} already covers "
        f"100% of the median image 16x18x14 at 1.5x1.5x2 mm (>= 25%, where nnU-Net plans no low-resolution stage)"
    )
    with pytest.raises(UsageError) as refused:
        plan_stages(fp, CPU, configuration=configuration)
    message = str(refused.value)
    assert message.startswith(expected) and message.endswith("drop --configuration or use --configuration fullres")
    assert "\n" not in message
    assert plan_stages(fp, CPU, configuration="fullres").configuration == "fullres"

    out = tmp_path / "run"
    args = ["--source-dir", str(source), "--output-dir", str(out), "--configuration", configuration, "--quiet"]
    done = subprocess.run(
        [sys.executable, "-m", "tfmis.plan", *args, "--workers", "1"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        cwd=tmp_path,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stderr[-2000:]
    assert errors == [f"error: {message}"] and done.stderr.rstrip().endswith(message)
    assert not out.exists()


def test_a_time_budget_that_leaves_a_stage_no_minutes_is_refused():
    """max_minutes 0.01 over a cascade gives the coarse stage 40%, 0.004 minutes, which rounds to no training: one
    error naming the option, the share and the least budget that works; 0.03 plans both stages (0.01 and 0.02);
    one stage with 0 minutes is refused the same way."""
    with pytest.raises(UsageError) as refused:
        plan_stages(CT_LIKE, CPU, max_minutes=0.01)
    assert str(refused.value) == (
        "max_minutes 0.01 (--max-minutes, training.max_minutes): this stage's 40% share is 0 minutes of training in "
        "hundredths of a minute; give at least 0.025 minutes, or no time budget"
    )
    staged = plan_stages(CT_LIKE, CPU, max_minutes=0.03)
    assert [plan.values["training.max_minutes"] for _, plan in staged.stages] == [0.01, 0.02]
    with pytest.raises(UsageError, match=r"^max_minutes 0 \(--max-minutes, training.max_minutes\): that is 0 minutes"):
        make_plan(CT_LIKE, CPU, max_minutes=0)


def test_the_target_gpus_memory_decides_whether_a_low_resolution_stage_is_needed():
    """CT_LIKE on one GPU of 24 GB and of 80 GB: the larger GPU's full-resolution patch has more voxels; on 24 GB it
    covers under 25% of the median image (fullres, lowres and cascade are candidates), on 80 GB at least 25%, so
    fullres is the only one, as nnU-Net drops 3d_lowres when its `-gpu_memory_target` patch covers a quarter."""
    small, large = plan_stages(CT_LIKE, GPU_24), plan_stages(CT_LIKE, GPU_80)
    patches = [staged.candidates["fullres"][0][1].values["pipeline.patch_size"] for staged in (small, large)]
    assert np.prod(patches[0]) < np.prod(patches[1]), patches
    median = ExperimentPlanner(CT_LIKE, GPU_80).determine_data().median_shape
    assert patch_coverage(patches[0], median) < 0.25 <= patch_coverage(patches[1], median)
    assert set(small.candidates) == {"fullres", "lowres", "cascade"} and set(large.candidates) == {"fullres"}


def test_a_gpu_cascade_with_a_time_budget_gives_each_stage_its_share():
    """On a 24 GB GPU a cascade with max_minutes 10 plans the coarse stage 4 minutes and the fine one 6, each
    reason naming its share."""
    staged = plan_stages(CT_LIKE, GPU_24, max_minutes=10)
    assert staged.configuration == "cascade"
    (_, coarse), (_, fine) = staged.stages
    assert (coarse.values["training.max_minutes"], fine.values["training.max_minutes"]) == (4.0, 6.0)
    assert coarse.reasons["training.max_minutes"] == "40% of the time budget given to the plan"
    assert fine.reasons["training.max_minutes"] == "60% of the time budget given to the plan"


def test_each_stage_is_planned_again_with_the_gpu_fit_measurement_of_its_own_config():
    """`gpu_fit_for` is asked with each candidate stage's config (fullres, lowres, the cascade's fine stage); the
    stage it has a measurement for (the fine one here) takes the measured batch size, sliding-window batch size and
    placement, the others stay as planned without it; with no measurement at all the plan is the one without
    `gpu_fit_for` (a 24 GB GPU, on which CT_LIKE plans a cascade)."""
    asked = []
    measured = {"num_images_per_batch": 5, "num_sw_batch_size": 3, "validation_data_device": "gpu", "source": "c"}

    def fine_only(config):
        asked.append(config.output.dir)
        return measured if config.output.dir.endswith("cascade") else None

    plain = plan_stages(CT_LIKE, GPU_24, output_dir="runs/ct")
    fitted = plan_stages(CT_LIKE, GPU_24, output_dir="runs/ct", gpu_fit_for=fine_only)
    assert sorted(asked) == ["runs/ct/cascade", "runs/ct/fullres", "runs/ct/lowres"]
    assert fitted.gpu_fitted and not plain.gpu_fitted
    (_, coarse), (_, fine) = fitted.stages
    assert (coarse.values, coarse.reasons) == (plain.stages[0][1].values, plain.stages[0][1].reasons)
    [(_, full)], [(_, plain_full)] = fitted.candidates["fullres"], plain.candidates["fullres"]
    assert (full.values, full.reasons) == (plain_full.values, plain_full.reasons)
    assert fine.values["pipeline.num_images_per_batch"] == 5 and fine.values["validation.num_sw_batch_size"] == 3
    assert fine.values["validation.validation_data_device"] == "gpu"
    assert fine.reasons["pipeline.num_images_per_batch"] == "measured by the GPU-fit search (c)"
    assert plain.stages[1][1].values["pipeline.num_images_per_batch"] != 5
    unmeasured = plan_stages(CT_LIKE, GPU_24, output_dir="runs/ct", gpu_fit_for=lambda config: None)
    assert not unmeasured.gpu_fitted
    assert [p.values for _, p in unmeasured.stages] == [p.values for _, p in plain.stages]


def test_validation_interval_keeps_the_sliding_windows_under_a_tenth_of_an_epochs_passes():
    """A large median image and few training cases (one validation costs more than an epoch's share): the interval
    comes from the cost, counted with the windows the real sliding window covers the median image with
    (`number_of_windows`), and keeps validation windows under 10% of an epoch's forward passes (crops x 3) while
    one epoch fewer would not; a small image keeps the count's interval (about 15 validations over the run)."""
    from tfmis.inference.windows import number_of_windows
    from tfmis.planning.decisions import DataDecision, PatchDecision, ScheduleDecision
    from tfmis.planning.training_steps import TrainingSteps

    patch = PatchDecision(
        patch=[48, 48, 48], strides=[], divisor=(8, 8, 8), initial_patch=[48, 48, 48], shrink_steps=0, square=True
    )
    schedule = ScheduleDecision(steps_per_epoch=12, epochs=17, validations=15)
    big = DataDecision(spacing=[1.5] * 3, median_shape=np.array([103, 122, 105]), norm=[], n_train=6, n_val=2)
    interval, reason = TrainingSteps.validation_interval(big, patch, schedule, 0.25)
    windows = 2 * number_of_windows((103, 122, 105), (48, 48, 48), 0.25)
    passes = 3 * 6 * 4  # an epoch: 6 volumes x 4 crops, each a forward and a backward pass
    assert windows / (interval * passes) <= 0.1 < windows / ((interval - 1) * passes)
    assert f"{windows} windows" in reason and "under 10%" in reason
    small = DataDecision(spacing=[2.0] * 3, median_shape=np.array([48, 48, 48]), norm=[], n_train=20, n_val=4)
    assert TrainingSteps.validation_interval(small, patch, schedule, 0.25) == (1, "about 15 validations over the run")


def test_a_cpu_plan_with_a_time_budget_counts_its_validations_and_one_without_spaces_them():
    """With `max_minutes` a CPU plan asks for about 15 validations over the length its time budget decides
    (`validation.validations`, the interval planned from the estimated pace kept as the least spacing); without a
    budget, and on a GPU, only the planned interval is set."""
    budgeted = make_plan(BRATS_LIKE, CPU, max_minutes=6)
    assert budgeted.values["validation.validations"] == 15
    assert budgeted.values["validation.val_interval"] >= 1
    assert "the time budget decides" in budgeted.reasons["validation.validations"]
    assert "validation.validations" not in make_plan(BRATS_LIKE, CPU).values
    assert "validation.validations" not in make_plan(BRATS_LIKE, GPU_80, max_minutes=6).values


def test_the_cpu_patch_target_bounds_the_patch_and_a_larger_one_plans_a_larger_patch():
    """`cpu_patch_voxels` (`--cpu-patch EDGE`): on a brain-size fingerprint the planned patch stays within the
    target, 64^3 plans more voxels than the default 48^3, and the patch's reason names the target given."""
    fp = fingerprint([1.0] * 3, [140, 172, 140], [3e6, 6e4, 2.5e4, 1.5e4], [70, 80, 60])
    default = make_plan(fp, CPU, source_dir="/data/x")
    larger = make_plan(fp, CPU, source_dir="/data/x", cpu_patch_voxels=64**3)
    small, big = (int(np.prod(p.values["pipeline.patch_size"])) for p in (default, larger))
    assert small <= 48**3 < big <= 64**3
    assert "262,144 voxels (given" in larger.reasons["pipeline.patch_size"]


def test_cpu_patch_edge_below_16_is_refused_before_the_dataset_is_read(tmp_path):
    """`tfmis-plan --cpu-patch 8`: exit 2, one line naming the option and a valid value, nothing written."""
    source = make_msd_dataset(tmp_path / "ds", num_cases=2)
    command = [sys.executable, "-m", "tfmis.plan", "--source-dir", str(source), "--cpu-patch", "8"]
    result = subprocess.run(
        command + ["--output", str(tmp_path / "p.yaml")], capture_output=True, text=True, env=_env()
    )
    assert result.returncode == 2 and "--cpu-patch 8" in result.stderr and "--cpu-patch 64" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "p.yaml").exists()
