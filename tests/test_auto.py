"""tfmis-auto: nnU-Net's protocol in one command on a real (tiny) MSD folder: plan, cross-validate, choose,
predict from the result, continue on a rerun; the budget split and its refusals."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_msd_dataset
from tfmis import auto
from tfmis.crossval.experiment import read_job_events

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
    """`--max-minutes 2.5`, 2 folds of 4 tiny cases: after planning and converting, the time left less 15 % is the
    trainings' lane (protocol.json), and each training's `training.max_minutes` is exactly what is left of the lane
    over the trainings left, less the start-up of a training process (assumed 20 s before any has run, then the one
    measured: its process's seconds in jobs.jsonl less its loop's in summary.json). Each training fits its schedule
    to that share and completes it, and the protocol ends at its budget, moved only by what it cannot foresee.

    What the split controls is checked exactly: the shares (to their 0.01-min floor), computed here from the run's
    own records (with the budget ignored there are none; with a fixed split they are off by the start-ups). Its
    accounting at the goal's 5 %: the time outside the jobs (planning, converting, choosing) is what the split
    measured before it, and the protocol ends at the budget moved by the three things it does not control, each
    measured here: the last training's start-up against the one measured before it (10-21 s, and once 47 s: a 35-s
    stall writing its validation preview), the out-of-fold predictions against their fixed 15 % (13-20 s of
    20-21 s), and the last training's loop ending short of its share: 0.75-1.05x (`tests/test_time_budget.py` says
    why), or less when the plan's training.epochs (~1000 steps' worth) caps its schedule, as it did at 0.80x and 0.56x
    of the share (tfmis-auto plans without the budget, so a training whose epochs run faster than the plan's pace
    cannot fill its share: the protocol then ended at 0.77x of its budget). Four runs on this 2-core machine shared
    with benchmark runs (load 3-7; one with 6 cases): the protocol at 0.96x, 0.97x, 1.15x (the stall) and 0.77x (the
    cap) of its budget, and at 1.002-1.008x with the unforeseen parts taken out; outside the jobs 1-2 s more than the
    planning and converting the split measured."""
    from tfmis.config import load_config
    from tfmis.crossval.jobs import FIRST_OVERHEAD_SECONDS
    from tfmis.crossval.protocol import OOF_SHARE

    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=4)
    out = tmp_path / "auto"
    budget = 2.5 * 60
    code, text = run(["--source-dir", source, "--output", out, "--folds", "2", "--max-minutes", "2.5"], capsys)
    assert code == 0, text
    assert "Protocol budget: 2.5 min" in text
    protocol = json.loads((out / "protocol.json").read_text())
    lane = protocol["lane_seconds"]
    planning = budget - lane / (1 - OOF_SHARE)  # what planning and converting took, as the split measured it
    reserve = lane / (1 - OOF_SHARE) * OOF_SHARE  # the out-of-fold predictions' and the choice's share
    assert protocol["trainings"] == 2 and 0 < planning < 60, protocol
    # each training's share: what is left of the lane over the trainings left, less the start-up measured so far
    events = [e for e in read_job_events(out / "cv") if e["event"] == "end"]
    ended = [e for e in events if e["job"] == "train"]
    assert [e["exit_code"] for e in ended] == [0, 0]
    done, shares = [], []  # (seconds of the process, seconds of its loop) and the share of each training so far
    for event in ended:
        run_dir = out / "cv" / "fullres" / f"fold_{event['fold']}"
        summary = json.loads((run_dir / "summary.json").read_text())
        start_up = sum(s - loop for s, loop in done) / len(done) if done else FIRST_OVERHEAD_SECONDS
        share = (lane - sum(s for s, _ in done)) / (2 - len(done)) - start_up
        given = summary["time_budget"]["max_minutes"]
        assert given == pytest.approx(math.floor(share / 60 * 100) / 100, abs=1e-9), (event, done, lane)
        # the training fits its schedule to its share and completes it (or the plan's training.epochs caps it)
        assert summary["stop_reason"] == "epochs" and summary["epochs"] == summary["time_budget"]["schedule_epochs"]
        capped = summary["epochs"] == load_config(run_dir / "config.yaml").training.epochs
        used = summary["time_budget"]["used_share"]
        assert used <= 1.05 and (capped or used >= 0.75), summary["time_budget"]
        done.append((event["seconds"], summary["elapsed_seconds"]))
        shares.append(given * 60)
    # the accounting: outside the jobs, only the planning and converting the split measured (and the choice)
    wall = protocol["wall_seconds"]
    outside = wall - sum(e["seconds"] for e in events)
    assert abs(outside - planning) <= 0.05 * budget, (outside, planning)
    # the end: the budget, moved by the last start-up's surprise, the out-of-fold predictions against their share
    # and the last loop's shortfall from its share
    start_ups = [s - loop for s, loop in done]
    oof = sum(e["seconds"] for e in events if e["job"] == "oof")
    loop = done[-1][1]
    estimate = sum(start_ups[:-1]) / len(start_ups[:-1])  # the last training's start-up as its share assumed
    unforeseen = (start_ups[-1] - estimate) + (oof - reserve) - (shares[-1] - loop)
    why = (
        f"protocol {wall:.1f} s of {budget:.0f} s; start-ups {[round(s, 1) for s in start_ups]} s, out-of-fold "
        f"{oof:.1f} s of {reserve:.1f} s, the last loop {loop:.1f} s of {shares[-1]:.1f} s"
    )
    assert abs(wall - unforeseen - budget) <= 0.05 * budget, why
