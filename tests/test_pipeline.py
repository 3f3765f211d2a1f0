import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from conftest import tiny_config

from tfmis.config import AugmentConfig
from tfmis.data.pipeline import (
    build_train_dataset,
    build_val_dataset,
    step_augmentation,
    train_steps_per_epoch,
)
from tfmis.data.records import load_index
from tfmis.transforms.augment import augment_patch, train_crop_size, window
from tfmis.transforms.crop import crop_starts, foreground_indices, rand_crop_by_pos_neg


def blob_volume(size=40, blob=(18, 22), second_class_voxel=(30, 30, 30)):
    """A volume with one foreground cube in the middle (class 1) and a single class-2 voxel."""
    label = np.zeros((size, size, size), np.uint8)
    a, b = blob
    label[a:b, a:b, a:b] = 1
    label[second_class_voxel] = 2
    image = np.stack([label.astype(np.float32), np.ones_like(label, np.float32)], axis=-1)
    return tf.constant(image), tf.constant(label)


def crops(image, label, n_calls, patch=(8, 8, 8), pos=1.0, neg=1.0, class_ratios=None, num_samples=4):
    fg, fg_class = foreground_indices(label, num_classes=3)
    out = []
    for i in range(n_calls):
        _, labels = rand_crop_by_pos_neg(
            image, label, fg, fg_class, patch, num_samples, pos, neg, tf.constant([0, i], tf.int64), class_ratios
        )
        out.append(labels.numpy())
    return np.concatenate(out)


def test_crop_shapes_and_image_label_alignment():
    image, label = blob_volume()
    fg, fg_class = foreground_indices(label, num_classes=3)
    images, labels = rand_crop_by_pos_neg(
        image, label, fg, fg_class, (8, 12, 6), 5, 1.0, 1.0, tf.constant([1, 2], tf.int64)
    )
    assert images.shape == (5, 8, 12, 6, 2) and labels.shape == (5, 8, 12, 6)
    # channel 0 of the image is the label itself: every crop cuts both at the same place
    np.testing.assert_array_equal(images.numpy()[..., 0], labels.numpy().astype(np.float32))


@pytest.mark.parametrize(
    "pos, neg, low, high", [(1, 0, 1.0, 1.0), (0, 1, 0.0, 0.15), (1, 1, 0.45, 0.65), (3, 1, 0.68, 0.85)]
)
def test_crop_balance_follows_pos_neg_ratio(pos, neg, low, high):
    """Share of crops containing foreground ~ pos/(pos+neg) (+ the few background crops that touch it)."""
    image, label = blob_volume()
    labels = crops(image, label, n_calls=60, pos=pos, neg=neg)  # 240 crops
    with_fg = np.mean([(l > 0).any() for l in labels])
    assert low <= with_fg <= high, with_fg


def test_class_ratios_choose_the_crop_class():
    image, label = blob_volume()
    labels = crops(image, label, n_calls=20, class_ratios=[0, 0, 1])  # always centre on class 2
    assert all((l == 2).any() for l in labels)
    labels = crops(image, label, n_calls=20, class_ratios=[0, 1, 0])
    assert all((l == 1).any() for l in labels)


def test_volume_smaller_than_patch_is_padded():
    image, label = blob_volume(size=10, blob=(4, 6), second_class_voxel=(8, 8, 8))
    labels = crops(image, label, n_calls=3, patch=(16, 16, 16), pos=1, neg=1)
    assert labels.shape == (12, 16, 16, 16)
    assert all(int((l == 1).sum()) == 8 for l in labels)  # the whole 2x2x2 blob is inside every crop


def test_crops_are_a_function_of_the_seed():
    image, label = blob_volume()
    fg, fg_class = foreground_indices(label, num_classes=3)
    args = (image, label, fg, fg_class, (8, 8, 8), 4, 1.0, 1.0)
    a = rand_crop_by_pos_neg(*args, tf.constant([3, 4], tf.int64))[1].numpy()
    b = rand_crop_by_pos_neg(*args, tf.constant([3, 4], tf.int64))[1].numpy()
    c = rand_crop_by_pos_neg(*args, tf.constant([3, 5], tf.int64))[1].numpy()
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_augmentation_keeps_image_and_label_aligned():
    """Flips and quarter turns move image and label together (intensity changes off)."""
    rng = np.random.default_rng(0)
    label = rng.integers(0, 3, (12, 12, 8)).astype(np.int32)
    image = tf.constant(np.stack([label, label * 10], axis=-1).astype(np.float32))
    config = AugmentConfig(flip_prob=0.5, rot90_prob=0.9, intensity_prob=0.0, noise_std=0.0)
    changed = 0
    for i in range(12):
        out_image, out_label = augment_patch(image, tf.constant(label), config, tf.constant([i, 0], tf.int64))
        np.testing.assert_array_equal(out_image.numpy()[..., 0], out_label.numpy())
        np.testing.assert_array_equal(out_image.numpy()[..., 1], out_label.numpy() * 10)
        changed += not np.array_equal(out_label.numpy(), label)
    assert changed >= 8  # the transforms do happen


