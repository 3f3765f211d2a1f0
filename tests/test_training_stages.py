"""The stage orchestration API under `tfmis-train` (`tfmis.stage_runner`): overrides split between the plan and its
stages, the stages of a config or of a plan of stages, `StageRunner` training stages in order with the real
trainer on a real converted dataset, skipping finished ones on resume, applying the GPU-fit measurement to every
stage after the conversion, and leaving the other workers free after a failure. No subprocess."""

from pathlib import Path

import pytest
import yaml
from conftest import make_msd_dataset, tiny_config

from tfmis.config import save_config
from tfmis.engine.distribution import StrategyBackend
from tfmis.errors import DataError, UsageError
from tfmis.run_plans import STAGE_PLAN_KEYS, load_stages, plan_source, split_overrides, stage_overrides
from tfmis.stage_runner import StageRunner


class RecordingBackend(StrategyBackend):
    """The real one-device backend, recording how the runner leaves (finish / leave_after_failure)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def finish(self, exit_status=None, **kwargs):
        self.calls.append(("finish", exit_status))
        super().finish(exit_status=exit_status, **kwargs)

    def leave_after_failure(self, timeout_s=120.0):
        self.calls.append(("leave_after_failure", timeout_s))
        super().leave_after_failure(timeout_s)


def write_plan(tmp_path: Path, dataset: Path, names=("lowres", "fullres"), *overrides) -> Path:
    """A plan of stages file naming one tiny config file per stage (each its own run folder)."""
    entries = []
    for name in names:
        path = tmp_path / name / "plan.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_config(tiny_config(dataset, tmp_path / "runs" / name, "training.epochs=1", *overrides), path)
        entries.append({"name": name, "config": str(path)})
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"stages": entries}))
    return plan


def test_split_overrides_keeps_the_plans_keys_apart_from_the_stages():
    """The dataset folder, run folder and time budget belong to the plan; the rest goes into every stage. A plain
    config takes every override; the stages of a stages file (one or several) all but the plan's."""
    given, rest = split_overrides(["output.dir=runs/x", "training.max_minutes=30", "training.epochs=3", "a.b=1"])
    assert given == {"output": {"dir": "runs/x"}, "training": {"max_minutes": 30}}
    assert rest == ["training.epochs=3", "a.b=1"]
    assert set(STAGE_PLAN_KEYS) == {"data.dataset_dir", "output.dir", "training.max_minutes"}
    assert stage_overrides(["output.dir=runs/x", "training.epochs=3"], False) == [
        "output.dir=runs/x",
        "training.epochs=3",
    ]
    assert stage_overrides(["output.dir=runs/x", "training.epochs=3"], True) == ["training.epochs=3"]


def test_load_stages_reads_a_config_as_one_stage_and_a_plan_as_named_stages(tmp_path, converted_dataset):
    """A plain config is one stage named "" with every override; a plan of stages (of two stages, or of one) gives
    its stages in order, each with the overrides, and `output.dir` as the parent of the stages' run folders (none
    is dropped)."""
    single = tmp_path / "single.yaml"
    save_config(tiny_config(converted_dataset, tmp_path / "one"), single)
    [stage] = load_stages(single, ["training.epochs=5", f"output.dir={tmp_path / 'elsewhere'}"])
    assert (stage.name, stage.path, stage.config.training.epochs) == ("", single, 5)
    assert stage.config.output.dir == str(tmp_path / "elsewhere") and stage.budget is None
    plan = write_plan(tmp_path, converted_dataset)
    stages = load_stages(plan, ["training.epochs=4", f"output.dir={tmp_path / 'parent'}"])
    assert [s.name for s in stages] == ["lowres", "fullres"]
    assert [s.config.training.epochs for s in stages] == [4, 4]
    assert [s.config.output.dir for s in stages] == [str(tmp_path / "parent" / n) for n in ("lowres", "fullres")]
    one = write_plan(tmp_path / "one", converted_dataset, ("lowres",))  # a recommended single stage among candidates
    [stage] = load_stages(one, ["training.epochs=4", f"output.dir={tmp_path / 'parent'}"])
    assert stage.name == "lowres" and stage.config.output.dir == str(tmp_path / "parent" / "lowres")
    assert stage.config.training.epochs == 4


