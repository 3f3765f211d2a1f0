"""`training.max_minutes` sets the schedule's length: the decision from measured epochs (`tfmis.engine.budget`), and
the real trainer on the tiny dataset ending within its budget with its learning-rate schedule complete, also
across a resume.

The trainer tests never assert absolute times (the machine is shared and noisy): the decided epochs are checked
against the times the run itself measured, and the run's length against its budget with wide margins (see
`test_budgeted_run_fits_its_schedule_to_the_budget`).
"""

from __future__ import annotations

import json
import math

import pytest
from conftest import tiny_config

from tfmis.engine.budget import SAFETY_SHARE, TimeBudget
from tfmis.engine.callbacks import Callback
from tfmis.engine.trainer import Trainer

BUDGET_MINUTES = 0.5  # 30 s: the first epoch (tracing) takes ~5 s of it, then dozens of 0.2-0.5 s epochs
BASE_LR = 1e-3  # the tiny config's (optimizer.learning_rate default, AdamW)


# ---------------------------------------------------------------- the decision alone


def _feed(budget: TimeBudget, epochs: int, seconds: float, validation: float, first: float = 5.0) -> float:
    """Epochs 1..`epochs` of `seconds` (the first `first`), each validated (`validation` s); returns the elapsed
    time after the last, having called `update` after each as the trainer does."""
    elapsed = 0.0
    for epoch in range(1, epochs + 1):
        s = first if epoch == 1 else seconds
        elapsed += s + validation
        budget.add_epoch(epoch, s, validation)
        budget.update(epoch, elapsed)
    return elapsed


def test_decision_waits_for_a_tenth_of_the_budget_and_fills_the_rest():
    """1 s epochs + 0.5 s validations in a 100 s budget: the first two epochs are not measured, the decision
    comes once the measured epochs span 10 s, and the epochs it decides end the run at the budget less the 5 %
    margin (not one more)."""
    budget = TimeBudget(max_minutes=100 / 60, max_epochs=10_000, val_interval=1)
    elapsed = _feed(budget, 11, seconds=1.0, validation=0.5)
    assert budget.epochs is None  # 9 measured epochs (3..11) = 9 s: decided after the next one
    elapsed = _feed_one(budget, 12, 1.0, 0.5, elapsed)
    (event,) = budget.events
    assert event["epoch"] == 12 and event["what"] == "decided" and event["epoch_seconds"] == pytest.approx(1.0)
    remaining = math.floor((100 * (1 - SAFETY_SHARE) - elapsed) / 1.5)
    assert budget.epochs == 12 + remaining
    assert "measured over epochs 3-12" in budget.reason and f"{budget.epochs} epochs" in budget.reason


def _feed_one(budget: TimeBudget, epoch: int, seconds: float, validation: float, elapsed: float) -> float:
    elapsed += seconds + validation
    budget.add_epoch(epoch, seconds, validation)
    budget.update(epoch, elapsed)
    return elapsed


def test_validations_every_interval_and_the_last_are_counted():
    """With val_interval 4 the projection counts the validations at multiples of 4 and at the last epoch."""
    budget = TimeBudget(max_minutes=1, max_epochs=100, val_interval=4)
    budget.validation_times = [9.0, 2.0]  # the first (cold) is ignored once a second is measured
    assert budget.validations(4, 10) == 2 and budget.validations(4, 12) == 2 and budget.validations(0, 1) == 1
    assert budget.projected_seconds(4, 10, elapsed=20.0, epoch_seconds=1.0) == pytest.approx(20 + 6 + 2 * 2.0)


def test_the_cap_bounds_the_schedule_which_follows_the_pace_until_three_quarters_then_only_shrinks():
    """training.epochs bounds the decision. In the first three quarters of a 60 s budget the length follows the
    recent pace both ways (epochs twice as slow shorten it, fast again lengthen it); after that, faster epochs never
    lengthen it and slower ones shorten it only when the projection passes the budget."""
    capped = TimeBudget(max_minutes=1, max_epochs=30, val_interval=1)
    _feed(capped, 10, seconds=1.0, validation=0.0)
    assert capped.epochs == 30 and "(training.epochs)" in capped.reason
    budget = TimeBudget(max_minutes=1, max_epochs=1000, val_interval=1)
    elapsed = _feed(budget, 16, seconds=0.5, validation=0.0)
    decided = budget.epochs
    assert decided is not None and decided > 16
    for epoch in range(17, 27):  # twice as slow (elapsed 12.5 -> 22.5 s)
        elapsed = _feed_one(budget, epoch, 1.0, 0.0, elapsed)
    assert elapsed < 45 and budget.epochs < decided and budget.events[-1]["what"] == "refined"
    slow = budget.epochs
    epoch = 26
    while elapsed < 45:  # fast again, before three quarters: the length grows back
        epoch += 1
        elapsed = _feed_one(budget, epoch, 0.5, 0.0, elapsed)
    assert budget.epochs > slow and budget.events[-1]["what"] == "refined"
    past_half = budget.epochs
    for _ in range(10):  # much faster in the last quarter: no growth
        epoch += 1
        elapsed = _feed_one(budget, epoch, 0.1, 0.0, elapsed)
    assert budget.epochs == past_half
    for _ in range(10):  # much slower in the last quarter: the projection overruns, shortened
        epoch += 1
        elapsed = _feed_one(budget, epoch, 2.0, 0.0, elapsed)
    assert budget.epochs < past_half and budget.events[-1]["what"] == "shortened"
    event = budget.events[-1]
    ends = budget.projected_seconds(event["epoch"], budget.epochs, event["elapsed_seconds"], event["epoch_seconds"])
    assert ends <= 60 * (1 - SAFETY_SHARE) or budget.epochs == event["epoch"] + 1  # or the least: the next epoch


