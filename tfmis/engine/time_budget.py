"""A time budget that sets the schedule's length: `training.max_minutes` fitted from the measured epoch time.

With `training.max_minutes` set, the trainer does not train a fixed number of epochs and stop when the clock runs
out (the learning rate would be cut mid-schedule): after a few epochs it measures what an epoch costs on this
machine and sets the learning-rate schedule's length (`tfmis.optimizers.ScheduleLength`) to the epochs that fit,
so that the run ends shortly before the budget with its schedule complete (docs/training.md, "Time budget").

- **Measured**: each epoch's wall time from the end of the previous epoch's validation to the end of its own,
  without its validation (the previous epoch's checkpoint and logs, this epoch's input wait and steps), and each
  validation's time apart, because it recurs only every `validation.val_interval` epochs. The first
  `SKIPPED_EPOCHS` epochs of a process are left out (graph tracing, cache filling, the first checkpoint's write);
  so is the first validation when a later one has been measured.
- **Decided**: once, after the validation of the epoch at which the measured epochs (at least `MEASURED_EPOCHS`)
  span `MEASURE_SHARE` of the budget, or once `DECIDE_BY_SHARE` of it has passed (long epochs; with a single
  measured epoch, once twice that has),
  from the mean of the measured epochs and validations: the largest epoch count N (at most `training.epochs`)
  whose projected end (time so far + remaining epochs + their validations, the last epoch's included) stays
  within the budget less `SAFETY_SHARE` of it. Until then the schedule runs over `training.epochs`, so moving
  its end changes the learning rate little (a cosine is still within 3 % of its peak at a tenth of its length).
  The first measured epoch is validated when no validation has been measured yet in this process.
- **Refined, then shrink only**: after every later epoch the same projection. Until `REFINE_UNTIL_SHARE` of the
  budget has passed, with the median of the last half of the measured epochs (at least `RECENT_EPOCHS`), N follows
  it both ways when it moves by more than `REFINE_TOLERANCE` (the first epochs are slower than the later ones
  while caches warm: a decision from them alone ended runs 7-9 % short of the budget); moving the end of a cosine
  by a few per cent changes the learning rate by a few hundredths of its peak. After that, with the median of the
  last `RECENT_EPOCHS` epochs, N only shrinks, when the projection passes the budget (the epochs have become
  slower: another process, a resume on a slower machine), to what fits the budget less its margin. A median, as
  the refinement's: a shortening is for good, and with their mean one slow epoch among ten 0.15-s ones (a write,
  another process for a second) shortened 30-s runs to end at 0.93x of their budget. For the same reason no
  shortening projects the validations left from the process's first validation alone (it traces the forward pass).
- **Validations counted** (`validation.validations`): with a count asked for, the decision also spaces the
  validations, every max(`val_interval`, N / count) epochs from then on, N the length that fits with that spacing
  (found by a few rounds of one and the other); a planned
  interval counted for an estimated speed would validate a faster machine's run several times as often (a 6-minute
  brain run planned every 3 epochs validated 55 times). The interval stays put when N is refined or shortened; a
  resumed run spaces them from the length it decided.
- **Hard stop**: whatever the projection, the loop still stops after the epoch that crosses the budget (as
  without a decision), validating that epoch.

Example:
```python
budget = TimeBudget(max_minutes=10, max_epochs=1000, val_interval=4)
for epoch, seconds in ((1, 9.0), (2, 2.5), (3, 1.9), (4, 1.9)):  # after each epoch's validation
    budget.add_epoch(epoch, seconds, validation_seconds=0.8 if epoch % 4 == 0 else None)
    budget.update(epoch, elapsed=...)  # the seconds since the run started; at epoch 4: the epochs that fit
```
"""

from __future__ import annotations

import math
import statistics