def test_a_plans_own_overrides_reach_every_stage_and_one_that_cannot_apply_is_refused(tmp_path, converted_dataset):
    """`--set` of the plan's keys on a real plan file of a coarse stage and its cascade (as the planner writes
    them: conversions D_lowres and D_roi, run folders <out>/lowres and <out>/cascade): `output.dir=X` puts each stage
    in X/<stage> and the cascade's coarse_run follows its coarse stage there; `data.dataset_dir=Y` gives Y_lowres
    and Y_roi; `training.max_minutes=M` is split over the stages in proportion to their planned minutes (or equally
    without) and raises the plan's training.epochs so that only the budget bounds the schedules, unless
    training.epochs is given too. Conversion folders with nothing in common cannot take one dataset_dir: one line."""
    from tfmis.config import ConfigError
    from tfmis.engine.time_budget import budget_epoch_bound

    base = tmp_path / "data" / "Task01"
    coarse = tiny_config(f"{base}_lowres", tmp_path / "out" / "lowres", "training.max_minutes=3")
    fine = tiny_config(f"{base}_roi", tmp_path / "out" / "cascade", f"cascade.coarse_run={tmp_path / 'out' / 'lowres'}")
    fine.training.max_minutes = 7
    entries = []
    for name, config in (("lowres", coarse), ("cascade", fine)):
        path = tmp_path / "out" / name / "plan.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_config(config, path)
        entries.append({"name": name, "config": str(path)})
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"stages": entries}))
    x, y = tmp_path / "elsewhere", tmp_path / "conv" / "Y"
    stages = load_stages(plan, [f"output.dir={x}", f"data.dataset_dir={y}", "training.max_minutes=4"])
    lowres, cascade = stages
    assert [s.config.output.dir for s in stages] == [str(x / "lowres"), str(x / "cascade")]
    assert cascade.config.cascade.coarse_run == str(x / "lowres")
    assert [s.config.data.dataset_dir for s in stages] == [f"{y}_lowres", f"{y}_roi"]
    assert lowres.budget is cascade.budget and lowres.budget.minutes == 4
    assert lowres.budget.weights == pytest.approx({"lowres": 0.3, "cascade": 0.7})  # the planned 3 and 7 minutes
    assert "in proportion to their planned training.max_minutes" in lowres.budget.line()
    assert [s.config.training.max_minutes for s in stages] == pytest.approx([1.2, 2.8])
    assert [s.config.training.epochs for s in stages] == [budget_epoch_bound(4)] * 2
    capped = load_stages(plan, ["training.max_minutes=4", "training.epochs=9"])
    assert [s.config.training.epochs for s in capped] == [9, 9]  # given with --set: it stays the bound
    equal = load_stages(write_plan(tmp_path / "eq", converted_dataset), ["training.max_minutes=2"])
    assert equal[0].budget.weights == {"lowres": 0.5, "fullres": 0.5} and "equally" in equal[0].budget.line()
    (tmp_path / "u").mkdir()
    unrelated = write_plan(tmp_path / "u", converted_dataset)
    config = load_stages(unrelated)[0].config
    config.data.dataset_dir = "/elsewhere/entirely"
    save_config(config, tmp_path / "u" / "lowres" / "plan.yaml")
    with pytest.raises(ConfigError, match="convert into unrelated folders") as refused:
        load_stages(unrelated, [f"data.dataset_dir={y}"])
    assert "\n" not in str(refused.value) and f"data.dataset_dir={y}" in str(refused.value)
    with pytest.raises(ConfigError, match="training.max_minutes"):
        load_stages(plan, ["training.max_minutes=0"])


