"""How the GPU-fit search proposes candidates: its Keras Tuner search space, declared up front, and the oracle of
each strategy (`bayesian`: Bayesian optimisation, a Gaussian process over the space, proposing a random unseen
point instead of one already tried; `grid`: every point of the space, in order).

`GpuFitSearch` (`tfmis.tuning.fit.search`) runs the oracle through `tfmis.tuning.kt` and measures what it proposes.
"""

from __future__ import annotations

import numpy as np

from tfmis.tuning.fit.specs import FitSpecs

STRATEGIES = ("bayesian", "grid")


def search_space(specs: FitSpecs, placements: list[str], recompute: bool, model_parallel: list[str]):
    """The Keras Tuner search space, declared up front.

    Args:
        specs: the ranges (`range_num_images_per_batch`, `range_num_sw_batch_size`, `sampling`, `search_recompute`).
        placements: the validation placements searched (one is a fixed value).
        recompute: the config's `model.recompute`, the fixed value when `specs.search_recompute` is off.
        model_parallel: the model-parallel settings searched (one is a fixed value).
    """
    import keras_tuner

    s = specs
    hp = keras_tuner.HyperParameters()
    log = s.sampling == "log"
    for name, (lo, hi) in (
        ("num_images_per_batch", s.range_num_images_per_batch),
        ("num_sw_batch_size", s.range_num_sw_batch_size),
    ):
        if lo == hi:
            hp.Fixed(name, lo)
        else:
            hp.Int(name, lo, hi, step=2 if log else 1, sampling="log" if log else "linear")
    if len(placements) > 1:
        hp.Choice("validation_data_device", placements)
    else:
        hp.Fixed("validation_data_device", placements[0])
    if s.search_recompute:
        hp.Boolean("recompute")
    else:
        hp.Fixed("recompute", bool(recompute))
    if len(model_parallel) > 1:
        hp.Choice("model_parallel", model_parallel)
    else:
        hp.Fixed("model_parallel", model_parallel[0])
    return hp


def grid_size(hp) -> int:
    """The points of the search space `hp`: the product of its hyperparameters' value counts."""
    sizes = []
    for h in hp.space:
        values = getattr(h, "values", None)
        sizes.append(len(list(values)) if values is not None else 1)
    return int(np.prod(sizes))


def make_oracle(strategy: str, specs: FitSpecs, hp, objective: str, stop_when):
    """The Keras Tuner oracle of `strategy` over `hp`, minimising `objective`, stopping when `stop_when()` holds.

    Bayesian: at most 10 x num_trials + 50 proposals (pruned ones included), `num_initial_points` random ones first
    (default max(3, num_trials // 3)); the Gaussian process may propose a point already tried: a random unseen one
    instead. Grid: every point once.
    """
    from tfmis.tuning import kt

    common = {
        "objective": objective,
        "direction": "min",
        "hyperparameters": hp,
        "seed": specs.seed,
        "stop_when": stop_when,
    }
    if strategy == "bayesian":
        num_initial = specs.num_initial_points or max(3, specs.num_trials // 3)
        # the Gaussian process may propose a point already tried: a random unseen one instead
        return kt.make_oracle(
            "bayesian",
            max_trials=10 * specs.num_trials + 50,
            num_initial_points=num_initial,
            replace_repeats=True,
            **common,
        )
    return kt.make_oracle("grid", replace_repeats=False, **common)


def describe_space(hp) -> str:
    """The search space in one line: each hyperparameter's name and values (`describe_hp`)."""
    return ", ".join(f"{h.name} {describe_hp(h)}" for h in hp.space)


def describe_hp(hp) -> str:
    values = getattr(hp, "values", None)
    if values is not None:
        values = [int(v) if isinstance(v, float) and v.is_integer() else v for v in values]
        return f"{values}" if len(values) <= 8 else f"[{values[0]}..{values[-1]}] ({len(values)} values)"
    return f"= {hp.value}"
