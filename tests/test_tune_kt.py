"""The one Keras Tuner adapter (`tfmis.tuning.kt`) against the real Keras Tuner: every private name it relies on
still exists and behaves as relied on, so that a Keras Tuner upgrade that changes one fails here, by name.

Each test runs a real in-process search (a real oracle and tuner writing a real project folder) over a tiny
space, with a trial function in place of a training run.
"""

from __future__ import annotations

import json

import keras_tuner
import pytest

from tfmis.tuning import kt


def _space(values=(1, 2, 3, 4)):
    hp = keras_tuner.HyperParameters()
    hp.Choice("batch", list(values))
    return hp


def _search(tmp_path, oracle, evaluate, project="project", overwrite=True):
    tuner = kt.make_tuner(
        evaluate, "seconds", oracle=oracle, directory=str(tmp_path), project_name=project, overwrite=overwrite
    )
    kt.run_search(tuner)
    return tuner


def test_private_names_the_adapter_uses_exist_in_this_keras_tuner():
    """Keras Tuner has no public API for what `tfmis.tuning.kt` does with these: they must exist (a rename in a
    new release fails here, naming it)."""
    from keras_tuner.src import config as kt_config

    assert isinstance(kt_config.DEBUG, bool)
    oracle = keras_tuner.oracles.RandomSearchOracle(
        objective=keras_tuner.Objective("seconds", "min"), hyperparameters=_space(), max_trials=2
    )
    for name in ("_duplicate", "_random_values", "_get_oracle_fname", "_get_trial_dir", "_save_trial"):
        assert callable(getattr(oracle, name, None)), name
    assert oracle._retry_queue == []
    assert keras_tuner.engine.trial.TrialStatus.STOPPED == "STOPPED"


def test_a_failed_trial_is_failed_with_its_reason_and_no_traceback_and_debug_is_restored(tmp_path, capsys):
    """`quiet` keeps Keras Tuner from printing a traceback per failed trial (its DEBUG switch), the reason is
    the trial's message, the search goes on after failures, and DEBUG is what it was afterwards."""
    from keras_tuner.src import config as kt_config

    before = kt_config.DEBUG
    oracle = kt.make_oracle(
        "grid",
        objective="seconds",
        direction="min",
        hyperparameters=_space(),
        seed=1,
        grid=[{"batch": b} for b in (1, 2, 3, 4)],
    )
    tuner = _search(
        tmp_path,
        oracle,
        lambda trial_id, v: (
            (None, f"batch {v['batch']} ran out of memory") if v["batch"] > 2 else (float(v["batch"]), None)
        ),
    )
    output = capsys.readouterr()
    assert "Traceback" not in output.out + output.err
    assert kt_config.DEBUG == before
    trials = kt.saved_trials(tmp_path / "project")
    assert sorted(t["status"] for t in trials.values()) == ["COMPLETED", "COMPLETED", "FAILED", "FAILED"]
    failed = [t for t in trials.values() if t["status"] == "FAILED"]
    assert all("ran out of memory" in t["message"] for t in failed)
    assert tuner.oracle.get_best_trials(1)[0].hyperparameters.values == {"batch": 1}


def test_bayesian_proposals_never_repeat_a_point_and_the_search_stops_when_the_space_is_used_up(tmp_path):
    """A Gaussian process on a flat objective keeps proposing the same point; the adapter replaces a repeat by
    an unseen random point (`_duplicate`, `_random_values`) and stops once every point was tried."""
    seen = []

    def evaluate(trial_id, values):
        seen.append(values["batch"])
        return 1.0, None

    oracle = kt.make_oracle(
        "bayesian",
        objective="seconds",
        direction="min",
        hyperparameters=_space(),
        seed=3,
        max_trials=50,
        num_initial_points=1,
    )
    _search(tmp_path, oracle, evaluate)
    assert sorted(seen) == [1, 2, 3, 4]


def test_stop_when_ends_the_search_before_the_next_proposal(tmp_path):
    """The caller's stop condition (the GPU-fit search's "measured enough") is asked before each proposal."""
    seen = []
    oracle = kt.make_oracle(
        "random",
        objective="seconds",
        direction="min",
        hyperparameters=_space(),
        seed=1,
        max_trials=50,
        stop_when=lambda: len(seen) >= 2,
    )
    _search(tmp_path, oracle, lambda trial_id, v: (seen.append(v["batch"]) or 1.0, None))
    assert len(seen) == 2


def test_list_grid_hands_out_each_point_once_in_order(tmp_path):
    """The list grid walks its points in the given order, skipping none and repeating none."""
    seen = []
    grid = [{"batch": b} for b in (4, 1, 3, 2)]
    oracle = kt.make_oracle("grid", objective="seconds", direction="min", hyperparameters=_space(), seed=1, grid=grid)
    _search(tmp_path, oracle, lambda trial_id, v: (seen.append(v["batch"]) or 1.0, None))
    assert seen == [4, 1, 3, 2]