@pytest.mark.slow
def test_stage_runner_trains_the_stages_in_order_and_skips_finished_ones_on_resume(tmp_path, converted_dataset):
    """Two stages train one after the other with the real trainer (a summary each, a run folder each), the
    workers leave through `finish` once; the first stage's trainer (its datasets, its model) is freed before the
    second stage's ends; resumed, both are skipped as finished and nothing trains again."""
    import weakref

    plan = write_plan(tmp_path, converted_dataset)
    backend = RecordingBackend()
    lines, trainers = [], []

    def on_stage_end(trainer, summary):  # each trainer as its stage ends: the first must be gone by the second's
        trainers.append((weakref.ref(trainer), [ref() is None for ref, _ in trainers]))

    runner = StageRunner(backend, gpu_fit=None, on_stage_end=on_stage_end, log=lines.append)
    summaries = runner.run(load_stages(plan), exit_status=None)
    assert [s["epochs"] for s in summaries] == [1, 1]
    assert [freed for _, freed in trainers] == [[], [True]]
    assert [t.config.output.dir for t in runner.trained] == [str(tmp_path / "runs" / n) for n in ("lowres", "fullres")]
    assert all((tmp_path / "runs" / n / "summary.json").is_file() for n in ("lowres", "fullres"))
    assert [line.split(":")[0] for line in lines if line.startswith("Stage")] == [
        "Stage 1/2 (lowres)",
        "Stage 2/2 (fullres)",
    ]
    assert backend.calls == [("finish", None)]

    again, lines = RecordingBackend(), []
    resumed = StageRunner(again, resume=True, gpu_fit=None, log=lines.append)
    assert resumed.run(load_stages(plan), exit_status=None) == [None, None]
    assert resumed.trained == []
    assert sum("finished earlier" in line for line in lines) == 2


@pytest.mark.slow
def test_stage_runner_applies_the_gpu_fit_to_every_stage_after_the_conversion(tmp_path):
    """`gpu_fit` runs for each stage once its data is converted (the measurement is keyed by the converted data),
    and the stages it returns are the ones trained: both stages train with its batch size."""
    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=4)
    data = [f"data.source_dir={source}", "data.conversion.split=[0.5,0.5]", "data.conversion.workers=1"]
    plan = write_plan(tmp_path, tmp_path / "tfrecords", ("lowres", "fullres"), *data)
    seen = []

    def gpu_fit(stages, planned):
        seen.append((planned, (tmp_path / "tfrecords" / "index.json").is_file()))
        for stage in stages:
            stage.config.pipeline.num_images_per_batch = 1
        return stages

    runner = StageRunner(RecordingBackend(), gpu_fit=gpu_fit, log=lambda line: None)
    planned = object()  # what plan_source returns; the runner only hands it to gpu_fit
    runner.run(load_stages(plan), planned, exit_status=None)
    assert seen == [(planned, True), (planned, True)]
    assert [t.config.pipeline.num_images_per_batch for t in runner.trained] == [1, 1]
    assert [t.global_batch for t in runner.trained] == [1, 1]


def test_a_failed_stage_leaves_the_other_workers_free_and_raises_its_error(tmp_path):
    """A stage whose data is missing raises the data error (not a line, not an exit) after
    `leave_after_failure`, so workers waiting at the end are not kept waiting; `finish` is not called."""
    missing = tmp_path / "no_tfrecords"
    plan = write_plan(tmp_path, missing, ("only",))
    backend = RecordingBackend()
    with pytest.raises(FileNotFoundError, match="no_tfrecords"):
        StageRunner(backend, gpu_fit=None, log=lambda line: None).run(load_stages(plan), exit_status=None)
    assert backend.calls == [("leave_after_failure", 120.0)]