# the share of the budget kept free at the end: the projection's error (noise of a shared machine, the epochs
# measured being a little faster or slower than the later ones) and what follows the last epoch (final weights,
# summary, plots) must fit in it
SAFETY_SHARE = 0.03
# the first epochs of a process that are not measured: the first traces the step and fills the caches, and the
# second's time (from the first's validation on) holds the first checkpoint's write and the first plots
SKIPPED_EPOCHS = 2
# the decision waits for at least this many measured epochs, spanning at least MEASURE_SHARE of the budget (the
# epochs of a loaded 2-core machine vary by tens of per cent: a longer mean is a better estimate)...
MEASURED_EPOCHS = 2
MEASURE_SHARE = 0.1
# ...or, with those epochs measured, once this share of the budget has passed (long epochs, or a long first epoch),
# and with one measured epoch once half of it has (epochs so long that few fit)
DECIDE_BY_SHARE = 0.25
# the re-check's epoch time: the median of the last this many measured epochs (the refinement's: of the last half of
# the measured epochs, at least this many; a 2-core machine's epochs vary by tens of per cent from one ten to the
# next, and another process slows a stretch of them)
RECENT_EPOCHS = 10
# until this share of the budget has passed, the re-check moves the length both ways (to the recent pace)...
REFINE_UNTIL_SHARE = 0.75
# ...when the epochs that fit differ from the decided ones by more than this share (not on every wobble)
REFINE_TOLERANCE = 0.02
# after that it only shortens, when its projection passes this share of the budget, back to the budget less
# SAFETY_SHARE; not on every wobble of a shared machine
SHORTEN_AT_SHARE = 1.0
# `budget_epoch_bound`: no epoch is this short, so `max_minutes * 60 / MIN_EPOCH_SECONDS` epochs never fit a budget
MIN_EPOCH_SECONDS = 0.01
LEAST_EPOCH_BOUND = 1000


def budget_epoch_bound(max_minutes: float) -> int:
    """A `training.epochs` that only bounds a schedule fitted to `max_minutes`: more epochs than fit the budget at
    `MIN_EPOCH_SECONDS` an epoch (at least `LEAST_EPOCH_BOUND`), so the budget, not the epoch count, decides the
    schedule's length (as `benchmarks/time_budget.py` raises `training.epochs`). Where a budget is split over several
    trainings (a plan's stages, cross-validation's folds and configurations), the epoch count a plan made for its
    step budget would otherwise end a training whose epochs run faster than the plan's estimate long before its
    share: a 30-minute share of a BraTS-size plan ended after a few minutes at the plan's 33-83 epochs.

    >>> budget_epoch_bound(1), budget_epoch_bound(30)
    (6000, 180000)
    """
    return max(LEAST_EPOCH_BOUND, math.ceil(60.0 * float(max_minutes) / MIN_EPOCH_SECONDS))


