"""tfmis-crossval: K folds of real tiny trainings run as parallel experiments, out-of-fold predictions on the original
grid, the configuration and postprocessing chosen from them, and a killed cross-validation continued."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from tests.conftest import tiny_config_file as write_config
from tfmis.config import load_config
from tfmis.crossval import main
from tfmis.crossvalidation.experiment import (
    DEFINITION_FILE,
    job_config,
    parse_configurations,
    read_job_events,
)

ROOT = Path(__file__).resolve().parents[1]


def nnunet_dice(prediction: np.ndarray, reference: np.ndarray, label: int) -> float:
    """nnU-Net's Dice written out: 2TP / (2TP + FP + FN), NaN when the label is in neither."""
    p, r = prediction == label, reference == label
    tp, fp, fn = int((p & r).sum()), int((p & ~r).sum()), int((~p & r).sum())
    return float("nan") if tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn)


def test_job_config_trains_on_the_other_folds_and_writes_into_the_cv_folder(tmp_path):
    """A fold's config validates on its fold, trains on the others, converts into the `-folds<K>` folder next to
    the configuration's own conversion, and writes its run folder inside the CV folder."""
    path = write_config(tmp_path, "tiny")
    (configuration,) = parse_configurations([str(path)])
    assert configuration.name == "tiny"
    config = job_config(tmp_path / "cv", configuration, 2, 4, None)
    assert config.data.val_split == "fold2"
    assert config.data.train_split == "fold0+fold1+fold3"
    assert config.data.dataset_dir == f"{tmp_path / 'tfrecords'}-folds4"
    assert Path(config.output.dir) == tmp_path / "cv" / "tiny" / "fold_2"
    assert config.output.progress is False


def test_a_plans_cascade_follows_the_same_folds_coarse_stage(tmp_path):
    """In a plan of stages, the cascade's fold k finds its regions with the coarse stage's fold k."""
    from tfmis.config import write_stages

    coarse = write_config(tmp_path, "lowres")
    coarse_dir = load_config(coarse).output.dir
    fine = write_config(tmp_path, "cascade", f"cascade.coarse_run={coarse_dir}")
    plan = write_stages(tmp_path / "plan.yaml", [("lowres", coarse), ("cascade", fine)])
    configurations = parse_configurations([f"ct={plan}"])
    assert [c.name for c in configurations] == ["ct_lowres", "ct_cascade"]
    assert configurations[1].coarse == "ct_lowres"
    config = job_config(tmp_path / "cv", configurations[1], 1, 5, None)
    assert Path(config.cascade.coarse_run) == tmp_path / "cv" / "ct_lowres" / "fold_1"


def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys):
    """A cascade's fine stage alone, one fold, and two configurations of one name are refused before anything runs."""
    path = write_config(tmp_path, "tiny")
    fine = write_config(tmp_path, "fine", "cascade.coarse_run=/elsewhere")
    for argv, words in (
        (["--config", str(fine)], "coarse stage"),
        (["--config", str(path), "--folds", "1"], "--folds must be at least 2"),
        (["--config", str(path), "--config", str(path)], "two configurations are named"),
        (["--config", str(path), "--run-folds", "7"], "folds are 0..4"),
    ):
        assert main([*argv, "--output", str(tmp_path / "cv")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    assert not (tmp_path / "cv" / DEFINITION_FILE).exists()


def test_training_budget_shares_what_is_left_less_the_measured_start_up(tmp_path):
    """Under `tfmis-auto`'s training budget (training_budget.json: 600 s per worker), each training's
    `training.max_minutes` is set when it starts: worker 0 of 2 has folds 0 and 2 of 4, two configurations each. Before
    any training: 600 s / 4 trainings - 20 s (the assumed start-up) = 130 s = 2.16 min. After one training that took
    200 s of which its loop took 150 s (start-up measured: 50 s): (600 - 200) / 3 - 50 = 83.3 s = 1.38 min. Worker 1's
    jobs do not count for worker 0; a used-up budget still gives the least share; no file, no budget."""
    from tfmis.crossvalidation.experiment import Configuration, Definition, append_job_event, fold_run_dir
    from tfmis.crossvalidation.jobs import (
        FIRST_OVERHEAD_SECONDS,
        LEAST_TRAINING_MINUTES,
        TRAINING_BUDGET_FILE,
        training_minutes,
    )

    definition = Definition([Configuration("a", {}), Configuration("b", {})], 4, [0, 1, 2, 3])
    cv = tmp_path / "cv"
    cv.mkdir()
    assert training_minutes(cv, definition, 0, 2) is None
    (cv / TRAINING_BUDGET_FILE).write_text(json.dumps({"lane_seconds": 600.0}))
    assert FIRST_OVERHEAD_SECONDS == 20.0
    assert training_minutes(cv, definition, 0, 2) == pytest.approx(2.16)  # floor(130 / 60, 2 decimals)
    run = fold_run_dir(cv, "a", 0)
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"elapsed_seconds": 150.0}))
    base = {"job": "train", "configuration": "a", "fold": 0, "worker": "worker0"}
    append_job_event(cv, {**base, "event": "start", "time": 0.0})
    append_job_event(cv, {**base, "event": "end", "time": 200.0, "seconds": 200.0, "exit_code": 0})
    other = {"job": "train", "configuration": "a", "fold": 1, "worker": "worker1", "event": "end"}
    append_job_event(cv, {**other, "seconds": 500.0, "exit_code": 0})
    assert training_minutes(cv, definition, 0, 2) == pytest.approx(math.floor((400 / 3 - 50) / 60 * 100) / 100)
    append_job_event(cv, {**base, "fold": 2, "event": "end", "seconds": 900.0, "exit_code": 1})
    assert training_minutes(cv, definition, 0, 2) == LEAST_TRAINING_MINUTES


