"""`training.max_minutes` sets the schedule's length: the decision from measured epochs
(`tfmis.engine.time_budget`), and the real trainer on the tiny dataset ending within its budget with its
learning-rate schedule complete, also across a resume.

The trainer tests never assert absolute times (the machine is shared and noisy). What the budget controls is checked
at the goal's 5 %: every length it sets is the most epochs whose end, projected at the pace the run itself measured,
fits the budget less its margin, within one epoch of it (`_assert_fitted`). The end of the run on its own clock
(`summary.json`'s `used_share`) also depends on the pace of the epochs after the length is fixed (three quarters of
the budget), which on a shared machine the budget does not control: it is checked against the bounds the design
allows (see `test_budgeted_run_fits_its_schedule_to_the_budget`).
"""

from __future__ import annotations

import json
import math

import pytest
from conftest import tiny_config

from tfmis.engine.callbacks import Callback
from tfmis.engine.time_budget import SAFETY_SHARE, TimeBudget, budget_epoch_bound
from tfmis.engine.trainer import Trainer

BUDGET_MINUTES = 0.4  # 24 s: the first epoch (tracing) takes 1-2 s of it, then ~100 epochs of 0.15-0.3 s
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


def test_one_slow_epoch_in_the_last_quarter_costs_the_schedule_only_its_own_time():
    """0.15-s epochs validated in 0.03 s in a 24-s budget, then past three quarters one epoch of 1.5 s (a slow write,
    another process for a second): its 1.35 s extra are spent, so the schedule is shortened by what they cost, and the
    run still ends within 5 % of its budget at the steady pace. With the mean of the last ten epochs as the pace the
    projection took it ten times over (0.15 s -> 0.29 s per epoch) and shortened the schedule for good to end at
    0.91x (real 30-s runs ended at 0.93x so); the median of the ten is the steady pace."""
    budget = TimeBudget(max_minutes=24 / 60, max_epochs=1000, val_interval=1)
    elapsed = _feed(budget, 2, seconds=0.15, validation=0.03, first=1.5)
    epoch = 2
    while elapsed < 0.76 * 24:
        epoch += 1
        elapsed = _feed_validated(budget, epoch, 0.15, 0.03, elapsed)
    kept = budget.epochs
    assert budget.projected_seconds(epoch, kept, elapsed, 0.15) == pytest.approx(0.97 * 24, abs=0.18)
    epoch += 1
    elapsed = _feed_validated(budget, epoch, 1.5, 0.03, elapsed)
    ends = budget.projected_seconds(epoch, budget.epochs, elapsed, 0.15)
    assert 0.95 * 24 <= ends <= 0.97 * 24, f"ends at {ends / 24:.3f}x at the steady pace"
    event = budget.events[-1]
    assert event["what"] == "shortened" and event["epoch_seconds"] == pytest.approx(0.15)
    assert math.floor(1.35 / 0.18) <= kept - budget.epochs <= math.ceil(1.35 / 0.18)  # the extra time, in epochs


def test_a_resumed_run_does_not_shorten_its_schedule_from_its_first_validation_alone():
    """A resumed process's first validation traces the forward pass: 0.30 s against 0.02-0.08 s warm in a real 24-s
    run resumed at epoch 19 with 105 epochs decided, whose shortening after epoch 21 projected the 42 validations left
    at 0.30 s (34 s instead of 22 s) and cut the schedule for good to 67 epochs (the run ended at 0.72x of its
    budget). The length is kept until a warm validation is measured; a real slowdown still shortens it then."""
    budget = TimeBudget(max_minutes=24 / 60, max_epochs=1000, val_interval=2, decided=105)
    elapsed = 7.4  # the earlier process's 18 epochs
    for epoch, seconds, validation in ((19, 1.2, None), (20, 0.2, 0.30), (21, 0.147, None)):  # 19, 20: not measured
        elapsed = _feed_validated(budget, epoch, seconds, validation, elapsed)
    assert budget.epochs == 105 and budget.events == []
    elapsed = _feed_validated(budget, 22, 0.147, 0.02, elapsed)
    assert budget.epochs == 105 and budget.events == []  # 22.4 s projected with the warm validation: it fits
    for epoch in range(23, 33):  # three times as slow: the rest overruns, shortened with the warm validation
        elapsed = _feed_validated(budget, epoch, 0.45, 0.02 if epoch % 2 == 0 else None, elapsed)
    assert budget.epochs < 105 and budget.events[-1]["what"] == "shortened"
    assert budget.events[0]["validation_seconds"] == pytest.approx(0.02)