def test_a_resumed_decision_is_kept():
    """A decision read from the checkpoint is not made again: the measured epochs of the new process only shorten
    it if the rest would overrun."""
    budget = TimeBudget(max_minutes=10, max_epochs=1000, val_interval=1, decided=300)
    assert budget.epochs == 300 and budget.resumed and "before the resume" in budget.reason
    _feed(budget, 20, seconds=0.5, validation=0.0)
    assert budget.epochs == 300 and budget.events == []


# ---------------------------------------------------------------- the trainer


def _history(run) -> list[dict]:
    return [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]


def _cosine(step: int, total: int, warmup: int, base: float = BASE_LR) -> float:
    """The schedule's closed form (cosine to 0 after a linear warm-up), written out independently."""
    if step < warmup:
        return base * step / warmup
    return base * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))


def _budgeted(converted_dataset, run, *extra):
    return tiny_config(
        converted_dataset,
        run,
        "training.epochs=1000",  # an upper bound the budget never reaches
        f"training.max_minutes={BUDGET_MINUTES}",
        "optimizer.warmup_epochs=1",
        *extra,
    )


@pytest.mark.slow
def test_budgeted_run_fits_its_schedule_to_the_budget(converted_dataset, tmp_path):
    """A 0.5-minute budget with training.epochs=1000: the trainer measures the tiny epochs, decides how many fit
    (consistent with what it measured), and runs exactly those: the last epoch's learning rate is the cosine's
    end (0), the warm-up came first, and the run ends within its budget.

    Margins: the decision targets 97 % of the budget. The run may end later only by the epoch that crosses the
    budget (the hard stop) plus the final validation: a fraction of a second here, so <= 1.1x. It ends earlier
    when the epochs measured for the decision were slower than the later ones: on a 2-core machine shared with
    other test processes (load 7 while this was written) the tiny epochs right after the start were up to 2x
    slower than the later ones (0.6x seen with an 18-s budget), so the lower bound is 0.5x, far from where a
    broken decision would land (the 1000-epoch cap: the hard stop mid-schedule; a few epochs: a few per cent).
    """
    run = tmp_path / "run"
    summary = Trainer(_budgeted(converted_dataset, run, "output.tensorboard=true")).fit()  # a reason line too
    history = _history(run)
    budget = summary["time_budget"]
    last = history[-1]
    assert summary["stop_reason"] == "epochs" and summary["epochs"] == last["epoch"] == budget["schedule_epochs"]
    assert last["schedule_epochs"] == last["epoch"] < 1000
    # the schedule completed: the rate after the last step is the cosine's end, the warm-up ran in epoch 1
    assert last["learning_rate"] == pytest.approx(0.0, abs=1e-9)
    assert history[0]["learning_rate"] == pytest.approx(BASE_LR, rel=1e-5)  # the warm-up's end, after epoch 1
    spe = 2  # training.steps_per_epoch of the tiny config
    for record in history[1:-1]:  # every epoch's rate on the schedule it trained with (its end known by then)
        total = history[record["epoch"] - 2]["schedule_epochs"] * spe
        assert record["learning_rate"] == pytest.approx(_cosine(record["epoch"] * spe, total, spe), abs=1e-7)
    # the decision is consistent with what was measured: the epochs that fit at the measured pace
    decided = next(e for e in budget["events"] if e["what"] == "decided")
    per_epoch = decided["epoch_seconds"] + decided["validation_seconds"]  # val_interval 1: every epoch validates
    target = 60 * BUDGET_MINUTES * (1 - SAFETY_SHARE)
    fit = decided["epoch"] + math.floor((target - decided["elapsed_seconds"]) / per_epoch)
    assert decided["epochs"] == fit
    assert history[decided["epoch"] - 1]["time_budget"] == decided["reason"]
    # the pace measured before the decision against the pace of the history's epochs up to it (elapsed times)
    measured = [r for r in history if 3 <= r["epoch"] <= decided["epoch"]]
    paced = (measured[-1]["elapsed_seconds"] - history[1]["elapsed_seconds"]) / len(measured)
    assert 0.7 < per_epoch / paced < 1.4
    # refinements come before three quarters of the budget, shortenings after them only shorten; the run ends
    # within its budget
    events = budget["events"]
    for before, event in zip(events, events[1:]):
        if event["what"] == "refined":
            assert event["elapsed_seconds"] < 0.75 * 60 * BUDGET_MINUTES
        else:
            assert event["what"] == "shortened" and event["epochs"] < before["epochs"]
    assert 0.5 < budget["used_share"] < 1.1, budget
    assert budget["used_minutes"] == pytest.approx(summary["elapsed_seconds"] / 60)


