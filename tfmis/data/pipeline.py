"""tf.data input pipelines for training (random patches) and validation (whole volumes).

Training:
```
shards ─interleave (parallel reads)─▶ parse ─▶ foreground indices ─▶ cache
       ─▶ shuffle volumes ─▶ repeat ─▶ N balanced crops per volume ─▶ augment ─▶ shuffle crops
       ─▶ batch ─▶ prefetch(AUTOTUNE)
```
Everything before `cache` is deterministic, so it is computed once; everything after is random,
drawn from stateless seeds derived from `training.seed` and the element's position, so
`deterministic: true` gives a reproducible stream.

Under a tf.distribute strategy, build through `strategy.distribute_datasets_from_function` with
`input_context`: files are sharded across input pipelines, and the batch is per replica.

Every function given to tf.data here is traced as written (`as_written`: AutoGraph off). They branch and loop on
Python values only (settings, static shapes), so tracing them as written builds the same graph; AutoGraph's rewrite
took 2.2-2.4 s of every training process's start (a tiny training's first `build_train_dataset`: 3.4 s with it,
1.0 s without, Intel Xeon): each cross-validation fold, tuning trial and test run pays it once.

Example:
```python
dataset = build_train_dataset(config)          # ((B, px, py, pz, C) float32, (B, px, py, pz) int32)
# pipeline.augment.placement: step -> (crops (B, *train_crop_size(p), C) float16 as stored, labels uint8
# (B, *train_crop_size(p)), seeds (B, 2) int64), augmented in the training step by step_augmentation(config.pipeline)
val = build_val_dataset(config)                # (1, X, Y, Z, C), (1, X, Y, Z), metadata
```
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import tensorflow as tf

from tfmis.data.records import image_as_float32, load_index, parse_example, shard_paths, split_entry, split_parts
from tfmis.data.smart_cache import REFILL_PARALLELISM, partial_cache_size, share_size, smart_cache
from tfmis.errors import ConfigError, DataError, UsageError
from tfmis.hardware import data_threads
from tfmis.hardware.cpu import usable_cpu_count
from tfmis.hardware.memory import MB
from tfmis.transforms.augment import (
    augment_patch,
    random_spatial,
    sampled_box,
    spatial_enabled,
    spatial_margin,
    spatial_seed,
    train_crop_size,
    window,
)
from tfmis.transforms.crop import crop_starts, crop_starts_at, foreground_indices, rand_crop_by_pos_neg

# a function for tf.data to trace as written, without AutoGraph (the module docstring says why)
as_written = tf.autograph.experimental.do_not_convert


def _cache(dataset: tf.data.Dataset, pipeline, name: str, fingerprint: dict) -> tf.data.Dataset:
    """Caches the deterministic part of a pipeline as `pipeline.cache` (memory, file, none, partial) says.

    `file` writes `<pipeline.cache_dir>/<name>-<hash>.*`. The hash covers `fingerprint`: the dataset's
    index.json and every setting that changes the cached elements, so a reconverted dataset or
    another setting writes a new cache instead of silently reading a stale one. `partial` is the training
    stream's bounded cache (`tfmis.data.smart_cache`, built by `build_train_dataset`); anything else cached
    through here under `partial` (the validation volumes) is read from the TFRecords each time, adding no memory.
    """
    if pipeline.cache in ("none", "partial", "patches"):
        return dataset
    if pipeline.cache == "memory":
        return dataset.cache()
    if pipeline.cache != "file" or not pipeline.cache_dir:
        raise ConfigError(
            f"pipeline.cache must be memory, none, partial or file (with pipeline.cache_dir), got "
            f"{pipeline.cache!r} (cache_dir {pipeline.cache_dir!r})"
        )
    folder = Path(pipeline.cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return dataset.cache(str(folder / f"{name}-{digest}"))


def input_shard(files, cases, input_context=None) -> dict:
    """What one input pipeline (one worker) reads of a split: `files` and the `cases` it keeps.

    With at least as many files as pipelines, each pipeline reads its own files (file-level sharding);
    otherwise every pipeline reads all files and keeps every N-th case (data-level). Either way each
    case belongs to exactly one pipeline, so N workers cache the dataset once between them, not N times.
    """
    n = input_context.num_input_pipelines if input_context is not None else 1
    i = input_context.input_pipeline_id if input_context is not None else 0
    if n == 1:
        return {"level": "none", "files": list(files), "cases": None}
    if len(files) >= n:
        return {"level": "file", "files": list(files)[i::n], "cases": None}
    if len(cases) < n:
        raise UsageError(
            f"{len(cases)} case(s) cannot be shared by {n} input pipelines (workers): every worker "
            "needs at least one; use fewer workers or more cases"
        )
    return {"level": "data", "files": list(files), "cases": sorted(cases)[i::n]}


# the volume pipeline reads at most this many shard files at once (`read_records`)
_INTERLEAVE_CYCLE = 8


def read_records(
    files, index, deterministic: bool, input_context=None, split: str | None = None, refill_seed: int | None = None
) -> tf.data.Dataset:
    """`refill_seed` set: the partial cache's reader (`tfmis.data.smart_cache`): a new seeded shard order on
    every pass, and no read-ahead (files read in turn, records parsed as they are asked for), so that only a
    few volumes are in flight besides the cached ones."""
    compression = index["preprocessing"]["compression"]
    dtype = index["preprocessing"]["image_dtype"]
    shard = input_shard(files, split_entry(index, split)["cases"] if split else [], input_context)
    files = shard["files"]
    names = tf.data.Dataset.from_tensor_slices(files)
    if refill_seed is not None:
        names = names.shuffle(len(files), seed=refill_seed, reshuffle_each_iteration=True)
    read_ahead = (
        {} if refill_seed is not None else {"num_parallel_calls": tf.data.AUTOTUNE, "deterministic": deterministic}
    )
    dataset = names.interleave(
        as_written(lambda f: tf.data.TFRecordDataset(f, compression_type="" if compression == "NONE" else compression)),
        cycle_length=min(len(files), _INTERLEAVE_CYCLE),
        **read_ahead,
    )
    if shard["cases"] is not None:
        mine = tf.constant(shard["cases"])

        def is_mine(serialized):
            case_id = tf.io.parse_single_example(serialized, {"case_id": tf.io.FixedLenFeature([], tf.string)})
            return tf.reduce_any(tf.equal(case_id["case_id"], mine))

        dataset = dataset.filter(as_written(is_mine))
    return dataset.map(as_written(lambda s: parse_example(s, dtype, half_as_bits=True)), **read_ahead)


def volume_order(index: dict, dataset_dir: str | Path, split: str, input_context=None) -> list[str]:
    """The case ids of `split` in the order the fast pipeline reads its records (before its shuffle).

    The fast pipeline interleaves its shard files (at most 8 open, one record from each in turn;
    `tf.data.Dataset.interleave` with `deterministic=True`) after `input_shard` has chosen this input
    pipeline's files or cases; this is that order, computed from `index.json` without reading a record.
    """
    files = shard_paths(dataset_dir, split, index)
    shard = input_shard(files, split_entry(index, split)["cases"], input_context)
    parts = set(split_parts(index, split))
    by_file = {}
    for case in index["cases"].values():
        if case["split"] in parts:
            by_file.setdefault(case["file"], []).append(case)
    queue = [
        [c["case_id"] for c in sorted(by_file.get(Path(f).name, []), key=lambda c: c["position"])]
        for f in shard["files"]
    ]
    order = _interleave(queue, min(len(queue), _INTERLEAVE_CYCLE))
    if shard["cases"] is not None:
        mine = set(shard["cases"])
        order = [c for c in order if c in mine]
    return order


def _interleave(inputs: list[list], cycle_length: int) -> list:
    """`tf.data.Dataset.interleave(cycle_length=..., block_length=1)` order over lists (TF's sequential algorithm)."""
    pending = list(inputs)
    slots: list[list | None] = [None] * max(cycle_length, 1)
    out, i, open_count, end_of_input = [], 0, 0, False
    while not end_of_input or open_count > 0:
        if slots[i] is not None:
            if slots[i]:
                out.append(slots[i].pop(0))
            else:  # exhausted: free the slot, the next input opens here when the cycle comes back
                slots[i] = None
                open_count -= 1
            i = (i + 1) % len(slots)
        elif pending:
            slots[i] = list(pending.pop(0))
            open_count += 1
        else:
            end_of_input = True
            i = (i + 1) % len(slots)
    return out


def train_steps_per_epoch(config, num_replicas: int = 1) -> int:
    """Optimizer steps per epoch: every training volume yields `num_crops_per_image` crops once."""
    if config.training.steps_per_epoch:
        return config.training.steps_per_epoch
    index = load_index(config.data.dataset_dir)
    volumes = split_entry(index, config.data.train_split)["num_records"]
    global_batch = config.pipeline.num_images_per_batch * num_replicas * config.training.accumulation_steps
    return max(1, math.ceil(volumes * config.pipeline.num_crops_per_image / global_batch))


def build_train_dataset(
    config, input_context: tf.distribute.InputContext | None = None, seed_offset: int = 0
) -> tf.data.Dataset:
    """The infinite training stream of augmented patch batches (batch = per replica × accumulation).

    `pipeline.augment.placement: step` yields `(images, labels, seeds)` instead: the same crops in the same order,
    un-augmented (`train_crop_size`, image as stored: `step_image_dtype`, label uint8), and each crop's
    augmentation seed (B, 2) int64, for
    `step_augmentation(config.pipeline)` to apply in the training step.

    Args:
        config: the training `Config`.
        input_context: from `distribute_datasets_from_function` (shards files across input pipelines).
        seed_offset: shifts the random stream (a resumed run passes its start epoch).
    """
    p, seed = config.pipeline, config.training.seed
    index = load_index(config.data.dataset_dir)
    num_classes = len(index["source"]["labels"])
    files = shard_paths(config.data.dataset_dir, config.data.train_split, index)
    if not files:
        raise DataError(f"{config.data.dataset_dir}: split {config.data.train_split!r} has no records")
    if p.augment.rot90_prob > 0 and p.patch_size[0] != p.patch_size[1]:
        raise ConfigError(f"pipeline.augment.rot90_prob > 0 needs a square in-plane patch, got {p.patch_size}")
    if p.class_ratios is not None and len(p.class_ratios) != num_classes:
        raise ConfigError(f"pipeline.class_ratios has {len(p.class_ratios)} entries for {num_classes} classes")

    # a resumed run (seed_offset = epochs done) draws a new volume order and new crops, not epoch 1's again
    stream_seed = seed + 7919 * seed_offset
    pipeline_id = input_context.input_pipeline_id if input_context else 0
    if p.cache == "patches":  # crops read from the memory-mapped arrays: no volume decoded or held
        dataset = _patch_stream(config, index, input_context, stream_seed, pipeline_id)
    else:
        dataset = _volume_stream(config, index, files, input_context, stream_seed, pipeline_id, num_classes)
    # placement step: the crops (patch + spatial margin) go out un-augmented with their seeds, and the training
    # step applies `step_augmentation`; otherwise tf.data augments them here
    augment = patch_augmentation(p) if p.augment.placement == "pipeline" else _unaugmented(p, step_image_dtype(index))
    # cache: patches counts one augmenting call per usable CPU in its byte budget (budget.patch_input): no more run
    parallel = tf.data.AUTOTUNE
    if p.cache == "patches":
        parallel = usable_cpu_count()
    dataset = dataset.map(as_written(augment), num_parallel_calls=parallel, deterministic=p.deterministic)
    if p.shuffle_crops > 1:
        dataset = dataset.shuffle(p.shuffle_crops, seed=stream_seed + 1)
    batch = p.num_images_per_batch * config.training.accumulation_steps
    dataset = dataset.batch(batch, drop_remainder=True)
    dataset = with_channel_count(dataset, len(index["source"]["modalities"]))
    options = pipeline_options(p.deterministic)
    prefetch = tf.data.AUTOTUNE
    if p.cache == "patches":  # tf.data's buffers within the pipeline's memory budget, as budget.patch_input counts
        from tfmis.data.memory_budget import PATCH_PREFETCH_BATCHES, pipeline_memory_budget

        options.autotune.ram_budget = int(pipeline_memory_budget(p) * MB)
        prefetch = PATCH_PREFETCH_BATCHES
    return dataset.prefetch(prefetch).with_options(options)


def _patch_stream(config, index, input_context, stream_seed: int, pipeline_id: int) -> tf.data.Dataset:
    """The crops of `pipeline.cache: patches`: `patch_crops` of the cases in the volume stream's order and shuffle."""
    from tfmis.data.memory_budget import patch_read_plan
    from tfmis.data.patch_layout import PatchArrays, check_locations

    p = config.pipeline
    order = volume_order(index, config.data.dataset_dir, config.data.train_split, input_context)
    plan = patch_read_plan(config, index)  # the plan the run's `Input memory:` line said
    arrays = PatchArrays(config.data.dataset_dir, order, drop_pages=plan["drop_pages"])
    check_locations(arrays, p.max_foreground_indices, config.training.seed)
    dataset = tf.data.Dataset.range(len(order))
    dataset = dataset.shuffle(p.shuffle_volumes, seed=stream_seed, reshuffle_each_iteration=True).repeat()
    dataset = dataset.enumerate()
    locate, read = patch_crops(p, arrays, stream_seed, pipeline_id, step_image_dtype(index))
    readers = plan["readers"]
    # where the crops lie (a few label voxels read) for two volumes at once, then `readers` crops read at once: a
    # parallel map holds at most its parallelism in flight and as many done, which is what the budget counts
    dataset = dataset.map(as_written(locate), num_parallel_calls=2, deterministic=p.deterministic).unbatch()
    return dataset.map(as_written(read), num_parallel_calls=readers, deterministic=p.deterministic)


def _volume_stream(config, index, files, input_context, stream_seed: int, pipeline_id: int, num_classes: int):
    """The crops of the volume caches (memory, file, none, partial): volumes read from the TFRecords, cached as
    `pipeline.cache` says, shuffled, cropped by `volume_crops`."""
    p, seed = config.pipeline, config.training.seed

    def with_foreground(image, label, meta):
        fg, fg_class = foreground_indices(label, num_classes, p.max_foreground_indices, seed)
        return image, label, fg, fg_class

    dataset = read_records(
        files,
        index,
        p.deterministic,
        input_context,
        config.data.train_split,
        refill_seed=stream_seed if p.cache == "partial" else None,
    )
    dataset = dataset.map(
        as_written(with_foreground),
        num_parallel_calls=REFILL_PARALLELISM if p.cache == "partial" else tf.data.AUTOTUNE,
        deterministic=p.deterministic,
    )
    if p.cache == "partial":  # a bounded, shuffled window of volumes, refilled from the TFRecords per cycle
        share = share_size(
            index,
            config.data.train_split,
            input_shard(files, split_entry(index, config.data.train_split)["cases"], input_context),
        )
        dataset = smart_cache(dataset, *partial_cache_size(p, share), seed=stream_seed)
    else:
        dataset = _cache(
            dataset,
            p,
            f"train{pipeline_id}",
            {
                "index": index,
                "split": config.data.train_split,
                "seed": seed,
                "deterministic": p.deterministic,
                "max_foreground_indices": p.max_foreground_indices,
                "input_pipelines": input_context.num_input_pipelines if input_context else 1,
            },
        )
        dataset = dataset.shuffle(p.shuffle_volumes, seed=stream_seed, reshuffle_each_iteration=True).repeat()
    # per-element seeds: (training seed, position in the stream), independent of thread scheduling
    dataset = dataset.enumerate()

    crop = volume_crops(p, stream_seed, pipeline_id)

    def crops(position, element):
        image, label, fg, fg_class = element
        return crop(position, image_as_float32(image), label, fg, fg_class)

    if p.deterministic:
        return dataset.flat_map(as_written(crops))
    return dataset.interleave(
        as_written(crops), cycle_length=2, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False
    )


def pipeline_options(deterministic: bool) -> tf.data.Options:
    """tf.data options of tfmis's pipelines: the order rule, and a private thread pool of the usable CPUs where a
    cgroup CPU quota is below the affinity mask (tf.data sizes its pools from the mask: `hardware.data_threads`)."""
    options = tf.data.Options()
    options.deterministic = deterministic
    threads = data_threads()
    if threads:
        options.threading.private_threadpool_size = threads
    return options


def with_channel_count(batches: tf.data.Dataset, channels: int) -> tf.data.Dataset:
    """`batches` (images, ...) with the images' channel count stated in the element spec.

    The training step is traced from this spec: with an unknown channel count (augmentation loses it) TensorFlow's
    CPU convolutions run several times slower (docs/benchmarks.md, "First epoch, precision and other costs").
    """
    return batches.map(
        as_written(lambda images, *rest: (tf.ensure_shape(images, [*images.shape[:4], channels]), *rest))
    )


def volume_crops(pipeline, stream_seed: int, pipeline_id: int):
    """`fn(position, image, label, fg, fg_class)`: the dataset of one volume's `num_crops_per_image` crops
    with their augmentation seeds, all drawn from (stream seed, pipeline, position in the stream), so any
    pipeline that feeds the same volumes in the same order gets the same patches; `patch_augmentation` (or, for
    `augment.placement: step`, `_unaugmented` then `step_augmentation`) takes its elements.

    Elements: `(patch, label patch, crop seed)`; with rotation, scaling or elastic deformation on,
    `(volume, label volume, origin, crop seed)` instead: the crop is the `train_crop_size` window at `origin`
    (the patch plus `spatial_margin` context per side, zeros outside the volume), left in the volume (no copy)
    for the augmentation to resample in place."""
    p = pipeline
    margin = spatial_margin(p.augment, p.patch_size)

    def crops(position, image, label, fg, fg_class):
        element_seed, seeds = crop_seeds(p, stream_seed, pipeline_id, position)
        if spatial_enabled(p.augment):  # the same patches as below, located, not cut
            starts = crop_starts(
                label,
                fg,
                fg_class,
                p.patch_size,
                p.num_crops_per_image,
                p.pos_neg_ratio[0],
                p.pos_neg_ratio[1],
                element_seed,
                p.class_ratios,
            )
            origins = starts - tf.constant(margin, tf.int32)
            return tf.data.Dataset.from_tensor_slices((origins, seeds)).map(
                as_written(lambda origin, seed: (image, label, origin, seed))
            )
        images, labels = rand_crop_by_pos_neg(
            image,
            label,
            fg,
            fg_class,
            p.patch_size,
            p.num_crops_per_image,
            p.pos_neg_ratio[0],
            p.pos_neg_ratio[1],
            element_seed,
            p.class_ratios,
        )
        return tf.data.Dataset.from_tensor_slices((images, labels, seeds))

    return crops


def crop_seeds(pipeline, stream_seed: int, pipeline_id: int, position) -> tuple[tf.Tensor, tf.Tensor]:
    """(element seed (2,) int64, crop seeds (num_crops_per_image, 2)) of the volume at `position` in the stream:
    where its crops are drawn and how each is augmented (`volume_crops`, `patch_crops`)."""
    element_seed = tf.stack([tf.constant(stream_seed + 1000 * pipeline_id, tf.int64), tf.cast(position, tf.int64)])
    seeds = tf.random.experimental.stateless_split(
        tf.random.experimental.stateless_fold_in(element_seed, 1), pipeline.num_crops_per_image
    )
    return element_seed, seeds


def step_image_dtype(index: dict) -> tf.DType:
    """The image dtype of `augment.placement: step` batches: the records' (float16 unless converted as float32),
    so the window-sized crops cross the input and the host-to-device copy at half the bytes, exactly; the step
    augments them in float32."""
    return tf.float16 if index["preprocessing"]["image_dtype"] == "float16" else tf.float32


def patch_crops(pipeline, arrays, stream_seed: int, pipeline_id: int, step_dtype: tf.DType = tf.float32):
    """`(locate, read)`: `volume_crops` of case number `case` of `arrays` (a `tfmis.data.patch_layout.PatchArrays`)
    read from its memory-mapped arrays: the same elements, cut where `volume_crops` cuts them from the decoded
    volume, reading only the crops and the few label voxels the background draws look at.

    `locate(position, case)` gives the case's `num_crops_per_image` crops as (cases (n,), window origins (n, 3),
    seeds (n, 2)); `read(case, origin, seed)` reads one of them into its element.

    Without the spatial augmentations the elements are `(patch, label patch, seed)`; with them `(crop, label crop,
    origin, seed)`, which `patch_augmentation` resamples as it resamples the window in the volume: with
    `augment.placement: pipeline` the crop is only the box of the `train_crop_size` window its draws read
    (`sampled_box`, at `-origin` in the window), with `step` the whole window (origin 0)."""
    p = pipeline
    margin = tf.constant(spatial_margin(p.augment, p.patch_size), tf.int32)
    size = train_crop_size(p)
    n, channels = p.num_crops_per_image, arrays.channels
    shapes = tf.constant(arrays.shapes)

    def locations(case):
        return arrays.locations(int(case))

    def labels_at(case, indices):
        return arrays.labels_at(int(case), indices)

    # placement step reads the windows as stored (`step_image_dtype`): no float32 copy of a window-sized crop
    read_dtype = step_dtype if p.augment.placement == "step" else tf.float32

    def box(case, origin, box_size):
        return arrays.window(int(case), origin, box_size, read_dtype.as_numpy_dtype)

    def locate(position, case):
        element_seed, seeds = crop_seeds(p, stream_seed, pipeline_id, position)
        fg, fg_class = tf.numpy_function(locations, [case], [tf.int32, tf.int32], stateful=False)
        fg, fg_class = tf.ensure_shape(fg, [None, 3]), tf.ensure_shape(fg_class, [None])
        starts = crop_starts_at(
            tf.gather(shapes, case),
            lambda indices: tf.ensure_shape(
                tf.numpy_function(labels_at, [case, indices], tf.uint8, stateful=False), [None]
            ),
            fg,
            fg_class,
            p.patch_size,
            n,
            p.pos_neg_ratio[0],
            p.pos_neg_ratio[1],
            element_seed,
            p.class_ratios,
        )
        return tf.fill([n], case), starts - margin[None, :], seeds

    boxed = spatial_enabled(p.augment) and p.augment.placement == "pipeline"

    def read(case, origin, seed):
        # one crop at a time, straight into its own tensor. Rotation / scaling / fields in tf.data: only the box
        # its draws sample (the patch when none is drawn), not the whole enlarged window: the same patch for a
        # fraction of the bytes
        low, high = tf.zeros([3], tf.int32), tf.constant(size, tf.int32)
        if boxed:
            low, high = sampled_box(p.augment, spatial_seed(tf.cast(seed, tf.int32)), p.patch_size, size)
        image, label = tf.numpy_function(box, [case, origin + low, high - low], [read_dtype, tf.uint8], stateful=False)
        shape = [None] * 3 if boxed else size
        image, label = tf.ensure_shape(image, [*shape, channels]), tf.ensure_shape(label, shape)
        return (image, label, -low, seed) if spatial_enabled(p.augment) else (image, label, seed)

    return locate, read


def patch_augmentation(pipeline):
    """`fn(*element)`: one element of `volume_crops` augmented as `pipeline.augment` says into a `patch_size`
    patch (image float32, label int32, static shapes). With the spatial augmentations on, the crop is resampled
    in place in its volume (`random_spatial` with the crop's origin), exactly as `augment_patch` resamples the crop
    cut out, which is what `step_augmentation` does."""
    p = pipeline
    crop = train_crop_size(p)

    def augment(*element):
        if spatial_enabled(p.augment):
            image, label, origin, crop_seed = element
            crop_seed = tf.cast(crop_seed, tf.int32)
            image, label = random_spatial(
                image, label, p.augment, spatial_seed(crop_seed), p.patch_size, origin=origin, input_size=crop
            )
        else:
            image, label, crop_seed = element
            crop_seed = tf.cast(crop_seed, tf.int32)
        image, label = augment_patch(image, label, p.augment, crop_seed, patch_size=p.patch_size, spatial=False)
        image = tf.ensure_shape(image, [*p.patch_size, None])
        return image, tf.ensure_shape(tf.cast(label, tf.int32), p.patch_size)

    return augment


def _unaugmented(pipeline, image_dtype: tf.DType):
    """Placement step's map: one element of `volume_crops` as (crop `image_dtype`, label uint8, seed int64), shapes
    static."""
    p = pipeline
    size = train_crop_size(p)

    def keep(*element):
        if spatial_enabled(p.augment):
            volume, volume_label, origin, crop_seed = element
            # cache: patches yields the window itself (origin 0): no copy
            image, label = (
                (volume, volume_label) if p.cache == "patches" else window(volume, volume_label, origin, size)
            )
        else:
            image, label, crop_seed = element
        return (
            tf.ensure_shape(tf.cast(image, image_dtype), [*size, None]),
            tf.ensure_shape(tf.cast(label, tf.uint8), size),
            tf.ensure_shape(tf.cast(crop_seed, tf.int64), [2]),
        )

    return keep


def step_augmentation(pipeline):
    """`fn(images, labels, seeds) -> (images, labels)`: the augmentation of a batch of un-augmented crops, for
    `pipeline.augment.placement: step` (the training step augments what `build_train_dataset` yields).

    Graph-safe (a `tf.map_fn` of stateless ops over static shapes, no py_function, XLA-compatible), so it runs
    inside a compiled training step on the accelerator. Crop i gets what placement `pipeline` gives it from
    seeds[i]: bit for bit in a tf.function on the same CPU; within float rounding (~1e-5) under XLA or on a GPU.

    Args (of fn):
        images: (B, *train_crop_size, C) float16 or float32; labels: (B, *train_crop_size) int (uint8 from
            `build_train_dataset`); seeds: (B, 2) int64 (int32
            values, as `build_train_dataset` yields them).

    Returns (of fn):
        images (B, *patch_size, C) float32, labels (B, *patch_size) int32.

    Example:
    ```python
    augment = step_augmentation(config.pipeline)
    images, labels, seeds = next(iter(build_train_dataset(config)))    # placement: step
    images, labels = augment(images, labels, seeds)
    ```
    """
    p = pipeline

    def augment(image, label, crop_seed):
        # volume_crops' seeds are int32, carried as int64: a seed's dtype changes its stateless_split stream
        image = tf.cast(image, tf.float32)  # carried as stored (step_image_dtype), augmented in float32
        image, label = augment_patch(image, label, p.augment, tf.cast(crop_seed, tf.int32), patch_size=p.patch_size)
        image = tf.ensure_shape(image, [*p.patch_size, None])
        return image, tf.ensure_shape(tf.cast(label, tf.int32), p.patch_size)

    def fn(images, labels, seeds):
        signature = (
            tf.TensorSpec([*p.patch_size, images.shape[-1]], tf.float32),
            tf.TensorSpec(p.patch_size, tf.int32),
        )
        return tf.map_fn(lambda crop: augment(*crop), (images, labels, seeds), fn_output_signature=signature)

    return fn


def synthetic_train_batches(config, in_channels: int, num_classes: int, seed: int = 0) -> tf.data.Dataset:
    """An endless dataset repeating one random batch with the element spec of `build_train_dataset(config)` on one
    replica (what the GPU-fit search times the step on): `(images, labels)` of `patch_size`, float32 and int32, or
    with `augment.placement: step` the un-augmented crops (`train_crop_size`, as the records store them:
    `step_image_dtype`, float16 without a converted dataset), uint8 labels and int64 seeds, static shapes."""
    import numpy as np

    p = config.pipeline
    batch = p.num_images_per_batch * config.training.accumulation_steps
    step_augment = p.augment.placement == "step"
    size = train_crop_size(p) if step_augment else list(p.patch_size)
    rng = np.random.default_rng(seed)
    images = tf.constant(rng.standard_normal((batch, *size, in_channels), dtype=np.float32))
    labels = tf.constant(rng.integers(0, num_classes, (batch, *size), dtype=np.int32))
    if not step_augment:
        return tf.data.Dataset.from_tensors((images, labels)).repeat()
    try:
        dtype = step_image_dtype(load_index(config.data.dataset_dir))
    except (DataError, OSError):  # no converted dataset yet (a search from specs): what tfmis-convert writes
        dtype = tf.float16
    seeds = tf.constant(rng.integers(0, 2**31 - 1, (batch, 2), dtype=np.int64))
    return tf.data.Dataset.from_tensors((tf.cast(images, dtype), tf.cast(labels, tf.uint8), seeds)).repeat()


def build_val_dataset(config, split: str | None = None, cached: bool = True) -> tf.data.Dataset:
    """Whole cached volumes, one at a time: ((1, X, Y, Z, C) float32, (1, X, Y, Z) int32, metadata).

    `cached=False` reads the TFRecords without `pipeline.cache`, for a reader that stops early (a cache read in part
    is discarded, with a warning from TensorFlow)."""
    index = load_index(config.data.dataset_dir)
    split = split or config.data.val_split
    files = shard_paths(config.data.dataset_dir, split, index)
    if not files:
        raise DataError(f"{config.data.dataset_dir}: split {split!r} has no records to validate on")
    dataset = read_records(files, index, deterministic=True)
    if config.validation.max_cases:  # before the cache: a cache read only in part is discarded
        dataset = dataset.take(config.validation.max_cases)
    if cached:
        dataset = _cache(
            dataset,
            config.pipeline,
            f"val-{split}",
            {"index": index, "split": split, "max_cases": config.validation.max_cases},
        )
    dataset = dataset.map(
        as_written(lambda image, label, meta: (image_as_float32(image)[None], tf.cast(label, tf.int32)[None], meta))
    )
    return dataset.prefetch(1).with_options(pipeline_options(True))