def test_a_validation_count_spaces_the_validations_from_the_decided_length_and_fits_it_with_that_spacing():
    """`validation.validations=5` with `val_interval=1`: 1-s epochs validated in 2 s in a 100-s budget. Until the
    decision every epoch is validated; after it they come every round(N / 5) epochs, N the decided length, which is
    the most epochs that fit the budget less its margin with that spacing (the projection written out here): far more
    epochs than the budget without a count decides on the same epochs (a validation costs two epochs)."""
    plain = TimeBudget(max_minutes=100 / 60, max_epochs=10_000, val_interval=1)
    counted = TimeBudget(max_minutes=100 / 60, max_epochs=10_000, val_interval=1, validations=5)
    elapsed = 0.0
    epoch = 0
    while counted.epochs is None:
        epoch += 1
        elapsed += (5.0 if epoch == 1 else 1.0) + 2.0
        for budget in (plain, counted):
            budget.add_epoch(epoch, 5.0 if epoch == 1 else 1.0, 2.0)
            budget.update(epoch, elapsed)
    assert plain.epochs is not None and plain.val_interval == 1  # no count: the interval stays
    interval = counted.val_interval
    assert interval == max(1, round(counted.epochs / 5)) > 1 and counted.events[0]["val_interval"] == interval
    assert f"every {interval} epochs" in counted.reason

    def projected_end(last: int) -> float:  # the epochs after the decision, each 1 s, every interval-th validated
        validated = sum(1 for e in range(epoch + 1, last + 1) if e % interval == 0 or e == last)
        return elapsed + (last - epoch) * 1.0 + validated * 2.0

    assert counted.epochs > plain.epochs
    assert projected_end(counted.epochs) <= 0.97 * 100 < projected_end(counted.epochs + 1)
    over_the_run = sum(1 for e in range(1, counted.epochs + 1) if e % interval == 0 or e == counted.epochs)
    assert 5 <= over_the_run <= 6, over_the_run  # at that spacing from epoch 1; the last epoch's may be one more


def test_a_resumed_budget_spaces_its_validations_from_the_length_it_decided():
    """A 6-minute run planned every 3 epochs with about 15 validations, resumed with 160 epochs decided: every
    round(160 / 15) = 11 epochs; a count that would space them closer than `val_interval` keeps `val_interval`; no
    count keeps it too."""
    assert TimeBudget(6, 1000, 3, decided=160, validations=15).val_interval == 11
    assert TimeBudget(6, 1000, 3, decided=30, validations=15).val_interval == 3
    assert TimeBudget(6, 1000, 3, decided=160).val_interval == 3


def _feed_validated(budget: TimeBudget, epoch: int, seconds: float, validation: float | None, elapsed: float) -> float:
    elapsed += seconds + (validation or 0.0)
    budget.add_epoch(epoch, seconds, validation)
    budget.update(epoch, elapsed)
    return elapsed


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


def _validations(done: int, last: int, interval: int) -> int:
    """The validations of epochs done+1..last: every `interval`-th epoch's and the last's."""
    return sum(1 for epoch in range(done + 1, last + 1) if epoch % interval == 0 or epoch == last)


def _planned_end(event: dict, last: int, interval: int) -> float:
    """The run's time at the end of epoch `last` as the budget projected it at `event`: the time then, plus the epochs
    after it and their validations at the times it measured."""
    validations = _validations(event["epoch"], last, interval) * event["validation_seconds"]
    return event["elapsed_seconds"] + (last - event["epoch"]) * event["epoch_seconds"] + validations


def _assert_fitted(events: list[dict], interval: int | None = None) -> None:
    """Every length the budget set (decided, refined, shortened) is the most epochs whose end, projected from the
    time then and the epoch and validation times it measured, fits the budget less its margin: one more epoch would
    pass it (or, when none fits, the next epoch: the least). Where an epoch was measured under 2 % of the budget that
    is the goal's 5 %: the planned end is within [0.95, 0.97] of the budget."""
    budget = 60 * BUDGET_MINUTES
    target = budget * (1 - SAFETY_SHARE)
    assert events and SAFETY_SHARE <= 0.05
    for event in events:
        epochs = event["epochs"]
        interval = event["val_interval"] if interval is None else interval
        planned, one_more = _planned_end(event, epochs, interval), _planned_end(event, epochs + 1, interval)
        assert event["epoch"] < epochs < 1000, event
        assert planned <= target + 1e-9 or epochs == event["epoch"] + 1, event
        assert target < one_more, event
        # with an epoch (and its validation) under 2 % of the budget, the goal's 5 %; a busy machine can make the
        # tiny epochs longer than that (0.49 s of 24 s seen in CI): the fit above is then all there is to check
        if one_more - planned < 0.02 * budget:
            assert 0.95 * budget <= planned, event