def test_state_files_are_complete_json_and_a_reload_never_reruns_an_ended_trial(tmp_path):
    """After a search, oracle.json and every trial.json are complete JSON (written atomically through
    `_get_oracle_fname`, `_get_trial_dir`, `_save_trial`), no trial is left ongoing (saved after `end_trial`);
    an oracle file that still lists an ended trial as ongoing (a kill mid-save) does not send it back to
    the retry queue on reload (`_retry_queue`)."""
    grid = [{"batch": b} for b in (1, 2, 3, 4)]
    oracle = kt.make_oracle(
        "grid", objective="seconds", direction="min", hyperparameters=_space(), seed=1, max_trials=2, grid=grid
    )
    _search(tmp_path, oracle, lambda trial_id, v: (float(v["batch"]), None))
    project = tmp_path / "project"
    assert kt.saved_oracle_state(project) == {"ongoing": [], "retry": []}
    trials = kt.saved_trials(project)
    assert len(trials) == 2 and all(t["status"] == "COMPLETED" for t in trials.values())
    ended = next(iter(trials))
    state = json.loads((project / kt.ORACLE_FILE).read_text())
    state["ongoing_trials"] = {"tuner0": ended}  # as a kill between Keras Tuner's save and its removal leaves it
    (project / kt.ORACLE_FILE).write_text(json.dumps(state))
    kt.allow_reload(project)
    assert (project / kt.CHIEF_FILE).is_file()
    reloaded = kt.make_oracle(
        "grid", objective="seconds", direction="min", hyperparameters=_space(), seed=1, max_trials=4, grid=grid
    )
    tuner = kt.make_tuner(
        lambda trial_id, v: (float(v["batch"]), None),
        "seconds",
        oracle=reloaded,
        directory=str(tmp_path),
        project_name="project",
        overwrite=False,
    )
    assert kt.retry_queue(tuner) == []
    kt.run_search(tuner)
    statuses = kt.saved_trials(project)
    assert len(statuses) == 4 and sorted(t["values"]["batch"] for t in statuses.values()) == [1, 2, 3, 4]


def test_a_trial_started_after_the_oracle_last_saved_is_rerun_on_reload(tmp_path):
    """Keras Tuner writes a new trial's trial.json before oracle.json; a search killed between the two leaves a
    RUNNING trial the saved oracle state does not list. The reloaded oracle queues it for a rerun
    (`_retry_queue`), `saved_oracle_state` names it as ongoing, and the resumed grid runs every point."""
    grid = [{"batch": b} for b in (1, 2, 3, 4)]
    oracle = kt.make_oracle(
        "grid", objective="seconds", direction="min", hyperparameters=_space(), seed=1, max_trials=3, grid=grid
    )
    _search(tmp_path, oracle, lambda trial_id, v: (float(v["batch"]), None))
    project = tmp_path / "project"
    trials = kt.saved_trials(project)
    assert len(trials) == 3
    last = max(trials, key=kt.trial_order)
    trial_file = next(project.glob(f"trial_*{last}/trial.json"))
    state = json.loads(trial_file.read_text())
    state["status"], state["score"], state["metrics"] = "RUNNING", None, {"metrics": {}}
    trial_file.write_text(json.dumps(state))  # started, but oracle.json (below) was saved before it
    oracle_state = json.loads((project / kt.ORACLE_FILE).read_text())
    oracle_state["end_order"] = [t for t in oracle_state["end_order"] if t != last]
    (project / kt.ORACLE_FILE).write_text(json.dumps(oracle_state))
    assert kt.saved_oracle_state(project)["ongoing"] == [last]
    kt.allow_reload(project)
    reloaded = kt.make_oracle(
        "grid", objective="seconds", direction="min", hyperparameters=_space(), seed=1, max_trials=4, grid=grid
    )
    seen = []
    tuner = kt.make_tuner(
        lambda trial_id, v: (seen.append(trial_id) or float(v["batch"]), None),
        "seconds",
        oracle=reloaded,
        directory=str(tmp_path),
        project_name="project",
        overwrite=False,
    )
    assert kt.retry_queue(tuner) == [last]
    kt.run_search(tuner)
    statuses = kt.saved_trials(project)
    assert last in seen and all(t["status"] == "COMPLETED" for t in statuses.values())
    assert sorted(t["values"]["batch"] for t in statuses.values()) == [1, 2, 3, 4]


def test_an_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="grid, random or bayesian"):
        kt.make_oracle("hyperband", objective="seconds", direction="min", hyperparameters=_space(), seed=1)
