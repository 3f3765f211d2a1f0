"""The one adapter to Keras Tuner, shared by the GPU-fit search (`tfmis.tuning.fit`) and the hyperparameter
search (`tfmis.tuning.hpo`). No other module of tfmis touches Keras Tuner's internals.

Both searches use Keras Tuner as a proposal engine (its oracles: grid, random, Bayesian) and as the
chief/worker protocol of its distributed mode; a "trial" is not a Keras model but a measurement in a
subprocess or a `tfmis.train` run. What they need beyond Keras Tuner's public API, all here:

- a trial that fails is an expected outcome with a reason, never a printed traceback (`quiet`:
  `keras_tuner.src.config.DEBUG`), and never the end of the search (`max_consecutive_failed_trials`);
- no point is proposed twice: a repeat of a tried or running point (a Gaussian process proposing the
  same point, or two workers asking before a result arrived) is replaced by a random unseen point
  (`Oracle._duplicate`, `Oracle._random_values`);
- a stop condition of the caller's (the GPU-fit search stops once it has measured enough);
- durable state: the oracle's and each trial's file are written atomically (`Oracle._get_oracle_fname`,
  `_get_trial_dir`, `_save_trial`), the state is saved once a trial has left the ongoing ones, and a
  trial that ended is never rerun on reload (`Oracle._retry_queue`);
- a grid handed to whichever worker asks first (Keras Tuner's `GridSearchOracle` derives each point from
  a finished trial, so N workers would wait for one another);
- reading a project's files back (`saved_trials`, `saved_oracle_state`) for reports and resumption.

`tests/test_tune_kt.py` checks every private name used here still exists and behaves as relied on, so
a Keras Tuner upgrade that changes one fails there, naming it.

Example:
```python
hp = keras_tuner.HyperParameters()
hp.Int("batch", 1, 8)
oracle = make_oracle("bayesian", objective="seconds", direction="min", hyperparameters=hp, seed=1,
                     max_trials=20, num_initial_points=5)
tuner = make_tuner(lambda trial_id, values: (measure(values), None), "seconds", oracle=oracle,
                   directory="runs/search", project_name="oracle", overwrite=True)
run_search(tuner)
```
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path

from tfmis.errors import ConfigError
from tfmis.utils.io import atomic_write_json

ENDED = ("COMPLETED", "FAILED")  # the statuses of a trial that is not run again
NEVER_STOP_ON_FAILURES = 10**9  # max_consecutive_failed_trials: a failed trial never ends a search
ORACLE_FILE = "oracle.json"  # Keras Tuner's state file in the project folder
CHIEF_FILE = "chief.json"  # Keras Tuner reloads a project's oracle only when this file exists


@functools.cache
def _classes() -> dict:
    """The oracle and tuner classes, defined on first use: they subclass Keras Tuner's, whose import brings
    TensorFlow, which a process that only plans devices or reads a report does not need."""
    import keras_tuner
    from keras_tuner.engine.trial import TrialStatus

    stopped = {"status": TrialStatus.STOPPED, "values": None}

    class TfmisOracle:
        """Oracle mixin: the caller's stop condition, no repeated points, durable state (see the module)."""

        stop_when: Callable[[], bool] | None = None
        replace_repeats: bool = True

        def populate_space(self, trial_id):
            if self.stop_when is not None and self.stop_when():
                return stopped
            response = super().populate_space(trial_id)
            if (
                self.replace_repeats
                and response["status"] == TrialStatus.RUNNING
                and self._duplicate(response["values"])
            ):
                values = self._random_values()
                response = stopped if values is None else {"status": TrialStatus.RUNNING, "values": values}
            return response

        def save(self):
            atomic_write_json(self._get_oracle_fname(), self.get_state())

        def _save_trial(self, trial):
            atomic_write_json(os.path.join(self._get_trial_dir(trial.trial_id), "trial.json"), trial.get_state())

        @keras_tuner.synchronized
        def end_trial(self, trial):
            super().end_trial(trial)
            # Keras Tuner saves before it removes the trial from the ongoing ones: the last trial of each
            # worker would stay "ongoing" on disk and be rerun by the next run
            self.save()

        def reload(self):
            super().reload()  # sends the trials that were ongoing to the retry queue
            self._retry_queue = [t for t in self._retry_queue if self.trials[t].status not in ENDED]
            # Keras Tuner writes a new trial's trial.json before oracle.json: a search stopped between the two
            # leaves a running trial the saved state does not know, and its grid point would never run
            for trial_id in sorted(self.trials, key=trial_order):
                if self.trials[trial_id].status == TrialStatus.RUNNING and trial_id not in self._retry_queue:
                    self._retry_queue.append(trial_id)

    class ListGridOracle(TfmisOracle, keras_tuner.Oracle):
        """The whole grid, each point once, handed to whichever worker asks first.

        Keras Tuner's GridSearchOracle derives each new point from a finished trial, so with several
        workers it hands out one trial at a time after the first two (the others wait IDLE), and its
        order is not part of its saved state; this one walks a fixed list, skipping the points tried or
        running (which the oracle saves), so it runs N at once and resumes.
        """

        def __init__(self, grid: list[dict], **kwargs):
            super().__init__(**kwargs)
            self.grid = grid

        def populate_space(self, trial_id):
            if self.stop_when is not None and self.stop_when():
                return stopped
            for values in self.grid:
                if not self._duplicate(values):
                    return {"status": TrialStatus.RUNNING, "values": dict(values)}
            return stopped

    class GridOracle(TfmisOracle, keras_tuner.oracles.GridSearchOracle):
        pass

    class RandomOracle(TfmisOracle, keras_tuner.oracles.RandomSearchOracle):
        pass

    class BayesianOracle(TfmisOracle, keras_tuner.oracles.BayesianOptimizationOracle):
        pass

    class Tuner(keras_tuner.Tuner):
        """A tuner whose trial is `evaluate(trial_id, values) -> (objective value, failure reason or None)`."""

        def __init__(self, evaluate, objective: str, **kwargs):
            super().__init__(**kwargs)
            self.evaluate, self.objective_name = evaluate, objective

        def run_trial(self, trial, *args, **kwargs):
            value, failure = self.evaluate(trial.trial_id, dict(trial.hyperparameters.values))
            if failure is not None:
                raise keras_tuner.errors.FailedTrialError(failure)
            return {self.objective_name: value}

        def save_model(self, trial_id, model, step=0):
            pass  # a trial measures a configuration or trains in its own run folder: no model here

    return {
        "keras_tuner": keras_tuner,
        "list_grid": ListGridOracle,
        "grid": GridOracle,
        "random": RandomOracle,
        "bayesian": BayesianOracle,
        "tuner": Tuner,
    }