def test_a_run_folder_held_by_another_process_stops_the_stage_before_its_data_are_converted(tmp_path):
    """The run folder's lock is taken before the conversion: with another live process holding it, the stage
    raises FolderLocked naming the holder and nothing is converted (the dataset folder is not created)."""
    from test_locks import _start_holder

    from tfmis.utils.lock import FolderLocked

    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=4)
    data = [f"data.source_dir={source}", "data.conversion.split=[0.5,0.5]", "data.conversion.workers=1"]
    plan = write_plan(tmp_path, tmp_path / "tfrecords", ("only",), *data)
    holder = _start_holder(tmp_path / "runs" / "only")
    try:
        with pytest.raises(FolderLocked, match=f"pid {holder.pid} on host"):
            StageRunner(RecordingBackend(), gpu_fit=None, log=lambda line: None).run(load_stages(plan))
    finally:
        holder.kill()
        holder.wait()
    assert not (tmp_path / "tfrecords").exists()


def test_plan_source_refuses_a_folder_without_dataset_json_and_keeps_a_plan_on_resume(tmp_path):
    """`plan_source` on a folder that is not an MSD dataset raises the usage error naming --source-dir (exit 2);
    with resume and a plan already in output.dir, that plan is read, not made again."""
    from tfmis.data.sources.errors import DatasetNotFound

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetNotFound, match="--source-dir") as raised:
        plan_source(empty)
    assert raised.value.exit_code == 2 and isinstance(raised.value, DataError)
    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=4)
    out = tmp_path / "run"
    (out).mkdir()
    save_config(tiny_config(tmp_path / "tfr", out), out / "plan.yaml")
    lines = []
    stages, planned = plan_source(source, [f"output.dir={out}"], resume=True, log=lines.append)
    assert [s.name for s in stages] == [""] and planned.fingerprint is None and planned.path == out / "plan.yaml"
    assert lines == [f"Resuming with the plan in {out / 'plan.yaml'}"]
    assert not issubclass(UsageError, DataError)


def test_every_stage_of_a_cascade_gets_the_gpu_fit_measurement_of_its_own_config(tmp_path):
    """`cached_gpu_fit` on a planned cascade (a CT-like fingerprint on a 24 GB GPU): each stage's config is looked
    up, both stage plans are written again with the measured batch size, sliding-window batch size and placement,
    and the reloaded stages carry them, with the stage overrides still applied; without a GPU nothing changes."""
    from test_planner_steps import CT_LIKE, GPU_24

    from tfmis.planning.stages import plan_stages
    from tfmis.run_plans import PlannedRun, cached_gpu_fit

    plan_args = {"source_dir": str(tmp_path / "src"), "dataset_dir": str(tmp_path / "tfr"), "output_dir": str(tmp_path)}
    staged = plan_stages(CT_LIKE, GPU_24, configuration="cascade", **plan_args)
    path = staged.write()
    planned = PlannedRun(path, ["training.epochs=7"], CT_LIKE, "cascade", {**plan_args, "max_minutes": None})
    stages = load_stages(path, planned.overrides)
    assert [s.name for s in stages] == ["lowres", "cascade"]
    measured = {"num_images_per_batch": 5, "num_sw_batch_size": 3, "validation_data_device": "auto", "source": "c"}
    asked = []

    def lookup(config):
        asked.append(config.output.dir)
        return measured

    fitted = cached_gpu_fit(stages, planned, log=lambda line: None, hardware=GPU_24, lookup=lookup)
    assert {s.config.output.dir for s in stages} <= set(asked)  # every candidate is planned again, these among them
    for stage in fitted:
        assert stage.config.pipeline.num_images_per_batch == 5 and stage.config.validation.num_sw_batch_size == 3
        assert stage.config.training.epochs == 7
    reread = load_stages(path)  # the plan files themselves hold the measurement
    assert [s.config.pipeline.num_images_per_batch for s in reread] == [5, 5]
    from tfmis.hardware import Hardware

    assert cached_gpu_fit(stages, planned, hardware=Hardware(), lookup=lookup) is stages
