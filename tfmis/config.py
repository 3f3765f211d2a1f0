"""Typed training configuration: dataclasses, YAML files and `--set key=value` overrides.

A YAML file mirrors the dataclass tree (`data`, `pipeline`, `model`, `loss`, `optimizer`,
`training`, `validation`, `runtime`, `profile`, `output`, `cascade`, `postprocessing`, `planning`). Unknown keys
and wrong types are errors that name the key (and suggest the closest valid one); values not given keep the
defaults below.

Example:
```python
config = load_config("configs/demo.yaml", overrides=["training.epochs=3", "pipeline.patch_size=[48,48,48]"])
print(config.training.epochs)
save_config(config, "runs/demo/config.yaml")
```
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Literal, Optional, Union

import yaml

from tfmis.data.conversion_options import ConversionOptions
from tfmis.errors import ConfigError  # noqa: F401  (config.ConfigError: part of this module's interface)
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
    source_dir: Optional[str] = None  # MSD folder converted into dataset_dir first if needed
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
    cache: Literal["memory", "none", "file", "partial"] = "memory"
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
        if self.devices < 1 or self.data < 1 or self.micro_batches < 1:
            raise ValueError(
                f"devices, data and micro_batches must be >= 1, got {self.devices}, {self.data}, {self.micro_batches}"
            )
        if self.axis is not None and self.axis not in (0, 1, 2):
            raise ValueError(f"axis: a patch axis 0, 1 or 2, or null for the longest; got {self.axis}")

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
    # redraw training_curves.png at most this often during training, and always at its end (0 = after every
    # epoch): a redraw is a noticeable share of a short CPU epoch (docs/benchmarks.md, "First epoch, precision
    # and other costs")
    plot_seconds: float = 30.0


@dataclasses.dataclass
class CascadeConfig:
    """The fine stage of a coarse-to-fine cascade (docs/planning.md, "Stages"): `python -m tfmis.predict` runs the
    coarse run on the whole scan, cuts a box around each connected piece of what it finds grown by `margin_mm`
    (overlapping boxes merged), and runs this run's model only there (the whole scan when the coarse stage finds
    nothing). Training is unchanged: the fine stage trains on cases cropped around their labels
    (`data.conversion.crop_to_label_mm`)."""

    coarse_run: Optional[str] = None  # the coarse stage's run folder; null = not a cascade
    margin_mm: float = 20.0  # kept around each piece of the coarse stage's foreground, per side
    # coarse pieces smaller than this (mm3, on the coarse grid) get no region of their own; 0 = every piece is kept
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


# ---------------------------------------------------------------- loading and checking

MOVED_KEYS = {"training.distribution": "runtime.distribution", "training.devices": "runtime.devices"}


def from_dict(cls, data, prefix: str = ""):
    """Builds dataclass `cls` from nested dicts, checking every key and type."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            full = f"{prefix}{key}"
            if full in MOVED_KEYS:
                raise ConfigError(
                    f"config key '{full}' has moved to '{MOVED_KEYS[full]}' (the runtime: section): "
                    f"write it there, e.g. --set {MOVED_KEYS[full]}=..."
                )
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys here: {', '.join(names)}"
            raise ConfigError(f"unknown config key '{full}'{hint}")
    kwargs = {key: _coerce(hints[key], value, f"{prefix}{key}") for key, value in data.items()}
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section's own cross-field checks (e.g. UNetArchitecture, ConversionOptions)
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {e}") from e


