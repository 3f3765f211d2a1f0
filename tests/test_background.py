"""Background found, not assumed: a channel whose border is a non-zero constant (a z-scored MRI, e.g. BraTS-style data
whose air is -3.6) is cropped, z-scored and fingerprinted against that constant; other channels keep zero as their
background and CT channels keep the window's low end."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest

from tfmis.data import case_stats
from tfmis.data.conversion_options import ConversionConfig
from tfmis.data.convert import convert, summary_text
from tfmis.data.demos.brain import make_demo_dataset
from tfmis.data.preprocess import (
    PreprocessConfig,
    border_constant,
    channel_backgrounds,
    foreground_mask,
    preprocess,
)
from tfmis.data.records import record_dataset
from tfmis.hardware import Hardware
from tfmis.metrics.boxes import mask_bounds
from tfmis.planning import plan_dataset_stages
from tfmis.planning.fingerprint import fingerprint_from_conversion, fingerprint_msd

CPU = Hardware(cpu_name="test cpu", cpu_count=2, host_memory_mb=16000, host_available_mb=12000)
SHAPE = (24, 26, 20)
BODY = (slice(5, 18), slice(6, 21), slice(4, 15))  # the body's box, off every face


def body_volume(rng: np.random.Generator, background: float = 0.0) -> np.ndarray:
    """(24, 26, 20) float32: scanner-like values 50-150 inside BODY, `background` everywhere else."""
    x = np.full(SHAPE, background, np.float32)
    x[BODY] = rng.uniform(50.0, 150.0, size=tuple(s.stop - s.start for s in BODY))
    return x


def zscored(x: np.ndarray) -> np.ndarray:
    """x z-scored over its non-zero voxels (the body), background included: the zero air becomes -mean/std."""
    body = x[x != 0]
    return ((x - body.mean()) / body.std()).astype(np.float32)


def records_by_case(target, split: str) -> dict:
    """case id -> (image, label) of the records of `split` in a conversion."""
    return {
        meta["case_id"].numpy().decode(): (image.numpy(), label.numpy())
        for image, label, meta in record_dataset(target, split)
    }


def box(mask: np.ndarray) -> tuple[list[int], list[int]]:
    start, stop = mask_bounds(mask)
    return [int(v) for v in start], [int(v) for v in stop]


# ------------------------------------------------------------------------------------------------ the border rule


def test_a_constant_non_zero_border_is_the_background_and_the_crop_is_the_body():
    """A z-scored channel (border -mean/std, about -3) has that constant as its background: the foreground mask is
    exactly the body, so the crop box is the body's box, not the whole grid."""
    x = zscored(body_volume(np.random.default_rng(0)))
    constant = x[0, 0, 0]
    assert constant < -1 and border_constant(x) == constant
    (background,) = channel_backgrounds(x[..., None], ("zscore",))
    assert background == constant and background.dtype == np.float32
    mask = foreground_mask(x[..., None], ("zscore",), None)
    expected = np.zeros(SHAPE, bool)
    expected[BODY] = True
    np.testing.assert_array_equal(mask, expected)
    assert box(mask) == ([5, 6, 4], [18, 21, 15])


def test_a_body_touching_a_face_leaves_the_border_constant_the_background():
    """The body reaching the top slice (as the 1 mm BraTS-size demo brain does) leaves most of the border the
    constant: still the background, and the crop still ends at the body's other faces."""
    raw = body_volume(np.random.default_rng(1))
    raw[5:18, 6:21, 15:] = 100.0  # the body now reaches the last z slice
    x = zscored(raw)
    assert not (x[:, :, -1] == x[0, 0, 0]).all() and border_constant(x) == x[0, 0, 0]
    assert box(foreground_mask(x[..., None], ("zscore",), None)) == ([5, 6, 4], [18, 21, 20])


def test_a_noisy_border_keeps_todays_rule_nonzero():
    """A border of noise (no value on most of the faces) has no border constant: the background is 0, as before, so
    every non-zero voxel is foreground (here the whole grid)."""
    rng = np.random.default_rng(2)
    x = body_volume(rng) + rng.normal(5.0, 1.0, SHAPE).astype(np.float32)
    assert border_constant(x) is None and channel_backgrounds(x[..., None], ("zscore",)) == [0.0]
    np.testing.assert_array_equal(foreground_mask(x[..., None], ("zscore",), None), x != 0)


def test_a_zero_border_keeps_todays_rule_nonzero():
    """A border of zeros (scanner units, skull-stripped) is today's case: background 0, foreground the non-zero
    voxels, including a stray non-zero voxel outside the body."""
    x = body_volume(np.random.default_rng(3))
    x[1, 1, 1] = 7.0
    assert border_constant(x) == 0 and channel_backgrounds(x[..., None], ("zscore",)) == [0.0]
    mask = foreground_mask(x[..., None], ("zscore",), None)
    np.testing.assert_array_equal(mask, x != 0)
    assert box(mask) == ([1, 1, 1], [18, 21, 15])