def test_intensity_augmentation_scales_and_shifts():
    image = tf.ones((4, 4, 4, 1))
    config = AugmentConfig(flip_prob=0, rot90_prob=0, intensity_prob=1.0, intensity_scale=0.1, intensity_shift=0.1)
    values = {
        float(augment_patch(image, tf.zeros((4, 4, 4), tf.int32), config, tf.constant([i, 1], tf.int64))[0][0, 0, 0, 0])
        for i in range(20)
    }
    assert len(values) == 20 and all(0.8 <= v <= 1.2 for v in values)


def test_train_pipeline_shapes_and_determinism(converted_dataset, tmp_path):
    config = tiny_config(converted_dataset, tmp_path, "pipeline.patch_size=[24,24,24]", "training.accumulation_steps=2")
    batches = list(build_train_dataset(config).take(3).as_numpy_iterator())
    for images, labels in batches:
        assert images.shape == (4, 24, 24, 24, 2) and images.dtype == np.float32  # 2 per replica x 2 accumulated
        assert labels.shape == (4, 24, 24, 24) and labels.dtype == np.int32
        assert set(np.unique(labels)) <= {0, 1, 2}
    again = list(build_train_dataset(config).take(3).as_numpy_iterator())
    for (a, b), (c, d) in zip(batches, again):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)
    other = tiny_config(
        converted_dataset,
        tmp_path,
        "pipeline.patch_size=[24,24,24]",
        "training.accumulation_steps=2",
        "training.seed=5",
    )
    assert not np.array_equal(next(build_train_dataset(other).as_numpy_iterator())[0], batches[0][0])
    # six volumes x two crops / (two per batch x two accumulated) = 3 optimizer steps per epoch
    assert (
        train_steps_per_epoch(
            tiny_config(converted_dataset, tmp_path, "training.steps_per_epoch=null", "training.accumulation_steps=2")
        )
        == 3
    )


def test_val_pipeline_gives_whole_volumes(converted_dataset, tmp_path):
    config = tiny_config(converted_dataset, tmp_path)
    index = load_index(converted_dataset)
    expected = {c["case_id"]: c["image_shape"] for c in index["cases"].values() if c["split"] == "val"}
    seen = {}
    for image, label, meta in build_val_dataset(config):
        seen[meta["case_id"].numpy().decode()] = image.shape
        assert image.shape[0] == 1 and label.shape == image.shape[:4] and image.dtype == tf.float32
    assert seen == {k: (1, *v) for k, v in expected.items()}


def dataset_copy(converted_dataset, tmp_path):
    """A private copy of the converted dataset, whose shards a test may take away."""
    copy = tmp_path / "tfrecords"
    shutil.copytree(converted_dataset, copy)
    return copy


def hide_shards(dataset_dir):
    """Renames every TFRecord shard: from now on only a cache can still provide the records."""
    dataset_dir = Path(dataset_dir)
    index = load_index(dataset_dir)
    hidden = 0
    for split in index["splits"].values():
        for shard in split["shards"]:
            path = dataset_dir / shard["file"]
            if path.exists():
                path.rename(path.with_name(path.name + ".hidden"))
                hidden += 1
    assert hidden > 0


def cache_overrides(mode, tmp_path):
    return (
        ["pipeline.cache=file", f"pipeline.cache_dir={tmp_path / 'cache'}"]
        if mode == "file"
        else [f"pipeline.cache={mode}"]
    )


def val_volumes(dataset):
    return [(meta["case_id"].numpy().decode(), image.numpy(), label.numpy()) for image, label, meta in dataset]


def assert_same_volumes(a, b):
    assert [case for case, _, _ in a] == [case for case, _, _ in b]
    for (_, image_a, label_a), (_, image_b, label_b) in zip(a, b):
        np.testing.assert_array_equal(image_a, image_b)
        np.testing.assert_array_equal(label_a, label_b)


