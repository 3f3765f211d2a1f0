"""The planner's training steps (`TrainingSteps`): the batch, the sampling (crops, class ratios, cache, quarter
turns), the schedule (loss, optimizer, training length or time budget, precision, XLA), validation, a cascade's
fine stage and the runtime (oneDNN)."""

from __future__ import annotations

import math

import numpy as np

from tfmis.hardware import GPU_RESERVED_MB
from tfmis.planning.decisions import (
    BatchDecision,
    DataDecision,
    Decision,
    NetworkDecision,
    ParallelDecision,
    PatchDecision,
    ScheduleDecision,
    Settings,
)
from tfmis.planning.inputs import PlanningInputs
from tfmis.planning.rules import inference_window_mb, training_memory_mb

# CPU: patches of at most 48^3 voxels and 1000 steps, so that the small network trains in about ten minutes on 2
# cores (its step time at batch 2: docs/benchmarks.md, "First epoch, precision and other costs")
CPU_TRAINING_STEPS = 1000
CPU_VALIDATIONS = 15
GPU_STEPS_PER_EPOCH, GPU_EPOCHS = 250, 1000  # nnU-Net
GPU_VALIDATIONS = 50
SMALL_CLASS_FRACTION = 0.01  # classes under 1% of the labelled voxels get twice the crop centres
DATASET_COVERAGE = 0.05  # nnU-Net: one batch covers at most 5% of the dataset's voxels
# validations take at most about this share of the training time: their sliding-window forward passes against an
# epoch's crops, each a forward and a backward pass (~TRAINING_STEP_FORWARDS forward passes). Planned every epoch on
# the real-anatomy zoo kind, validation took 29% of a 2-minute run (30 of 103 s); the count predicted that share
VALIDATION_TIME_SHARE = 0.1
TRAINING_STEP_FORWARDS = 3