def make_oracle(
    strategy: str,
    *,
    objective: str,
    direction: str,
    hyperparameters,
    seed: int,
    max_trials: int | None = None,
    num_initial_points: int | None = None,
    grid: list[dict] | None = None,
    stop_when: Callable[[], bool] | None = None,
    replace_repeats: bool = True,
):
    """An oracle over `hyperparameters` (a `keras_tuner.HyperParameters` declared up front, no new entries).

    Args:
        strategy: `grid` (with `grid`: that list of points, in order; without: Keras Tuner's exhaustive
            `GridSearchOracle` over the space), `random` or `bayesian`.
        objective, direction: the metric name the trials report and `min` or `max`.
        seed: the oracle's seed (Keras Tuner takes 0 as "pick one at random").
        max_trials: proposals in all (grid: the grid's end stops it).
        num_initial_points: Bayesian: random proposals before the Gaussian process.
        stop_when: called before each proposal; True stops the search.
        replace_repeats: replace a proposal of a tried or running point by a random unseen one.
    """
    classes = _classes()
    kwargs = {
        "objective": classes["keras_tuner"].Objective(objective, direction),
        "hyperparameters": hyperparameters,
        "allow_new_entries": False,
        "tune_new_entries": False,
        "seed": seed,
        "max_consecutive_failed_trials": NEVER_STOP_ON_FAILURES,
    }
    if max_trials is not None:
        kwargs["max_trials"] = max_trials
    if strategy == "grid":
        oracle = classes["list_grid"](grid, **kwargs) if grid is not None else classes["grid"](**kwargs)
    elif strategy == "random":
        oracle = classes["random"](**kwargs)
    elif strategy == "bayesian":
        oracle = classes["bayesian"](num_initial_points=num_initial_points, **kwargs)
    else:
        raise ConfigError(f"strategy must be grid, random or bayesian, got {strategy!r}")
    oracle.stop_when, oracle.replace_repeats = stop_when, replace_repeats
    return oracle