def test_each_channel_finds_its_own_background_in_a_two_channel_case():
    """Channel 0 z-scored (border -mean/std), channel 1 raw (border 0) with a body shifted by 2 voxels: each channel is
    compared with its own background and the foreground is the union of the two bodies."""
    rng = np.random.default_rng(4)
    first = zscored(body_volume(rng))
    second = np.roll(body_volume(rng), 2, axis=0)
    image = np.stack([first, second], axis=-1)
    backgrounds = channel_backgrounds(image, ("zscore", "zscore"))
    assert backgrounds[0] == first[0, 0, 0] and backgrounds[1] == 0
    mask = foreground_mask(image, ("zscore",), None)
    np.testing.assert_array_equal(mask, (first != first[0, 0, 0]) | (second != 0))
    assert box(mask) == ([5, 6, 4], [20, 21, 15])
    # the same rule through one channel at a time (the planner's first pass looks at the non-CT channels only)
    np.testing.assert_array_equal(foreground_mask(image, ("zscore",), None, channels=[1]), second != 0)


def test_a_ct_channel_keeps_the_window_rule_whatever_its_border():
    """A CT channel whose border is the -1024 padding constant is still foreground above the window's low end (its
    background is not looked up): air at -1000 stays background, as before."""
    ct = np.full(SHAPE, -1024.0, np.float32)
    ct[2:22, 2:24, 2:18] = -1000.0  # air inside the scanner's circle
    ct[BODY] = 40.0
    assert border_constant(ct) == -1024 and channel_backgrounds(ct[..., None], ("ct",)) == [None]
    mask = foreground_mask(ct[..., None], ("ct",), (-100.0, 200.0))
    assert box(mask) == ([5, 6, 4], [18, 21, 15])


def test_preprocess_crops_and_normalises_a_zscored_case_as_its_raw_one():
    """preprocess (the conversion's and the predictor's chain) on a z-scored two-channel case gives the raw case's crop
    box and, z-scoring over the same foreground, the same normalised values (0 outside the body)."""
    rng = np.random.default_rng(5)
    raw = np.stack([body_volume(rng), body_volume(rng)], axis=-1)
    z = np.stack([zscored(raw[..., 0]), zscored(raw[..., 1])], axis=-1)
    affine = np.diag([1.0, 1.0, 2.0, 1.0])
    config = PreprocessConfig(spacing=(1.0, 1.0, 2.0), normalization=("zscore", "zscore"), image_dtype="float32")
    out_raw, _, g_raw = preprocess(raw, None, affine, config)
    out_z, _, g_z = preprocess(z, None, affine, config)
    assert (g_z.crop_start, g_z.crop_stop) == (g_raw.crop_start, g_raw.crop_stop) == ([5, 6, 4], [18, 21, 15])
    np.testing.assert_allclose(out_z, out_raw, atol=1e-4)


def test_the_intensity_sample_of_an_unlabelled_zscored_case_is_its_body():
    """Without labelled voxels the fingerprint samples the foreground: a z-scored case's sample holds no voxel of
    its background constant; the recorded background is that constant (0 for a raw channel, None for CT)."""
    rng = np.random.default_rng(6)
    image = np.stack([zscored(body_volume(rng)), body_volume(rng)], axis=-1)
    values = case_stats.intensity_sample(image, None, 100_000, np.random.default_rng(0))
    assert len(values) == int(np.prod([s.stop - s.start for s in BODY]))
    assert not (values[:, 0] == image[0, 0, 0, 0]).any()
    assert case_stats.case_background(image) == [float(image[0, 0, 0, 0]), 0.0]
    assert case_stats.case_background(image, ct_channels=[1]) == [float(image[0, 0, 0, 0]), None]


# ------------------------------------------------------------ the BraTS-size demo, raw and z-scored, end to end


@pytest.fixture(scope="module")
def brats_pair(tmp_path_factory):
    """The BraTS-size demo at 4 mm (60 x 60 x 39, constant border kept), 3 cases, 2 channels: raw int16 and
    z-scored float32 (the same anatomy and labels)."""
    root = tmp_path_factory.mktemp("background")
    common = dict(num_training=3, num_test=0, size="brats", channels=2, spacing=4.0)
    raw = make_demo_dataset(root / "Task01_DemoBraTS", **common)
    z = make_demo_dataset(root / "Task01_DemoBraTS_z", zscore=True, **common)
    return root, raw, z