@pytest.mark.parametrize("mode", ["memory", "file"])
def test_validation_volumes_come_from_the_cache_once_the_shards_are_gone(mode, converted_dataset, tmp_path):
    """After one full pass, a second pass needs no TFRecord file: it reads the memory or on-disk cache."""
    config = tiny_config(dataset_copy(converted_dataset, tmp_path), tmp_path, *cache_overrides(mode, tmp_path))
    dataset = build_val_dataset(config)
    first = val_volumes(dataset)
    assert len(first) == 2
    hide_shards(config.data.dataset_dir)
    assert_same_volumes(val_volumes(dataset), first)
    if mode == "file":  # a new pipeline (another run, another process) reads the files left on disk
        assert_same_volumes(val_volumes(build_val_dataset(config)), first)


def test_one_uncached_validation_case_leaves_no_partial_cache(converted_dataset, tmp_path, capfd):
    """The preview's read (`cached=False`, the first case only) writes nothing into pipeline.cache_dir and draws no
    'did not fully read the dataset being cached' warning from TensorFlow, and is the first case of the cached
    validation pipeline (whose full pass then writes its cache files)."""
    import gc

    config = tiny_config(converted_dataset, tmp_path, *cache_overrides("file", tmp_path))
    image, label, meta = next(iter(build_val_dataset(config, cached=False)))
    gc.collect()
    cache_dir = tmp_path / "cache"
    assert not cache_dir.exists() or not any(cache_dir.iterdir())
    assert "did not fully read the dataset being cached" not in capfd.readouterr().err
    first = val_volumes(build_val_dataset(config))[0]
    assert_same_volumes([(meta["case_id"].numpy().decode(), image.numpy(), label.numpy())], [first])
    assert any(cache_dir.iterdir())


def test_validation_without_cache_rereads_the_shards(converted_dataset, tmp_path):
    """The control for the test above: with `cache: none` the second pass fails on the missing shards."""
    config = tiny_config(dataset_copy(converted_dataset, tmp_path), tmp_path, "pipeline.cache=none")
    dataset = build_val_dataset(config)
    assert len(val_volumes(dataset)) == 2
    hide_shards(config.data.dataset_dir)
    with pytest.raises(tf.errors.NotFoundError):
        val_volumes(dataset)


def train_batches(iterator, n):
    return [next(iterator) for _ in range(n)]


@pytest.mark.parametrize("mode", ["memory", "file", "none"])
def test_training_stream_continues_from_the_cache_once_the_shards_are_gone(mode, converted_dataset, tmp_path):
    """Epochs after the first read the cached volumes: same batches as with the shards present; `none` fails.

    Six training volumes x two crops / two per batch = 6 batches per epoch; 30 batches need 5 more epochs.
    """
    dataset_dir = dataset_copy(converted_dataset, tmp_path)
    reference = list(
        build_train_dataset(tiny_config(dataset_dir, tmp_path, "pipeline.cache=none")).take(36).as_numpy_iterator()
    )
    config = tiny_config(dataset_dir, tmp_path, *cache_overrides(mode, tmp_path))
    stream = build_train_dataset(config).as_numpy_iterator()
    batches = train_batches(stream, 6)  # the whole first epoch: every volume has been read and cached
    hide_shards(dataset_dir)
    if mode == "none":
        with pytest.raises(tf.errors.NotFoundError):
            train_batches(stream, 30)
        return
    batches += train_batches(stream, 30)
    for (image, label), (ref_image, ref_label) in zip(batches, reference, strict=True):
        np.testing.assert_array_equal(image, ref_image)
        np.testing.assert_array_equal(label, ref_label)
    if mode == "file":
        assert len(list((tmp_path / "cache").glob("train0-*.index"))) == 1
        again = train_batches(build_train_dataset(config).as_numpy_iterator(), 12)
        for (image, _), (ref_image, _) in zip(again, reference):
            np.testing.assert_array_equal(image, ref_image)


def test_file_cache_is_not_reused_for_other_cached_settings(converted_dataset, tmp_path):
    """The cached volumes carry foreground indices: another `max_foreground_indices` must not read them."""
    dataset_dir = dataset_copy(converted_dataset, tmp_path)
    config = tiny_config(dataset_dir, tmp_path, *cache_overrides("file", tmp_path))
    train_batches(build_train_dataset(config).as_numpy_iterator(), 6)
    hide_shards(dataset_dir)
    other = tiny_config(dataset_dir, tmp_path, *cache_overrides("file", tmp_path), "pipeline.max_foreground_indices=7")
    with pytest.raises(tf.errors.NotFoundError):  # it looks for the shards instead of a stale cache
        train_batches(build_train_dataset(other).as_numpy_iterator(), 6)
    train_batches(build_train_dataset(config).as_numpy_iterator(), 6)  # the original settings still hit


# ---- spatial augmentation crops and augmentation placement (pipeline.augment.placement)


