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

Example:
```python
dataset = build_train_dataset(config)          # ((B, px, py, pz, C) float32, (B, px, py, pz) int32)
val = build_val_dataset(config)                # (1, X, Y, Z, C), (1, X, Y, Z), metadata
```
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import tensorflow as tf

from tfmis.data.records import load_index, parse_example, shard_paths
from tfmis.transforms.augment import augment_patch
from tfmis.transforms.crop import foreground_indices, rand_crop_by_pos_neg


def _cache(dataset: tf.data.Dataset, pipeline, name: str, fingerprint: dict) -> tf.data.Dataset:
    """Caches the deterministic part of a pipeline as `pipeline.cache` (memory, file, none) says.

    `file` writes `<pipeline.cache_dir>/<name>-<hash>.*`. The hash covers `fingerprint`: the dataset's
    index.json and every setting that changes the cached elements, so a reconverted dataset or
    another setting writes a new cache instead of silently reading a stale one.
    """
    if pipeline.cache == "none":
        return dataset
    if pipeline.cache == "memory":
        return dataset.cache()
    if pipeline.cache != "file" or not pipeline.cache_dir:
        raise ValueError(f"pipeline.cache must be memory, none or file (with pipeline.cache_dir), got "
                         f"{pipeline.cache!r} (cache_dir {pipeline.cache_dir!r})")
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
        raise ValueError(f"{len(cases)} case(s) cannot be shared by {n} input pipelines (workers): every worker "
                         "needs at least one; use fewer workers or more cases")
    return {"level": "data", "files": list(files), "cases": sorted(cases)[i::n]}


def _read(files, index, deterministic: bool, input_context=None, split: str | None = None) -> tf.data.Dataset:
    compression = index["preprocessing"]["compression"]
    dtype = index["preprocessing"]["image_dtype"]
    shard = input_shard(files, index["splits"][split]["cases"] if split else [], input_context)
    files = shard["files"]
    dataset = tf.data.Dataset.from_tensor_slices(files).interleave(
        lambda f: tf.data.TFRecordDataset(f, compression_type="" if compression == "NONE" else compression),
        cycle_length=min(len(files), 8), num_parallel_calls=tf.data.AUTOTUNE, deterministic=deterministic)
    if shard["cases"] is not None:
        mine = tf.constant(shard["cases"])

        def is_mine(serialized):
            case_id = tf.io.parse_single_example(serialized, {"case_id": tf.io.FixedLenFeature([], tf.string)})
            return tf.reduce_any(tf.equal(case_id["case_id"], mine))

        dataset = dataset.filter(is_mine)
    return dataset.map(lambda s: parse_example(s, dtype), num_parallel_calls=tf.data.AUTOTUNE,
                       deterministic=deterministic)


def train_steps_per_epoch(config, num_replicas: int = 1) -> int:
    """Optimizer steps per epoch: every training volume yields `num_crops_per_image` crops once."""
    if config.training.steps_per_epoch:
        return config.training.steps_per_epoch
    index = load_index(config.data.dataset_dir)
    volumes = index["splits"][config.data.train_split]["num_records"]
    global_batch = config.pipeline.num_images_per_batch * num_replicas * config.training.accumulation_steps
    return max(1, math.ceil(volumes * config.pipeline.num_crops_per_image / global_batch))


