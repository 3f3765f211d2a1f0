"""Region-based training (`model.output: regions`, nnU-Net's BraTS setting): the loss against Dice + BCE written out
per region, nnU-Net's painting order, the config's errors, and a real training run that validates and predicts
label maps.

BraTS-like labels (MSD Task01): 1 edema, 2 non-enhancing core, 3 enhancing; regions whole tumour {1, 2, 3}, tumour
core {2, 3}, enhancing {3}, painted WT→1, TC→2, ET→3.
"""

import csv
import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import tensorflow as tf
from conftest import tiny_config
from scipy import special

from tfmis.config import ConfigError, load_config, region_paint_labels
from tfmis.data.pipeline import build_val_dataset
from tfmis.engine.trainer import Trainer
from tfmis.inference.inputs import collect_inputs
from tfmis.inference.predictor import Predictor
from tfmis.inference.restore import paint_regions, restore_labels, sigmoid_in_place
from tfmis.losses import DeepSupervisionLoss, DiceCELoss, DiceFocalLoss, DiceLoss, build_loss
from tfmis.losses.dice import region_membership
from tfmis.predict import main as predict_main
from tfmis.task import SegmentationTask

BRATS = {"whole_tumour": [1, 2, 3], "tumour_core": [2, 3], "enhancing_tumour": [3]}
BRATS_SET = "validation.regions={whole_tumour: [1, 2, 3], tumour_core: [2, 3], enhancing_tumour: [3]}"
REGIONS_ON = ["model.output=regions", "loss.activation=sigmoid"]
BRATS_INFO = {"source": {"modalities": ["FLAIR", "T1w", "T1gd", "T2w"], "labels": ["bg", "ed", "ncr", "et"]}}

# Two samples of 2x2x1 voxels; labels 0..3 and region probabilities (WT, TC, ET) per voxel
LABELS = [[0, 1, 2, 3], [3, 3, 1, 0]]
PROBABILITIES = [
    [[0.2, 0.1, 0.1], [0.8, 0.3, 0.2], [0.7, 0.6, 0.3], [0.9, 0.8, 0.7]],
    [[0.6, 0.5, 0.4], [0.95, 0.9, 0.85], [0.4, 0.2, 0.1], [0.1, 0.3, 0.05]],
]


def as_tensors(labels=LABELS, probabilities=PROBABILITIES):
    p = np.array(probabilities, np.float64)
    logits = np.log(p / (1 - p)).reshape(len(labels), 2, 2, 1, -1)
    return tf.constant(np.array(labels).reshape(len(labels), 2, 2, 1), tf.uint8), tf.constant(logits, tf.float32)


def dice_bce_written_out(labels, probabilities, regions, smooth=1e-5, batch=False):
    """nnU-Net's region loss on the example, one region and one sample at a time: 1 - soft Dice (per sample, or
    over the batch) averaged over regions (every region counts), plus binary cross-entropy averaged over every
    sample, voxel and region."""
    labels, p = np.array(labels), np.array(probabilities, np.float64)  # (B, V), (B, V, R)
    dice_terms, bce_terms = [], []
    for r, region in enumerate(regions.values()):
        g = np.isin(labels, region).astype(np.float64)
        groups = [(g, p[..., r])] if batch else [(g[b], p[b, :, r]) for b in range(len(labels))]
        for gb, pb in groups:
            dice_terms.append(1 - (2 * np.sum(pb * gb) + smooth) / (np.sum(pb) + np.sum(gb) + smooth))
        bce_terms.extend((-(g * np.log(p[..., r]) + (1 - g) * np.log(1 - p[..., r]))).ravel())
    return np.mean(dice_terms), np.mean(bce_terms)


# ---------------------------------------------------------------- the loss


