"""The GPU-fit search's memory model: a candidate's peak memory predicted from the trials measured so far,
so that one clearly over the budget is pruned without being run (as YOLOv5's autobatch and DeepSpeed's
autotuner fit memory against the batch size).

Example:
    >>> [round(v, 6) for v in fit_line([(1, 110.0), (2, 120.0), (4, 140.0)])]  # MB at batch 0, MB per image
    [100.0, 10.0]
"""

from __future__ import annotations

import numpy as np

NO_MODEL_PARALLEL = "none"


def model_parallel_of(values: dict) -> str:
    """A candidate's model-parallel setting (`none`, `spatial:2`, ...); records from before the search had
    the key (a cache) ran on one device."""
    return values.get("model_parallel") or NO_MODEL_PARALLEL


def train_line_name(recompute: bool, model_parallel: str = NO_MODEL_PARALLEL) -> str:
    """The summary's name of a training line: `training (recompute=false)`, `training (recompute=false,
    model_parallel=spatial:2)`."""
    extra = "" if model_parallel == NO_MODEL_PARALLEL else f", model_parallel={model_parallel}"
    return f"training (recompute={str(bool(recompute)).lower()}{extra})"


def validation_line_name(placement: str, model_parallel: str = NO_MODEL_PARALLEL) -> str:
    """The summary's name of a validation line: `validation (cpu)`, `validation (cpu, model_parallel=spatial:2)`."""
    extra = "" if model_parallel == NO_MODEL_PARALLEL else f", model_parallel={model_parallel}"
    return f"validation ({placement}{extra})"


def is_memory_failure(record: dict) -> bool:
    """Whether a trial ran out of memory or over its budget (its flag, or its reason says so)."""
    if record.get("out_of_memory"):
        return True
    reason = (record.get("reason") or "").lower()
    return record["status"] == "failed" and ("out of memory" in reason or "budget" in reason)


def fit_line(points) -> tuple[float, float] | None:
    """Least-squares (intercept, slope) through (x, y) points; None without two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    x, y = np.array(points, dtype=float).T
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


class MemoryModel:
    """Predicts a candidate's peak memory from the trials measured so far.

    Training peak ≈ a + b · batch, one line per (`recompute`, model-parallel setting); validation
    peak ≈ c + d · sw batch, one line per (placement, model-parallel setting), fitted on trials
    whose validation peak stood out from their training peak (on a CPU the validation phase's
    resident memory includes what training left, so a flat validation peak says nothing about the
    sw batch). A model cut over N devices holds a different share of its activations per device
    (on GPUs the measured peak is the largest device's), so its lines are its own. A candidate's
    peak is the larger of the two. A candidate at least as large as one that ran out of memory in
    the same phase, with the same recompute and model-parallel setting, cannot fit either.

    Args:
        budget_mb: the memory budget.
        tolerance: prune when the prediction exceeds the budget by more than this fraction.
    """

    def __init__(self, budget_mb: float, tolerance: float = 0.1):
        self.budget_mb = budget_mb
        self.tolerance = tolerance
        self.records: list[dict] = []

    def add(self, record: dict) -> None:
        """Keeps a measured record (ok or failed); pruned and skipped candidates measured nothing."""
        if record["status"] in ("ok", "failed"):
            self.records.append(record)

    def train_line(self, recompute: bool, model_parallel: str = NO_MODEL_PARALLEL):
        return fit_line(
            [
                (r["values"]["num_images_per_batch"], r["train_peak_mb"])
                for r in self.records
                if r["values"]["recompute"] == recompute
                and model_parallel_of(r["values"]) == model_parallel
                and r.get("train_peak_mb")
                and r.get("failed_phase") != "training"
            ]
        )

    def validation_line(self, placement: str, model_parallel: str = NO_MODEL_PARALLEL):
        return fit_line(
            [
                (r["values"]["num_sw_batch_size"], r["validation_peak_mb"])
                for r in self.records
                if r["values"]["validation_data_device"] == placement
                and model_parallel_of(r["values"]) == model_parallel
                and r.get("validation_peak_mb")
                and r.get("failed_phase") != "validation"
                and r["validation_peak_mb"] > 1.05 * (r.get("train_peak_mb") or 0)
            ]
        )

    def predict(self, values: dict) -> float | None:
        """Predicted peak in MB, or None while the lines are not determined yet."""
        predictions = []
        model_parallel = model_parallel_of(values)
        train = self.train_line(values["recompute"], model_parallel)
        if train is not None:
            predictions.append(train[0] + train[1] * values["num_images_per_batch"])
        validation = self.validation_line(values["validation_data_device"], model_parallel)
        if validation is not None:
            predictions.append(validation[0] + validation[1] * values["num_sw_batch_size"])
        return max(predictions) if predictions else None

    def verdict(self, values: dict) -> tuple[float | None, str | None]:
        """(predicted peak, reason to prune or None)."""
        b, s = values["num_images_per_batch"], values["num_sw_batch_size"]
        for r in self.records:
            if (
                not is_memory_failure(r)
                or r["values"]["recompute"] != values["recompute"]
                or model_parallel_of(r["values"]) != model_parallel_of(values)
            ):
                continue
            rv = r["values"]
            if r.get("failed_phase") == "training" and rv["num_images_per_batch"] <= b:
                return self.predict(values), (
                    f"batch {b} >= {rv['num_images_per_batch']}, which ran out of memory "
                    f"in training in trial {r['trial']}"
                )
            if (
                r.get("failed_phase") == "validation"
                and rv["validation_data_device"] == values["validation_data_device"]
                and rv["num_images_per_batch"] <= b
                and rv["num_sw_batch_size"] <= s
            ):
                return self.predict(values), (
                    f"batch {b} >= {rv['num_images_per_batch']} and sw batch {s} >= "
                    f"{rv['num_sw_batch_size']}, which ran out of memory in validation in "
                    f"trial {r['trial']}"
                )
        predicted = self.predict(values)
        if predicted is not None and predicted > self.budget_mb * (1 + self.tolerance):
            return predicted, f"predicted {predicted:.0f} MB > budget {self.budget_mb:.0f} MB"
        return predicted, None

    def summary(self) -> dict:
        """The fitted lines and, per measured trial, the fitted value against the measurement."""
        lines = {}
        for recompute, model_parallel in sorted(
            {(r["values"]["recompute"], model_parallel_of(r["values"])) for r in self.records}
        ):
            line = self.train_line(recompute, model_parallel)
            if line:
                lines[train_line_name(recompute, model_parallel)] = {
                    "x": "num_images_per_batch",
                    "intercept_mb": line[0],
                    "slope_mb": line[1],
                }
        for placement, model_parallel in sorted(
            {(r["values"]["validation_data_device"], model_parallel_of(r["values"])) for r in self.records}
        ):
            line = self.validation_line(placement, model_parallel)
            if line:
                lines[validation_line_name(placement, model_parallel)] = {
                    "x": "num_sw_batch_size",
                    "intercept_mb": line[0],
                    "slope_mb": line[1],
                }
        errors = []
        for r in self.records:
            predicted = self.predict(r["values"])
            if predicted is not None and r.get("peak_mb") and r["status"] == "ok":
                errors.append(abs(predicted - r["peak_mb"]) / r["peak_mb"])
        return {
            "lines": lines,
            "fitted_trials": len(errors),
            "mean_abs_error_fraction": float(np.mean(errors)) if errors else None,
            "max_abs_error_fraction": float(np.max(errors)) if errors else None,
        }