def build_train_dataset(config, input_context: tf.distribute.InputContext | None = None,
                        seed_offset: int = 0) -> tf.data.Dataset:
    """The infinite training stream of augmented patch batches (batch = per replica × accumulation).

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
        raise ValueError(f"{config.data.dataset_dir}: split {config.data.train_split!r} has no records")
    if p.augment.rot90_prob > 0 and p.patch_size[0] != p.patch_size[1]:
        raise ValueError(f"pipeline.augment.rot90_prob > 0 needs a square in-plane patch, got {p.patch_size}")
    if p.class_ratios is not None and len(p.class_ratios) != num_classes:
        raise ValueError(f"pipeline.class_ratios has {len(p.class_ratios)} entries for {num_classes} classes")

    def with_foreground(image, label, meta):
        fg, fg_class = foreground_indices(label, num_classes, p.max_foreground_indices, seed)
        return image, label, fg, fg_class

    dataset = _read(files, index, p.deterministic, input_context, config.data.train_split)
    dataset = dataset.map(with_foreground, num_parallel_calls=tf.data.AUTOTUNE, deterministic=p.deterministic)
    pipeline_id = input_context.input_pipeline_id if input_context else 0
    dataset = _cache(dataset, p, f"train{pipeline_id}", {
        "index": index, "split": config.data.train_split, "seed": seed, "deterministic": p.deterministic,
        "max_foreground_indices": p.max_foreground_indices,
        "input_pipelines": input_context.num_input_pipelines if input_context else 1})
    # a resumed run (seed_offset = epochs done) draws a new volume order and new crops, not epoch 1's again
    stream_seed = seed + 7919 * seed_offset
    dataset = dataset.shuffle(p.shuffle_volumes, seed=stream_seed, reshuffle_each_iteration=True).repeat()
    # per-element seeds: (training seed, position in the stream), independent of thread scheduling
    dataset = dataset.enumerate()

    crop = volume_crops(p, stream_seed, pipeline_id)

    def crops(position, element):
        image, label, fg, fg_class = element
        return crop(position, tf.cast(image, tf.float32), label, fg, fg_class)

    augment = patch_augmentation(p)
    dataset = dataset.flat_map(crops) if p.deterministic else dataset.interleave(
        crops, cycle_length=2, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    dataset = dataset.map(augment, num_parallel_calls=tf.data.AUTOTUNE, deterministic=p.deterministic)
    if p.shuffle_crops > 1:
        dataset = dataset.shuffle(p.shuffle_crops, seed=stream_seed + 1)
    batch = p.num_images_per_batch * config.training.accumulation_steps
    dataset = dataset.batch(batch, drop_remainder=True)
    options = tf.data.Options()
    options.deterministic = p.deterministic
    return dataset.prefetch(tf.data.AUTOTUNE).with_options(options)


def volume_crops(pipeline, stream_seed: int, pipeline_id: int):
    """`fn(position, image, label, fg, fg_class)`: the dataset of one volume's `num_crops_per_image` patches
    with their augmentation seeds, all drawn from (stream seed, pipeline, position in the stream), so any
    pipeline that feeds the same volumes in the same order gets the same patches."""
    p = pipeline

    def crops(position, image, label, fg, fg_class):
        element_seed = tf.stack([tf.constant(stream_seed + 1000 * pipeline_id, tf.int64), position])
        images, labels = rand_crop_by_pos_neg(image, label, fg, fg_class, p.patch_size, p.num_crops_per_image,
                                              p.pos_neg_ratio[0], p.pos_neg_ratio[1], element_seed, p.class_ratios)
        seeds = tf.random.experimental.stateless_split(tf.random.experimental.stateless_fold_in(element_seed, 1),
                                                       p.num_crops_per_image)
        return tf.data.Dataset.from_tensor_slices((images, labels, seeds))

    return crops


def patch_augmentation(pipeline):
    """`fn(image, label, crop_seed)`: one patch augmented as `pipeline.augment` says, shapes fixed, label int32."""
    p = pipeline

    def augment(image, label, crop_seed):
        image, label = augment_patch(image, label, p.augment, crop_seed)
        image = tf.ensure_shape(image, [*p.patch_size, None])
        return image, tf.ensure_shape(tf.cast(label, tf.int32), p.patch_size)

    return augment


def build_val_dataset(config, split: str | None = None) -> tf.data.Dataset:
    """Whole cached volumes, one at a time: ((1, X, Y, Z, C) float32, (1, X, Y, Z) int32, metadata)."""
    index = load_index(config.data.dataset_dir)
    split = split or config.data.val_split
    files = shard_paths(config.data.dataset_dir, split, index)
    if not files:
        raise ValueError(f"{config.data.dataset_dir}: split {split!r} has no records to validate on")
    dataset = _read(files, index, deterministic=True)
    if config.validation.max_cases:  # before the cache: a cache read only in part is discarded
        dataset = dataset.take(config.validation.max_cases)
    dataset = _cache(dataset, config.pipeline, f"val-{split}",
                     {"index": index, "split": split, "max_cases": config.validation.max_cases})
    dataset = dataset.map(lambda image, label, meta: (tf.cast(image, tf.float32)[None], tf.cast(label, tf.int32)[None],
                                                      meta))
    return dataset.prefetch(1)