def test_region_loss_is_dice_plus_bce_per_region_written_out():
    labels, logits = as_tensors()
    dice, bce = dice_bce_written_out(LABELS, PROBABILITIES, BRATS)
    regions = list(BRATS.values())
    loss = DiceCELoss(activation="sigmoid", regions=regions)
    assert float(loss(labels, logits)) == pytest.approx(dice + bce, rel=1e-5)
    # the Dice term alone; include_background does not apply (channel 0 is the whole tumour, not background)
    for include_background in (False, True):
        only_dice = DiceLoss(activation="sigmoid", regions=regions, include_background=include_background)
        assert float(only_dice(labels, logits)) == pytest.approx(dice, rel=1e-5)
    weighted = DiceCELoss(activation="sigmoid", regions=regions, lambda_dice=0.3, lambda_ce=2.0, batch=True)
    batch_dice, _ = dice_bce_written_out(LABELS, PROBABILITIES, BRATS, batch=True)
    assert float(weighted(labels, logits)) == pytest.approx(0.3 * batch_dice + 2.0 * bce, rel=1e-5)
    # the focal term at gamma 0 is the same binary cross-entropy
    focal = DiceFocalLoss(activation="sigmoid", regions=regions, gamma=0.0)
    assert float(focal(labels, logits)) == pytest.approx(dice + bce, rel=1e-5)


def test_region_targets_come_from_the_membership_table():
    assert region_membership(list(BRATS.values())) == [
        [0.0, 0.0, 0.0],  # background: in no region
        [1.0, 0.0, 0.0],  # edema: whole tumour only
        [1.0, 1.0, 0.0],  # non-enhancing core: whole tumour and core
        [1.0, 1.0, 1.0],  # enhancing: all three
        [0.0, 0.0, 0.0],  # any label above the regions' (none in a checked config)
    ]
    # with a label in no region, the loss equals the one where that label is background
    labels, logits = as_tensors([[0, 1, 2, 7], [3, 3, 1, 0]])
    background, _ = as_tensors([[0, 1, 2, 0], [3, 3, 1, 0]])
    loss = build_loss("dice_ce", activation="sigmoid", regions=list(BRATS.values()))
    assert float(loss(labels, logits)) == pytest.approx(float(loss(background, logits)), rel=1e-6)


