"""tfmis-auto: nnU-Net's protocol in one command on a real (tiny) MSD folder: plan, cross-validate, choose,
predict from the result, continue on a rerun; the budget split and its refusals."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import make_msd_dataset
from tfmis import auto
from tfmis.config import load_config
from tfmis.crossvalidation.experiment import read_job_events
from tfmis.engine.time_budget import budget_epoch_bound

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["--set", "training.epochs=2", "--set", "training.steps_per_epoch=2", "--set", "validation.val_interval=1"]


def run(argv, capsys) -> tuple[int, str]:
    try:
        code = auto.main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.slow
def test_a_budget_too_small_for_the_trainings_and_a_missing_candidate_are_one_line_exit_2(tmp_path, capsys):
    """After planning and converting a real tiny dataset, a 0.05-minute budget would leave each of the 2 trainings
    under half a minute after its start-up: exit 2, one line giving the minutes it would need; `--configurations
    lowres` on data whose plan offers only full resolution: exit 2, one line saying what the plan offers. Nothing is
    trained."""
    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=4)
    code, out = run(
        ["--source-dir", source, "--output", tmp_path / "a", "--folds", "2", "--max-minutes", "0.05"], capsys
    )
    errors = [line for line in out.splitlines() if line.startswith("error")]
    assert code == 2 and len(errors) == 1, out
    assert "--max-minutes 0.05" in errors[0] and "would get" in errors[0] and "give at least" in errors[0]
    code, out = run(["--source-dir", source, "--output", tmp_path / "b", "--configurations", "lowres"], capsys)
    errors = [line for line in out.splitlines() if line.startswith("error")]
    assert code == 2 and len(errors) == 1 and "the plan offers fullres" in errors[0], out
    assert not list(tmp_path.glob("*/cv/*/fold_*/summary.json"))


@pytest.mark.slow
def test_auto_plans_cross_validates_chooses_and_predict_takes_its_folder(tmp_path, capsys):
    """A real tiny MSD folder: the plan (fullres, the only candidate here), 2 folds trained and scored out of fold
    with their final weights, the configuration chosen; protocol.json says what ran; `tfmis-predict --checkpoint
    OUTPUT/cv` segments the test scan; a rerun trains nothing again; other settings into the same folder are
    refused with one line."""
    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=6)
    out = tmp_path / "auto"
    argv = ["--source-dir", source, "--output", out, "--folds", "2", *SHORT]
    code, text = run(argv, capsys)
    assert code == 0, text
    protocol = json.loads((out / "protocol.json").read_text())
    assert protocol["configurations"] == ["fullres"] and protocol["trainings"] == 2
    result = json.loads((out / "cv" / "crossval.json").read_text())
    assert result["chosen"]["configurations"] == ["fullres"] and result["weights"] == "final"
    trained = [e for e in read_job_events(out / "cv") if e["event"] == "start" and e["job"] == "train"]
    assert len(trained) == 2
    predicted = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfmis.predict",
            "--checkpoint",
            str(out / "cv"),
            "--input",
            str(source / "dataset.json"),
        ]
        + ["--output", str(tmp_path / "pred"), "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert predicted.returncode == 0, predicted.stderr[-2000:]
    assert (tmp_path / "pred" / "case_900.nii.gz").is_file()
    code, text = run(argv, capsys)
    assert code == 0 and "Continuing the protocol" in text, text
    assert len([e for e in read_job_events(out / "cv") if e["event"] == "start" and e["job"] == "train"]) == 2
    code, text = run([*argv, "--folds", "3"], capsys)
    assert code == 2 and "holds a protocol run with other settings" in text, text


@pytest.mark.slow
def test_a_budget_is_split_over_the_trainings_and_the_protocol_ends_near_it(tmp_path, capsys):
    """`--max-minutes 2.5`, 2 folds of 4 tiny cases: after planning and converting, the time left less 2 % (the
    choice) is the worker's lane for its trainings and its out-of-fold predictions (protocol.json), and each fold's
    `training.max_minutes` is exactly what is left of the lane, less the predictions left (15 % of the time left
    assumed before one has run, then the one measured), over the trainings left, less the start-up of a training
    process (20 s assumed before any has run, then the one measured: its process's seconds in jobs.jsonl less its
    loop's in summary.json). Each training fits its schedule to that share, far beyond the plan's training.epochs
    (raised to the budget's bound: it no longer caps the schedule, which ended runs at 0.56-0.80x of their share), and
    the protocol ends near its budget.

    What the split controls is checked exactly: the shares (to their 0.01-min floor), computed here from the run's
    own records. Its end: within 5 % of the budget once the three things the split cannot foresee (the last
    training's start-up and loop, the last prediction), each measured here, are taken out. The bare wall time is
    not asserted: in CI another test shares the 2 cores, and one start-up once took 39.7 s where the first took
    11.2 s (172 s of 150 s; 148 s with that surprise taken out); the protocol's bare wall time, on a machine left
    alone, is what benchmarks/protocol_vs_single.py prints for its `auto` arm."""
    from tfmis.crossvalidation.jobs import FIRST_OVERHEAD_SECONDS
    from tfmis.crossvalidation.protocol import CHOICE_SHARE

    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=4)
    out = tmp_path / "auto"
    budget = 2.5 * 60
    start = time.perf_counter()
    code, text = run(["--source-dir", source, "--output", out, "--folds", "2", "--max-minutes", "2.5"], capsys)
    outer = time.perf_counter() - start
    assert code == 0, text
    assert "Protocol budget: 2.5 min" in text
    protocol = json.loads((out / "protocol.json").read_text())
    lane, oof_prior = protocol["lane_seconds"], protocol["oof_seconds"]
    planning = budget - lane / (1 - CHOICE_SHARE)  # what planning and converting took, as the split measured it
    assert protocol["trainings"] == 2 and 0 < planning < 60, protocol
    events = [e for e in read_job_events(out / "cv") if e["event"] == "end"]
    assert [(e["job"], e["fold"], e["exit_code"]) for e in events] == [("train", 0, 0), ("oof", 0, 0)] + [
        ("train", 1, 0),
        ("oof", 1, 0),
    ]
    shares, loops, start_ups = [], [], []
    for i, event in enumerate(events):
        if event["job"] != "train":
            continue
        before = events[:i]
        run_dir = out / "cv" / "fullres" / f"fold_{event['fold']}"
        summary = json.loads((run_dir / "summary.json").read_text())
        start_up = sum(start_ups) / len(start_ups) if start_ups else FIRST_OVERHEAD_SECONDS
        oofs = [e["seconds"] for e in before if e["job"] == "oof"]
        oof = (sum(oofs) / len(oofs) if oofs else oof_prior) * (2 - len(oofs))
        share = (lane - sum(e["seconds"] for e in before) - oof) / (2 - len(loops)) - start_up
        given = summary["time_budget"]["max_minutes"]
        assert given == pytest.approx(math.floor(share / 60 * 100) / 100, abs=1e-9), (event, before, lane)
        # the training fits its schedule to its share and completes it; the plan's epoch count no longer caps it
        config = load_config(run_dir / "config.yaml")
        assert config.training.epochs == budget_epoch_bound(given) > summary["epochs"]
        assert summary["stop_reason"] == "epochs" and summary["epochs"] == summary["time_budget"]["schedule_epochs"]
        assert 0.75 <= summary["time_budget"]["used_share"] <= 1.05, summary["time_budget"]
        loops.append(summary["elapsed_seconds"])
        start_ups.append(event["seconds"] - summary["elapsed_seconds"])
        shares.append(given * 60)
    wall = protocol["wall_seconds"]
    assert abs(outer - wall) < 5  # the command's wall time is what protocol.json records (its imports included)
    oofs = [e["seconds"] for e in events if e["job"] == "oof"]
    unforeseen = (start_ups[1] - start_ups[0]) + (oofs[1] - oofs[0]) - (shares[1] - loops[1])
    why = (
        f"protocol {wall:.1f} s of {budget:.0f} s; start-ups {[round(s, 1) for s in start_ups]} s, out-of-fold "
        f"{[round(s, 1) for s in oofs]} s, the last loop {loops[1]:.1f} s of {shares[1]:.1f} s"
    )
    assert abs(wall - unforeseen - budget) <= 0.05 * budget, why


def test_overrides_tfmis_auto_would_drop_or_that_fight_its_budget_are_refused_in_one_line(tmp_path, capsys):
    """`--set output.dir` (the protocol writes into --output), `--set training.max_minutes` (the budget is
    --max-minutes) and `--set training.epochs` with `--max-minutes` (the budget fits each training's schedule, so
    the candidates get the same time): exit 2, one line each, before anything is planned."""
    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=4)
    base = ["--source-dir", source, "--output", tmp_path / "a"]
    for extra, words in (
        (["--set", "output.dir=x"], "--set output.dir: tfmis-auto writes"),
        (["--set", "training.max_minutes=3"], "give the protocol's budget as --max-minutes"),
        (["--max-minutes", "5", "--set", "training.epochs=4"], "--set training.epochs with --max-minutes"),
    ):
        code, out = run([*base, *extra], capsys)
        errors = [line for line in out.splitlines() if line.strip()]
        assert code == 2 and len(errors) == 1 and words in errors[0], out
    assert not (tmp_path / "a" / "plan").exists()