@pytest.mark.slow
def test_resumed_budgeted_run_continues_the_same_schedule(converted_dataset, tmp_path):
    """A budgeted run interrupted after its decision is resumed: the restored schedule length is the saved one
    (no second decision), the first resumed epoch's learning rate lies on that schedule, and the run ends at its
    end (rate 0) within the budget, the earlier process's time included."""
    run = tmp_path / "run"
    decided = {}

    class StopAfterTheDecision(Callback):  # interrupts the run two committed epochs after the decision
        def on_epoch_end(self, trainer, epoch, record):
            if "time_budget" in record and not decided:
                decided.update(epoch=epoch, epochs=record["schedule_epochs"])
            if decided and epoch == decided["epoch"] + 2:
                raise KeyboardInterrupt

    first = Trainer(_budgeted(converted_dataset, run, "validation.val_interval=2"), callbacks=[StopAfterTheDecision()])
    with pytest.raises(KeyboardInterrupt):
        first.fit()
    saved = _history(run)
    assert saved[-1]["epoch"] == decided["epoch"] + 2 and decided["epochs"] > saved[-1]["epoch"]
    spe = 2
    resumed = Trainer(_budgeted(converted_dataset, run, "validation.val_interval=2"))
    done = resumed.restore(resume=True)
    assert done == saved[-1]["epoch"]
    assert resumed.schedule_length.total_steps == saved[-1]["schedule_epochs"] * spe  # the saved length
    assert int(resumed.budget_epochs.numpy()) == saved[-1]["schedule_epochs"]
    summary = resumed.fit(resume=True)
    history = _history(run)
    budget = summary["time_budget"]
    assert all(e["what"] == "shortened" for e in budget["events"])  # no second decision
    if not budget["events"]:
        assert "decided before the resume" in budget["reason"]
    next_record = history[done]  # the first resumed epoch, on the saved schedule
    assert next_record["learning_rate"] == pytest.approx(
        _cosine((done + 1) * spe, saved[-1]["schedule_epochs"] * spe, spe), abs=1e-7
    )
    assert summary["stop_reason"] == "epochs" and history[-1]["learning_rate"] == pytest.approx(0.0, abs=1e-9)
    assert history[-1]["epoch"] == history[-1]["schedule_epochs"] <= saved[-1]["schedule_epochs"]
    assert budget["used_share"] < 1.1 and summary["elapsed_seconds"] > saved[-1]["elapsed_seconds"]


def test_a_warm_up_as_long_as_the_schedule_is_cut_to_half_of_it_and_the_run_trains(converted_dataset, tmp_path, capsys):
    """training.epochs=1 with optimizer.warmup_epochs=1 (a short first try of a config with a warm-up): the run
    trains instead of stopping in the schedule's ValueError, says in one line that the warm-up was cut to half
    the schedule, and its one epoch's learning rate is the cosine's end after a 1-step warm-up of 2 steps."""
    run = tmp_path / "run"
    summary = Trainer(tiny_config(converted_dataset, run, "training.epochs=1", "optimizer.warmup_epochs=1")).fit()
    assert summary["epochs"] == 1
    assert "the warm-up is cut to 1 step, half of it" in capsys.readouterr().err
    (record,) = _history(run)
    assert record["learning_rate"] == pytest.approx(_cosine(2, 2, 1), abs=1e-9)  # the end of the schedule: 0


def test_a_short_slow_stretch_before_three_quarters_does_not_shorten_the_schedule():
    """1 s epochs in a 100 s budget, then 5 epochs three times as slow (another process for a moment), then 1 s
    again: the refinement's pace is the median of the last half of the measured epochs, so the length stays where
    the steady pace puts it from there (the mean of the same epochs would have cut more than 5 epochs more)."""
    budget = TimeBudget(max_minutes=100 / 60, max_epochs=10_000, val_interval=1)
    elapsed = _feed(budget, 30, seconds=1.0, validation=0.0)
    epoch = 30
    for seconds in [3.0] * 5 + [1.0] * 5:
        epoch += 1
        elapsed = _feed_one(budget, epoch, seconds, 0.0, elapsed)
    assert elapsed < 75
    assert budget.refine_epoch_seconds == pytest.approx(1.0)
    steady_fit = budget.fitting_epochs(epoch, elapsed, 1.0)  # the epochs the steady pace fits from here
    assert abs(budget.epochs - steady_fit) <= 0.02 * budget.epochs + 1
    half = [s for _, s in budget.epoch_times[-max(10, len(budget.epoch_times) // 2) :]]
    assert budget.fitting_epochs(epoch, elapsed, sum(half) / len(half)) < steady_fit - 5  # what the mean would do