def test_region_loss_under_deep_supervision_subsamples_the_labels_then_builds_targets():
    rng = np.random.default_rng(0)
    labels = tf.constant(rng.integers(0, 4, (1, 8, 8, 8)), tf.uint8)
    outputs = [tf.constant(rng.normal(size=(1, 8 // f, 8 // f, 8 // f, 3)), tf.float32) for f in (1, 2)]
    inner = DiceCELoss(activation="sigmoid", regions=list(BRATS.values()))
    loss = DeepSupervisionLoss(inner, factors=[(2, 2, 2)])
    expected = (2 / 3) * float(inner(labels, outputs[0])) + (1 / 3) * float(
        inner(labels[:, 1::2, 1::2, 1::2], outputs[1])
    )
    assert float(loss(labels, outputs)) == pytest.approx(expected, rel=1e-5)


def test_region_loss_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="activation='sigmoid'"):
        DiceCELoss(regions=[[1, 2], [2]])  # softmax over overlapping regions
    with pytest.raises(ValueError, match="2 regions but the logits have 3 channels"):
        DiceCELoss(activation="sigmoid", regions=[[1, 2], [2]])(*as_tensors())
    with pytest.raises(ValueError, match="sigmoid form"):
        DiceFocalLoss(activation="sigmoid", regions=[[1]], focal_use_softmax=True)


# ---------------------------------------------------------------- painting


def nnunet_paint(probabilities, paint_labels):
    """nnU-Net's `convert_probabilities_to_segmentation` for regions, written out voxel by voxel: background, then
    each region in `regions_class_order` overwrites with its label where its probability is above 0.5."""
    flat = probabilities.reshape(-1, probabilities.shape[-1])
    out = np.zeros(len(flat), np.uint8)
    for v, voxel in enumerate(flat):
        for channel, label in enumerate(paint_labels):
            if voxel[channel] > 0.5:
                out[v] = label
    return out.reshape(probabilities.shape[:-1])


def test_painting_follows_nnunets_regions_class_order():
    assert region_paint_labels(BRATS) == [1, 2, 3]  # WT→1, TC→2, ET→3
    probabilities = np.random.default_rng(1).uniform(size=(6, 5, 4, 3)).astype(np.float32)
    expected = nnunet_paint(probabilities, [1, 2, 3])
    np.testing.assert_array_equal(paint_regions(probabilities, [1, 2, 3]), expected)
    # a later region overwrites an earlier one even where the earlier is below 0.5 (nnU-Net's order, no nesting)
    assert paint_regions(np.array([[0.1, 0.2, 0.9]]), [1, 2, 3]).tolist() == [3]
    # validation paints the logits on the device: logit > 0 is probability > 0.5
    task = SegmentationTask(load_config(None, [*REGIONS_ON, BRATS_SET]), data_info=BRATS_INFO)
    logits = np.log(probabilities / (1 - probabilities))
    np.testing.assert_array_equal(task.label_map(tf.constant(logits)).numpy(), expected)
    # painting a label map's true regions gives it back
    label = np.random.default_rng(2).integers(0, 4, size=(5, 6, 7))
    truth = np.stack([np.isin(label, region) for region in BRATS.values()], axis=-1).astype(np.float32)
    np.testing.assert_array_equal(paint_regions(truth, [1, 2, 3]), label)


def test_sigmoid_in_place_and_the_slab_wise_restore_paint_the_resampled_probabilities():
    from tfmis.data.preprocess import Geometry

    logits = np.random.default_rng(3).normal(0, 30, size=(9, 8, 7, 3)).astype(np.float32)
    logits[0, 0, 0] = [-1e4, 1e4, 0.0]  # no overflow at the extremes
    expected = special.expit(logits.astype(np.float64))
    for dtype, tolerance in ((np.float32, 1e-6), (np.float16, 1e-3)):
        buffer = logits.astype(dtype)
        assert sigmoid_in_place(buffer, chunk_voxels=100) is buffer
        np.testing.assert_allclose(buffer, expected, atol=tolerance)
    probabilities = sigmoid_in_place(logits.copy())
    identity = np.eye(4).tolist()
    shape = [9, 8, 7]
    geometry = Geometry(shape, identity, "RAS", shape, [0, 0, 0], shape, shape, [1.0, 1.0, 1.0], identity)
    labels, restored = restore_labels(probabilities, geometry, paint_labels=[1, 2, 3], probabilities_out=True)
    np.testing.assert_array_equal(labels, nnunet_paint(probabilities, [1, 2, 3]))
    np.testing.assert_allclose(restored, probabilities, atol=1e-6)
    # outside the filled box nothing is predicted: label 0, region probabilities 0 (no background channel)
    labels, restored = restore_labels(
        probabilities, geometry, box=([0, 0, 0], [4, 8, 7]), paint_labels=[1, 2, 3], probabilities_out=True
    )
    assert not labels[4:].any() and not restored[4:].any()


# ---------------------------------------------------------------- the config


def test_region_paint_labels_and_config_errors_name_the_key_and_the_fix():
    config = load_config(None, [*REGIONS_ON, BRATS_SET])
    assert config.model.output == "regions" and list(config.validation.regions) == list(BRATS)
    assert load_config().model.output == "classes"  # the default
    assert region_paint_labels({"organ": [1, 2], "lesion": [2]}) == [1, 2]
    cases = [
        # regions listed smallest first: whole_tumour is painted first and adds nothing after the others
        (
            "validation.regions={enhancing: [3], core: [2, 3], whole: [1, 2, 3]}",
            r"validation.regions.enhancing: .* adds no label.*largest to the smallest",
        ),
        ("validation.regions={both: [1, 2], core: [3]}", r"validation.regions.both: .* adds the labels \[1, 2\]"),
    ]
    for regions, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [*REGIONS_ON, regions])
    with pytest.raises(ConfigError, match=r"validation.regions is empty.*validation.regions=\{whole_tumour"):
        load_config(None, REGIONS_ON)
    with pytest.raises(ConfigError, match="loss.activation is 'softmax'.*set loss.activation=sigmoid"):
        load_config(None, ["model.output=regions", BRATS_SET])
    with pytest.raises(ConfigError, match=r"model.output: 'region' is not one of \['classes', 'regions'\]"):
        load_config(None, ["model.output=region"])
    # the dataset's classes: a foreground label in no region could never be predicted
    partial = load_config(None, [*REGIONS_ON, "validation.regions={core: [2, 3], enhancing: [3]}"])
    with pytest.raises(ValueError, match=r"no region of validation.regions holds the label 1 \(ed\)"):
        SegmentationTask(partial, data_info=BRATS_INFO)
    task = SegmentationTask(load_config(None, [*REGIONS_ON, BRATS_SET]), data_info=BRATS_INFO)
    assert (task.out_channels, task.paint_labels) == (3, [1, 2, 3])
    classes = SegmentationTask(load_config(None, [BRATS_SET]), data_info=BRATS_INFO)
    assert (classes.out_channels, classes.regions, classes.paint_labels) == (4, None, None)


# ---------------------------------------------------------------- training, validation and predict

# the test dataset (conftest): label 1 organ with label 2 core inside it
REGION_TRAINING = [*REGIONS_ON, "validation.regions={organ_all: [1, 2], inner: [2]}"]


@pytest.fixture(scope="module")
def region_run(converted_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("region_run")
    config = tiny_config(
        converted_dataset,
        out,
        *REGION_TRAINING,
        "training.epochs=15",
        "training.steps_per_epoch=4",
        "optimizer.learning_rate=0.01",
        "validation.val_interval=5",
    )
    trainer = Trainer(config)
    summary = trainer.fit()
    trainer.model.load_weights(str(out / "best.weights.h5"))
    return {"config": config, "dir": out, "trainer": trainer, "summary": summary}


def dataset_json(run) -> Path:
    """The test dataset's source (conftest.converted_dataset: the MSD folder next to the TFRecords)."""
    return Path(run["config"].data.dataset_dir).parent / "Task99_Test" / "dataset.json"


def test_a_short_region_training_learns_validates_and_saves_a_two_channel_model(region_run):
    trainer, summary = region_run["trainer"], region_run["summary"]
    assert trainer.model.output.shape[-1] == 2  # one sigmoid per region, no background channel
    assert trainer.training_model.output.shape[-1] == 2
    record = json.loads((region_run["dir"] / "history.jsonl").read_text().splitlines()[-1])
    assert {"val_dice_organ_all", "val_dice_inner", "val_mean_region_dice"} <= set(record)
    assert summary["best_dice_per_region"]["organ_all"] > 0.5  # it learnt the organ in 60 steps
    # the class Dice is scored on the painted label map: organ = organ_all minus inner
    assert set(summary["best_dice_per_class"]) == {"organ", "core"}


def test_predict_writes_painted_label_maps_that_score_as_validation(region_run, tmp_path):
    run = region_run["dir"]
    validation = region_run["trainer"].evaluate(build_val_dataset(region_run["config"]))
    args = ["--checkpoint", str(run), "--output", str(tmp_path / "out"), "--quiet", "--probabilities"]
    assert predict_main([*args, "--input", str(dataset_json(region_run)), "--subset", "split:val"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "out" / "predictions.csv")))
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    for row in rows:
        labels = np.asanyarray(nib.load(row["output"]).dataobj)
        assert labels.dtype == np.uint8 and set(np.unique(labels)) <= {0, 1, 2}
        probabilities = nib.load(str(tmp_path / "out" / f"{row['case']}_probabilities.nii.gz")).get_fdata()
        assert probabilities.shape == labels.shape + (2,)  # organ_all, inner
        assert probabilities.min() >= 0 and probabilities.max() <= 1.0001
        # the label map is the painting of the (8-bit stored) region probabilities but for near-0.5 voxels
        assert np.mean(paint_regions(probabilities, [1, 2]) == labels) > 0.99
    # scored on the original grid, the Dice per region averages to the validation's on the preprocessed grid
    for region in ("organ_all", "inner"):
        scores = [float(r[f"dice_{region}"]) for r in rows if r[f"dice_{region}"] not in ("", "nan")]
        assert np.mean(scores) == pytest.approx(validation[f"dice_{region}"], abs=1e-3)


def test_predict_array_of_a_region_model_matches_the_whole_volume_painting(region_run):
    """The slab-wise restore of a region model equals sigmoid, per-region resampling and painting of the whole
    volume, as restore_geometry computes it."""
    from tfmis.data.preprocess import preprocess, restore_geometry

    predictor = Predictor(region_run["config"], region_run["dir"])
    case = collect_inputs(dataset_json(region_run), "split:val", index=predictor.index)[0]
    img = nib.load(case.image)
    image, affine = np.asanyarray(img.dataobj).astype(np.float32), img.affine
    labels, probabilities, _ = predictor.predict_array(image, affine)
    volume, _, geometry = preprocess(image, None, affine, predictor.preprocessing)
    logits, _ = predictor.logits(volume.astype(np.float32))
    sigmoid = 1 / (1 + np.exp(-logits))
    restored = np.stack([restore_geometry(sigmoid[..., r], geometry, order=1, cval=0.0) for r in range(2)], axis=-1)
    np.testing.assert_allclose(probabilities, restored, atol=1e-5)
    np.testing.assert_array_equal(labels, nnunet_paint(restored, [1, 2]))