def coordinate_volume(size):
    """blob_volume's label, and an image whose channels are each voxel's (x, y, z) + 1: a crop shows where it
    came from, and 0 where it lies outside the volume."""
    image, label = blob_volume(
        size=size, blob=(size // 2 - 2, size // 2 + 2), second_class_voxel=(size - 3, size - 3, size - 3)
    )
    coords = np.stack(np.meshgrid(*[np.arange(size)] * 3, indexing="ij"), -1).astype(np.float32) + 1
    return tf.constant(coords), label


@pytest.mark.parametrize("size, class_ratios", [(40, None), (40, [0, 0, 1]), (10, None)])
def test_crop_starts_locate_rand_crop_by_pos_neg_crops_and_windows_add_context(size, class_ratios):
    """Same seed: the window at each crop start is rand_crop_by_pos_neg's crop (foreground and background
    centres, class ratios, a volume smaller than the patch), and a window with margins is one contiguous region of
    the volume around it, zeros outside."""
    image, label = coordinate_volume(size)
    fg, fg_class = foreground_indices(label, num_classes=3)
    margin = np.array([3, 4, 5])
    for i in range(6):
        seed = tf.constant([i, 11], tf.int64)
        starts = crop_starts(label, fg, fg_class, (16, 16, 16), 4, 1.0, 1.0, seed, class_ratios)
        images, labels = rand_crop_by_pos_neg(image, label, fg, fg_class, (16, 16, 16), 4, 1.0, 1.0, seed, class_ratios)
        for k in range(4):
            crop, crop_label = window(image, label, starts[k], (16, 16, 16))
            np.testing.assert_array_equal(crop.numpy(), images[k].numpy())
            np.testing.assert_array_equal(crop_label.numpy(), labels[k].numpy())
            big, big_label = window(image, label, starts[k] - margin, (22, 24, 26))
            big, big_label = big.numpy(), big_label.numpy()
            np.testing.assert_array_equal(big[3:-3, 4:-4, 5:-5], images[k].numpy())
            grid = np.stack(np.meshgrid(*[np.arange(n) for n in big.shape[:3]], indexing="ij"), -1) + (
                starts[k].numpy() - margin
            )
            inside = np.all((grid >= 0) & (grid < size), axis=-1)
            np.testing.assert_array_equal(big[inside], grid[inside] + 1)  # the volume's own voxels, in place
            np.testing.assert_array_equal(big_label[inside], label.numpy()[tuple(grid[inside].T)])
            assert not big[~inside].any() and not big_label[~inside].any()
            if size == 10:
                assert not inside.all()


SPATIAL_AUGMENT = [
    "pipeline.augment.flip_prob=0.5",
    "pipeline.augment.rot90_prob=0.5",
    "pipeline.augment.intensity_prob=0.5",
    "pipeline.augment.noise_std=0.1",
    "pipeline.augment.noise_prob=0.5",
    "pipeline.augment.rotate_prob=0.5",
    "pipeline.augment.scale_prob=0.5",
]


def test_pipeline_placement_with_rotation_and_scaling_yields_patches(converted_dataset, tmp_path):
    """Rotation and scaling on: crops are cut larger (train_crop_size) and the batches are still patch-sized,
    float32 images and int32 labels holding only the dataset's classes."""
    config = tiny_config(converted_dataset, tmp_path, *SPATIAL_AUGMENT)
    assert all(c > p for c, p in zip(train_crop_size(config.pipeline), config.pipeline.patch_size))
    for images, labels in build_train_dataset(config).take(4).as_numpy_iterator():
        assert images.shape == (2, 16, 16, 16, 2) and images.dtype == np.float32
        assert labels.shape == (2, 16, 16, 16) and labels.dtype == np.int32
        assert set(np.unique(labels)) <= {0, 1, 2}


@pytest.mark.parametrize(
    "extra",
    [
        [],
        [
            "pipeline.augment.elastic_prob=0.5",
            "pipeline.augment.elastic_sigma=[3,4]",
            "pipeline.augment.elastic_magnitude=[0,2]",
        ],
    ],
)
def test_step_placement_gives_the_pipeline_placement_batches(converted_dataset, tmp_path, extra):
    """Placement step yields (un-augmented crops of train_crop_size as the records store them (float16), uint8
    labels, (B, 2) int64 seeds) in the pipeline placement's order; step_augmentation in a tf.function (as in the
    training step) turns them into the pipeline placement's batches bit for bit (flips, quarter turns, intensity,
    noise, rotation, scaling, elastic): the same stateless draws from the same seeds and the same CPU kernels in
    the same order."""
    config = tiny_config(converted_dataset, tmp_path, *SPATIAL_AUGMENT, *extra)
    step_config = tiny_config(converted_dataset, tmp_path, *SPATIAL_AUGMENT, *extra, "pipeline.augment.placement=step")
    expected = list(build_train_dataset(config).take(6).as_numpy_iterator())  # one epoch: 6 volumes x 2 / 2
    augment = tf.function(step_augmentation(step_config.pipeline))
    size = train_crop_size(step_config.pipeline)
    changed = 0
    for (image, label), (crops, crop_labels, seeds) in zip(
        expected, build_train_dataset(step_config).take(6), strict=True
    ):
        assert crops.shape == (2, *size, 2) and crops.dtype == tf.float16  # as the records store it, exactly
        assert crop_labels.shape == (2, *size) and crop_labels.dtype == tf.uint8
        assert seeds.shape == (2, 2) and seeds.dtype == tf.int64
        out_image, out_label = augment(crops, crop_labels, seeds)
        np.testing.assert_array_equal(out_image.numpy(), image)
        np.testing.assert_array_equal(out_label.numpy(), label)
        margin = [(c - p) // 2 for c, p in zip(size, config.pipeline.patch_size)]
        centre = crops.numpy()[
            :, margin[0] : size[0] - margin[0], margin[1] : size[1] - margin[1], margin[2] : size[2] - margin[2]
        ]
        changed += sum(not np.array_equal(a, b) for a, b in zip(centre, image))
    assert changed >= 6  # the augmentation did change most of the 12 patches


@pytest.mark.slow
def test_step_augmentation_under_xla_gives_the_pipeline_placement_batches(converted_dataset, tmp_path):
    """training.jit_compile: step_augmentation compiled by XLA (static shapes, no py_function) draws the same
    augmentations from the same seeds (Philox named explicitly, floats made from its integer bits); XLA's own
    cos/sin/log and fusions move images by float rounding only (< 2e-5), labels by near-ties only (< 0.1 %)."""
    extra = [
        "pipeline.augment.elastic_prob=0.5",
        "pipeline.augment.elastic_sigma=[3,4]",
        "pipeline.augment.elastic_magnitude=[0,2]",
    ]
    config = tiny_config(converted_dataset, tmp_path, *SPATIAL_AUGMENT, *extra)
    step_config = tiny_config(converted_dataset, tmp_path, *SPATIAL_AUGMENT, *extra, "pipeline.augment.placement=step")
    expected = list(build_train_dataset(config).take(3).as_numpy_iterator())
    augment = tf.function(step_augmentation(step_config.pipeline), jit_compile=True)
    for (image, label), (crops, crop_labels, seeds) in zip(
        expected, build_train_dataset(step_config).take(3), strict=True
    ):
        out_image, out_label = augment(crops, crop_labels, seeds)
        np.testing.assert_allclose(out_image.numpy(), image, atol=2e-5)
        assert np.mean(out_label.numpy() != label) < 1e-3


# ---------------------------------------------------------------- pipeline.cache: partial (tfmis.data.smart_cache)

PARTIAL_PROBE = r'''
"""Runs in its own process: one training stream, its peak memory growth, and the case of every crop."""
import json, sys, time
args = json.loads(sys.argv[1])
sys.path.insert(0, args["tests"])
from conftest import tiny_config
import numpy as np
from tfmis.data.pipeline import build_train_dataset
from tfmis.data.records import record_dataset

def status(key):  # bytes, from the kernel's accounting of this process
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

config = tiny_config(args["dataset"], args["out"], *args["overrides"])
stream = iter(build_train_dataset(config))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident set (VmHWM) restarts here
base = status("VmRSS")
samples = []
for _ in range(args["batches"]):
    images, _ = next(stream)
    samples += [crop[..., 0].numpy().ravel()[:4] for crop in images]  # 4 voxels identify the volume
growth = status("VmHWM") - base
del stream
owners = [[] for _ in samples]  # the training volumes whose channel 0 holds all 4 values of a crop
for image, _, meta in record_dataset(args["dataset"], "train"):
    values = np.sort(image.numpy()[..., 0].astype(np.float32).ravel())
    for owner, sample in zip(owners, samples):
        at = np.minimum(np.searchsorted(values, sample), len(values) - 1)
        if np.array_equal(values[at], sample):
            owner.append(meta["case_id"].numpy().decode())
print(json.dumps({"growth": growth, "owners": owners}))
'''


@pytest.fixture(scope="module")
def partial_cache_dataset(tmp_path_factory):
    """30 cases of 128^3 x 2 channels converted to float32, uncompressed: 24 training volumes of 124^3 x 2 after the
    foreground crop, 17.2 MB each decoded (15.3 MB image + 1.9 MB label), 412 MB for the whole training split."""
    from conftest import make_msd_dataset

    from tfmis.data.conversion_options import ConversionConfig
    from tfmis.data.convert import convert

    root = tmp_path_factory.mktemp("partial")
    source = make_msd_dataset(root / "Task97_Partial", num_cases=30, shape=(128, 128, 128))
    convert(
        ConversionConfig(
            str(source),
            str(root / "tfrecords"),
            split=(0.8, 0.2),
            shards=4,
            workers=1,
            progress=False,
            compression="NONE",
            image_dtype="float32",
        )
    )
    shutil.rmtree(source)
    return root / "tfrecords"


def volume_bytes(dataset_dir, split="train"):
    """Decoded bytes of the largest volume of `split`: image (at its storage dtype) + uint8 label."""
    index = load_index(dataset_dir)
    itemsize = np.dtype(index["preprocessing"]["image_dtype"]).itemsize
    return max(
        int(np.prod(c["image_shape"])) * itemsize + int(np.prod(c["image_shape"][:3]))
        for c in index["cases"].values()
        if c["split"] == split
    )


def probe_stream(dataset_dir, out, overrides, batches):
    """`PARTIAL_PROBE` in a fresh Python process. glibc's malloc is told to return every freed block above 64 KiB
    to the system (MALLOC_MMAP_THRESHOLD_), so that the resident set counts the volumes held, not freed ones
    kept for reuse."""
    import json
    import os
    import subprocess
    import sys

    args = {
        "tests": str(Path(__file__).parent),
        "dataset": str(dataset_dir),
        "out": str(out),
        "overrides": overrides,
        "batches": batches,
    }
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run(
        [sys.executable, "-c", PARTIAL_PROBE, json.dumps(args)], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_partial_cache_size_follows_cache_num_cache_rate_and_replace_rate():
    """`partial_cache_size(pipeline, share)`: cache_num when set, else cache_rate of the share (at least 1); never
    more than the share; replace_num = ceil(replace_rate x cache_num), at least 1, 0 when the whole share fits."""
    from tfmis.config import PipelineConfig
    from tfmis.data.smart_cache import partial_cache_size

    assert partial_cache_size(PipelineConfig(cache="partial", cache_num=100, replace_rate=0.25), 400) == (100, 25)
    assert partial_cache_size(PipelineConfig(cache="partial", cache_num=100, replace_rate=0.1), 400) == (100, 10)
    assert partial_cache_size(PipelineConfig(cache="partial", cache_num=4, replace_rate=0.2), 24) == (4, 1)
    assert partial_cache_size(PipelineConfig(cache="partial", cache_rate=0.25, replace_rate=0.2), 500) == (125, 25)
    assert partial_cache_size(PipelineConfig(cache="partial", cache_rate=0.01), 50) == (1, 1)
    assert partial_cache_size(PipelineConfig(cache="partial", cache_num=30, replace_rate=0.5), 24) == (24, 0)
    assert partial_cache_size(PipelineConfig(cache="partial", cache_num=20, replace_rate=0.5), 24) == (20, 4)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "pipeline.cache_num=0",
            r"pipeline.cache_num must be >= 1 volume \(or null to use pipeline.cache_rate\), got 0",
        ),
        ("pipeline.cache_rate=0", r"pipeline.cache_rate must be in \(0, 1\]"),
        ("pipeline.cache_rate=1.5", r"pipeline.cache_rate must be in \(0, 1\]"),
        ("pipeline.replace_rate=0", r"pipeline.replace_rate must be in \(0, 1\]"),
        ("pipeline.replace_rate=2", r"pipeline.replace_rate must be in \(0, 1\]"),
    ],
)
def test_partial_cache_settings_out_of_range_name_the_key(override, message):
    from tfmis.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, ["pipeline.cache=partial", override])