def test_training_budget_counts_the_out_of_fold_predictions_a_worker_has_left(tmp_path):
    """With `oof_seconds` in training_budget.json (tfmis-auto's lane holds the trainings and the out-of-fold
    predictions), a share is (the lane - the worker's finished jobs - the predictions left) / the trainings left - the
    start-up: 600 s, 2 folds x 2 configurations, predictions assumed 30 s: (600 - 60) / 4 - 20 = 115 s = 1.91 min.
    After fold 0's trainings (200 s and 100 s, loops 150 s and 80 s: start-up 35 s) and its prediction (12 s,
    measured: it replaces the 30 s): (600 - 312 - 12) / 2 - 35 = 103 s = 1.71 min."""
    from tfmis.crossvalidation.experiment import Configuration, Definition, append_job_event, fold_run_dir
    from tfmis.crossvalidation.jobs import TRAINING_BUDGET_FILE, training_minutes

    definition = Definition([Configuration("a", {"model": {}}), Configuration("b", {"model": {}})], 2, [0, 1])
    cv = tmp_path / "cv"
    cv.mkdir()
    (cv / TRAINING_BUDGET_FILE).write_text(json.dumps({"lane_seconds": 600.0, "oof_seconds": 30.0}))
    assert training_minutes(cv, definition, 0, 1) == pytest.approx(1.91)
    for name, seconds, loop in (("a", 200.0, 150.0), ("b", 100.0, 80.0)):
        run = fold_run_dir(cv, name, 0)
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"elapsed_seconds": loop}))
        event = {"job": "train", "configuration": name, "fold": 0, "worker": "worker0", "event": "end"}
        append_job_event(cv, {**event, "seconds": seconds, "exit_code": 0})
    append_job_event(
        cv, {"job": "oof", "fold": 0, "worker": "worker0", "event": "end", "seconds": 12.0, "exit_code": 0}
    )
    for name in ("a", "b"):
        (fold_run_dir(cv, name, 0) / "validation").mkdir()
        (fold_run_dir(cv, name, 0) / "validation" / "scores.json").write_text("{}")
    (cv / "ensembles" / "a+b" / "fold_0" / "validation").mkdir(parents=True)
    (cv / "ensembles" / "a+b" / "fold_0" / "validation" / "scores.json").write_text("{}")
    assert training_minutes(cv, definition, 0, 1) == pytest.approx(math.floor((276 / 2 - 35) / 60 * 100) / 100)


