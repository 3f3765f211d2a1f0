"""The regular input pipeline: NIfTI files decoded and preprocessed on every read, nothing cached.

This is the baseline arm of `tfmis-benchmark` (MONAI's fast-training notebook, in TensorFlow): a
typical first TensorFlow implementation reads each training volume from the MSD source folder every
time it is used, in Python (`tf.py_function`), one at a time, and runs the whole preprocessing chain
on it again:

```
case ids ─shuffle─▶ repeat ─▶ read NIfTI + reorient + crop + resample + normalise (tf.py_function, serial)
         ─▶ foreground indices ─▶ N balanced crops ─▶ augment ─▶ shuffle crops ─▶ batch
```
(no cache, no parallel map, no explicit prefetch: only the prefetch tf.data injects by default after `batch`).

It uses the project's own functions for every step, so it sees the same voxels as the fast pipeline
(`tfmis.data.pipeline.build_train_dataset`): `tfmis.data.sources.cases.load_case` and
`tfmis.data.preprocess.preprocess` with the parameters recorded in the converted dataset's
`index.json` (spacing, normalisation, crop), kept in float32 where the TFRecords store float16, and
the same `foreground_indices` and the fast pipeline's own `volume_crops` and `patch_augmentation`
with the same seeds. The cases are the converted dataset's training split, visited in the fast
pipeline's volume order, so with `pipeline.deterministic: true` both streams hold the same patches
(up to float16 rounding).

Example:
```python
from tfmis.data.regular import build_regular_train_dataset, RegularSource
dataset = build_regular_train_dataset(config)       # same signature and element spec as build_train_dataset
trainer = Trainer(config, train_dataset_fn=build_regular_train_dataset)
image, label = RegularSource.from_config(config).load("case_003")   # one case, numpy, as the pipeline reads it
```
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np
import tensorflow as tf

from tfmis.data.pipeline import as_written, patch_augmentation, volume_crops, volume_order, with_channel_count
from tfmis.data.preprocess import PreprocessConfig, preprocess
from tfmis.data.records import load_index
from tfmis.data.sources.cases import load_case
from tfmis.data.sources.layouts import open_dataset
from tfmis.errors import ConfigError, DataError, MissingInput
from tfmis.transforms.crop import foreground_indices


class RegularSource:
    """The MSD source folder of a converted dataset, read and preprocessed case by case.

    Args:
        source_dir: the MSD folder (holding dataset.json) that was converted into `dataset_dir`.
        dataset_dir: the converted dataset: its `index.json` gives the preprocessing parameters.
        image_dtype: dtype of the preprocessed image (`float32`: no float16 rounding).

    Raises:
        FileNotFoundError: no dataset.json in `source_dir`.
        ValueError: `source_dir` is not the folder `dataset_dir` was converted from (its dataset.json differs).

    Example:
    ```python
    source = RegularSource("data/demo/Task00_DemoBrain", "data/demo/tfrecords")
    image, label = source.load("demo_003")    # (x, y, z, C) float32, (x, y, z) uint8
    ```
    """

    def __init__(self, source_dir: str | Path, dataset_dir: str | Path, image_dtype: str = "float32"):
        self.index = load_index(dataset_dir)
        self.dataset_dir = Path(dataset_dir)
        source = Path(source_dir)
        if not (source / "dataset.json").is_file():
            raise MissingInput(
                f"{source / 'dataset.json'}: not found; the regular pipeline reads the MSD folder "
                f"that {dataset_dir} was converted from: set data.source_dir to it"
            )
        digest = hashlib.sha256((source / "dataset.json").read_bytes()).hexdigest()
        expected = self.index["source"].get("dataset_json_sha256")
        if expected and digest != expected:
            raise DataError(
                f"{source / 'dataset.json'} differs from the one converted into {dataset_dir} "
                f"(converted from {self.index['source']['dir']}): set data.source_dir to that folder, "
                "or convert this one again"
            )
        self.dataset = open_dataset(source)
        self.cases = {c.case_id: c for c in self.dataset.training}
        prep = PreprocessConfig.from_dict(self.index["preprocessing"])
        self.preprocessing = dataclasses.replace(prep, image_dtype=image_dtype)

    @classmethod
    def from_config(cls, config, image_dtype: str = "float32") -> RegularSource:
        """From a training config: `data.source_dir`, or else the folder `data.dataset_dir` was converted from."""
        index = load_index(config.data.dataset_dir)
        return cls(config.data.source_dir or index["source"]["dir"], config.data.dataset_dir, image_dtype)

    def load(self, case_id: str) -> tuple[np.ndarray, np.ndarray]:
        """Reads one training case's NIfTI files and preprocesses them as the conversion did.

        Returns:
            image (x, y, z, C) in `image_dtype`, label (x, y, z) uint8.
        """
        if case_id not in self.cases:
            raise DataError(f"case {case_id!r} is not in the 'training' list of {self.dataset.root / 'dataset.json'}")
        loaded = load_case(self.cases[case_id], self.dataset)
        image, label, _ = preprocess(loaded.image, loaded.label, loaded.affine, self.preprocessing)
        return image, label


def build_regular_train_dataset(
    config, input_context: tf.distribute.InputContext | None = None, seed_offset: int = 0
) -> tf.data.Dataset:
    """The regular training stream: each volume read from NIfTI and preprocessed again on every use.

    Same signature, element spec and random draws as `tfmis.data.pipeline.build_train_dataset`
    (a drop-in `Trainer(train_dataset_fn=...)`), but with the work a first implementation does: a
    serial `tf.py_function` decodes, reorients, crops, resamples and normalises every volume it reads,
    and nothing is cached, run in parallel or explicitly prefetched (`pipeline.cache` is ignored). The only
    overlap with training is the one tf.data adds to any pipeline by default: an autotuned prefetch after the
    final batch (`tf.data.Options().experimental_optimization.inject_prefetch`), as a first implementation gets.

    Args:
        config: the training `Config` (`data.source_dir`, else the folder recorded in the converted
            dataset's index, is read; `data.dataset_dir` gives the split and the preprocessing).
        input_context: from `distribute_datasets_from_function` (cases are shared out as the fast
            pipeline shares them).
        seed_offset: shifts the random stream (a resumed run passes its start epoch).

    Returns:
        ((B, px, py, pz, C) float32, (B, px, py, pz) int32) batches, B = per-replica batch × accumulation.
    """
    p, seed = config.pipeline, config.training.seed
    source = RegularSource.from_config(config)
    index = source.index
    num_classes = len(index["source"]["labels"])
    channels = len(index["source"]["modalities"])
    if p.augment.rot90_prob > 0 and p.patch_size[0] != p.patch_size[1]:
        raise ConfigError(f"pipeline.augment.rot90_prob > 0 needs a square in-plane patch, got {p.patch_size}")
    if p.class_ratios is not None and len(p.class_ratios) != num_classes:
        raise ConfigError(f"pipeline.class_ratios has {len(p.class_ratios)} entries for {num_classes} classes")
    order = volume_order(index, config.data.dataset_dir, config.data.train_split, input_context)
    if not order:
        raise DataError(f"{config.data.dataset_dir}: split {config.data.train_split!r} has no records")
    missing = [c for c in order if c not in source.cases]
    if missing:
        raise DataError(
            f"{source.dataset.root / 'dataset.json'} lists no training case {missing[:3]} of split "
            f"{config.data.train_split!r} of {config.data.dataset_dir}: set data.source_dir to the "
            "folder that was converted"
        )
    case_ids = tf.constant(order)

    def read(case_id):
        image, label = source.load(case_id.numpy().decode())
        return image, label

    def load(position, i):
        image, label = tf.py_function(read, [tf.gather(case_ids, i)], [tf.float32, tf.uint8])
        image.set_shape([None, None, None, channels])
        label.set_shape([None, None, None])
        return position, image, label

    pipeline_id = input_context.input_pipeline_id if input_context else 0
    stream_seed = seed + 7919 * seed_offset  # as the fast pipeline: same volume order, same crops
    dataset = tf.data.Dataset.range(len(order))
    dataset = dataset.shuffle(p.shuffle_volumes, seed=stream_seed, reshuffle_each_iteration=True).repeat()
    dataset = dataset.enumerate().map(as_written(load))  # serial: one volume decoded at a time

    crop = volume_crops(p, stream_seed, pipeline_id)  # the fast pipeline's crops and augmentation

    def crops(position, image, label):
        fg, fg_class = foreground_indices(label, num_classes, p.max_foreground_indices, seed)
        return crop(position, image, label, fg, fg_class)

    dataset = dataset.flat_map(as_written(crops)).map(as_written(patch_augmentation(p)))
    if p.shuffle_crops > 1:
        dataset = dataset.shuffle(p.shuffle_crops, seed=stream_seed + 1)
    return with_channel_count(
        dataset.batch(p.num_images_per_batch * config.training.accumulation_steps, drop_remainder=True), channels
    )
