"""A training plan from a dataset fingerprint and the hardware, written as a commented tfmis config.

`ExperimentPlanner` (`make_plan`) applies nnU-Net v2's rules (`tfmis.planning.rules`) and this machine's
strengths (`tfmis.hardware`) in overridable `determine_*` steps and records every decision with its reason;
`Plan.to_yaml` writes a normal config file with a comment on each planned value, which `load_config` reads
like any other.

What is planned, in order: the conversion (target spacing with nnU-Net's anisotropy rule, CT window,
split, shards), the patch (median preprocessed shape, aspect ratio of the physical extent, a voxel
target on CPUs or a memory target on GPUs, divisible by the stride products), the U-Net (depth and
per-axis strides by nnU-Net's pooling rule, filters, instance norm), crops (class ratios that
oversample classes under 1% of the voxels), batch size, cache, loss, optimizer, training length,
precision and XLA, validation (roi = patch, sliding-window batch, overlap, placement).

The steps are grouped by what they decide, each group an object `ExperimentPlanner` builds from its resolved
arguments (`inputs.PlanningInputs`) and calls: `data_steps.DataSteps` (conversion), `topology.TopologySteps` (patch,
model parallelism, network), `training_steps.TrainingSteps` (batch, sampling, schedule, validation, cascade,
runtime); what they return is in `decisions`. This module holds the order of the steps, the plan file's header and
`make_plan`. No TensorFlow is imported.

Example:
```python
from tfmis.hardware import detect_hardware
from tfmis.planning import fingerprint_msd, make_plan

plan = make_plan(fingerprint_msd("data/Task09_Spleen"), detect_hardware(), source_dir="data/Task09_Spleen")
plan.write("runs/Task09_Spleen/plan.yaml")     # validated with load_config
print(plan.table())
```
"""

from __future__ import annotations

import datetime
import textwrap

from tfmis.hardware import MAX_CASE_WORKERS, Hardware
from tfmis.planning.data_steps import DataSteps
from tfmis.planning.decisions import (
    BatchDecision,
    DataDecision,
    Decision,
    Decisions,
    NetworkDecision,
    ParallelDecision,
    PatchDecision,
    ScheduleDecision,
)
from tfmis.planning.fingerprint import DatasetFingerprint
from tfmis.planning.inputs import PlanningInputs
from tfmis.planning.plan_file import Plan, fmt_shape
from tfmis.planning.rules import fmt_mm
from tfmis.planning.topology import TopologySteps
from tfmis.planning.training_steps import TrainingSteps


