"""What the planner's steps decide, as values: each `determine_*` step of `ExperimentPlanner` returns a `Decision`
(its config keys with their reasons, in writing order, and comment lines above config sections) or a subclass
carrying the values later steps read; `Decisions` holds them all in the order `plan()` records them."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tfmis.planning.plan_file import Plan

Setting = tuple  # (dotted config key, value, reason)


class Settings(list):
    """A step's config keys with their reasons, in writing order, collected as `Plan.set` takes them."""

    def set(self, key: str, value, reason: str) -> None:
        self.append((key, value, reason))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
    """What one planning step decided: the config keys it sets with their reasons, in writing order, and comment
    lines above config sections. A key set again by a later step takes the new value and reason in its place."""

    settings: tuple[Setting, ...] = ()
    notes: dict = dataclasses.field(default_factory=dict)

    def record(self, plan: Plan) -> None:
        """Sets this decision's keys (with their reasons) and notes on `plan`."""
        for key, value, reason in self.settings:
            plan.set(key, value, reason)
        plan.notes.update(self.notes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataDecision(Decision):
    """`determine_data`: the target spacing (mm), the median preprocessed shape there (for a cascade's fine stage:
    of the labels' boxes grown by the margin), the per-channel normalisation lines, the number of training and
    validation cases."""

    spacing: list
    median_shape: np.ndarray
    norm: list
    n_train: int
    n_val: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class PatchDecision(Decision):
    """`determine_patch`: the patch, the strides per level, the divisor (the stride products), nnU-Net's initial
    patch before shrinking, the shrinking steps taken, and whether the patch is square in-plane."""

    patch: list
    strides: list
    divisor: tuple
    initial_patch: list
    shrink_steps: int
    square: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelDecision(Decision):
    """`determine_model_parallel`: `model_parallel` None or ("spatial", GPUs per model, data-parallel groups), and
    the patch the later steps use (the proposed one, or the initial patch split over the GPUs)."""

    model_parallel: tuple | None
    patch: PatchDecision


@dataclasses.dataclass(frozen=True, kw_only=True)
class NetworkDecision(Decision):
    """`determine_network`: the filters per level and the residual units per block."""

    filters: list
    num_res_units: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchDecision(Decision):
    """`determine_batch`: images per step and the memory estimate at batch 2 (`rules.training_memory_mb`)."""

    batch: int
    memory: dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleDecision(Decision):
    """`determine_schedule`: optimizer steps per epoch, epochs, and about how many validations over the run."""

    steps_per_epoch: int
    epochs: int
    validations: int


@dataclasses.dataclass(frozen=True)
class Decisions:
    """Every step's decision, in the order `ExperimentPlanner.decide` makes them and `plan` records them."""

    data: DataDecision
    proposed_patch: PatchDecision
    parallel: ParallelDecision
    network: NetworkDecision
    batch: BatchDecision
    sampling: Decision
    schedule: ScheduleDecision
    validation: Decision
    cascade: Decision
    runtime: Decision

    @property
    def patch(self) -> PatchDecision:
        """The patch the network trains on (`determine_patch`'s, or the initial one split over GPUs)."""
        return self.parallel.patch

    def in_order(self) -> list[Decision]:
        return [getattr(self, field.name) for field in dataclasses.fields(self)]