def test_cache_num_without_partial_cache_is_refused_with_the_fix():
    """A bound given for another cache mode would be silently ignored (and the whole split cached): refused."""
    from tfmis.config import ConfigError, load_config

    with pytest.raises(
        ConfigError,
        match=r"pipeline.cache_num=8 only bounds pipeline.cache=partial, but "
        r"pipeline.cache is 'memory': set pipeline.cache=partial",
    ):
        load_config(None, ["pipeline.cache_num=8"])
    assert load_config(None, ["pipeline.cache=partial", "pipeline.cache_num=8"]).pipeline.cache_num == 8


def test_smart_cache_cycles_are_sliding_windows_of_the_record_stream(converted_dataset):
    """`smart_cache` over the real TFRecords (the partial cache's reader, shard order reshuffled per pass): cycle k
    holds exactly the records k..k+2 of the stream (cache_num 3, replace_num 1), in a shuffled order; every training
    case is in the cache within 4 cycles; the stream is reproducible."""
    from tfmis.data.pipeline import read_records
    from tfmis.data.records import shard_paths
    from tfmis.data.smart_cache import smart_cache

    index = load_index(converted_dataset)
    files = shard_paths(converted_dataset, "train", index)

    def volumes():
        return read_records(files, index, True, None, "train", refill_seed=3).map(
            lambda image, label, meta: meta["case_id"]
        )

    def case_ids(dataset, n):
        return [c.decode() for c in dataset.take(n).as_numpy_iterator()]

    cycles = 12
    cached = case_ids(smart_cache(volumes(), 3, 1, seed=5), 3 * cycles)
    stream = case_ids(volumes().repeat(), 36)
    train = set(index["splits"]["train"]["cases"])
    passes = {tuple(stream[i : i + 6]) for i in range(0, 36, 6)}
    assert len(train) == 6 and all(set(p) == train for p in passes)  # one pass = every case once
    assert len(passes) > 1  # later passes read the shards in another order
    for k in range(cycles):
        assert sorted(cached[3 * k : 3 * k + 3]) == sorted(stream[k : k + 3]), k
    assert set(cached[:12]) == train
    assert sum(cached[3 * k : 3 * k + 3] != stream[k : k + 3] for k in range(cycles)) >= cycles // 3  # shuffled
    assert case_ids(smart_cache(volumes(), 3, 1, seed=5), 3 * cycles) == cached