def test_overrides_the_folds_would_drop_are_refused_in_one_line(tmp_path, capsys):
    """`--set output.dir`, `data.split.*`, `training.target_dice` (each fold's config sets them) and
    `training.epochs` together with `training.max_minutes` (the budget decides each fold's schedule): exit 2, one
    line naming the key and why, before anything is converted."""
    config = write_config(tmp_path, "a")
    for override, words in (
        ("output.dir=x", "--set output.dir: cross-validation sets it for every fold"),
        ("data.split.fold=1", "--set data.split.fold: cross-validation sets it"),
        ("training.target_dice=0.9", "held-out fold"),
    ):
        code = main(["--config", str(config), "--output", str(tmp_path / "cv"), "--set", override])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and words in err[0], err
    argv = ["--config", str(config), "--output", str(tmp_path / "cv"), "--set", "training.max_minutes=2"]
    assert main([*argv, "--set", "training.epochs=5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give one of them" in err[0], err
    assert not (tmp_path / "tfrecords").exists() and not (tmp_path / "cv" / DEFINITION_FILE).exists()


def test_progress_table_shows_a_failed_job_with_its_exit_code_until_it_is_retried(tmp_path):
    """The folds' table, read from jobs.jsonl as the workers append it: a training or an out-of-fold prediction that
    ended with a non-zero exit shows `failed (exit N)` (not `waiting`), a running one its epoch, a retried one
    running again."""
    from tfmis.crossvalidation.driver import progress_rows
    from tfmis.crossvalidation.experiment import Configuration, Definition, append_job_event

    definition = Definition([Configuration("a", {}), Configuration("b", {})], 3, [0, 1, 2])
    cv = tmp_path / "cv"
    cv.mkdir()

    def job(event, job, fold, configuration=None, **extra):
        append_job_event(cv, {"job": job, "configuration": configuration, "fold": fold, "event": event, **extra})

    job("start", "train", 0, "a")
    job("end", "train", 0, "a", exit_code=1, reason="error: boom")
    job("start", "train", 1, "a")
    job("end", "train", 1, "a", exit_code=0, reason="")
    job("start", "train", 1, "b")
    job("start", "oof", 2)
    job("end", "oof", 2, exit_code=4, reason="error: boom")
    rows = progress_rows(cv, definition)
    assert rows == [
        ("fold", "a", "b", "out-of-fold"),
        ("0", "failed (exit 1)", "waiting", "-"),
        ("1", "waiting", "training, epoch 1/?", "-"),  # a ended 0 without summary.json: not trained
        ("2", "waiting", "waiting", "failed (exit 4)"),
    ]
    job("start", "train", 0, "a")  # the rerun retries it
    assert progress_rows(cv, definition)[1] == ("0", "training, epoch 1/?", "waiting", "-")


@pytest.mark.slow
def test_a_failed_fold_is_a_partial_failure_exit_3_naming_the_fold_its_reason_and_its_log(tmp_path, capsys):
    """A fold whose training fails (its run folder's place taken by a file) makes the command exit 3 after the
    other work: one error line names the configuration, the fold, the training's own error line and its log, the
    last line says how many folds are unfinished, the table shows the job failed, and nothing is chosen."""
    path = write_config(tmp_path, "a")
    cv = tmp_path / "cv"
    (cv / "a").mkdir(parents=True)
    (cv / "a" / "fold_1").write_text("not a run folder")
    code = main(["--config", str(path), "--folds", "2", "--run-folds", "1", "--output", str(cv)])
    captured = capsys.readouterr()
    assert code == 3, captured.err
    err = [line for line in captured.err.strip().splitlines() if line.startswith("error")]
    log = cv / "logs" / "a_fold_1.train.log"
    assert err == [
        f"error: a fold 1 failed (exit 1): error: {cv / 'a' / 'fold_1'} is a file, not a folder: remove it or give "
        "another folder",
        "error: 1 fold(s) unfinished: rerun the same command to continue",
    ], captured.err
    assert log.is_file() and "is a file, not a folder" in log.read_text()
    lines = captured.out.splitlines()
    assert lines[-1].startswith("Dice: each training's last epoch on its held-out fold")  # what the Dice is
    assert lines[-2].split() == ["1", "failed", "(exit", "1)", "-"]  # the last table, fold 1
    assert not (cv / "crossval.json").exists()


@pytest.fixture(scope="module")
def two_configurations_cv(tmp_path_factory):
    """A real 2-fold cross-validation of two tiny configurations on two workers, made once for the tests that read
    it (a test that changes it works on a copy): `a` trains 3 epochs with a target Dice of 0.99 (the folds must
    drop it), `b` has other filters. Returns the folder, the configs, the exit status and what the command printed."""
    folder = tmp_path_factory.mktemp("cv2")
    a = write_config(folder, "a", "training.epochs=3", "training.target_dice=0.99")
    b = write_config(folder, "b", "model.filters=[4,4]")
    cv = folder / "cv"
    argv = ["--config", str(a), "--config", str(b), "--folds", "2", "--workers", "2", "--output", str(cv)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return {"cv": cv, "configs": [a, b], "code": code, "out": out.getvalue(), "err": err.getvalue()}


@pytest.mark.slow
def test_two_folds_of_two_configurations_on_two_workers_choose_and_score_out_of_fold(two_configurations_cv):
    """Two folds of two configurations trained by two pinned worker processes: every case predicted once out of
    fold on its original grid, scored with nnU-Net's Dice (checked here from the written maps), the best of the two
    configurations and their average chosen by the foreground mean (out-of-fold with the final weights), and the
    plan written with the postprocessing."""
    cv, code, out = two_configurations_cv["cv"], two_configurations_cv["code"], two_configurations_cv["out"]
    assert code == 0, out + two_configurations_cv["err"]
    assert "cross-validation progress" in out
    result = json.loads((cv / "crossval.json").read_text())
    assert result["weights"] == "final" and set(result["candidates"]) == {"a", "b", "a+b"}
    best = max(result["candidates"], key=lambda c: result["candidates"][c]["dice"]["foreground_mean"])
    assert result["chosen"]["candidate"] == best
    # every training case exactly once out of fold, scored as nnU-Net scores it
    seen = []
    for fold in range(2):
        info = json.loads((cv / "a" / f"fold_{fold}" / "training_data.json").read_text())
        held_out = info["splits"][f"fold{fold}"]["cases"]
        scores = json.loads((cv / "a" / f"fold_{fold}" / "validation" / "scores.json").read_text())
        assert sorted(scores["cases"]) == sorted(held_out)
        for case, dice in scores["cases"].items():
            prediction = np.asarray(nib.load(cv / "a" / f"fold_{fold}" / "validation" / f"{case}.nii.gz").dataobj)
            reference = np.asarray(nib.load(scores["references"][case]).dataobj)
            assert prediction.shape == reference.shape  # the original grid
            for label in (1, 2):  # scores.json names a class by its label, as nnU-Net's summary does
                expected = nnunet_dice(prediction, reference, label)
                got = dice[str(label)] if dice[str(label)] is not None else float("nan")
                assert np.isclose(got, expected, equal_nan=True), (case, label, got, expected)
        seen += held_out
    assert sorted(seen) == sorted(f"case_{i:03d}" for i in range(6))
    # the two workers each trained folds (pinned to one core each on this machine)
    workers = {e["worker"] for e in read_job_events(cv) if e["event"] == "start"}
    assert workers == {"worker0", "worker1"}
    plan = load_config(cv / "plan.yaml")
    assert (
        plan.postprocessing.largest_foreground_component
        == result["chosen"]["postprocessing"]["largest_foreground_component"]
    )
    assert (cv / "crossval_dice.png").stat().st_size > 1000
    assert "Chosen:" in (cv / "crossval.md").read_text()


@pytest.mark.slow
def test_a_plans_coarse_stage_and_cascade_cross_validated_together(tmp_path):
    """A plan of a coarse stage and its cascade: both trained per fold, the cascade's out-of-fold predictions made
    with the same fold's coarse stage (a region per fold), both and their average scored, one chosen."""
    from tfmis.config import write_stages

    coarse = write_config(tmp_path, "lowres")
    fine = write_config(
        tmp_path,
        "cascade",
        f"cascade.coarse_run={load_config(coarse).output.dir}",
        f"data.dataset_dir={tmp_path / 'tfrecords_fine'}",
        "data.conversion.crop_to_label_mm=6",
    )
    plan = write_stages(tmp_path / "plan.yaml", [("lowres", coarse), ("cascade", fine)])
    cv = tmp_path / "cv"
    assert main(["--config", str(plan), "--folds", "2", "--workers", "2", "--output", str(cv)]) == 0
    result = json.loads((cv / "crossval.json").read_text())
    assert set(result["candidates"]) == {"lowres", "cascade", "lowres+cascade"}
    for fold in range(2):
        config = load_config(cv / "cascade" / f"fold_{fold}" / "config.yaml")
        assert Path(config.cascade.coarse_run) == cv / "lowres" / f"fold_{fold}"
        scores = json.loads((cv / "cascade" / f"fold_{fold}" / "validation" / "scores.json").read_text())
        assert len(scores["cases"]) == 3
    log = (cv / "logs" / "fold_0.oof.log").read_text()
    assert "cascade fold 0" in log


@pytest.mark.slow
def test_a_killed_cross_validation_continues_without_retraining_finished_folds(tmp_path):
    """The command (2 folds) killed while fold 1 trains (after fold 0 finished), then rerun: fold 0 is not trained
    again, fold 1 continues from its last committed epoch, and the cross-validation completes."""
    path = write_config(tmp_path, "tiny", "training.epochs=8", "training.steps_per_epoch=3")
    cv = tmp_path / "cv"
    command = [sys.executable, "-m", "tfmis.crossval", "--config", str(path), "--folds", "2", "--output", str(cv)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    history = cv / "tiny" / "fold_1" / "history.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline:
        if history.is_file() and len(history.read_text().splitlines()) >= 3:
            break
        assert child.poll() is None, "the command ended before fold 1 trained"
        time.sleep(0.5)
    child.send_signal(signal.SIGKILL)  # the worker and its training die with it (PR_SET_PDEATHSIG)
    child.wait()
    fold0 = cv / "tiny" / "fold_0" / "summary.json"
    assert fold0.is_file() and not (cv / "tiny" / "fold_1" / "summary.json").is_file()
    stamp = fold0.stat().st_mtime_ns
    time.sleep(1.0)
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert fold0.stat().st_mtime_ns == stamp
    starts = [e for e in read_job_events(cv) if e["event"] == "start" and e["job"] == "train"]
    assert [e["fold"] for e in starts].count(0) == 1
    resumed = [e for e in starts if e["fold"] == 1]
    assert len(resumed) == 2 and resumed[1]["resumed"]
    epochs = [json.loads(line)["epoch"] for line in history.read_text().splitlines()]
    assert epochs == list(range(1, 9))  # continued, not restarted
    assert (cv / "crossval.json").is_file()


def _mpirun_problem() -> str | None:
    import shutil

    if shutil.which("mpirun") is None:
        return "mpirun not found: install Open MPI (Debian/Ubuntu: apt-get install openmpi-bin libopenmpi-dev)"
    version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    return None if "Open MPI" in version else f"this test drives Open MPI's mpirun; found {version.splitlines()[:1]}"


def _slurm_problem() -> str | None:
    import shutil

    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return "srun not found: SLURM is not installed (CI: .ci/run sets up a one-node SLURM)"
    idle = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    if idle.returncode != 0 or not idle.stdout.strip():
        return f"no SLURM controller answers (sinfo: {idle.stderr.strip()[:200]}): tools/slurm_single_node.sh"
    return None


@pytest.mark.launcher
def test_folds_over_the_ranks_of_tfmis_launch(tmp_path):
    """`tfmis-launch --nproc 2 -- tfmis-crossval`: each rank trains its own folds alone (rank 0 folds 0 and 2, rank 1
    fold 1), rank 0 chooses after both ranks ended, and no training joined a cluster (each trained on one replica).
    Under `mpirun` and `srun` the killed-rank test below asserts the same split of folds over ranks."""
    path = write_config(tmp_path, "tiny")
    cv = tmp_path / "cv"
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, "-m", "tfmis.crossval", "--config", str(path), "--folds", "3", "--output", str(cv)]
    prefix = [sys.executable, "-m", "tfmis.launch", "--nproc", "2", "--"]
    done = subprocess.run([*prefix, *command], capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    starts = [e for e in read_job_events(cv) if e["event"] == "start" and e["job"] == "train"]
    assert sorted((e["fold"], e["worker"]) for e in starts) == [(0, "worker0"), (1, "worker1"), (2, "worker0")]
    for fold in range(3):
        summary = json.loads((cv / "tiny" / f"fold_{fold}" / "summary.json").read_text())
        assert summary["num_replicas"] == 1  # alone, not a worker of a MultiWorker cluster
    assert json.loads((cv / "crossval.json").read_text())["chosen"]["configurations"] == ["tiny"]


@pytest.mark.launcher
@pytest.mark.parametrize("launcher", ["mpirun", "srun"])
def test_a_rank_killed_mid_fold_ends_every_rank_within_the_bound_and_a_rerun_continues(tmp_path, launcher):
    """Two ranks, two folds: once rank 1's fold training runs, rank 1's process (its pid from its heartbeat) is
    killed with SIGKILL. Under `mpirun` Open MPI ends the job (its line names the rank); under `srun`, which lets the
    other task run on, rank 0 stops waiting after `--rank-timeout 20` with one line naming rank 1 and exits 3
    (fold 1 unfinished). Either way the job ends within 120 s of the kill, no process of it is left, and rerunning
    the same command trains what is missing and chooses; every fold was trained by its own rank alone (rank 0 fold
    0, rank 1 fold 1, one replica each), not by a MultiWorker cluster the launcher's variables could have made."""
    problem = {"mpirun": _mpirun_problem, "srun": _slurm_problem}[launcher]()
    if problem:
        pytest.skip(problem)
    path = write_config(tmp_path, "tiny", "training.epochs=40", "validation.val_interval=10")
    cv = tmp_path / "cv"
    env = {**{k: v for k, v in os.environ.items() if k != "TF_CONFIG"}, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "tfmis.crossval", "--config", str(path), "--folds", "2", "--output", str(cv)]
    command += ["--rank-timeout", "20"]
    if launcher == "mpirun":
        prefix = ["mpirun", "-np", "2", "--oversubscribe", "-x", "PYTHONPATH"]
        prefix += ["--allow-run-as-root"] if os.geteuid() == 0 else []
    else:
        prefix = ["srun", "-N", "1", "-n", "2", "--output", str(tmp_path / "task%t.log")]
    job = subprocess.Popen([*prefix, *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.monotonic() + 600
    while not any(e["event"] == "start" and e["job"] == "train" and e["fold"] == 1 for e in _events_or_none(cv)):
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()[0].decode()[-3000:]
        time.sleep(0.5)
    time.sleep(3)  # into the fold's training
    rank1 = json.loads((cv / "ranks" / "rank1.json").read_text())
    os.kill(rank1["pid"], signal.SIGKILL)
    killed = time.monotonic()
    output = job.communicate(timeout=300)[0].decode()
    took = time.monotonic() - killed
    output += "".join(p.read_text() for p in sorted(tmp_path.glob("task*.log")))
    assert took < 120, f"the job took {took:.0f} s to end after rank 1 was killed"
    assert job.returncode != 0, output[-3000:]
    if launcher == "mpirun":
        assert "rank 1" in output, output[-3000:]
    else:
        lines = [line for line in output.splitlines() if line.startswith("error: rank 1")]
        assert len(lines) == 1 and f"pid {rank1['pid']}" in lines[0] and "stopped answering" in lines[0], output
    time.sleep(2)
    left = subprocess.run(["pgrep", "-f", str(cv)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the killed job are still running: {left}"
    done = subprocess.run([*prefix, *command], capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert json.loads((cv / "crossval.json").read_text())["chosen"]["configurations"] == ["tiny"]
    starts = {(e["fold"], e["worker"]) for e in read_job_events(cv) if e["event"] == "start" and e["job"] == "train"}
    assert starts == {(0, "worker0"), (1, "worker1")}
    for fold in range(2):
        assert json.loads((cv / "tiny" / f"fold_{fold}" / "summary.json").read_text())["num_replicas"] == 1


def _events_or_none(cv: Path) -> list:
    try:
        return read_job_events(cv)
    except (OSError, ValueError):
        return []


@pytest.mark.slow
def test_a_fold_whose_out_of_fold_step_died_is_recomputed_as_the_full_run_scored_it(tmp_path):
    """Two configurations that predict the same classes are averaged as a pair (a pair of a class and a region
    configuration never is). Fold 0 of two real tiny trainings (one step each, in this process) is predicted out of
    fold in full; then the out-of-fold step is made to have died (1) between the configurations and the pair: the
    pair's folder gone, the fold counts as unfinished and choosing is refused with one line naming the pair, the fold
    and the rerun; the rerun keeps the configurations' scores and recomputes the pair from their probabilities; (2)
    inside b's predictions: b's scores.json and its last case's label and probability maps gone, the pair's folder
    too; the rerun predicts b again and the pair. Each time the recomputed label maps and scores are exactly the full
    run's, and the pair's maps are the argmax of the two configurations' averaged probabilities, computed here."""
    import shutil

    from tfmis.crossvalidation.driver import prepare
    from tfmis.crossvalidation.experiment import SCORES_FILE, Configuration, Definition, averaging_pairs, candidate_dir
    from tfmis.crossvalidation.jobs import fold_done
    from tfmis.crossvalidation.oof import PROBABILITIES_SUFFIX, predict_fold
    from tfmis.crossvalidation.selection import candidates
    from tfmis.engine.trainer import Trainer
    from tfmis.errors import RunStateError

    classes = {"model": {"output": "classes"}, "validation": {"regions": {}}}
    regions = {"model": {"output": "regions"}, "validation": {"regions": {"whole": [1, 2], "core": [2]}}}
    mixed = Definition([Configuration("a", classes), Configuration("b", classes), Configuration("r", regions)], 2, [0])
    assert averaging_pairs(mixed) == [("a", "b")]

    one_step = ("training.epochs=1", "training.steps_per_epoch=1")
    a = write_config(tmp_path, "a", *one_step, cases=4)
    b = write_config(tmp_path, "b", *one_step, "model.filters=[4,4]")
    definition = Definition(parse_configurations([str(a), str(b)]), 2, [0])  # fold 0 only: 2 held-out cases
    assert averaging_pairs(definition) == [("a", "b")]
    cv = tmp_path / "cv"
    cv.mkdir()
    prepare(cv, definition)  # the folds converted, the job configs written
    for name in ("a", "b"):
        Trainer(load_config(cv / name / "fold_0.yaml")).fit()
    folders = {c: candidate_dir(cv, c, 0) for c in ("a", "b", "a+b")}

    def outputs() -> dict:
        """Each candidate's scores.json and label maps."""
        out = {}
        for candidate, folder in folders.items():
            scores = json.loads((folder / SCORES_FILE).read_text())
            maps = {case: _labels(folder / name) for case, name in scores["predictions"].items()}
            out[candidate] = scores, maps
        return out

    assert predict_fold(cv, 0) == 0
    full = outputs()
    cases = sorted(full["a"][0]["cases"])
    assert len(cases) == 2 and sorted(full["a+b"][0]["cases"]) == cases
    for case in cases:  # the pair: the argmax of the averaged probabilities, not either configuration's map
        mean = sum(_probabilities(folders[c] / f"{case}{PROBABILITIES_SUFFIX}") for c in ("a", "b")) / 2
        np.testing.assert_array_equal(full["a+b"][1][case], np.argmax(mean, axis=-1))
        assert all(not np.array_equal(full["a+b"][1][case], full[c][1][case]) for c in ("a", "b")), case
    assert len({json.dumps(full[c][0]["cases"]) for c in folders}) == 3  # three different scores to recompute

    # (1) died between the configurations and the pair
    shutil.rmtree(folders["a+b"])
    kept = {c: (folders[c] / SCORES_FILE).stat().st_mtime_ns for c in ("a", "b")}
    assert not fold_done(cv, definition, 0)
    with pytest.raises(RunStateError, match=r"^a\+b has no out-of-fold scores for fold 0 .*rerun the same"):
        candidates(cv, definition)
    assert predict_fold(cv, 0) == 0
    assert {c: (folders[c] / SCORES_FILE).stat().st_mtime_ns for c in ("a", "b")} == kept  # not predicted again
    _assert_same_outputs(outputs(), full)
    assert fold_done(cv, definition, 0) and candidates(cv, definition) == ["a", "b", "a+b"]

    # (2) died inside b's predictions: a kept, b predicted again, then the pair
    (folders["b"] / SCORES_FILE).unlink()
    for suffix in (".nii.gz", PROBABILITIES_SUFFIX):
        (folders["b"] / f"{cases[1]}{suffix}").unlink()
    shutil.rmtree(folders["a+b"])
    assert not fold_done(cv, definition, 0)
    assert predict_fold(cv, 0) == 0
    assert (folders["a"] / SCORES_FILE).stat().st_mtime_ns == kept["a"]
    _assert_same_outputs(outputs(), full)
    assert fold_done(cv, definition, 0)


def _probabilities(path: Path) -> np.ndarray:
    return np.asarray(nib.load(str(path)).dataobj, dtype=np.float32)


def _assert_same_outputs(got: dict, full: dict) -> None:
    """The same scores (every case's Dice per structure) and the same label maps as the full run's."""
    assert got.keys() == full.keys()
    for candidate, (scores, maps) in full.items():
        assert got[candidate][0] == scores, candidate
        assert got[candidate][1].keys() == maps.keys()
        for case, labels in maps.items():
            np.testing.assert_array_equal(got[candidate][1][case], labels, err_msg=f"{candidate} {case}")


def _run_module(module: str, *args) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` in a fresh process, as a user runs the command."""
    command = [sys.executable, "-m", module, *(str(a) for a in args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT)


def _labels(path: Path) -> np.ndarray:
    return np.asarray(nib.load(str(path)).dataobj)


@pytest.mark.slow
def test_out_of_fold_predictions_use_the_final_weights_and_val_best_the_best(two_configurations_cv, tmp_path, capsys):
    """Held-out folds are predicted with the weights training ended with, never with weights chosen on that fold:
    after a real 2-fold cross-validation of two configurations (its progress table shows each training's final
    Dice and says the held-out fold chooses nothing; each fold's log says its model is final.weights.h5), fold 0's
    best.weights.h5 of configuration a is replaced by another model's (so best and final certainly differ) and its
    out-of-fold step rerun on a copy of the folds: its label maps are still
    exactly those a Predictor makes with `final.weights.h5`, crossval.json and crossval.md say so, and a target Dice
    (stopping on the held-out fold) is dropped from the fold configs. `tfmis-predict --checkpoint <cv>/a/fold_0`
    predicts with final.weights.h5 by default (says so; the same maps as `--weights final`), `--weights best` warns
    that it is optimistic, and `tfmis-export` of the fold folder exports its final weights. The same folds scored
    with --val-best warn, mark the best Dice optimistic and are exactly the best weights' predictions. A rerun with
    the other choice into the same folder is refused (exit 2)."""
    import shutil

    from tfmis.inference.cascade import make_predictor
    from tfmis.inference.inputs import InputCase

    assert two_configurations_cv["code"] == 0, two_configurations_cv["err"]
    configs = [arg for path in two_configurations_cv["configs"] for arg in ("--config", str(path))]
    cv = tmp_path / "cv"
    shutil.copytree(two_configurations_cv["cv"], cv)  # the shared folds, changed here
    table = two_configurations_cv["out"]
    assert "trained, final Dice" in table and "the held-out fold chooses nothing" in table
    assert "optimistic" not in table and "best Dice" not in table
    log = (cv / "logs" / "a_fold_0.train.log").read_text()
    assert "Fold 0 of 2: the Dice above is measured on the held-out fold" in log and "final.weights.h5" in log
    assert load_config(cv / "a" / "fold_0.yaml").training.target_dice is None
    result = json.loads((cv / "crossval.json").read_text())
    assert result["weights"] == "final"
    assert "weights its training ended with" in (cv / "crossval.md").read_text()
    fold0, fold1 = cv / "a" / "fold_0", cv / "a" / "fold_1"
    shutil.copyfile(fold1 / "final.weights.h5", fold0 / "best.weights.h5")  # best now another model
    shutil.rmtree(fold0 / "validation")
    (cv / "crossval.json").unlink()
    assert main([*configs, "--folds", "2", "--output", str(cv)]) == 0
    scores = json.loads((fold0 / "validation" / "scores.json").read_text())
    config = load_config(fold0 / "config.yaml")
    outputs = {}
    for weights in ("final", "best"):
        predictor = make_predictor(config, fold0, device="cpu", weights=weights)
        out = tmp_path / f"direct_{weights}"
        for case, reference in scores["references"].items():
            image = Path(reference.replace("labelsTr", "imagesTr"))
            assert predictor.predict_file(InputCase(case, str(image)), out).status == "ok"
        outputs[weights] = {case: _labels(out / f"{case}.nii.gz") for case in scores["references"]}
    first, reference = next(iter(scores["references"].items()))
    first_image = Path(reference.replace("labelsTr", "imagesTr"))
    assert any(not np.array_equal(outputs["final"][c], outputs["best"][c]) for c in outputs["final"]), (
        "best and final predict the same maps: the test cannot tell them apart"
    )
    for case in scores["references"]:
        np.testing.assert_array_equal(_labels(fold0 / "validation" / f"{case}.nii.gz"), outputs["final"][case])

    # the fold's run folder as a user reaches it: predict (final weights unless told) and export
    predicted = {}
    for weights in (None, "final", "best"):
        target = tmp_path / f"pred_{weights}"
        flag = ["--weights", weights] if weights else []
        done = _run_module("tfmis.predict", "--checkpoint", fold0, "--input", first_image, "--output", target, *flag)
        assert done.returncode == 0, done.stderr[-2000:]
        predicted[weights] = (done.stderr, _labels(target / f"{first}.nii.gz"))
    assert "is fold 0 of 2: predicting with final.weights.h5" in predicted[None][0]
    np.testing.assert_array_equal(predicted[None][1], outputs["final"][first])
    np.testing.assert_array_equal(predicted["final"][1], outputs["final"][first])
    np.testing.assert_array_equal(predicted["best"][1], outputs["best"][first])
    assert "warning: --weights best" in predicted["best"][0] and "optimistic" in predicted["best"][0]
    assert "warning" not in predicted["final"][0]
    done = _run_module("tfmis.export", "--checkpoint", fold0, "--output", tmp_path / "model", "--format", "saved_model")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "predicting with final.weights.h5" in done.stderr
    manifest = (tmp_path / "model" / "manifest.json").read_text()
    assert "final.weights.h5" in manifest and "best.weights.h5" not in manifest

    assert main([*configs, "--folds", "2", "--val-best", "--output", str(cv)]) == 2
    assert "weights" in capsys.readouterr().err
    best_cv = tmp_path / "cv_best"
    shutil.copytree(cv, best_cv)
    for folder in best_cv.glob("**/fold_*/validation"):  # every configuration's and the pair's
        shutil.rmtree(folder)
    definition = json.loads((best_cv / DEFINITION_FILE).read_text())
    definition["weights"] = "best"  # as --val-best writes it, on the same trained folds
    (best_cv / DEFINITION_FILE).write_text(json.dumps(definition))
    (best_cv / "crossval.json").unlink()
    assert main([*configs, "--folds", "2", "--val-best", "--output", str(best_cv)]) == 0
    captured = capsys.readouterr()
    assert "warning: --val-best" in captured.err and "optimistic" in captured.err
    assert "trained, best Dice" in captured.out and "(optimistic)" in captured.out
    assert json.loads((best_cv / "crossval.json").read_text())["weights"] == "best"
    assert "optimistic" in (best_cv / "crossval.md").read_text()
    for case in scores["references"]:
        predicted = _labels(best_cv / "a" / "fold_0" / "validation" / f"{case}.nii.gz")
        np.testing.assert_array_equal(predicted, outputs["best"][case])