def make_tuner(evaluate: Callable[[str, dict], tuple] | None, objective: str, **kwargs):
    """A `keras_tuner.Tuner` whose trial is `evaluate(trial_id, values) -> (objective value, failure reason or
    None)`: a reason makes the trial FAILED with that message; there is no model to build or save.

    Args:
        evaluate: the trial (None on a chief, which only serves the oracle).
        objective: the metric name the oracle optimises.
        **kwargs: `keras_tuner.Tuner`'s (oracle, directory, project_name, overwrite).
    """
    return _classes()["tuner"](evaluate, objective, **kwargs)


def retry_queue(tuner) -> list[str]:
    """Trial ids the tuner's oracle will run again (they were running when an earlier search stopped)."""
    return list(tuner.oracle._retry_queue)


@contextlib.contextmanager
def quiet():
    """Failed trials without Keras Tuner's tracebacks (its default debug mode prints one per failure), and
    without scikit-learn's Gaussian-process warnings about length scales on tiny spaces."""
    from keras_tuner.src import config as kt_config

    debug, kt_config.DEBUG = kt_config.DEBUG, False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=UserWarning)
            yield
    finally:
        kt_config.DEBUG = debug


def run_search(tuner) -> None:
    """Runs `tuner.search` until its oracle stops (a worker), or serves the oracle (the chief)."""
    with quiet():
        tuner.search(verbose=0)


def allow_reload(project_dir: str | Path) -> None:
    """Lets a chief reload the oracle state in `project_dir` (Keras Tuner reloads only when its chief file is
    there, which an interrupted chief may not have written)."""
    project = Path(project_dir)
    if (project / ORACLE_FILE).is_file() and not (project / CHIEF_FILE).is_file():
        atomic_write_json(project / CHIEF_FILE, {})


def trial_order(trial_id: str):
    """Sort key: numeric trial ids in numeric order, others after them."""
    return (int(trial_id), trial_id) if str(trial_id).isdigit() else (math.inf, str(trial_id))


def saved_trials(project_dir: str | Path) -> dict[str, dict]:
    """The trials saved in a project folder, by trial id: {"status", "values", "score", "message"}."""
    trials = {}
    for path in sorted(Path(project_dir).glob("trial_*/trial.json")):
        try:
            state = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        trials[str(state["trial_id"])] = {
            "status": state["status"],
            "values": state["hyperparameters"]["values"],
            "score": state.get("score"),
            "message": state.get("message"),
        }
    return trials


def saved_oracle_state(project_dir: str | Path) -> dict | None:
    """{"ongoing": trial ids that were running, "retry": trial ids queued to rerun} of a saved oracle, or None
    when the project has none. A trial whose own trial.json says it was running counts as ongoing even when the
    oracle's file was saved before it started (the reloaded oracle reruns it)."""
    path = Path(project_dir) / ORACLE_FILE
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    ongoing = {str(t) for t in (state.get("ongoing_trials") or {}).values()}
    ongoing |= {t for t, trial in saved_trials(project_dir).items() if trial["status"] == "RUNNING"}
    return {
        "ongoing": sorted(ongoing, key=trial_order),
        "retry": [str(t) for t in state.get("retry_queue") or []],
    }
