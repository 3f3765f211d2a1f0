"""The config schema: one dataclass per section of a config file, and `Config`, their tree.

Each field's type is what a YAML value must be (`tfmis.config.parse` checks it and names the key); its default is
what a file that does not give it gets. A section's `__post_init__` checks what concerns that section alone (a
`ValueError`, which parsing turns into a `ConfigError` naming the section); checks across sections are in
`tfmis.config.checks`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from tfmis.data.conversion_options import ConversionOptions
from tfmis.networks.architecture import UNetArchitecture


@dataclasses.dataclass
class SplitConfig:
    """Cross-validation (docs/crossval.md, "Folds"): the dataset is converted once into K folds, stratified by the
    classes each case holds (or read from `file`), and this run trains on every other fold and validates on fold
    `fold`. It sets data.conversion.folds, data.train_split (e.g. fold0+fold1+fold3+fold4) and data.val_split
    (fold2) when the config is loaded."""

    folds: int = 5  # K (nnU-Net's 5); a `file` sets it
    fold: int = 0  # the fold this run validates on, 0..K-1
    # a splits_final.json in nnU-Net v2's format, [{"train": [case ids], "val": [case ids]}, ...] (case ids: image file
    # names without .nii.gz): its val lists are the folds; null = stratified folds seeded by data.conversion.seed
    file: Optional[str] = None


@dataclasses.dataclass
class DataConfig:
    dataset_dir: str = "data/demo/tfrecords"  # converted TFRecord folder (tfmis-convert --target-dir)
    source_dir: Optional[str] = (
        None  # dataset folder (MSD or nnU-Net v2 raw) converted into dataset_dir first if needed
    )
    demo: bool = False  # generate the built-in demo dataset into source_dir if it is missing
    # a split name of the converted dataset, or several joined by + (fold0+fold1); set by `split` when it is given
    train_split: str = "train"
    val_split: str = "val"
    conversion: ConversionOptions = dataclasses.field(default_factory=ConversionOptions)  # tfmis-convert flags
    split: Optional[SplitConfig] = None  # cross-validation folds; null = data.conversion's split, no folds


@dataclasses.dataclass
class AugmentConfig:
    flip_prob: float = 0.5  # per spatial axis
    flip_axes: list[int] = dataclasses.field(default_factory=lambda: [0, 1, 2])
    rot90_prob: float = 0.5  # in-plane (x, y) quarter turns; needs a square in-plane patch
    intensity_scale: float = 0.1  # x * (1 + U(-s, s))
    intensity_shift: float = 0.1  # x + U(-o, o)
    intensity_prob: float = 0.5
    noise_std: float = 0.0  # gaussian noise, applied with noise_prob
    noise_prob: float = 0.1
    # spatial (nnU-Net's, off here; nnU-Net 3D uses rotate_prob 0.2 with +-30 degrees per axis and scale_prob 0.2
    # in 0.7-1.4): rotation, scaling and elastic deformation as one resampling of the patch about its centre,
    # trilinear for the image, nearest for the label, applied before the flips and quarter turns
    rotate_prob: float = 0.0
    rotate_range: list[float] = dataclasses.field(default_factory=lambda: [0.5236, 0.5236, 0.5236])  # radians
    # per axis: angle ~ U(-r, r) about axes 0, 1, 2 (0.5236 rad = 30 degrees)
    scale_prob: float = 0.0
    scale_range: list[float] = dataclasses.field(default_factory=lambda: [0.7, 1.4])  # one factor for all axes
    # multiplying the sampling grid (> 1 zooms out); half the draws in [low, 1], half in [1, high], as nnU-Net
    elastic_prob: float = 0.0
    elastic_sigma: list[float] = dataclasses.field(default_factory=lambda: [9.0, 13.0])  # smoothness, voxels
    elastic_magnitude: list[float] = dataclasses.field(default_factory=lambda: [0.0, 4.0])  # largest displacement,
    # voxels, drawn per patch
    # crop a larger region (patch + 2 x the margin the largest rotation / scale / displacement needs) so that the
    # transformed patch samples real voxels, not zero padding (nnU-Net's patch size for spatial transform)
    enlarge_crop: bool = True
    # where the random augmentation runs: "pipeline" (tf.data, on the CPU) or "step" (inside the compiled
    # training step, on the accelerator: the pipeline yields un-augmented crops and their seeds)
    placement: Literal["pipeline", "step"] = "pipeline"

    def __post_init__(self):
        for key in (
            "flip_prob",
            "rot90_prob",
            "intensity_prob",
            "noise_prob",
            "rotate_prob",
            "scale_prob",
            "elastic_prob",
        ):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"{key} is a probability in [0, 1], got {getattr(self, key)}")
        if any(a not in (0, 1, 2) for a in self.flip_axes):
            raise ValueError(f"flip_axes: spatial axes 0, 1, 2 only, got {self.flip_axes}")
        if len(self.rotate_range) != 3 or not all(0.0 <= r <= 3.1416 for r in self.rotate_range):
            raise ValueError(
                f"rotate_range: three angles in radians in [0, pi], one per axis (0.5236 = 30 degrees), "
                f"got {self.rotate_range}"
            )
        for key, low_limit in (("scale_range", 0.0), ("elastic_sigma", 0.0)):
            value = getattr(self, key)
            if len(value) != 2 or not low_limit < value[0] <= value[1]:
                raise ValueError(f"{key}: expected [low, high] with 0 < low <= high, got {value}")
        if len(self.elastic_magnitude) != 2 or not 0.0 <= self.elastic_magnitude[0] <= self.elastic_magnitude[1]:
            raise ValueError(
                f"elastic_magnitude: expected [low, high] voxels with 0 <= low <= high, got {self.elastic_magnitude}"
            )
        if self.placement not in ("pipeline", "step"):
            raise ValueError(f"placement: 'pipeline' (tf.data) or 'step' (the training step), got {self.placement!r}")


@dataclasses.dataclass
class PipelineConfig:
    patch_size: list[int] = dataclasses.field(default_factory=lambda: [64, 64, 64])
    num_images_per_batch: int = 2  # crops per replica per step
    num_crops_per_image: int = 2  # crops drawn from each volume read (like MONAI num_samples)
    pos_neg_ratio: list[float] = dataclasses.field(default_factory=lambda: [1.0, 1.0])  # crop centres on fg : bg
    class_ratios: Optional[list[float]] = None  # per-class crop centre ratios (MONAI RandCropByLabelClasses)
    # cache of the decoded volumes (+ foreground indices): "memory" (host RAM), "file" (on disk in
    # cache_dir, reused by later runs), "none" (read the TFRecords every epoch), "partial" (MONAI's SmartCache:
    # cache_num volumes in RAM, replace_rate of them swapped for new ones from the TFRecords in the background
    # after each pass over the cached set; for data larger than memory, see tfmis.data.smart_cache)
    # "patches": no volume cached; each crop read from the memory-mapped uncompressed arrays written beside the
    # TFRecords (<dataset_dir>/arrays, tfmis.data.patch_layout): for datasets larger than memory
    cache: Literal["memory", "none", "file", "partial", "patches"] = "memory"
    # the most the training input may hold (a memory size: "6GB", "800MB"); null = half the usable memory (after
    # any cgroup limit) at start. cache: memory above it is refused; patches gives it to tf.data's buffers
    memory_budget: Optional[float | str] = None
    cache_num: Optional[int] = None  # partial: volumes held per input pipeline (worker); null = cache_rate
    cache_rate: float = 0.5  # partial, when cache_num is null: share of the worker's training volumes held
    # partial: share of the cached volumes replaced per pass over them; MONAI's default is 0.1 (it re-runs its
    # whole transform chain per load), here a load is only a TFRecord decode, so twice as many fit: each volume
    # stays 5 passes, the whole split goes through the cache twice as fast, still < 1/10 of cache: none's reads
    replace_rate: float = 0.2
    cache_dir: Optional[str] = None  # folder for cache: file; relative = to the working directory
    shuffle_volumes: int = 32  # shuffle buffer of cached volumes
    shuffle_crops: int = 16  # shuffle buffer of crops (mixes crops of different volumes)
    deterministic: bool = False  # True = reproducible order (slower interleave)
    max_foreground_indices: int = 20000  # per class, for crop centre sampling (bounds memory)
    augment: AugmentConfig = dataclasses.field(default_factory=AugmentConfig)


@dataclasses.dataclass
class LossConfig:
    name: Literal["dice", "dice_ce", "dice_focal"] = "dice_ce"
    # softmax over the classes, or one sigmoid per channel (required by model.output: regions)
    activation: Literal["softmax", "sigmoid"] = "softmax"
    # keep the background channel in the Dice term; model.output: regions has no background channel (every
    # channel is a region and counts), so it does not apply there
    include_background: bool = False
    batch: bool = False  # batch Dice: sum over the batch before dividing
    squared_pred: bool = False  # squared denominator
    lambda_dice: float = 1.0
    lambda_ce: float = 1.0
    lambda_focal: float = 1.0
    gamma: float = 2.0


@dataclasses.dataclass
class OptimizerConfig:
    name: Literal["adam", "adamw", "sgd", "novograd"] = "adamw"
    learning_rate: float = 1e-3
    weight_decay: float = 1e-5
    momentum: float = 0.99  # sgd
    nesterov: bool = True  # sgd
    beta_1: float = 0.9
    beta_2: float = 0.999
    schedule: Literal["constant", "poly", "cosine"] = "cosine"
    warmup_epochs: float = 0.0
    power: float = 0.9  # poly
    min_learning_rate: float = 0.0
    clipnorm: Optional[float] = None
    # learning rate vs the global batch (replicas x num_images_per_batch x accumulation_steps): `none` keeps
    # learning_rate; `linear` multiplies it (and min_learning_rate) by global batch / lr_reference_batch (Goyal et
    # al.), `sqrt` by the square root of that ratio (Adam-style optimizers)
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    lr_reference_batch: Optional[int] = None  # the global batch learning_rate was tuned for; null = one replica's


@dataclasses.dataclass
class TrainingConfig:
    epochs: int = 100
    steps_per_epoch: Optional[int] = None  # null = train volumes * crops per volume / global batch
    # auto = this machine's best (tfmis.hardware.resolve_precision): mixed_float16 on GPUs of compute
    # capability >= 7 (tensor cores), float32 on CPUs (float16 is emulated there) and older GPUs
    precision: Literal["auto", "float32", "mixed_float16", "mixed_bfloat16"] = "auto"
    jit_compile: bool = False  # XLA
    accumulation_steps: int = 1  # gradient accumulation: optimizer step every N micro-batches
    # optimizer steps per host round-trip: one tf.function runs this many steps over the input iterator and the
    # host reads their losses once (as tensorflow/models' orbit); more keeps an accelerator's queue full
    steps_per_loop: int = 1
    seed: int = 0
    target_dice: Optional[float] = None  # stop when the validation mean Dice reaches it
    # wall-clock budget (resumed runs count their earlier time): the trainer fits the learning-rate schedule to it
    # from the epoch time it measures (epochs is then an upper bound; docs/training.md, "Time budget"), and stops
    # after the epoch that crosses it if the clock runs out anyway, validating that epoch
    max_minutes: Optional[float] = None
    dice_thresholds: list[float] = dataclasses.field(default_factory=lambda: [0.8, 0.9, 0.93, 0.95])
    keep_checkpoints: int = 2


@dataclasses.dataclass
class ValidationConfig:
    val_interval: int = 1  # epochs between validations
    # with training.max_minutes: about this many validations over the run; the interval becomes the decided
    # schedule's length / validations (never under val_interval) once the time budget decides it, so the count holds
    # however fast the machine trains (tfmis.engine.time_budget); null = every val_interval epochs throughout
    validations: Optional[int] = None
    roi_size: Optional[list[int]] = None  # sliding window size; null = pipeline.patch_size
    num_sw_batch_size: int = 4  # windows per forward pass
    overlap: float = 0.5
    mode: Literal["constant", "gaussian"] = "gaussian"
    # where the whole volume and the aggregation buffers live (tfmis.inference.placement): "accelerator"
    # (out of memory is an error), "cpu" (host memory), "auto" (the accelerator, falling back to the CPU and to
    # smaller sliding-window batches on out-of-memory, so that a long run does not die at validation)
    validation_data_device: Literal["accelerator", "cpu", "auto"] = "auto"
    # auto: volumes with at least this many voxels are aggregated on the CPU straight away (the GPU-fit search
    # writes it when it measured that size not fitting); null = learn from the first OOM
    cpu_from_voxels: Optional[int] = None
    hd95: bool = False  # also compute the 95th-percentile Hausdorff distance (slower)
    # normalised surface Dice, the Decathlon's second metric: the share of both surfaces within a tolerance of
    # the other (MONAI compute_surface_dice; one pair of distance transforms per class and region, shared with hd95)
    nsd: bool = False
    # the accepted deviation in mm: one number, one per foreground class, or one per foreground class then one
    # per region (a region without one takes the smallest tolerance of its labels); the MSD set it per task and
    # class from the spread between annotators, so there is no default
    nsd_tolerance_mm: Optional[float | list[float]] = None
    # label unions scored like classes besides them (Dice, and hd95 / nsd when on): name -> labels, e.g. BraTS
    # (MSD Task01 labels) {whole_tumour: [1, 2, 3], tumour_core: [2, 3], enhancing_tumour: [3]}; the names become
    # metric keys (val_dice_whole_tumour) and predictions.csv columns (dice_whole_tumour); scored on the label map
    # (with model.output: classes the model predicts the classes and the regions are unioned from its label map;
    # with model.output: regions it predicts these regions, one sigmoid each, painted into a label map in this
    # order: see region_paint_labels)
    regions: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    max_cases: Optional[int] = None  # validate on the first N cases only

    def __post_init__(self):
        if self.val_interval < 1:
            raise ValueError(f"val_interval must be >= 1 (epochs between validations), got {self.val_interval}")
        if self.validations is not None and self.validations < 1:
            raise ValueError(
                f"validations must be >= 1 (validations over a time-budgeted run) or null, got {self.validations}"
            )
        if self.num_sw_batch_size < 1:
            raise ValueError(f"num_sw_batch_size must be >= 1, got {self.num_sw_batch_size}")
        if self.cpu_from_voxels is not None and self.cpu_from_voxels < 1:
            raise ValueError(f"cpu_from_voxels must be a voxel count >= 1 (or null), got {self.cpu_from_voxels}")


@dataclasses.dataclass
class ProfileConfig:
    """A TensorFlow profiler trace of a few training steps, written to <output.dir>/tensorboard/plugins/profile
    (TensorBoard's Profile tab opens it); the steps carry trace ranges: data wait, train step, validation."""

    start_step: Optional[int] = None  # global optimizer step at which tracing starts (1 = the first); null = off
    num_steps: int = 5
    # input-bound report: epochs (after the first, whose cache is cold) that wait for input longer than this share
    # of step time get one line naming the likely fix, also written to summary.json as `input_bound`
    input_wait_threshold: float = 0.10


@dataclasses.dataclass
class ModelParallelConfig:
    """One model over several devices (tfmis.networks.parallel, docs/model-parallel.md): for a patch or a network
    whose activations do not fit one device."""

    # none; pipeline: the layers cut into `devices` stages, the batch into `micro_batches` (GPipe); spatial: each
    # patch cut into `devices` slabs along `axis`, convolutions exchanging halos, norms reducing over all slabs
    mode: Literal["none", "pipeline", "spatial"] = "none"
    devices: int = 2  # devices per model: GPUs when there are enough, else the CPU split into logical devices
    micro_batches: int = 2  # pipeline: micro-batches per step (must divide the images per step)
    axis: Optional[int] = None  # spatial: the patch axis (0, 1, 2) to cut; null = the longest that can be cut
    data: int = 1  # data-parallel groups of `devices` devices each (a data x model mesh): data x devices in all

    def __post_init__(self):
        for key, what in (("devices", "devices per model"), ("data", "data groups"), ("micro_batches", "per step")):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1 ({what}), got {getattr(self, key)}")
        if self.axis is not None and self.axis not in (0, 1, 2):
            raise ValueError(f"axis must be a patch axis 0, 1 or 2, or null for the longest; got {self.axis}")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


@dataclasses.dataclass
class RuntimeConfig:
    """Where the one training loop runs (tfmis.engine.distribution), set up before anything touches devices."""

    # auto: horovod under horovodrun, multiworker when TF_CONFIG / SLURM (srun) / MPI (mpirun) name several
    # workers, mirrored when this process sees several GPUs (or `devices` lists several), else none
    distribution: Literal["auto", "none", "mirrored", "multiworker", "horovod"] = "auto"
    devices: Optional[list[str]] = None  # mirrored: devices to use (null = all GPUs), e.g. ["/cpu:0", "/cpu:1"]
    # multiworker all-reduce: ring (gRPC, CPUs), nccl (GPUs), auto (TensorFlow picks)
    communication: Literal["auto", "ring", "nccl"] = "auto"
    port: int = 23456  # SLURM / MPI launches: worker k listens on port + local rank
    # MPI launches: the folder where workers exchange their addresses (shared by all nodes); null = output.dir
    rendezvous_dir: Optional[str] = None
    rendezvous_timeout_seconds: float = 300.0
    # TensorFlow's oneDNN CPU kernels, decided before TensorFlow is imported: auto = on where they were measured
    # faster for 3D convolutions (x86-64 with AVX2 and FMA), TensorFlow's default elsewhere, and a
    # TF_ENABLE_ONEDNN_OPTS set in the environment is respected; on / off force it (docs/training.md, "CPU speed")
    onednn: Literal["auto", "on", "off"] = "auto"
    # model parallelism (pipeline or spatial partitioning of one model over several devices); see ModelParallelConfig
    model_parallel: ModelParallelConfig = dataclasses.field(default_factory=ModelParallelConfig)


@dataclasses.dataclass
class OutputConfig:
    dir: str = "runs/demo"
    tensorboard: bool = True
    progress: bool = True
    # when standard error is not a terminal (a SLURM log, `> train.log`): a plain progress line every this many
    # seconds within an epoch (0 = every step) instead of a progress bar; the epoch line is always printed
    progress_seconds: float = 60.0
    # sample GPU utilisation and memory (NVML; CPU and RSS without NVIDIA GPUs) every this many seconds during
    # training into resources.csv / resources.png in the run folder; null = off
    monitor_seconds: Optional[float] = None
    # draw training_curves.png at most this often during training (the first time this long after it began), and
    # always at its end (0 = after every epoch): a redraw is a noticeable share of a short CPU epoch
    # (docs/benchmarks.md, "First epoch, precision and other costs")
    plot_seconds: float = 30.0


@dataclasses.dataclass
class CascadeConfig:
    """The fine stage of a coarse-to-fine cascade (docs/planning.md, "Stages"): `python -m tfmis.predict` runs the
    coarse run on the whole scan, cuts a box around each connected piece of what it finds grown by `margin_mm`
    (overlapping boxes merged), and runs this run's model only there (the whole scan when the coarse stage finds
    nothing); pieces under `min_region_mm3` keep the coarse stage's label (docs/predicting.md, "Through a cascade").
    Training is unchanged: the fine stage trains on cases cropped around their labels
    (`data.conversion.crop_to_label_mm`)."""

    coarse_run: Optional[str] = None  # the coarse stage's run folder; null = not a cascade
    margin_mm: float = 20.0  # kept around each piece of the coarse stage's foreground, per side
    # coarse pieces smaller than this (mm3, on the coarse grid) get no region of their own and keep the coarse stage's
    # label (never dropped); 0 = every piece gets a region
    min_region_mm3: float = 0.0
    # the label values the fine stage decides (inside its box); the others come from the coarse stage, which draws
    # large structures from more context than the fine patch holds; null = the fine stage decides every class
    fine_classes: Optional[list[int]] = None

    def __post_init__(self):
        if self.margin_mm < 0:
            raise ValueError(f"margin_mm must be >= 0 mm, got {self.margin_mm}")
        if not self.min_region_mm3 >= 0:
            raise ValueError(f"min_region_mm3 must be >= 0 mm3, got {self.min_region_mm3}")
        if self.fine_classes is not None and (not self.fine_classes or min(self.fine_classes) < 1):
            raise ValueError(f"fine_classes: foreground label values (>= 1), or null for all, got {self.fine_classes}")


@dataclasses.dataclass
class PostprocessingConfig:
    """What `python -m tfmis.predict` does to each label map after predicting it: nnU-Net's removal of all but the
    largest connected component (26-connected), the removed voxels set to background. Off by default; chosen by
    cross-validation (`tfmis-crossval` keeps a step only where it raised the out-of-fold Dice, docs/crossval.md)."""

    largest_foreground_component: bool = False  # all foreground labels as one structure: only its largest piece stays
    # each entry a structure (a class [c], or a region: several labels as one [a, b]); only its largest piece stays
    largest_component_labels: list[list[int]] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        for labels in self.largest_component_labels:
            if not labels or min(labels) < 1:
                raise ValueError(
                    f"largest_component_labels: each entry a list of foreground labels (>= 1), got {labels}"
                )


@dataclasses.dataclass
class PlannedFor:
    """The hardware a plan was made for (`tfmis-plan` writes it; `Hardware.planned_for`)."""

    gpus: int = 0  # GPUs per machine (0: a CPU-only machine)
    gpu_memory_mb: Optional[float] = None  # each GPU's memory; null without GPUs
    name: Optional[str] = None  # the GPU model, e.g. H100-80GB or NVIDIA A100-SXM4-80GB
    source: Literal["detected", "target"] = "detected"  # the planning machine itself, or a target given to tfmis-plan

    def __post_init__(self):
        if self.gpus < 0:
            raise ValueError(f"gpus is a GPU count >= 0, got {self.gpus}")
        if self.gpu_memory_mb is not None and not self.gpu_memory_mb > 0:
            raise ValueError(f"gpu_memory_mb is > 0 MB (or null), got {self.gpu_memory_mb}")


@dataclasses.dataclass
class PlanningConfig:
    """What the planner (`tfmis-plan`, `tfmis-train --source-dir`) recorded about a plan; training reads it to
    warn when its machine has less than the plan was made for (docs/planning.md, "Planning for another machine")."""

    # null: not planned (or planned before plans recorded it), no warning; set planning.planned_for=null to silence
    planned_for: Optional[PlannedFor] = None


@dataclasses.dataclass
class Config:
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    model: UNetArchitecture = dataclasses.field(default_factory=UNetArchitecture)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    validation: ValidationConfig = dataclasses.field(default_factory=ValidationConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    profile: ProfileConfig = dataclasses.field(default_factory=ProfileConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)
    cascade: CascadeConfig = dataclasses.field(default_factory=CascadeConfig)
    postprocessing: PostprocessingConfig = dataclasses.field(default_factory=PostprocessingConfig)
    planning: PlanningConfig = dataclasses.field(default_factory=PlanningConfig)