class TrainingSteps:
    """`ExperimentPlanner`'s batch, sampling, schedule, validation, cascade and runtime steps, from the planner's
    `inputs` and the decisions each step is given."""

    def __init__(self, inputs: PlanningInputs):
        self.inputs = inputs

    # ------------------------------------------------------------------ batch and sampling

    def determine_batch(
        self, data: DataDecision, patch: PatchDecision, network: NetworkDecision, parallel: ParallelDecision
    ) -> BatchDecision:
        """Images per step: measured (GPU-fit search), estimated from the memory model (GPU), or 2 (CPU); with the
        memory estimate at batch 2."""
        hardware = self.inputs.hardware
        memory = training_memory_mb(
            patch.patch,
            patch.strides,
            network.filters,
            network.num_res_units,
            self.inputs.in_channels,
            self.inputs.num_classes,
            2,
            self.inputs.precision,
        )
        total_voxels = float(np.prod(self.inputs.fp.shapes_at(data.spacing), axis=1).sum())
        coverage_cap = max(2, round(DATASET_COVERAGE * total_voxels / float(np.prod(patch.patch))))
        if self.inputs.gpu and self.inputs.gpu_fit:
            batch = int(self.inputs.gpu_fit["num_images_per_batch"])
            batch_reason = f"measured by the GPU-fit search ({self.inputs.gpu_fit.get('source', 'its cache')})"
        elif self.inputs.gpu and parallel.model_parallel is not None:
            # one model over N GPUs: nnU-Net's 2 per model, the data groups make the step's batch
            _, n, groups = parallel.model_parallel
            batch = 2 * groups
            batch_reason = (
                f"2 images per model (nnU-Net's minimum; the patch was sized for it on {n} GPUs) x {groups} "
                f"data-parallel group(s) (runtime.model_parallel.data)"
            )
        elif self.inputs.gpu:
            budget = self.inputs.gpu_budget_mb() - memory["fixed_mb"]  # the target GPU's budget, which set the patch
            fit = max(2, int(budget // memory["per_image_mb"]))
            batch = max(2, min(fit, coverage_cap))
            batch_reason = (
                f"estimated: {memory['per_image_mb']:.0f} MB per image fits {fit} in 85% of the GPU (the budget "
                f"that set the patch); at "
                f"most 5% of the dataset's voxels per batch ({coverage_cap}), at least 2 (nnU-Net); "
                f"`python -m tfmis.train --gpu-customization` measures it"
            )
        else:
            batch = 2
            batch_reason = (
                f"nnU-Net's minimum; on a CPU more images per step only lengthen the step (estimated peak "
                f"{memory['fixed_mb'] + 2 * memory['per_image_mb']:.0f} MB of "
                f"{hardware.host_available_mb / 1024:.1f} GB available)"
            )
        return BatchDecision(
            settings=(("pipeline.num_images_per_batch", batch, batch_reason),), batch=batch, memory=memory
        )

    def determine_sampling(self, data: DataDecision, patch: PatchDecision) -> Decision:
        """Crops per volume, crop centres per class (small classes oversampled), the cache, quarter turns."""
        fp, square = self.inputs.fp, patch.patch[0] == patch.patch[1]
        out = Settings()
        out.set(
            "pipeline.num_crops_per_image", 4, "4 crops per volume read (MONAI num_samples): fewer decodes per step"
        )
        fractions = fp.class_fraction
        small = [i for i in range(1, self.inputs.num_classes) if fractions[i] < SMALL_CLASS_FRACTION]
        if small:
            ratios = [1] + [2 if i in small else 1 for i in range(1, self.inputs.num_classes)]
            names = ", ".join(f"{fp.labels[i]} {100 * fractions[i]:.2g}%" for i in small)
            out.set(
                "pipeline.class_ratios",
                ratios,
                f"crop centres per class [background, ...]: classes under {SMALL_CLASS_FRACTION:.0%} of the "
                f"voxels get twice the share ({names}); ahead of pos/neg 2:1 on the zoo's structures under 0.1%, "
                "mixed between 0.2% and 1% (docs/benchmarks.md, the crop sampling)",
            )
        else:
            out.set(
                "pipeline.pos_neg_ratio",
                [2, 1],
                "every class has >= 1% of the voxels: 2 foreground-centred crops per background one",
            )
        volume_voxels = fp.shapes_at(data.spacing).prod(axis=1)
        # float16 image, uint8 label, slack
        cache_mb = float(volume_voxels.sum()) * (2 * self.inputs.in_channels + 1 + 4) / 2**20
        available = self.inputs.hardware.host_available_mb
        if cache_mb <= 0.3 * available:
            out.set(
                "pipeline.cache",
                "memory",
                f"the converted volumes (~{cache_mb:.0f} MB decoded) fit in 30% of the {available / 1024:.1f} GB "
                "available: decoded once, held in memory (level with patch reads in Dice and speed on the zoo's "
                "largest kind, no copy on disk: docs/benchmarks.md, the cache)",
            )
        else:
            out.set(
                "pipeline.cache",
                "patches",
                f"the converted volumes (~{cache_mb / 1024:.1f} GB decoded) do not fit in 30% of the "
                f"{available / 1024:.1f} GB available: each crop is read from memory-mapped arrays on disk "
                "(<dataset>/arrays, ~the decoded size), no volume held",
            )
        out.set(
            "pipeline.augment.rot90_prob",
            0.5 if square else 0.0,
            "in-plane quarter turns: the patch is square in x, y"
            if square
            else "no quarter turns: the patch is not square in x, y",
        )
        return Decision(settings=tuple(out))

    # ------------------------------------------------------------------ loss, optimizer, length

    def determine_schedule(self, data: DataDecision, batch: BatchDecision) -> ScheduleDecision:
        """Loss, optimizer and learning-rate schedule, training length, precision, XLA, seed: nnU-Net's on a GPU,
        the demo recipe's on a CPU."""
        out = Settings()
        out.set("loss.name", "dice_ce", "Dice + cross-entropy (nnU-Net)")
        out.set("loss.include_background", False, "Dice over the foreground classes")
        steps_per_epoch = max(1, math.ceil(data.n_train * 4 / batch.batch))
        share = f"{self.inputs.training_share:.0%} of " if self.inputs.training_share < 1 else ""
        if self.inputs.gpu:
            out.set("optimizer.name", "sgd", "nnU-Net: SGD, Nesterov momentum 0.99")
            out.set("optimizer.learning_rate", 0.01, "nnU-Net's initial learning rate")
            out.set("optimizer.momentum", 0.99, "nnU-Net")
            out.set("optimizer.nesterov", True, "nnU-Net")
            out.set("optimizer.weight_decay", 3e-5, "nnU-Net")
            out.set("optimizer.schedule", "poly", "nnU-Net: polynomial decay (power 0.9)")
            out.set("optimizer.warmup_epochs", 0.0, "none (nnU-Net)")
            steps_per_epoch = GPU_STEPS_PER_EPOCH
            epochs = GPU_EPOCHS
            out.set("training.steps_per_epoch", steps_per_epoch, "nnU-Net: 250 iterations per epoch")
            out.set(
                "training.epochs",
                epochs,
                "nnU-Net: 1000 epochs (250k iterations)"
                + (
                    "; at most: the trainer fits the learning-rate schedule to training.max_minutes from the "
                    "measured step time"
                    if self.inputs.max_minutes is not None
                    else ""
                ),
            )
            validations = GPU_VALIDATIONS
        else:
            out.set(
                "optimizer.name",
                "adamw",
                "AdamW converges in the short CPU budget (the demo recipe's measured "
                "choice; nnU-Net's SGD needs its 250k iterations)",
            )
            out.set(
                "optimizer.learning_rate",
                0.005,
                "the CPU recipe's (configs/demo.yaml: 5e-3 reached 0.90 sooner than MONAI's 3e-3 on the demo; on "
                "seven zoo kinds ahead on five, by 0.02-0.03 on the three with the smallest structures, and "
                "0.003-0.005 behind on two near their ceiling: docs/benchmarks.md, the learning rate)",
            )
            out.set("optimizer.weight_decay", 1e-5, "the demo recipe's (and MONAI's there)")
            out.set("optimizer.schedule", "cosine", "cosine decay to 0 over the run")
            out.set("optimizer.warmup_epochs", 1.0, "one epoch of linear warm-up")
            budget = round(CPU_TRAINING_STEPS * self.inputs.training_share)
            epochs = max(1, round(budget / steps_per_epoch))
            if self.inputs.max_minutes is None:
                out.set(
                    "training.epochs",
                    epochs,
                    f"{share}a CPU budget of ~{CPU_TRAINING_STEPS} optimizer steps ({steps_per_epoch} per epoch: "
                    f"{data.n_train} training volumes x 4 crops / batch {batch.batch}); about ten minutes on 2 "
                    f"cores at 48^3 for the whole budget",
                )
            else:
                # the trainer sets the schedule's length from the epoch time it measures (tfmis.engine.time_budget);
                # training.epochs only bounds it, at this many times the step budget's pace (a faster CPU than the
                # development one still fits). The validations are spaced for the step budget's pace scaled to the
                # minutes (CPU_TRAINING_STEPS per ten minutes): `epochs` below is that estimate
                CPU_BUDGET_EPOCH_FACTOR = 10
                epochs = max(1, round(CPU_TRAINING_STEPS * float(self.inputs.max_minutes) / 10 / steps_per_epoch))
                out.set(
                    "training.epochs",
                    CPU_BUDGET_EPOCH_FACTOR * epochs,
                    f"from the measured step time: the trainer fits the learning-rate schedule to "
                    f"training.max_minutes after its first epochs; this bounds it ({CPU_BUDGET_EPOCH_FACTOR}x the "
                    f"~{epochs} epochs of ~{CPU_TRAINING_STEPS} optimizer steps per ten minutes on 2 cores, "
                    f"{steps_per_epoch} per epoch)",
                )
            validations = CPU_VALIDATIONS
        out.set("training.precision", self.inputs.precision, self.inputs.precision_reason)
        out.set(
            "training.jit_compile",
            False,
            "XLA: ~10x slower than plain TensorFlow on the development CPU"
            if not self.inputs.gpu
            else "off: XLA's gain on 3D convolutions varies by GPU; try true and compare epoch times",
        )
        out.set("training.seed", self.inputs.seed, "split and weight initialisation")
        if self.inputs.max_minutes is not None:
            out.set(
                "training.max_minutes",
                round(float(self.inputs.max_minutes), 2),
                f"{share}the time budget given to the plan",
            )
        return ScheduleDecision(
            settings=tuple(out), steps_per_epoch=steps_per_epoch, epochs=epochs, validations=validations
        )

    # ------------------------------------------------------------------ validation

    def determine_validation(
        self, data: DataDecision, patch: PatchDecision, network: NetworkDecision, schedule: ScheduleDecision
    ) -> Decision:
        """How often (`validation_interval`), the window (the patch), windows per forward pass, overlap, blending,
        where the volume lives."""
        gpu, gpu_fit = self.inputs.gpu, self.inputs.gpu_fit
        overlap = 0.5 if gpu else 0.25
        out = Settings()
        interval, reason = self.validation_interval(data, patch, schedule, overlap)
        out.set("validation.val_interval", interval, reason)
        if not gpu and self.inputs.max_minutes is not None:
            # the interval above spaces validations for the development CPU's pace; a machine 4-5x faster or 2x
            # slower validates far more or less often than planned. Counted, the time budget spaces them over the
            # length it decides (measured on the zoo: docs/benchmarks.md, "Validations counted")
            out.set(
                "validation.validations",
                schedule.validations,
                f"about {schedule.validations} validations over the length the time budget decides (every "
                f"max(val_interval, epochs / {schedule.validations}) epochs from its decision on): the epochs "
                f"planned here are an estimate of this machine's pace",
            )
        out.set("validation.roi_size", [int(p) for p in patch.patch], "the training patch (nnU-Net)")
        window_mb = inference_window_mb(
            patch.patch, patch.strides, network.filters, self.inputs.num_classes, self.inputs.precision
        )
        if gpu and gpu_fit:
            sw = int(gpu_fit["num_sw_batch_size"])
            sw_reason = f"measured by the GPU-fit search ({gpu_fit.get('source', 'its cache')})"
            placement = gpu_fit["validation_data_device"]
            placement_reason = f"measured by the GPU-fit search ({gpu_fit.get('source', 'its cache')})"
        elif gpu:
            budget = 0.25 * ((self.inputs.hardware.gpu_memory_mb or 16 * 1024) - GPU_RESERVED_MB)
            sw = max([s for s in (1, 2, 4, 8) if s * window_mb <= budget] or [1])
            sw_reason = (
                f"estimated: {window_mb:.0f} MB per window within a quarter of the GPU, at most 8; "
                f"--gpu-customization measures it"
            )
            placement = "auto"
            placement_reason = "the GPU, falling back to the CPU on out-of-memory"
        else:
            sw = 4
            sw_reason = f"4 windows per forward pass (~{window_mb:.0f} MB each): the demo recipe's on a CPU"
            placement = "cpu"
            placement_reason = "no accelerator"
        out.set("validation.num_sw_batch_size", sw, sw_reason)
        out.set(
            "validation.overlap",
            overlap,
            "nnU-Net's half-window step" if gpu else "a quarter: fewer windows on a CPU (nnU-Net uses 0.5)",
        )
        out.set("validation.mode", "gaussian", "Gaussian-weighted window blending (nnU-Net)")
        out.set("validation.validation_data_device", placement, placement_reason)
        if self.inputs.fp.regions:  # nnU-Net v2's region labels: trained as regions, as nnU-Net trains them
            out.set(
                "validation.regions",
                {name: list(labels) for name, labels in self.inputs.fp.regions.items()},
                "the regions of dataset.json's labels, in its order (painted as its regions_class_order)",
            )
            out.set("model.output", "regions", "dataset.json declares region labels: one sigmoid per region (nnU-Net)")
            out.set("loss.activation", "sigmoid", "regions overlap: one sigmoid each")
        out.set("output.dir", str(self.inputs.output_dir), "the run folder")
        return Decision(settings=tuple(out))

    @staticmethod
    def validation_interval(
        data: DataDecision, patch: PatchDecision, schedule: ScheduleDecision, overlap: float
    ) -> tuple[int, str]:
        """(epochs between validations, the reason): about `schedule.validations` over the run, and no more often
        than keeps the validations' sliding windows (on the median image, every validation case) under
        `VALIDATION_TIME_SHARE` of an epoch's forward passes (its crops x `TRAINING_STEP_FORWARDS`). A ratio of two
        counts of the same network's passes, so it holds on any machine, and when a time budget fits more epochs
        than planned."""
        steps = [max(1, int(p * (1 - overlap))) for p in patch.patch]
        per_case = int(
            np.prod([math.ceil(max(m - p, 0) / s) + 1 for m, p, s in zip(data.median_shape, patch.patch, steps)])
        )
        windows = per_case * data.n_val
        crops = data.n_train * 4  # every training volume read once, 4 crops each (determine_sampling)
        by_cost = math.ceil(windows / (VALIDATION_TIME_SHARE * TRAINING_STEP_FORWARDS * crops))
        by_count = max(1, round(schedule.epochs / schedule.validations))
        if by_cost > by_count:
            return by_cost, (
                f"a validation ({windows} windows: {per_case} on the median image x {data.n_val} case(s)) costs "
                f"{windows / (TRAINING_STEP_FORWARDS * crops):.0%} of an epoch ({crops} crops, each ~"
                f"{TRAINING_STEP_FORWARDS} forward passes): every {by_cost} epochs keeps validation under "
                f"{VALIDATION_TIME_SHARE:.0%} of the training time"
            )
        return by_count, f"about {schedule.validations} validations over the run"

    def determine_cascade(self) -> Decision:
        """The fine stage of a cascade: which coarse run finds its region, and the margin around it."""
        if self.inputs.roi_margin_mm is None or self.inputs.coarse_run is None:
            return Decision()
        return Decision(
            settings=(
                (
                    "cascade.coarse_run",
                    str(self.inputs.coarse_run),
                    "the coarse stage finds the region on the whole scan",
                ),
                (
                    "cascade.margin_mm",
                    float(self.inputs.roi_margin_mm),
                    "kept around each piece of the coarse stage's foreground, as around the labels in training",
                ),
            )
        )

    def determine_runtime(self) -> Decision:
        """oneDNN: decided on each machine that trains (the plan may travel), with this machine's decision."""
        here = f"; here: {self.inputs.hardware.onednn}" if self.inputs.hardware.onednn else ""
        return Decision(
            settings=(
                (
                    "runtime.onednn",
                    "auto",
                    "TensorFlow's oneDNN CPU kernels, decided on the machine that trains before TensorFlow starts: on "
                    f"for x86-64 CPUs with AVX2 and FMA, TensorFlow's default elsewhere{here}",
                ),
            )
        )
