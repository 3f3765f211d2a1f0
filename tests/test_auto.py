"""tfmis-auto: nnU-Net's protocol in one command on a real (tiny) MSD folder: plan, cross-validate, choose,
predict from the result, continue on a rerun; the budget split and its refusals."""

from __future__ import annotations

import json
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
    """`--max-minutes 2.5`, 2 folds: after planning and converting, the time left less 15% is split over the 2
    trainings (protocol.json's `training.max_minutes`), each training's schedule fits its share, and the whole
    protocol ends between 0.6x and 1.15x of the budget (margins for a shared 2-core machine)."""
    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=6)
    out = tmp_path / "auto"
    code, text = run(["--source-dir", source, "--output", out, "--folds", "2", "--max-minutes", "2.5"], capsys)
    assert code == 0, text
    protocol = json.loads((out / "protocol.json").read_text())
    (override,) = protocol["overrides"]
    each = float(override.split("=")[1])
    assert override.startswith("training.max_minutes=") and 0.5 <= each <= 2.5 * 0.85 / 2
    assert "Protocol budget: 2.5 min" in text
    assert 0.6 * 150 <= protocol["wall_seconds"] <= 1.15 * 150, protocol["wall_seconds"]