@pytest.mark.slow
def test_budgeted_run_fits_its_schedule_to_the_budget(converted_dataset, tmp_path, capsys):
    """A 24-s budget with training.epochs=1000: the trainer measures the tiny epochs, decides how many fit
    (consistent with what it measured), and runs exactly those: the last epoch's learning rate is the cosine's
    end (0), the warm-up came first, and the run ends within its budget.

    What the budget controls, at the goal's 5 %: every length it set (`_assert_fitted`) ends, at the pace the run
    measured then, within one epoch of 97 % of the budget (never below 95 %); without it the 1000-epoch cap would run
    for over twice the budget (checked: 4-8x here) and the hard stop would end the run mid-schedule.

    The end on the run's own clock (`used_share`, from the loop's start to the last epoch's commit): the hard stop
    bounds it above by one epoch past the budget (<= 1.05x). Below, the design guarantees only three quarters: the
    length is fixed for good at three quarters of the budget (only shortened after that), so the last 22 % of it runs
    at whatever pace the machine then has, and the run ends at 0.75 + 0.22 / r of the budget when those epochs run r
    times faster than the median pace they were planned with. They do run faster: an epoch after a validation that
    raised the best Dice also writes best.weights.h5 (0.05-0.07 s on top of 0.13-0.17 s) and the tiny model's Dice
    stops rising late; and the load of this 2-core machine shared with benchmark runs changes. In 10 real runs of this
    test r was 1.06-1.35 and the runs ended at 0.90-0.95x, except one (r 2.06: the load fell from 6 to 3) at 0.85x;
    39 runs of the budget replayed on the epoch times of real runs (15-40-s budgets) ended at 0.92-1.00x, 6 below
    0.95x. Hence >= 0.75x, the share after which the length is never lengthened.

    The epoch lines count to the fitted schedule, not to the budget's epoch bound (`budget_epoch_bound`, as a
    planned run's `training.epochs`): "epoch 1/?" before the budget has measured enough, "epoch N/N" at the end.

    With `validation.validations=5`, every epoch is validated until the decision, and after it every K-th epoch and
    the last, K = round(N / 5) for the N decided (the length then fitted with that spacing): K > 1 from 8 epochs on
    (CI's busy machine decided 24, which made K = round(24 / 20) = 1 when this asked for 20 validations).
    """
    run = tmp_path / "run"
    bound = budget_epoch_bound(BUDGET_MINUTES)  # training.epochs as a planned run has it: only the budget's bound
    config = _budgeted(
        converted_dataset, run, "output.tensorboard=true", f"training.epochs={bound}", "validation.validations=5"
    )
    summary = Trainer(config).fit()  # a reason line too
    history = _history(run)
    budget = summary["time_budget"]
    last = history[-1]
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("epoch ")]
    assert lines[0].startswith("epoch 1/?  ") and lines[-1].startswith(f"epoch {last['epoch']}/{last['epoch']}  ")
    assert not any(f"/{bound} " in line for line in lines)
    assert summary["stop_reason"] == "epochs" and summary["epochs"] == last["epoch"] == budget["schedule_epochs"]
    assert last["schedule_epochs"] == last["epoch"] < 1000
    # the schedule completed: the rate after the last step is the cosine's end, the warm-up ran in epoch 1
    assert last["learning_rate"] == pytest.approx(0.0, abs=1e-9)
    assert history[0]["learning_rate"] == pytest.approx(BASE_LR, rel=1e-5)  # the warm-up's end, after epoch 1
    spe = 2  # training.steps_per_epoch of the tiny config
    for record in history[1:-1]:  # every epoch's rate on the schedule it trained with (its end known by then)
        total = history[record["epoch"] - 2]["schedule_epochs"] * spe
        assert record["learning_rate"] == pytest.approx(_cosine(record["epoch"] * spe, total, spe), abs=1e-7)
    # the decision is the run's own measurements: its epochs 3..decided (the first two are not measured) and their
    # validations are the run's clock from epoch 2's end to the decided epoch's end
    events = budget["events"]
    decided = events[0]
    assert decided["what"] == "decided" and history[decided["epoch"] - 1]["time_budget"] == decided["reason"]
    measured = [r for r in history if 3 <= r["epoch"] <= decided["epoch"]]
    spent = decided["epoch_seconds"] * len(measured) + sum(r["val_seconds"] for r in measured)
    assert spent == pytest.approx(measured[-1]["elapsed_seconds"] - history[1]["elapsed_seconds"], abs=0.05)
    assert decided["elapsed_seconds"] == pytest.approx(measured[-1]["elapsed_seconds"], abs=0.05)
    per_epoch = decided["epoch_seconds"] + decided["validation_seconds"]
    assert 1000 * per_epoch > 2 * 60 * BUDGET_MINUTES  # the cap alone would be far from the budget
    # every length set fits the budget at 5 %; refinements come before three quarters of it, shortenings after them
    # only shorten
    _assert_fitted(events)
    interval = decided["val_interval"]
    assert interval == max(1, round(decided["epochs"] / 5)) > 1 and budget["val_interval"] == interval
    validated = [r["epoch"] for r in history if "val_mean_dice" in r]
    assert validated[: decided["epoch"]] == list(range(1, decided["epoch"] + 1))
    assert validated[decided["epoch"] :] == [
        e for e in range(decided["epoch"] + 1, last["epoch"] + 1) if e % interval == 0 or e == last["epoch"]
    ]
    for before, event in zip(events, events[1:]):
        if event["what"] == "refined":
            assert event["elapsed_seconds"] < 0.75 * 60 * BUDGET_MINUTES
        else:
            assert event["what"] == "shortened" and event["epochs"] < before["epochs"]
    # the end on the run's own clock: the last length's epochs, at the bounds above
    assert budget["used_minutes"] == pytest.approx(summary["elapsed_seconds"] / 60)
    final = events[-1]
    after = [r for r in history if r["epoch"] > final["epoch"]]
    pace = (last["elapsed_seconds"] - final["elapsed_seconds"]) / max(1, len(after))
    planned = final["epoch_seconds"] + final["validation_seconds"]
    why = f"{budget}; the epochs after the last change took {pace:.3f} s each, planned {planned:.3f} s"
    assert 0.75 <= budget["used_share"] <= 1.05, why