@pytest.mark.slow
def test_partial_cache_holds_at_most_its_bound_of_volumes_and_sees_every_case(partial_cache_dataset, tmp_path):
    """The training stream of `pipeline.cache: partial` (cache_num 4, replace_rate 0.2: 1 volume replaced per cycle
    of 4) on 24 training volumes of 17.2 MB, each run in its own process, every crop traced back to its volume:

    - any 3 consecutive cycles (4 volumes x 2 crops each) draw from at most 4 + 2 x 1 volumes, and all 24 volumes
      come through the cache over 90 batches (22 cycles);
    - the process's peak resident memory grows by less than `partial_cache_bound` volumes (cache_num + replace_num
      + the few in flight), while the same stream with `cache: memory` grows by more than the whole split (the
      control: the measurement sees cached volumes)."""
    from tfmis.data.smart_cache import partial_cache_bound

    common = ["pipeline.patch_size=[32,32,32]", "pipeline.shuffle_crops=1", "pipeline.augment.intensity_prob=0"]
    batches, crops_per_cycle = 90, 4 * 2
    volume = volume_bytes(partial_cache_dataset)
    partial = probe_stream(
        partial_cache_dataset, tmp_path, [*common, "pipeline.cache=partial", "pipeline.cache_num=4"], batches
    )
    memory = probe_stream(partial_cache_dataset, tmp_path, [*common, "pipeline.cache=memory"], batches)

    windows = {}
    for name, run in (("partial", partial), ("memory", memory)):
        assert all(len(owner) == 1 for owner in run["owners"])  # every crop comes from exactly one volume
        cases = [owner[0] for owner in run["owners"]]
        windows[name] = [
            len(set(cases[i : i + 3 * crops_per_cycle]))
            for i in range(0, len(cases) - 3 * crops_per_cycle + 1, crops_per_cycle)
        ]
        if name == "partial":
            assert len(set(cases)) == 24
    assert max(windows["partial"]) <= 4 + 2 * 1, windows["partial"]
    assert max(windows["memory"]) > 4 + 2 * 1  # the observable tells a full cache from the partial one

    bound = partial_cache_bound(4, 1) * volume
    assert partial["growth"] < bound, (partial["growth"] / 2**20, bound / 2**20)
    assert memory["growth"] > 24 * volume > bound, (memory["growth"] / 2**20, 24 * volume / 2**20)