class ExperimentPlanner:
    """Plans a training config for a dataset fingerprint on this hardware, as nnU-Net v2's `ExperimentPlanner`:
    `decide()` runs the `determine_*` steps in order, each given the earlier decisions it needs and returning its
    own (a `Decision`: its config keys with their reasons, and the values later steps read); `plan()` records them
    on a `Plan`. The steps leave nothing on the planner, so each can be called alone. Subclass and override one
    step to change one decision (e.g. `determine_patch` for another patch budget) and keep the rest. Each step is
    computed by one of three step objects built from `inputs` (the arguments below, resolved): `data_steps`,
    `topology` and `training`.

    Args:
        fingerprint: a `DatasetFingerprint` (first pass or conversion).
        hardware: a `tfmis.hardware.Hardware` (`detect_hardware()`).
        source_dir: the MSD folder (default: the fingerprint's).
        dataset_dir: where the conversion goes (default: `<source>_tfrecords` next to the source).
        output_dir: the run folder (default: `runs/<source folder name>`).
        gpu_fit: measured values of the GPU-fit search (num_images_per_batch, num_sw_batch_size,
            validation_data_device, source) to use instead of estimates.
        split: train/val/test fractions.
        seed: split and training seed.
        spacing: a fixed target spacing (mm) with its reason, `(spacing, reason)`, instead of nnU-Net's
            full-resolution rule (a low-resolution stage; `tfmis.planning.stages`).
        roi_margin_mm: plan the fine stage of a cascade: cases cropped to their labels' box grown by this many mm
            (the median of those boxes sizes the patch) and `cascade.coarse_run` set to `coarse_run`.
        coarse_run: the coarse stage's run folder (with `roi_margin_mm`).
        training_share: share of the CPU step budget this stage gets (stages share one budget).
        max_minutes: `training.max_minutes` of this stage (null: none); refused (`UsageError`) when it rounds (to
            hundredths) to no training.
        cpu_patch_voxels: a CPU plan's patch voxel target (default `CPU_PATCH_VOXELS`, 48^3); a pilot tries another
            (`tfmis.crossvalidation.pilot`).
    """

    def __init__(self, fingerprint: DatasetFingerprint, hardware: Hardware, **arguments):
        self.inputs = PlanningInputs.resolve(fingerprint, hardware, **arguments)
        self.data_steps = DataSteps(self.inputs)
        self.topology = TopologySteps(self.inputs)
        self.training = TrainingSteps(self.inputs)

    # ------------------------------------------------------------------ the steps, in the order `decide` runs them

    def determine_data(self) -> DataDecision:
        """`DataSteps.determine_data`: folders, target spacing, normalisation, split, shards, the median shape."""
        return self.data_steps.determine_data()

    def determine_patch(self, data: DataDecision) -> PatchDecision:
        """`TopologySteps.determine_patch`: the patch the target's budget holds."""
        return self.topology.determine_patch(data)

    def determine_model_parallel(self, data: DataDecision, patch: PatchDecision) -> ParallelDecision:
        """`TopologySteps.determine_model_parallel`: a spatial split when one GPU cannot hold a sensible patch."""
        return self.topology.determine_model_parallel(data, patch)

    def determine_network(self, patch: PatchDecision) -> NetworkDecision:
        """`TopologySteps.determine_network`: filters, strides, residual units, norm."""
        return self.topology.determine_network(patch)

    def determine_batch(
        self, data: DataDecision, patch: PatchDecision, network: NetworkDecision, parallel: ParallelDecision
    ) -> BatchDecision:
        """`TrainingSteps.determine_batch`: images per step."""
        return self.training.determine_batch(data, patch, network, parallel)

    def determine_sampling(self, data: DataDecision, patch: PatchDecision) -> Decision:
        """`TrainingSteps.determine_sampling`: crops, class ratios, cache, quarter turns."""
        return self.training.determine_sampling(data, patch)

    def determine_schedule(self, data: DataDecision, batch: BatchDecision) -> ScheduleDecision:
        """`TrainingSteps.determine_schedule`: loss, optimizer, training length or time budget, precision, XLA."""
        return self.training.determine_schedule(data, batch)

    def determine_validation(
        self, data: DataDecision, patch: PatchDecision, network: NetworkDecision, schedule: ScheduleDecision
    ) -> Decision:
        """`TrainingSteps.determine_validation`: the window, its batch, overlap, placement and interval."""
        return self.training.determine_validation(data, patch, network, schedule)

    def determine_cascade(self) -> Decision:
        """`TrainingSteps.determine_cascade`: a cascade's fine stage (its coarse run and margin), else nothing."""
        return self.training.determine_cascade()

    def determine_runtime(self) -> Decision:
        """`TrainingSteps.determine_runtime`: the runtime settings (oneDNN)."""
        return self.training.determine_runtime()

    def decide(self) -> Decisions:
        """Every step in order, each given the earlier decisions it needs."""
        data = self.determine_data()
        proposed = self.determine_patch(data)
        parallel = self.determine_model_parallel(data, proposed)
        patch = parallel.patch  # the initial patch when it is split over GPUs, else the proposed one
        network = self.determine_network(patch)
        batch = self.determine_batch(data, patch, network, parallel)
        sampling = self.determine_sampling(data, patch)
        schedule = self.determine_schedule(data, batch)
        validation = self.determine_validation(data, patch, network, schedule)
        return Decisions(
            data,
            proposed,
            parallel,
            network,
            batch,
            sampling,
            schedule,
            validation,
            self.determine_cascade(),
            self.determine_runtime(),
        )

    def plan(self, decisions: Decisions | None = None) -> Plan:
        """The plan of `decisions` (default: `decide()`): every step's keys with their reasons in order, then the
        header and the summary."""
        decisions = decisions or self.decide()
        plan = Plan()
        for decision in decisions.in_order():
            decision.record(plan)
        hardware = self.inputs.hardware
        plan.set(
            "planning.planned_for",
            hardware.planned_for(),
            f"the hardware this plan is for: {hardware.planned_for_text()}; training warns in one line on a machine "
            "with fewer GPUs, smaller ones or none",
        )
        plan.header, plan.summary = self.describe(decisions)
        return plan

    # ------------------------------------------------------------------ header and summary

    def describe(self, decisions: Decisions) -> tuple[list[str], dict]:
        """(the plan file's header: fingerprint, hardware, input parallelism; the numbers behind the plan)."""
        fp, hardware, data = self.inputs.fp, self.inputs.hardware, decisions.data
        fractions_text = ", ".join(f"{name} {100 * f:.3g}%" for name, f in zip(fp.labels, fp.class_fraction))
        parallel = (
            f"{hardware.cpu_count} cores: the conversion uses {max(1, min(hardware.cpu_count, MAX_CASE_WORKERS))} "
            f"worker processes, tf.data runs its map and interleave stages on all cores (AUTOTUNE)"
        )
        if hardware.cpu_count <= 4:
            parallel += "; with so few cores the volumes are cached decoded so the step does not wait for input"
        header = [
            f"tfmis plan for {fp.name}, made by python -m tfmis.plan on "
            f"{datetime.datetime.now().isoformat(timespec='minutes')}.",
            f"Fingerprint ({fp.source}): modalities {', '.join(fp.modalities)}; voxels per class {fractions_text}; "
            f"median spacing {fmt_mm(fp.median_spacing)} mm; median shape at the target spacing "
            f"{fmt_shape(data.median_shape)}"
            + (f"; {len(fp.skipped)} unreadable case(s) skipped" if fp.skipped else ""),
            f"Hardware: {hardware.describe()}.",
            f"Planned for: {hardware.planned_for_text()}.",
            f"Input parallelism: {parallel}.",
            "Every planned value carries its reason; keys not written keep tfmis's defaults.",
        ]
        header = [w for line in header for w in (textwrap.wrap(line, 114, subsequent_indent="  ") or [""])]
        summary = {
            "name": fp.name,
            "num_cases": fp.num_cases,
            "modalities": list(fp.modalities),
            "hardware": hardware.describe(),
            "planned_for": hardware.planned_for(),
            "planned_for_text": hardware.planned_for_text(),
            "median_shape": [float(s) for s in data.median_shape],
            "normalisation": data.norm,
            "steps_per_epoch": decisions.schedule.steps_per_epoch,
            "num_train": data.n_train,
            "memory_mb": decisions.batch.memory,
            "initial_patch": decisions.patch.initial_patch,
            "divisor": list(decisions.patch.divisor),
        }
        return header, summary


def make_plan(fingerprint: DatasetFingerprint, hardware: Hardware, **kwargs) -> Plan:
    """The plan of `ExperimentPlanner(fingerprint, hardware, **kwargs)` (see its arguments)."""
    return ExperimentPlanner(fingerprint, hardware, **kwargs).plan()