def test_the_zscored_demo_is_the_raw_one_z_scored_over_the_brain(brats_pair):
    """--zscore writes float32 images whose channels are (raw - mean) / std over the brain: the same labels and
    affines, body mean 0 and std 1, and a non-zero constant border (the background) per case and channel."""
    _, raw, z = brats_pair
    for name in ("demo_000", "demo_001", "demo_002"):
        a, b = nib.load(raw / "imagesTr" / f"{name}.nii.gz"), nib.load(z / "imagesTr" / f"{name}.nii.gz")
        np.testing.assert_array_equal(a.affine, b.affine)
        la, lb = (np.asarray(nib.load(d / "labelsTr" / f"{name}.nii.gz").dataobj) for d in (raw, z))
        np.testing.assert_array_equal(la, lb)
        x, y = np.asarray(a.dataobj), np.asarray(b.dataobj)
        assert x.dtype == np.int16 and y.dtype == np.float32
        for c in range(2):
            body = x[..., c] != 0
            assert abs(float(y[..., c][body].mean())) < 1e-4 and abs(float(y[..., c][body].std()) - 1) < 1e-4
            assert border_constant(y[..., c]) == y[0, 0, 0, c] < -1 and border_constant(x[..., c]) == 0
    assert "z-scored" in json.loads((z / "dataset.json").read_text())["description"]


def test_zscored_demo_plans_like_the_raw_one(brats_pair):
    """The first-pass fingerprint and the staged plan (python -m tfmis.plan's API) of the z-scored demo equal the raw
    demo's: the same crop shapes, the same configuration and, per stage, the same spacing, patch, strides and
    filters; the z-scored fingerprint records each channel's border constant in all 3 cases."""
    root, raw, z = brats_pair
    plans, fingerprints = {}, {}
    for name, source in (("raw", raw), ("z", z)):
        staged, fingerprint = plan_dataset_stages(
            source, root / f"none_{name}", root / f"run_{name}", workers=1, progress=False, hardware=CPU
        )
        fingerprints[name] = fingerprint
        plans[name] = (
            staged.configuration,
            [
                (
                    stage,
                    plan.config().data.conversion.spacing,
                    plan.config().pipeline.patch_size,
                    plan.config().model.strides,
                    plan.config().model.filters,
                )
                for stage, plan in staged.stages
            ],
        )
    raw_fp, z_fp = fingerprints["raw"], fingerprints["z"]
    np.testing.assert_array_equal(z_fp.crop_shapes, raw_fp.crop_shapes)
    assert (z_fp.crop_shapes < np.array([60, 60, 39])).any(axis=1).all()  # every case is cropped, not whole
    assert plans["z"] == plans["raw"]
    assert [c["border_constant_cases"] for c in z_fp.background] == [3, 3]
    assert [c["border_constant_cases"] for c in raw_fp.background] == [0, 0] and raw_fp.background_lines == []
    assert z_fp.background_lines[0].startswith("background: channel 0 FLAIR is the border constant")


def test_zscored_demo_converts_like_the_raw_one(brats_pair):
    """The real conversion of the z-scored demo cuts the raw demo's crop box from every case, stores the same
    normalised images (z-scored over the same foreground) and logs one background line per z-scored channel; the
    fingerprint read back from it records the border constants and the raw shapes, and the planner's first pass
    over the z-scored folder predicts its converted shapes exactly."""
    root, raw, z = brats_pair
    index, records = {}, {}
    for name, source in (("raw", raw), ("z", z)):
        target = root / f"tfr_{name}"
        config = ConversionConfig(
            str(source), str(target), split=(1.0,), shards=1, image_dtype="float32", workers=1, progress=False
        )
        index[name] = convert(config)
        records[name] = records_by_case(target, "train")
    boxes = {
        name: {cid: (c["geometry"]["crop_start"], c["geometry"]["crop_stop"]) for cid, c in cases["cases"].items()}
        for name, cases in index.items()
    }
    assert boxes["z"] == boxes["raw"] and len(boxes["z"]) == 3
    assert all(stop != [60, 60, 39] or start != [0, 0, 0] for start, stop in boxes["z"].values())
    for cid, (image, label) in records["raw"].items():
        np.testing.assert_allclose(records["z"][cid][0], image, atol=1e-3)
        np.testing.assert_array_equal(records["z"][cid][1], label)
    lines = [line.strip() for line in summary_text(index["z"]).splitlines() if "background:" in line]
    assert [line.split(" is ")[0] for line in lines] == ["background: channel 0 FLAIR", "background: channel 1 T1w"]
    assert all("(not 0) in 3 of 3 cases" in line for line in lines)
    assert "background:" not in summary_text(index["raw"])
    from_conversion = fingerprint_from_conversion(root / "tfr_z")
    assert [c["border_constant_cases"] for c in from_conversion.background] == [3, 3]
    np.testing.assert_allclose(
        from_conversion.crop_shapes, fingerprint_from_conversion(root / "tfr_raw").crop_shapes, atol=1e-9
    )
    first_pass = fingerprint_msd(z, workers=1, progress=False)
    spacing = index["z"]["preprocessing"]["spacing"]
    converted = {cid: c["image_shape"][:3] for cid, c in index["z"]["cases"].items()}
    assert dict(zip(first_pass.case_ids, first_pass.shapes_at(spacing).tolist())) == converted