@pytest.mark.slow
def test_training_with_partial_cache_on_data_larger_than_the_cache_trains_every_epoch(partial_cache_dataset, tmp_path):
    """A real `Trainer.fit()` (U-Net 8-16-32, 4 crops of 32^3 per step, one volume per step) with
    `pipeline.cache: partial`, cache_num 4 of the 24 training volumes (replace_rate 0.2: one new volume read from the
    TFRecords every 4 steps, so 12 steps replace volumes 3 times): both epochs train, with finite losses, and
    history.jsonl reports each epoch's input-wait share as data_wait / (data_wait + compute), between 0 and 1.

    How small that share is (under 5 % after the first epoch on an idle machine) is a timing claim that a busy
    2-core CI box cannot check: `python benchmarks/partial_cache.py` measures and prints it, next to `memory`."""
    import json
    import math

    from tfmis.engine.trainer import Trainer

    config = tiny_config(
        partial_cache_dataset,
        tmp_path / "run",
        "model.filters=[8,16,32]",
        "model.strides=[1,2,2]",
        "pipeline.patch_size=[32,32,32]",
        "pipeline.num_images_per_batch=4",
        "pipeline.num_crops_per_image=4",
        "pipeline.deterministic=false",
        "pipeline.cache=partial",
        "pipeline.cache_num=4",
        "training.epochs=2",
        "training.steps_per_epoch=12",
        "validation.val_interval=100",
        "validation.max_cases=1",
        "validation.overlap=0",
        "validation.roi_size=[64,64,64]",
    )
    Trainer(config).fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]
    for r in records:
        assert math.isfinite(r["train_loss"]), r
        wait, compute = r["data_wait_seconds"], r["compute_seconds"]
        assert 0 <= r["data_wait_fraction"] <= 1 and compute > 0
        assert r["data_wait_fraction"] == pytest.approx(wait / (wait + compute)), r