class TimeBudget:
    """The schedule length that fits `max_minutes`, from the epoch and validation times measured so far.

    Args:
        max_minutes: the budget (`training.max_minutes`), counted from the start of the training loop, a resumed
            run's earlier time included.
        max_epochs: `training.epochs`: the schedule never runs longer.
        val_interval: `validation.val_interval`: the interval before the decision, and the least after it.
        validations: `validation.validations`: about this many validations over the decided length, or None (every
            `val_interval` epochs throughout).
        decided: the epoch count an earlier process of this run decided (its checkpoint's), or None: it is kept
            (no second decision), and only shrinks if the rest would overrun.

    Attributes:
        val_interval: the epochs between validations now (set at the decision when `validations` is given).
        epochs: the decided epoch count (the schedule ends there), None before the decision.
        reason: one line saying how it was decided (or last changed).
        events: the decision and every change: dicts with `epoch` (after which), `elapsed_seconds` (then),
            `epochs` (the new length), `what` (`decided`, `refined`, `shortened`), `epoch_seconds` and
            `validation_seconds` (the estimates used), `reason`.
    """

    def __init__(
        self,
        max_minutes: float,
        max_epochs: int,
        val_interval: int,
        decided: int | None = None,
        validations: int | None = None,
    ):
        self.seconds = 60.0 * float(max_minutes)
        self.max_minutes = float(max_minutes)
        self.max_epochs, self.val_interval = int(max_epochs), max(1, int(val_interval))
        self.least_interval, self.wanted_validations = self.val_interval, validations
        self.epochs = min(int(decided), self.max_epochs) if decided else None
        if self.epochs is not None:
            self.val_interval = self.interval_for(self.epochs)
        self.resumed = self.epochs is not None
        self.reason = (
            f"time budget {self.max_minutes:g} min: the schedule decided before the resume ends at epoch {self.epochs}"
            if self.resumed
            else None
        )
        self.epoch_times: list[tuple[int, float]] = []  # (epoch, seconds) of the measured epochs, no validation
        self.validation_times: list[float] = []  # every validation of this process, the first (cold) included
        self.events: list[dict] = []
        self._seen_epochs = 0  # epochs of this process so far

    # ------------------------------------------------------------------ measurements

    def add_epoch(self, epoch: int, seconds: float, validation_seconds: float | None) -> None:
        """One finished epoch: its wall time without validation, and its validation's time (None: not validated).
        The first `SKIPPED_EPOCHS` of the process are counted but not measured."""
        self._seen_epochs += 1
        if self._seen_epochs > SKIPPED_EPOCHS:
            self.epoch_times.append((epoch, float(seconds)))
        if validation_seconds is not None:
            self.validation_times.append(float(validation_seconds))

    @property
    def epoch_seconds(self) -> float | None:
        """An epoch's measured time without validation: the mean of the measured epochs (None: none yet)."""
        return sum(s for _, s in self.epoch_times) / len(self.epoch_times) if self.epoch_times else None

    @property
    def recent_epoch_seconds(self) -> float | None:
        """The median of the last `RECENT_EPOCHS` measured epochs: a slower stretch shortens the schedule once it is
        most of them, not one slow epoch (a shortening is never undone)."""
        recent = [s for _, s in self.epoch_times[-RECENT_EPOCHS:]]
        return statistics.median(recent) if recent else None

    @property
    def refine_epoch_seconds(self) -> float | None:
        """The median of the last half of the measured epochs (at least the last `RECENT_EPOCHS`): a few minutes
        of another process on the machine slow a stretch of epochs, and the length it fixes for good after three
        quarters must not follow them."""
        recent = sorted(s for _, s in self.epoch_times[-max(RECENT_EPOCHS, len(self.epoch_times) // 2) :])
        if not recent:
            return None
        middle = len(recent) // 2
        return recent[middle] if len(recent) % 2 else (recent[middle - 1] + recent[middle]) / 2

    @property
    def validation_seconds(self) -> float | None:
        """A validation's time: the mean of those after the process's first (which traces and fills the
        validation cache), or the first alone (an overestimate) while it is the only one; None before any."""
        warm = self.validation_times[1:]
        if warm:
            return sum(warm) / len(warm)
        return self.validation_times[0] if self.validation_times else None

    # ------------------------------------------------------------------ the decision

    def wants_validation(self, epoch: int) -> bool:
        """Whether `epoch` must be validated for the decision: it is the first measured epoch of this process, no
        validation has been measured in it yet, and the length is still to be decided."""
        return (
            self.epochs is None
            and not self.validation_times
            and self._seen_epochs + 1 > SKIPPED_EPOCHS
            and epoch < self.max_epochs
        )

    def _deciding(self, epoch: int, elapsed: float) -> bool:
        """Whether the length is decided after `epoch` (its `add_epoch` done), `elapsed` seconds into the run."""
        if self.epochs is not None or not self.epoch_times or epoch >= self.max_epochs:
            return False
        measured = sum(s for _, s in self.epoch_times)
        if len(self.epoch_times) >= MEASURED_EPOCHS:
            return measured >= MEASURE_SHARE * self.seconds or elapsed >= DECIDE_BY_SHARE * self.seconds
        return elapsed >= 2 * DECIDE_BY_SHARE * self.seconds

    def interval_for(self, epochs: int) -> int:
        """The validation interval of a schedule of `epochs`: about `validations` of them, at least `val_interval`
        epochs apart (`val_interval` when no count was asked for).

        >>> TimeBudget(6, 1000, 3, validations=15).interval_for(160), TimeBudget(6, 1000, 3).interval_for(160)
        (11, 3)
        """
        if not self.wanted_validations:
            return self.least_interval
        return max(self.least_interval, round(epochs / self.wanted_validations))

    def validations(self, done: int, last: int) -> int:
        """Validations in epochs done+1..last: every `val_interval`-th epoch, and the last."""
        return last // self.val_interval - done // self.val_interval + (1 if last % self.val_interval else 0)

    def projected_seconds(self, done: int, last: int, elapsed: float, epoch_seconds: float) -> float:
        """The run's time at the end of epoch `last`: `elapsed` after epoch `done`, then the epochs between and
        their validations."""
        return elapsed + (last - done) * epoch_seconds + self.validations(done, last) * (self.validation_seconds or 0.0)

    def fitting_epochs(self, done: int, elapsed: float, epoch_seconds: float) -> int:
        """The largest epoch count in done+1..`max_epochs` whose projected end is within the budget less its
        margin (done+1 when none is: the hard stop then ends the run at the budget)."""
        target = self.seconds * (1.0 - SAFETY_SHARE)
        low, high = done + 1, max(done + 1, self.max_epochs)
        if self.projected_seconds(done, high, elapsed, epoch_seconds) <= target:
            return high
        while high - low > 1:  # projected(low) fits (or low is the least allowed), projected(high) does not
            middle = (low + high) // 2
            if self.projected_seconds(done, middle, elapsed, epoch_seconds) <= target:
                low = middle
            else:
                high = middle
        return low

    def update(self, epoch: int, elapsed: float) -> int | None:
        """After epoch `epoch` (its `add_epoch` done), `elapsed` seconds into the run: decides the length at the
        deciding epoch, then refits it to the recent pace until `REFINE_UNTIL_SHARE` of the budget has passed, later
        only shortens it when the projection passes `SHORTEN_AT_SHARE` of the budget. Returns
        the epoch count when it was set or changed now, else None."""
        if self._deciding(epoch, elapsed):
            self.epochs = self.fitting_epochs(epoch, elapsed, self.epoch_seconds)
            for _ in range(8):  # with a count: the spacing for that length, the length that fits with it, until both
                if self.interval_for(self.epochs) == self.val_interval:  # agree (fewer validations: more epochs fit)
                    break
                self.val_interval = self.interval_for(self.epochs)
                self.epochs = self.fitting_epochs(epoch, elapsed, self.epoch_seconds)
            self._record(epoch, elapsed, self.epoch_seconds, "decided")
            return self.epochs
        recent = self.recent_epoch_seconds
        if self.epochs is None or epoch >= self.epochs or recent is None:
            return None
        if elapsed < REFINE_UNTIL_SHARE * self.seconds and not self.resumed:  # a resumed decision is kept
            pace = self.refine_epoch_seconds
            fitting = self.fitting_epochs(epoch, elapsed, pace)
            if abs(fitting - self.epochs) <= REFINE_TOLERANCE * self.epochs:
                return None
            self.epochs = fitting
            self._record(epoch, elapsed, pace, "refined")
            return self.epochs
        if len(self.validation_times) == 1 and self.validations(epoch, self.epochs):
            # the process's only validation so far is its first, which traces the forward pass (after a resume:
            # several times a warm one): projected over the validations left it would shorten for good (to 0.72x)
            return None
        if self.projected_seconds(epoch, self.epochs, elapsed, recent) <= self.seconds * SHORTEN_AT_SHARE:
            return None
        shorter = self.fitting_epochs(epoch, elapsed, recent)
        if shorter >= self.epochs:
            return None
        self.epochs = shorter
        self._record(epoch, elapsed, recent, "shortened")
        return self.epochs

    def _record(self, epoch: int, elapsed: float, epoch_seconds: float, what: str) -> None:
        measured = [e for e, _ in self.epoch_times]
        span = f"epoch {measured[0]}" if len(measured) == 1 else f"epochs {measured[0]}-{measured[-1]}"
        if what in ("shortened", "refined"):
            recent = measured[-(RECENT_EPOCHS if what == "shortened" else max(RECENT_EPOCHS, len(measured) // 2)) :]
            span = f"epochs {recent[0]}-{recent[-1]}" if len(recent) > 1 else f"epoch {recent[0]}"
        validation = self.validation_seconds
        every = "every epoch" if self.val_interval == 1 else f"every {self.val_interval} epochs"
        val_text = f" (validation {_seconds(validation)} {every})" if validation is not None else ""
        capped = " (training.epochs)" if self.epochs == self.max_epochs else ""
        verb = f"{what} after epoch {epoch}, " if what in ("shortened", "refined") else ""
        self.reason = (
            f"time budget {self.max_minutes:g} min: {verb}{_seconds(epoch_seconds)} per epoch measured over {span}"
            f"{val_text}: {self.epochs} epochs{capped}, the learning-rate schedule ends at epoch {self.epochs}"
        )
        self.events.append(
            {
                "epoch": epoch,
                "elapsed_seconds": elapsed,
                "epochs": self.epochs,
                "what": what,
                "epoch_seconds": epoch_seconds,
                "validation_seconds": validation,
                "val_interval": self.val_interval,
                "reason": self.reason,
            }
        )


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value >= 10 else f"{value:.2g} s"


def describe(budget: TimeBudget | None, elapsed_seconds: float) -> dict | None:
    """`summary.json`'s `time_budget`: the planned and the used minutes, the decided epochs and why."""
    if budget is None:
        return None
    return {
        "max_minutes": budget.max_minutes,
        "used_minutes": elapsed_seconds / 60.0,
        "used_share": elapsed_seconds / budget.seconds,
        "schedule_epochs": budget.epochs,
        "val_interval": budget.val_interval,
        "reason": budget.reason,
        "events": budget.events,
    }