def _coerce(tp, value, key: str):
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key + ".")
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            if len(args) < len(typing.get_args(tp)):
                return None
            raise ConfigError(f"{key}: expected {_describe(tp)}, got null")
        errors = []
        for arg in args:  # the first alternative that takes the value, e.g. int | tuple[int, int, int]
            try:
                return _coerce(arg, value, key)
            except ConfigError as e:
                errors.append(e)
        if len(args) == 1:
            raise errors[0]
        raise ConfigError(f"{key}: expected {_describe(tp)}, got {type(value).__name__} {value!r}")
    if origin is tuple:
        items = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list of {_describe(items[0])}, got {type(value).__name__} {value!r}")
        if items[-1] is Ellipsis:
            return tuple(_coerce(items[0], v, f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(items):
            raise ConfigError(f"{key}: expected {len(items)} values, got {len(value)} in {list(value)}")
        return tuple(_coerce(t, v, f"{key}[{i}]") for i, (t, v) in enumerate(zip(items, value)))
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            same_but_case = [str(c) for c in choices if str(c).lower() == str(value).lower()]
            close = same_but_case or difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key}: {value!r} is not one of {list(choices)}{hint}")
        return value
    if origin is dict:
        key_type, item = typing.get_args(tp)
        if value is None:  # `regions:` with nothing under it
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of name: value, got {type(value).__name__} {value!r}")
        return {
            _coerce(key_type, k, f"{key} (the key {k!r})"): _coerce(item, v, f"{key}.{k}") for k, v in value.items()
        }
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list of {item.__name__}, got {type(value).__name__} {value!r}")
        return [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if value is None:
        raise ConfigError(f"{key}: expected {tp.__name__}, got null")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")  # a bug in the schema, not in the file


def _describe(tp) -> str:
    """A type as a reader says it: int, a number, 3 values, an integer or 3 values..."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is tuple:
        items = typing.get_args(tp)
        return f"a list of {_describe(items[0])}" if items[-1] is Ellipsis else f"{len(items)} values"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(tp, str(tp))


def set_key(data: dict, key: str, value) -> None:
    """Sets dotted `key` (e.g. `training.epochs`) in nested config dicts `data`, creating sections on the way."""
    node = data
    *path, leaf = key.strip().split(".")
    for part in path:
        if node.get(part) is None:  # absent, or null in the file (e.g. data.split: null)
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: '{part}' is not a config section")
    node[leaf] = value


def apply_override(data: dict, override: str) -> None:
    """Applies `a.b.c=value` (value parsed as YAML) to nested dict `data` in place."""
    if "=" not in override:
        raise ConfigError(f"--set {override!r}: expected key=value, e.g. training.epochs=3")
    key, raw = override.split("=", 1)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key}: cannot parse value {raw!r} ({e})") from e
    try:
        set_key(data, key, value)
    except ConfigError as e:
        raise ConfigError(f"--set {e}") from None


def parse_config(data, overrides=(), source: str = "config") -> Config:
    """A validated `Config` from the nested dicts of a YAML document (None = the defaults) and `key=value`
    overrides; `source` (a file name) starts the error when the document is not a mapping."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: expected a mapping of config sections (data:, pipeline:, model:, ...), got "
            f"{type(data).__name__}"
        )
    for override in overrides:
        apply_override(data, override)
    config = from_dict(Config, data)
    validate(config)
    return config


def read_yaml(path: str | Path, kind: str = "config"):
    """The document of a YAML (or JSON) file; a `ConfigError` naming the file when it is missing or not YAML.

    Args:
        kind: what the file is, for the message ("config", "space", "specs").
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{kind} file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {e.object[e.start : e.start + 1]!r} at offset {e.start}): save the "
            f"{kind} file as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the {kind} file ({e.strerror or e})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        detail = " ".join(str(e).split())  # one line: PyYAML's message spans several
        raise ConfigError(f"{path}: not valid YAML ({detail})") from e


def load_config(path: str | Path | None = None, overrides=()) -> Config:
    """Reads a YAML config (or the defaults when `path` is None) and applies `key=value` overrides."""
    data = read_yaml(path) if path is not None else {}
    if isinstance(data, dict) and STAGES_KEY in data:
        stages = ", ".join(f"{s.get('name')}: {s.get('config')}" for s in data[STAGES_KEY] if isinstance(s, dict))
        raise ConfigError(
            f"{path} is a plan of several stages ({stages}): python -m tfmis.train --config {path} trains them in "
            f"order; give one stage's config file to use that stage alone"
        )
    return parse_config(data, overrides, str(path) if path is not None else "config")


# ---------------------------------------------------------------- plans of several stages

STAGES_KEY = "stages"


def write_stages(path: str | Path, stages, comments=()) -> Path:
    """Writes a stages file: the stage configs (name, path) to train in order, with comment lines on top."""
    from tfmis.utils.io import atomic_writer

    path = Path(path)
    body = yaml.safe_dump({STAGES_KEY: [{"name": n, "config": str(p)} for n, p in stages]}, sort_keys=False)
    header = "".join(f"# {line}\n" for line in comments)
    with atomic_writer(path) as f:
        f.write(
            f"# tfmis plan of {len(stages)} stages, trained in order by: python -m tfmis.train --config {path}\n"
            + header
            + body
        )
    return path


def load_stages(path: str | Path) -> list[tuple[str, Path]] | None:
    """The (name, config path) list of a stages file; None when `path` is a plain config.

    Raises:
        ConfigError: the file is missing, not YAML, or a stage is malformed or missing (named).
    """
    data = read_yaml(path)
    if not isinstance(data, dict) or STAGES_KEY not in data:
        return None
    stages = data[STAGES_KEY]
    if not isinstance(stages, list) or not stages:
        raise ConfigError(f"{path}: '{STAGES_KEY}' must be a list of {{name, config}} entries")
    result = []
    for i, stage in enumerate(stages):
        if not isinstance(stage, dict) or not {"name", "config"} <= set(stage):
            raise ConfigError(f"{path}: {STAGES_KEY}[{i}] needs a name and a config (a stage's config file)")
        if not Path(stage["config"]).is_file():
            raise ConfigError(f"{path}: stage {stage['name']}: config file {stage['config']} does not exist")
        result.append((str(stage["name"]), Path(stage["config"])))
    return result


def validate(config: Config) -> None:
    """Cross-field checks that types alone cannot express (and the splits `data.split` derives)."""
    _resolve_data_split(config.data)
    p = config.pipeline
    if len(p.patch_size) != 3 or min(p.patch_size) < 1:
        raise ConfigError(f"pipeline.patch_size: expected three positive sizes, got {p.patch_size}")
    if len(p.pos_neg_ratio) != 2 or min(p.pos_neg_ratio) < 0 or sum(p.pos_neg_ratio) <= 0:
        raise ConfigError(f"pipeline.pos_neg_ratio: expected [pos, neg] >= 0, got {p.pos_neg_ratio}")
    if p.num_images_per_batch < 1 or p.num_crops_per_image < 1:
        raise ConfigError("pipeline.num_images_per_batch and pipeline.num_crops_per_image must be >= 1")
    if p.cache == "file" and not p.cache_dir:
        raise ConfigError(
            "pipeline.cache is 'file' but pipeline.cache_dir is not set: give the folder for the "
            "on-disk cache, e.g. pipeline.cache_dir=/scratch/tfmis-cache"
        )
    if p.cache_num is not None and p.cache_num < 1:
        raise ConfigError(
            f"pipeline.cache_num must be >= 1 volume (or null to use pipeline.cache_rate), got {p.cache_num}"
        )
    if p.cache_num is not None and p.cache != "partial":
        raise ConfigError(
            f"pipeline.cache_num={p.cache_num} only bounds pipeline.cache=partial, but pipeline.cache "
            f"is {p.cache!r}: set pipeline.cache=partial (or pipeline.cache_num=null)"
        )
    if not 0 < p.cache_rate <= 1:
        raise ConfigError(
            f"pipeline.cache_rate must be in (0, 1] (the share of the training volumes held by "
            f"pipeline.cache=partial), got {p.cache_rate}"
        )
    if not 0 < p.replace_rate <= 1:
        raise ConfigError(
            f"pipeline.replace_rate must be in (0, 1] (the share of the partial cache replaced per "
            f"pass over it, e.g. 0.2), got {p.replace_rate}"
        )
    o = config.optimizer
    _validate_optimizer(o)
    if o.lr_reference_batch is not None and o.lr_reference_batch < 1:
        raise ConfigError(
            f"optimizer.lr_reference_batch must be a batch size >= 1 (or null), got {o.lr_reference_batch}"
        )
    if config.training.max_minutes is not None and config.training.max_minutes <= 0:
        raise ConfigError(f"training.max_minutes must be > 0 (or null), got {config.training.max_minutes}")
    if config.training.accumulation_steps < 1:
        raise ConfigError("training.accumulation_steps must be >= 1")
    if config.training.steps_per_loop < 1:
        raise ConfigError(
            f"training.steps_per_loop must be >= 1 (optimizer steps per host round-trip; 1 = "
            f"read every step's loss), got {config.training.steps_per_loop}"
        )
    if not 0 <= config.validation.overlap < 1:
        raise ConfigError(f"validation.overlap must be in [0, 1), got {config.validation.overlap}")
    if config.validation.roi_size is not None and len(config.validation.roi_size) != 3:
        raise ConfigError(f"validation.roi_size: expected three sizes, got {config.validation.roi_size}")
    _validate_surface_and_regions(config.validation)
    if config.model.output == "regions":
        _validate_region_output(config)


def _resolve_data_split(data: DataConfig) -> None:
    """With `data.split` set: K folds from the conversion (data.conversion.folds = K, split null) in
    `folds_dataset_dir` (unless data.conversion.folds already said data.dataset_dir holds them), trained on every
    fold but `fold` (data.train_split, the joined fold names) and validated on `fold` (data.val_split). Derived the
    same every time, so a run folder's config.yaml loads to the same splits (and one made for another fold is
    re-derived for this one).

    Raises:
        ConfigError: a fold out of range, fewer than 2 folds, a bad splits file, or a conflicting
            data.conversion.split / folds or data.train_split / val_split (named, with the fix).
    """
    import re

    from tfmis.data.folds import DEFAULT_SPLIT, read_splits_file
    from tfmis.data.records import SPLIT_JOIN, cross_validation_splits

    s = data.split
    if s is None:
        return
    # K from the file; a run folder's config.yaml whose file has gone keeps the K it was made with
    if s.file is not None and Path(s.file).is_file():
        try:
            s.folds = len(read_splits_file(s.file))
        except (OSError, ValueError) as e:
            raise ConfigError(f"data.split.file: {e}") from None
    if s.folds < 2:
        raise ConfigError(f"data.split.folds must be at least 2 (nnU-Net uses 5), got {s.folds}")
    if not 0 <= s.fold < s.folds:
        raise ConfigError(
            f"data.split.fold={s.fold} is out of range for {s.folds} folds: set data.split.fold to 0..{s.folds - 1}"
        )
    c = data.conversion
    if c.split is not None and c.split != DEFAULT_SPLIT:
        raise ConfigError(
            f"data.conversion.split={list(c.split)} asks for train/val/test fractions, but data.split asks for "
            f"{s.folds} folds: set data.conversion.split=null (data.split sets data.conversion.folds)"
        )
    if c.folds is not None and c.folds != s.folds:
        raise ConfigError(
            f"data.conversion.folds={c.folds} but data.split makes {s.folds} folds: set data.conversion.folds=null "
            "(data.split sets it)"
        )
    train, val = cross_validation_splits(s.folds, s.fold)
    for key, default in (("train_split", "train"), ("val_split", "val")):
        value = getattr(data, key)
        derived_before = all(re.fullmatch(r"fold\d+", part) for part in value.split(SPLIT_JOIN))
        if value != default and not derived_before:
            raise ConfigError(
                f"data.{key}={value!r} conflicts with data.split (fold {s.fold} of {s.folds} trains on {train} and "
                f"validates on {val}): remove data.{key}"
            )
    data.train_split, data.val_split = train, val
    if c.folds is None:  # not a folder the config says holds these folds: the one tfmis-crossval converts into
        data.dataset_dir = folds_dataset_dir(data.dataset_dir, s.folds)
    data.conversion = dataclasses.replace(c, split=None, folds=s.folds)


def folds_dataset_dir(dataset_dir: str, folds: int) -> str:
    """Where the K-fold conversion of a config's data goes: `<dataset_dir>-folds<K>`, next to its train/val/test
    conversion (a folder holds one conversion), shared by every fold and configuration of `tfmis-crossval` and by a
    `tfmis-train` run with `data.split`; a folder already so named is kept.

    Example:
        >>> folds_dataset_dir("data/demo/tfrecords", 5), folds_dataset_dir("data/demo/tfrecords-folds5", 5)
        ('data/demo/tfrecords-folds5', 'data/demo/tfrecords-folds5')
    """
    base = str(dataset_dir).rstrip("/")
    return base if base.endswith(f"-folds{folds}") else f"{base}-folds{folds}"


BRATS_REGIONS_EXAMPLE = "{whole_tumour: [1, 2, 3], tumour_core: [2, 3], enhancing_tumour: [3]}"


def region_paint_labels(regions: dict[str, list[int]]) -> list[int]:
    """The label each region paints when region outputs become a label map (`model.output: regions`).

    The label map starts as background and the regions are painted in their order, each where its sigmoid
    exceeds 0.5, with the one label it holds that no later region holds (nnU-Net's `regions_class_order`): for
    BraTS's {whole_tumour: [1, 2, 3], tumour_core: [2, 3], enhancing_tumour: [3]} that is 1, 2, 3. So a region
    must add exactly one label to the regions after it; then painting the true regions of a label map gives that
    label map back.

    Raises:
        ConfigError: a region adds no label or several (named, with the fix).

    Example:
        >>> region_paint_labels({"whole_tumour": [1, 2, 3], "tumour_core": [2, 3], "enhancing_tumour": [3]})
        [1, 2, 3]
        >>> region_paint_labels({"organ": [1, 2], "lesion": [2]})
        [1, 2]
    """
    names = list(regions)
    paint = []
    for i, name in enumerate(names):
        later = {label for other in names[i + 1 :] for label in regions[other]}
        own = sorted(set(regions[name]) - later)
        if len(own) != 1:
            what = "no label" if not own else f"the labels {own}"
            raise ConfigError(
                f"validation.regions.{name}: with model.output=regions the regions are painted into a label map "
                f"in their order, each painting the one label that no later region holds, but {name} adds {what}. "
                f"List the regions from the largest to the smallest, each adding exactly one label to the ones "
                f"after it, e.g. BraTS {BRATS_REGIONS_EXAMPLE}, or set model.output=classes"
            )
        paint.append(own[0])
    return paint


def _validate_region_output(config: Config) -> None:
    """model.output: regions needs regions to predict, a sigmoid per channel and a painting order; that the regions
    cover every foreground class is checked with the dataset's classes (`tfmis.task.SegmentationTask`)."""
    if not config.validation.regions:
        raise ConfigError(
            "model.output is regions but validation.regions is empty: give the label unions the model predicts, "
            f"largest first, e.g. validation.regions={BRATS_REGIONS_EXAMPLE} (BraTS), or set model.output=classes"
        )
    if config.loss.activation != "sigmoid":
        raise ConfigError(
            f"model.output is regions but loss.activation is {config.loss.activation!r}: regions overlap, so each "
            "has its own sigmoid: set loss.activation=sigmoid"
        )
    region_paint_labels(config.validation.regions)


def _validate_optimizer(o: OptimizerConfig) -> None:
    """Hyperparameters no optimizer can use (a negative learning rate trains uphill): named with the fix."""
    import math

    def finite(x) -> bool:
        return isinstance(x, (int, float)) and math.isfinite(x)

    if not (finite(o.learning_rate) and o.learning_rate > 0):
        raise ConfigError(f"optimizer.learning_rate must be a number > 0 (e.g. 0.001), got {o.learning_rate}")
    for key, hint in (
        ("min_learning_rate", "where the schedule ends"),
        ("weight_decay", "0 = off"),
        ("warmup_epochs", "0 = no warm-up"),
    ):
        value = getattr(o, key)
        if not (finite(value) and value >= 0):
            raise ConfigError(f"optimizer.{key} must be a number >= 0 ({hint}), got {value}")
    for key in ("momentum", "beta_1", "beta_2"):
        value = getattr(o, key)
        if not (finite(value) and 0 <= value < 1):
            raise ConfigError(f"optimizer.{key} must be in [0, 1) (e.g. 0.9), got {value}")
    if not (finite(o.power) and o.power > 0):
        raise ConfigError(f"optimizer.power must be > 0 (the poly schedule's exponent, e.g. 0.9), got {o.power}")
    if o.clipnorm is not None and not (finite(o.clipnorm) and o.clipnorm > 0):
        raise ConfigError(f"optimizer.clipnorm must be > 0 (or null = no clipping), got {o.clipnorm}")


def _validate_surface_and_regions(v: ValidationConfig) -> None:
    """validation.nsd / nsd_tolerance_mm / regions; the labels are checked against the dataset's classes when the
    metrics are built (tfmis.metrics.check_regions), as the config does not know them."""
    import math
    import re

    tolerances = v.nsd_tolerance_mm if isinstance(v.nsd_tolerance_mm, list) else [v.nsd_tolerance_mm]
    if v.nsd and v.nsd_tolerance_mm is None:
        raise ConfigError(
            "validation.nsd is true but validation.nsd_tolerance_mm is not set: give the accepted surface "
            "deviation in mm, one number or one per foreground class, e.g. validation.nsd_tolerance_mm=2.0"
        )
    if v.nsd_tolerance_mm is not None and (not tolerances or not all(math.isfinite(t) and t >= 0 for t in tolerances)):
        raise ConfigError(
            f"validation.nsd_tolerance_mm: expected distances >= 0 mm (one, or one per foreground class), "
            f"got {v.nsd_tolerance_mm}"
        )
    for name, labels in v.regions.items():
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name):
            raise ConfigError(
                f"validation.regions: the name {name!r} must be a letter then letters, digits or _ (it names "
                "metrics and CSV columns, e.g. dice_whole_tumour): rename it, e.g. whole_tumour"
            )
        if not labels or min(labels) < 1 or len(set(labels)) != len(labels):
            raise ConfigError(
                f"validation.regions.{name}: expected a list of distinct foreground labels >= 1 (the classes "
                f"it unites, e.g. [1, 2, 3]), got {labels}"
            )


def to_dict(config) -> dict:
    """Plain nested dicts and lists (tuples become lists), as YAML writes them."""

    def plain(value):
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return plain(dataclasses.asdict(config))


def save_config(config: Config, path: str | Path) -> None:
    from tfmis.utils.io import atomic_writer

    with atomic_writer(path) as f:
        yaml.safe_dump(to_dict(config), f, sort_keys=False)