@pytest.mark.parametrize("workers", [2, 3])
def test_partial_cache_of_each_worker_holds_only_its_own_share(converted_dataset, tmp_path, workers):
    """Under N input pipelines (2 workers: one shard each, file-level sharding; 3 workers for 2 shards: every 3rd
    case, data-level), each pipeline's partial cache sizes itself on its own share and cycles only through its own
    cases; together the workers cover the 6 training cases once; `build_train_dataset` streams batches for each."""
    from tfmis.data.pipeline import input_shard, read_records
    from tfmis.data.records import shard_paths
    from tfmis.data.smart_cache import share_size, smart_cache

    index = load_index(converted_dataset)
    files = shard_paths(converted_dataset, "train", index)
    config = tiny_config(converted_dataset, tmp_path, "pipeline.cache=partial", "pipeline.cache_num=1")
    seen = []
    for i in range(workers):
        context = tf.distribute.InputContext(num_input_pipelines=workers, input_pipeline_id=i)
        shard = input_shard(files, index["splits"]["train"]["cases"], context)
        assert shard["level"] == ("file" if workers == 2 else "data")
        share = share_size(index, "train", shard)
        volumes = read_records(files, index, True, context, "train", refill_seed=0).map(
            lambda image, label, meta: meta["case_id"]
        )
        cases = {c.decode() for c in smart_cache(volumes, 1, 1, seed=0).take(4 * share).as_numpy_iterator()}
        assert len(cases) == share == 6 // workers
        seen += sorted(cases)
        images, labels = next(iter(build_train_dataset(config, context)))
        assert images.shape == (2, 16, 16, 16, 2) and labels.shape == (2, 16, 16, 16)
    assert sorted(seen) == sorted(index["splits"]["train"]["cases"])


def test_input_bound_diagnosis_names_the_partial_cache_fix(converted_dataset, tmp_path):
    """With `cache: partial`, an input-bound run is blamed on the cache refills, with the settings that fix it."""
    from tfmis.engine.callbacks import input_bound_diagnosis

    records = [{"epoch": e, "data_wait_seconds": 3.0, "compute_seconds": 7.0} for e in (1, 2, 3)]
    config = tiny_config(converted_dataset, tmp_path, "pipeline.cache=partial", "pipeline.replace_rate=0.3")
    found = input_bound_diagnosis(config, records)
    assert found["data_wait_fraction"] == pytest.approx(0.3) and found["epochs"] == [2, 3]
    assert "pipeline.cache is partial" in found["cause"] and "replace_rate=0.3" in found["cause"]
    assert "lower pipeline.replace_rate" in found["fix"] and "pipeline.cache_num" in found["fix"]


def test_validation_under_partial_cache_reads_the_shards_each_time(converted_dataset, tmp_path):
    """`cache: partial` bounds the training volumes; the validation volumes are not cached at all (no memory): a
    second validation pass reads the shards again and fails once they are gone."""
    config = tiny_config(dataset_copy(converted_dataset, tmp_path), tmp_path, "pipeline.cache=partial")
    dataset = build_val_dataset(config)
    assert len(val_volumes(dataset)) == 2
    hide_shards(config.data.dataset_dir)
    with pytest.raises(tf.errors.NotFoundError):
        val_volumes(dataset)
