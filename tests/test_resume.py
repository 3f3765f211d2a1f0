"""Resuming a run: a new random stream, exactly the committed state, and one commit point per epoch."""

import numpy as np

from conftest import tiny_config
from tfmis.data.pipeline import build_train_dataset

WHOLE_VOLUMES = [  # a patch larger than every volume: each crop is its whole (padded) volume, unaugmented,
    # so a batch shows which volumes the stream visited, whatever the crop seeds are
    "pipeline.patch_size=[32,32,32]", "pipeline.num_crops_per_image=1", "pipeline.num_images_per_batch=1",
    "pipeline.augment.flip_prob=0", "pipeline.augment.rot90_prob=0", "pipeline.augment.intensity_prob=0",
    "pipeline.augment.noise_prob=0", "pipeline.shuffle_crops=1",  # no crop buffer mixing one pass into the next
]


def _volume_order(config, seed_offset, steps=6):
    import keras

    keras.utils.set_random_seed(config.training.seed)  # as the trainer does before building its pipeline
    return [float(images.sum()) for images, _ in build_train_dataset(config, seed_offset=seed_offset)
            .take(steps).as_numpy_iterator()]


def test_resumed_stream_does_not_replay_the_first_epochs_volume_order(converted_dataset, tmp_path):
    """The train stream of a run resumed at epoch 4 (seed_offset 3) visits the volumes in another order
    than epoch 1 did; the same offset gives the same order again."""
    config = tiny_config(converted_dataset, tmp_path, *WHOLE_VOLUMES)
    first = _volume_order(config, 0)
    assert len(set(first)) == 6  # six distinct training volumes, one per step
    resumed = _volume_order(config, 3)
    assert sorted(resumed) == sorted(first)  # the same six volumes, one pass...
    assert resumed != first  # ...in another order
    assert _volume_order(config, 3) == resumed