@pytest.mark.slow
def test_resumed_budgeted_run_continues_the_same_schedule(converted_dataset, tmp_path):
    """A budgeted run interrupted after its decision is resumed: the restored schedule length is the saved one
    (no second decision), the first resumed epoch's learning rate lies on that schedule, and the run ends at its
    end (rate 0) within the budget, the earlier process's time included: every length set, before and after the
    resume, fits the budget at 5 % (`_assert_fitted`), and the run ends at most one epoch past the budget (<= 1.05x).

    Below, a resumed run allows less than `test_budgeted_run_fits_its_schedule_to_the_budget`: its length is never
    refined, only shortened, from the resume (a tenth of the budget in, here) on, so any shortening is for good and
    the epochs after it may run faster: it ends at t + (0.97 - t) / r of the budget after a last shortening at t
    with the later epochs r times faster. In 7 real runs of this test on this loaded machine the last shortening came
    at 0.33-0.53 of the budget and the later epochs ran 1.08-1.39x faster than planned: ends at 0.80-0.91x (0.72x and
    0.77x when the resumed process's first, cold, validation was projected over the rest: no longer). Hence >= 0.6x
    (t = 0.3, r up to 2)."""
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
    first_events = first.time_budget.events
    assert first_events[0]["what"] == "decided"
    _assert_fitted(first_events, interval=2)
    spe = 2
    resumed = Trainer(_budgeted(converted_dataset, run, "validation.val_interval=2"))
    done = resumed.restore(resume=True)
    assert done == saved[-1]["epoch"]
    assert resumed.schedule_length.total_steps == saved[-1]["schedule_epochs"] * spe  # the saved length
    assert int(resumed.state.budget_epochs.numpy()) == saved[-1]["schedule_epochs"]
    summary = resumed.fit(resume=True)
    history = _history(run)
    budget = summary["time_budget"]
    assert all(e["what"] == "shortened" for e in budget["events"])  # no second decision
    if budget["events"]:
        _assert_fitted(budget["events"], interval=2)
    else:
        assert "decided before the resume" in budget["reason"]
    next_record = history[done]  # the first resumed epoch, on the saved schedule
    assert next_record["learning_rate"] == pytest.approx(
        _cosine((done + 1) * spe, saved[-1]["schedule_epochs"] * spe, spe), abs=1e-7
    )
    assert summary["stop_reason"] == "epochs" and history[-1]["learning_rate"] == pytest.approx(0.0, abs=1e-9)
    assert history[-1]["epoch"] == history[-1]["schedule_epochs"] <= saved[-1]["schedule_epochs"]
    assert summary["elapsed_seconds"] > saved[-1]["elapsed_seconds"]
    assert 0.6 <= budget["used_share"] <= 1.05, budget


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
