import csv
import itertools
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from conftest import lps_affine, tiny_config, write_nifti

from tfmis.data.pipeline import build_val_dataset
from tfmis.engine.trainer import Trainer
from tfmis.inference.inputs import InputCase, collect_inputs
from tfmis.inference.predictor import Predictor
from tfmis.predict import main as predict_main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def trained_run(converted_dataset, tmp_path_factory):
    """A real (tiny) training run: its config, best weights and the validation Dice it reported."""
    out = tmp_path_factory.mktemp("run")
    config = tiny_config(converted_dataset, out, "training.epochs=3", "training.steps_per_epoch=4")
    trainer = Trainer(config)
    trainer.fit()
    trainer.model.load_weights(str(out / "best.weights.h5"))
    validation = trainer.evaluate(build_val_dataset(config))
    from tfmis.config import save_config

    save_config(config, out / "config.yaml")
    return {"config": config, "dir": out, "validation": validation, "source": converted_dataset.parent / "Task99_Test"}


def test_dice_in_original_geometry_matches_validation(trained_run, tmp_path):
    config = trained_run["config"]
    predictor = Predictor(config, trained_run["dir"])
    cases = collect_inputs(trained_run["source"] / "dataset.json", "split:val", index=predictor.index)
    assert len(cases) == 2 and all(c.label for c in cases)
    results = [predictor.predict_file(c, tmp_path) for c in cases]
    assert all(r.status == "ok" for r in results)
    names = predictor.class_names[1:]
    for k, name in enumerate(names):
        predicted = np.nanmean([r.dice[name] for r in results])
        assert predicted == pytest.approx(trained_run["validation"]["dice_per_class"][k], abs=1e-3)


def orientations_of(image, label, affine, axcodes):
    ornt = nib.orientations.ornt_transform(
        nib.orientations.io_orientation(affine), nib.orientations.axcodes2ornt(axcodes)
    )
    new_affine = affine @ nib.orientations.inv_ornt_aff(ornt, image.shape[:3])
    return (
        nib.orientations.apply_orientation(image, ornt),
        nib.orientations.apply_orientation(label, ornt),
        new_affine,
    )


def test_predictions_keep_each_inputs_geometry(trained_run, tmp_path):
    """RAS, LPS and anisotropic inputs: same shape/affine/orientation out; RAS and LPS agree voxel for voxel."""
    source = trained_run["source"]
    img = nib.load(str(source / "imagesTr" / "case_000.nii.gz"))
    image, affine = np.asanyarray(img.dataobj).astype(np.float32), img.affine
    label = np.asanyarray(nib.load(str(source / "labelsTr" / "case_000.nii.gz")).dataobj)
    inputs = tmp_path / "inputs"
    ras_image, ras_label, ras_affine = orientations_of(image, label, affine, "RAS")
    write_nifti(inputs / "as_ras.nii.gz", ras_image, ras_affine)
    write_nifti(inputs / "as_lps.nii.gz", image, affine)  # the dataset's own storage is LPS
    thick = image[:, :, ::2]  # 2 mm → 4 mm slices: resampled on the way in and out
    thick_affine = affine.copy()
    thick_affine[:3, 2] *= 2
    write_nifti(inputs / "thick_slices.nii.gz", thick, thick_affine)
    code = predict_main(
        [
            "--config",
            str(trained_run["dir"] / "config.yaml"),
            "--checkpoint",
            str(trained_run["dir"] / "best.weights.h5"),
            "--input",
            str(inputs),
            "--output",
            str(tmp_path / "out"),
            "--quiet",
        ]
    )
    assert code == 0
    for name in ("as_ras", "as_lps", "thick_slices"):
        source_img = nib.load(str(inputs / f"{name}.nii.gz"))
        out = nib.load(str(tmp_path / "out" / f"{name}.nii.gz"))
        assert out.shape == source_img.shape[:3] and out.get_data_dtype() == np.uint8
        np.testing.assert_array_equal(out.affine, source_img.affine)
        assert nib.aff2axcodes(out.affine) == nib.aff2axcodes(source_img.affine)
    lps = np.asanyarray(nib.load(str(tmp_path / "out" / "as_lps.nii.gz")).dataobj)
    ras = np.asanyarray(nib.load(str(tmp_path / "out" / "as_ras.nii.gz")).dataobj)
    np.testing.assert_array_equal(orientations_of(lps, lps, affine, "RAS")[0], ras)
    thick_prediction = np.asanyarray(nib.load(str(tmp_path / "out" / "thick_slices.nii.gz")).dataobj)
    assert set(np.unique(thick_prediction)) <= {0, 1, 2}


def test_accelerator_budget_precheck_sends_large_volumes_to_the_cpu(trained_run, tmp_path):
    """The `accelerator_memory_mb` pre-check: no allocation fails; the placement policy does not try
    the accelerator for a volume whose whole-volume buffers would exceed the budget, and aggregates
    it on the CPU.

    Both too-large volumes go to the CPU (the reason, and the pre-check in the policy's events, say
    so), a smaller one stays on the primary device (here also the CPU), nothing is learned as if
    memory had run out, and every label map equals the one predicted without a budget.
    """
    source = trained_run["source"]
    img = nib.load(str(source / "imagesTr" / "case_001.nii.gz"))
    image = np.asanyarray(img.dataobj).astype(np.float32)
    cases = []
    for name, crop in [("a_medium", image[:, :, :14]), ("b_large", image), ("c_small", image[:, :, :10])]:
        write_nifti(tmp_path / "in" / f"{name}.nii.gz", crop, lps_affine())
        cases.append(InputCase(name, str(tmp_path / "in" / f"{name}.nii.gz")))
    free = Predictor(trained_run["config"], trained_run["dir"])
    reference = [free.predict_file(c, tmp_path / "free") for c in cases]
    primary = reference[0].device  # "cpu:0" here, "gpu:0" on a GPU machine
    assert [r.device for r in reference] == [primary] * 3
    # after the foreground crop the volumes are 16x18x12 (medium), 16x18x14 (large), 16x18x8 (small) voxels,
    # each needing (3 classes + 1 weight + 2 channels) x 4 bytes: a 0.065 MiB budget fits only the small one
    budgeted = Predictor(trained_run["config"], trained_run["dir"], device="gpu", accelerator_memory_mb=0.065)
    results = [budgeted.predict_file(c, tmp_path / "budget") for c in cases]
    assert [r.status for r in results] == ["ok"] * 3
    assert [r.device for r in results] == ["cpu (over the accelerator memory budget)"] * 2 + [primary]
    events = budgeted.placement.events
    assert [e.case_id for e in events] == ["a_medium", "b_large"] and events[0].voxels == 16 * 18 * 12
    assert all(e.failed[0].startswith("pre-check: the whole-volume buffers need 0.1 MiB") for e in events)
    assert budgeted.placement.cpu_from_voxels is None
    for c in cases:
        a = np.asanyarray(nib.load(str(tmp_path / "free" / f"{c.case_id}.nii.gz")).dataobj)
        b = np.asanyarray(nib.load(str(tmp_path / "budget" / f"{c.case_id}.nii.gz")).dataobj)
        np.testing.assert_array_equal(a, b)


REAL_OOM_SCRIPT = r"""
import json
import mmap
import resource
import sys

import numpy as np
import tensorflow as tf

from tfmis.config import load_config
from tfmis.inference.predictor import Predictor

config_path, checkpoint, squeeze_at, out_path = sys.argv[1:5]
SLACK = 8 * 2**20  # left free by the co-tenant: below the 9.4 MiB weight sum and the 28 MiB blending buffer


def address_space():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))


class SharedMachinePredictor(Predictor):
    # While the first attempt runs, a co-tenant maps all but SLACK of the capped address space; it
    # leaves when that attempt ends (here the accelerator and the fallback share the host memory).
    limit = None

    def _window_logits(self, volume, device, sw_batch_size):
        forward, ballast = self._forward, []
        squeeze = self.limit is not None and not self.caught

        def take_memory():
            if squeeze and not ballast:
                ballast.append(mmap.mmap(-1, self.limit - address_space() - SLACK))

        def forward_then_take_memory(windows):
            out = forward(windows)
            take_memory()
            return out

        if squeeze_at == "start":
            take_memory()
        else:
            self._forward = forward_then_take_memory
        try:
            return super()._window_logits(volume, device, sw_batch_size)
        except (MemoryError, tf.errors.OpError) as e:
            self.caught.append(f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
            raise
        finally:
            self._forward = forward
            for b in ballast:
                b.close()


config = load_config(config_path, ["validation.roi_size=[80,80,48]"])
rng = np.random.default_rng(0)
image = rng.normal(100, 10, (160, 160, 96, 2)).astype(np.float32)
image[40:100, 50:110, 30:60, 0] += 30
affine = np.diag([1.5, 1.5, 2.0, 1.0])  # the training spacing: no resampling; no zero voxel: no crop
reference = Predictor(config, checkpoint, device="gpu", overlap=0.0)
constrained = SharedMachinePredictor(config, checkpoint, device="gpu", overlap=0.0)
constrained.caught = []
for p in (reference, constrained):  # traces the model and starts TensorFlow's threads before the cap
    p.predict_array(image[:24, :24, :24], affine)
constrained.limit = address_space() + 2 * 2**30
resource.setrlimit(resource.RLIMIT_AS, (constrained.limit, resource.RLIM_INFINITY))
result = {"caught": constrained.caught}
try:
    labels, probabilities, result["device"] = constrained.predict_array(image, affine)
    ref_labels, ref_probabilities, result["reference_device"] = reference.predict_array(image, affine)
    result["labels_equal"] = bool(np.array_equal(labels, ref_labels))
    result["probabilities_equal"] = bool(np.array_equal(probabilities, ref_probabilities))
    result["foreground"] = int((labels > 0).sum())
except MemoryError as e:
    result["escaped"] = f"{type(e).__name__}: {e}"
with open(out_path, "w") as f:
    json.dump(result, f)
"""


WEIGHT_SUM_FAILS = (
    "MemoryError: Unable to allocate 9.38 MiB for an array with shape (160, 160, 96) and data type float32"
)
BUFFER_FAILS = (
    "MemoryError: Unable to allocate 28.1 MiB for an array with shape (1, 160, 160, 96, 3) and data type float32"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status are Linux")
@pytest.mark.parametrize(
    "squeeze_at, environment, errors",
    [
        # before any forward pass: the next large allocation is the host blend's sum of importance weights
        # (X·Y·Z float32), or, when the allocator serves that one from memory the warm-up freed, the blending
        # buffer (B·X·Y·Z·K float32): either is a real MemoryError
        ("start", {}, (WEIGHT_SUM_FAILS, BUFFER_FAILS)),
        # after the first window batch, before the next forward pass: the blending buffer
        ("first_forward", {}, (BUFFER_FAILS,)),
    ],
    ids=["before_first_forward_MemoryError", "blending_buffer_MemoryError"],
)
@pytest.mark.slow
def test_a_real_failed_allocation_falls_back_and_gives_the_same_prediction(
    trained_run, tmp_path, squeeze_at, environment, errors
):
    """A real allocation fails in the first (accelerator) attempt; the fallback's result is bit-identical.

    In a subprocess: the address space is capped (`RLIMIT_AS`, 2 GiB above the process' size), and
    while the first attempt runs a co-tenant maps all of it but 8 MiB, so the next large allocation
    (the 9.4 MiB weight sum, or the 28 MiB blending buffer) genuinely fails. The co-tenant leaves
    when that attempt ends (on a GPU the fallback would use host memory instead; on this CPU-only
    machine both share it), the CPU fallback runs, and its label map and probabilities equal those
    of an unconstrained predictor on the same 160x160x96 volume.
    """
    import json
    import os

    script = tmp_path / "real_oom.py"
    script.write_text(REAL_OOM_SCRIPT)
    out = tmp_path / "result.json"
    result = subprocess.run(
        [
            sys.executable,
            str(script),
            str(trained_run["dir"] / "config.yaml"),
            str(trained_run["dir"]),
            squeeze_at,
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **environment},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report["caught"]) == 1 and report["caught"][0].startswith(errors), report
    assert "escaped" not in report, report
    assert report["device"] == "cpu (fallback after out-of-memory)" and report["reference_device"] == "cpu:0"
    assert report["labels_equal"] and report["probabilities_equal"], report
    assert report["foreground"] > 0


def test_a_bad_case_never_stops_the_others(trained_run, tmp_path):
    """Unreadable, truncated and one-channel images and a truncated label each fail their case alone (its line on
    stderr, its row in predictions.csv); the others are written, and the command exits 3."""
    source = trained_run["source"]
    inputs, labels = tmp_path / "in", tmp_path / "labels"
    inputs.mkdir()
    labels.mkdir()
    for name in ("case_000", "case_001", "case_002"):
        (inputs / f"{name}.nii.gz").write_bytes((source / "imagesTr" / f"{name}.nii.gz").read_bytes())
        (labels / f"{name}.nii.gz").write_bytes((source / "labelsTr" / f"{name}.nii.gz").read_bytes())
    (labels / "case_002.nii.gz").write_bytes((labels / "case_002.nii.gz").read_bytes()[:200])  # truncated label
    (inputs / "broken.nii.gz").write_bytes(b"not a nifti")
    (inputs / "truncated.nii.gz").write_bytes((inputs / "case_000.nii.gz").read_bytes()[:300])
    write_nifti(inputs / "one_channel.nii.gz", np.ones((20, 22, 18)), lps_affine())
    (inputs / "._case_000.nii.gz").write_bytes(b"macOS junk, never read")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfmis.predict",
            "--config",
            str(trained_run["dir"] / "config.yaml"),
            "--checkpoint",
            str(trained_run["dir"]),
            "--input",
            str(inputs),
            "--output",
            str(tmp_path / "out"),
            "--label-dir",
            str(labels),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 3, result.stderr[-2000:]
    for name in ("broken", "one_channel", "truncated", "case_002"):
        assert f"{name}: FAILED" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "1 channel(s)" in result.stdout
    assert "2 of 6 case(s) written" in result.stdout and "mean Dice over 2 case(s)" in result.stdout
    rows = {r["case"]: r for r in csv.DictReader(open(tmp_path / "out" / "predictions.csv"))}
    assert set(rows) == {"case_000", "case_001", "case_002", "broken", "one_channel", "truncated"}
    assert "cannot be read" in rows["truncated"]["reason"]
    assert rows["case_002"]["reason"].startswith("label file") and "cannot be read" in rows["case_002"]["reason"]
    assert rows["case_000"]["status"] == "ok" and 0 <= float(rows["case_000"]["dice_mean"]) <= 1
    assert rows["broken"]["status"] == "failed" and "cannot be read" in rows["broken"]["reason"]
    assert (tmp_path / "out" / "case_001.nii.gz").is_file()


def test_tta_logits_are_the_mean_over_all_eight_flips_and_probabilities_their_softmax(trained_run, tmp_path):
    """`tta=True` against the definition, computed here without the TTA code path: the test-time-augmented logits
    of a preprocessed case equal the mean over all 2^3 flip combinations of (flip the volume along those axes ->
    the same model's plain sliding-window logits -> flip back), to 1e-4 (float32 sums of 8 passes). They differ
    from the un-augmented logits by far more than that (so the check can tell TTA from no TTA). The probabilities
    on the preprocessed grid are the softmax of those averaged logits; the written probability map is a
    distribution per voxel whose argmax is the written label map. `tta_axes=(0,)` keeps 2 passes."""
    from tfmis.data.preprocess import preprocess
    from tfmis.data.sources.image_io import load_image

    source = trained_run["source"]
    predictor = Predictor(trained_run["config"], trained_run["dir"], tta=True)
    plain = Predictor(trained_run["config"], trained_run["dir"])
    flips = [axes for n in range(4) for axes in itertools.combinations((0, 1, 2), n)]  # spatial axes of a volume
    assert len(flips) == 8 and sorted(map(tuple, predictor.tta_flips)) == sorted(tuple(a + 1 for a in f) for f in flips)
    path = source / "imagesTr" / "case_002.nii.gz"
    image, affine, _ = load_image(path, len(predictor.modalities), "case_002", integers=True)
    volume, _, _ = preprocess(image, None, affine, predictor.preprocessing)
    augmented, _ = predictor.logits(volume)
    passes = [np.flip(plain.logits(np.ascontiguousarray(np.flip(volume, f)))[0], f) for f in flips]
    expected = np.mean(passes, axis=0)
    assert augmented.shape == expected.shape == volume.shape[:3] + (3,)
    np.testing.assert_allclose(augmented, expected, atol=1e-4, rtol=0)
    assert np.abs(augmented - plain.logits(volume)[0]).max() > 1e-2  # TTA changes the logits measurably
    grid = predictor.grid_prediction(image, affine)
    e = np.exp(expected - expected.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(grid.probabilities, e / e.sum(axis=-1, keepdims=True), atol=1e-5, rtol=0)

    result = predictor.predict_file(InputCase("case_002", str(path)), tmp_path, probabilities=True)
    assert result.status == "ok"
    probs = nib.load(str(tmp_path / "case_002_probabilities.nii.gz")).get_fdata()
    labels = np.asanyarray(nib.load(str(tmp_path / "case_002.nii.gz")).dataobj)
    assert probs.shape == labels.shape + (3,)
    assert probs.min() >= 0 and probs.max() <= 1.0001
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, atol=0.01)
    agree = np.mean(np.argmax(probs, axis=-1) == labels)
    assert agree > 0.99  # equal but for ties introduced by storing probabilities in 8 bits
    single = Predictor(trained_run["config"], trained_run["dir"], tta=True, tta_axes=(0,))
    assert single.tta_flips == [[], [1]]


def test_cli_help_and_bad_arguments(trained_run, tmp_path, capsys):
    """--help exits 0; a --checkpoint that does not exist is an unusable checkpoint (exit 1) named in one line,
    even with a valid --config (not the training data it would have looked for)."""
    with pytest.raises(SystemExit) as help_exit:
        predict_main(["--help"])
    assert help_exit.value.code == 0
    missing = tmp_path / "missing.weights.h5"
    assert (
        predict_main(
            [
                "--config",
                str(trained_run["dir"] / "config.yaml"),
                "--checkpoint",
                str(missing),
                "--input",
                str(tmp_path),
                "--output",
                str(tmp_path / "o"),
            ]
        )
        == 1
    )
    assert f"--checkpoint {missing}: no such file or folder" in capsys.readouterr().err


REGION_OVERRIDES = [
    "validation.regions={lesion: [1, 2], core_only: [2]}",  # organ ∪ core, and a one-label region
    "validation.hd95=true",
    "validation.nsd=true",
    "validation.nsd_tolerance_mm=[1.5, 3.0]",  # organ, core; regions take the smallest of their labels'
]


def test_predict_writes_region_hd95_and_nsd_columns(trained_run, tmp_path):
    """A real `predict` run with regions, HD95 and NSD configured: predictions.csv keeps its class columns and
    appends the scores, each equal to the formula computed here from the written prediction and the label
    (union Dice by hand, NSD and HD95 by brute force over listed surface voxels, spacing from the affine)."""
    from test_metrics import brute_force_hd95, brute_force_nsd, union_dice_by_hand

    from tfmis.config import load_config, save_config

    config = load_config(trained_run["dir"] / "config.yaml", REGION_OVERRIDES)
    save_config(config, tmp_path / "config.yaml")
    args = ["--config", str(tmp_path / "config.yaml"), "--checkpoint", str(trained_run["dir"] / "best.weights.h5")]
    args += ["--input", str(trained_run["source"] / "dataset.json"), "--subset", "split:val"]
    assert predict_main([*args, "--output", str(tmp_path / "out"), "--quiet"]) == 0
    with open(tmp_path / "out" / "predictions.csv") as f:
        header = next(csv.reader(f))
    with open(tmp_path / "out" / "predictions.csv") as f:
        rows = list(csv.DictReader(f))
    assert header == [
        "case", "status", "shape", "seconds", "peak_rss_mb", "foreground_voxels", "device", "output", "reason",
        "dice_organ", "dice_core", "dice_mean", "absent_from_label",
        "dice_lesion", "dice_core_only", "dice_mean_regions",
        "hd95_organ", "hd95_core", "hd95_lesion", "hd95_core_only",
        "nsd_organ", "nsd_core", "nsd_lesion", "nsd_core_only", "nsd_mean",
    ]  # fmt: skip
    assert len(rows) == 2
    source = trained_run["source"]
    for row in rows:
        predicted = nib.load(row["output"])
        prediction = np.asanyarray(predicted.dataobj)
        label = np.asanyarray(nib.load(str(source / "labelsTr" / f"{row['case']}.nii.gz")).dataobj).astype(int)
        spacing = nib.affines.voxel_sizes(predicted.affine)
        assert tuple(spacing) == pytest.approx((1.5, 1.5, 2.0))  # anisotropic (conftest.lps_affine)
        lesion_dice = union_dice_by_hand(prediction, label, [1, 2])
        assert float(row["dice_lesion"]) == pytest.approx(lesion_dice, abs=1e-4)
        assert row["dice_core_only"] == row["dice_core"]  # a one-label region is that class
        assert float(row["dice_mean_regions"]) == pytest.approx(
            np.nanmean([lesion_dice, float(row["dice_core"])]), abs=1e-4
        )
        masks = {"organ": [1], "core": [2], "lesion": [1, 2], "core_only": [2]}
        tolerances = {"organ": 1.5, "core": 3.0, "lesion": 1.5, "core_only": 3.0}
        for name, labels in masks.items():
            p, t = np.isin(prediction, labels), np.isin(label, labels)
            assert float(row[f"nsd_{name}"]) == pytest.approx(
                brute_force_nsd(p, t, tolerances[name], spacing), abs=1e-4
            )
            hd95 = brute_force_hd95(p, t, spacing) if p.any() and t.any() else float("inf")
            assert float(row[f"hd95_{name}"]) == pytest.approx(hd95, abs=1e-4)
        assert float(row["nsd_mean"]) == pytest.approx(np.mean([float(row["nsd_organ"]), float(row["nsd_core"])]), 1e-3)


def test_validation_reports_region_and_nsd_metrics_in_history(converted_dataset, trained_run, tmp_path):
    """Training with regions and NSD configured records them per epoch (history.jsonl / history.csv) and in
    summary.json; the validation's region Dice (preprocessed grid, whole volumes) equals predict's (original
    grid) averaged over the same cases, as the class Dice does."""
    import json

    config = tiny_config(converted_dataset, tmp_path / "run", "training.epochs=1", *REGION_OVERRIDES)
    trainer = Trainer(config)
    summary = trainer.fit()
    record = json.loads((tmp_path / "run" / "history.jsonl").read_text().splitlines()[-1])
    for key in ("val_dice_lesion", "val_dice_core_only", "val_mean_region_dice", "val_mean_nsd", "val_nsd_lesion"):
        assert key in record, key
    assert set(record["val_nsd"]) == {"organ", "core"} and "val_hd95_lesion" in record
    assert record["val_dice_core_only"] == pytest.approx(record["val_dice"]["core"], nan_ok=True)
    header = (tmp_path / "run" / "history.csv").read_text().splitlines()[0].split(",")
    assert {"val_dice_lesion", "val_nsd/organ", "val_mean_nsd"} <= set(header)
    assert summary["best_dice_per_region"] == {
        "lesion": record["val_dice_lesion"],
        "core_only": pytest.approx(record["val_dice_core_only"], nan_ok=True),
    }
    assert (
        json.loads((tmp_path / "run" / "summary.json").read_text())["best_dice_per_region"]["lesion"]
        == (record["val_dice_lesion"])
    )
    # the same cases through predict: its per-case region Dice averages to the validation's
    validation = trainer.evaluate(build_val_dataset(config))
    predictor = Predictor(config, tmp_path / "run")
    cases = collect_inputs(trained_run["source"] / "dataset.json", "split:val", index=predictor.index)
    results = [predictor.predict_file(c, tmp_path / "out") for c in cases]
    assert np.nanmean([r.scores["dice_lesion"] for r in results]) == pytest.approx(validation["dice_lesion"], abs=1e-3)
    assert validation["dice_lesion"] == pytest.approx(record["val_dice_lesion"])  # best = last (one epoch)


NSD_OVERRIDES = ["validation.hd95=true", "validation.nsd=true", "validation.nsd_tolerance_mm=[1.5, 2.0]"]


def test_read_label_map_gives_the_rounded_labels_as_uint8_from_real_nifti_files(tmp_path):
    """Scoring reads a label NIfTI slab by slab (70 slices along the file's last axis: three slabs) into uint8
    (uint16 beyond 256 classes): from .nii.gz and .nii, float32 near integers, big-endian int16 and int16 with a
    scale factor, the values equal what scoring read before (`np.rint` of nibabel's whole array, then integers);
    a value that is no class (too large, NaN) is a ValueError, a shape other than the image's a CaseError."""
    from tfmis.data.sources.errors import CaseError
    from tfmis.data.sources.label_maps import LABEL_SLAB_SLICES, read_label_map

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, (9, 11, 70)).astype(np.uint8)
    assert labels.shape[-1] > 2 * LABEL_SLAB_SLICES
    affine = lps_affine()
    scaled = nib.Nifti1Image(labels.astype(np.int16) * 2, affine)  # stored 0, 2, 4 with scl_slope 0.5
    scaled.header.set_slope_inter(0.5, 0.0)
    nib.save(scaled, str(tmp_path / "scaled.nii.gz"))
    files = [
        write_nifti(tmp_path / "uint8.nii.gz", labels, affine),
        write_nifti(tmp_path / "uint8.nii", labels, affine),
        write_nifti(tmp_path / "float32.nii.gz", labels + rng.uniform(-0.2, 0.2, labels.shape), affine, np.float32),
        write_nifti(tmp_path / "int16_big_endian.nii.gz", labels, affine, ">i2"),
        tmp_path / "scaled.nii.gz",
    ]
    for path in files:
        before = np.rint(np.asanyarray(nib.load(str(path)).dataobj)).astype(np.int64)
        read = read_label_map(path, 3, "case", labels.shape)
        assert read.dtype == np.uint8 and read.shape == labels.shape, path.name
        np.testing.assert_array_equal(read, before, err_msg=path.name)
        np.testing.assert_array_equal(read, labels, err_msg=path.name)
    many = write_nifti(tmp_path / "many.nii.gz", labels.astype(np.uint16) * 150, affine)
    read = read_label_map(many, 301)
    assert read.dtype == np.uint16 and np.array_equal(read, labels.astype(np.uint16) * 150)
    with pytest.raises(ValueError, match=r"outside the classes 0\.\.1 \(in \[0, 2\]"):
        read_label_map(files[0], 2)
    holes = labels.astype(np.float32)
    holes[4, 5, 66] = np.nan
    with pytest.raises(ValueError, match="outside the classes 0..2"):
        read_label_map(write_nifti(tmp_path / "nan.nii.gz", holes, affine), 3)
    with pytest.raises(CaseError, match="has shape"):
        read_label_map(files[0], 3, "case", (9, 11, 69))


def test_validation_nsd_equals_predict_nsd_when_the_preprocessed_grid_is_the_original_grid(trained_run, tmp_path):
    """The test dataset is stored at the training spacing (1.5 x 1.5 x 2 mm, its median): preprocessing only crops
    to the foreground and reorients, which changes no distance between surfaces. So validation's HD95 and NSD
    (Trainer.evaluate: the preprocessed grid and spacing) equal predict's (the original grid and the file's
    spacing), per class averaged over the same cases."""
    from tfmis.config import load_config

    overrides = [f"output.dir={tmp_path / 'run'}", *NSD_OVERRIDES]
    config = load_config(trained_run["dir"] / "config.yaml", overrides)
    trainer = Trainer(config)
    trainer.model.load_weights(str(trained_run["dir"] / "best.weights.h5"))
    validation = trainer.evaluate(build_val_dataset(config))
    predictor = Predictor(config, trained_run["dir"])
    cases = collect_inputs(trained_run["source"] / "dataset.json", "split:val", index=predictor.index)
    results = [predictor.predict_file(c, tmp_path / "out") for c in cases]
    assert len(results) == 2 and all(r.status == "ok" for r in results)
    for k, name in enumerate(predictor.class_names[1:]):
        for metric in ("nsd", "hd95"):
            per_case = [r.scores[f"{metric}_{name}"] for r in results]
            assert np.nanmean(per_case) == pytest.approx(validation[f"{metric}_per_class"][k], rel=1e-12), name
    assert 0 < validation["mean_nsd"] < 1  # a partly right prediction: a real comparison


def test_on_a_resampled_case_validation_and_predict_nsd_are_different_definitions(trained_run, tmp_path):
    """A scan finer than the training grid (1.0 x 1.2 x 1.5 mm against 1.5 x 1.5 x 2 mm): validation scores the
    prediction on the preprocessed grid against the label resampled as the training data is, with the preprocessed
    spacing (the `SegmentationMetrics.update` call of Trainer.evaluate); predict scores the restored prediction
    against the label as stored, with the file's spacing. Each equals the brute-force NSD on its own grid, and the
    two differ: docs/training.md calls the first "NSD on the preprocessed grid", docs/predicting.md the second
    "NSD on the original grid"."""
    from scipy import ndimage
    from test_metrics import brute_force_nsd

    from tfmis.config import load_config
    from tfmis.data.preprocess import preprocess

    config = load_config(trained_run["dir"] / "config.yaml", NSD_OVERRIDES)
    image, affine = resampled_case(trained_run)
    stored = np.asanyarray(nib.load(str(trained_run["source"] / "labelsTr" / "case_000.nii.gz")).dataobj)
    zoom = [n / s for n, s in zip(image.shape[:3], stored.shape)]
    label = ndimage.zoom(stored, zoom, order=0)
    write_nifti(tmp_path / "in" / "fine.nii.gz", image, affine)
    write_nifti(tmp_path / "labels" / "fine.nii.gz", label, affine, np.uint8)
    predictor = Predictor(config, trained_run["dir"])
    case = InputCase("fine", str(tmp_path / "in" / "fine.nii.gz"), str(tmp_path / "labels" / "fine.nii.gz"))
    result = predictor.predict_file(case, tmp_path / "out")
    assert result.status == "ok"
    written = np.asanyarray(nib.load(str(tmp_path / "out" / "fine.nii.gz")).dataobj)

    _, grid_label, geometry = preprocess(image, label, affine, predictor.preprocessing)
    grid_prediction = predictor.grid_prediction(image, affine).grid_labels()
    assert grid_prediction.shape == grid_label.shape != written.shape
    validation = predictor.task.build_metrics().update(grid_prediction, grid_label, spacing=geometry.spacing)

    tolerances = {"organ": 1.5, "core": 2.0}
    differences = []
    for c, (name, tolerance) in enumerate(tolerances.items(), start=1):
        original = brute_force_nsd(written == c, label == c, tolerance, (1.0, 1.2, 1.5))
        preprocessed = brute_force_nsd(grid_prediction == c, grid_label == c, tolerance, geometry.spacing)
        assert result.scores[f"nsd_{name}"] == pytest.approx(original, rel=1e-12)
        assert validation[f"nsd_{name}"] == pytest.approx(preprocessed, rel=1e-12)
        differences.append(abs(original - preprocessed))
    assert max(differences) > 0.01, differences


def whole_volume_reference(predictor, image, affine):
    """The label map and probabilities as whole-scan prediction computed them before the memory work:
    float32 logits of the whole volume, softmax, `restore_geometry` per class, stack, argmax."""
    from tfmis.data.preprocess import preprocess, restore_geometry

    volume, _, geometry = preprocess(image, None, affine, predictor.preprocessing)
    logits, _ = predictor.logits(volume.astype(np.float32))
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probabilities = e / e.sum(axis=-1, keepdims=True)
    restored = np.stack(
        [
            restore_geometry(probabilities[..., k], geometry, order=1, cval=1.0 if k == 0 else 0.0)
            for k in range(probabilities.shape[-1])
        ],
        axis=-1,
    )
    return np.argmax(restored, axis=-1).astype(np.uint8), restored


def resampled_case(trained_run, spacing=(1.0, 1.2, 1.5), shape=(40, 34, 30)):
    """A case of the test dataset on a finer grid (resampled on the way in and out), as a real NIfTI file."""
    from scipy import ndimage

    img = nib.load(str(trained_run["source"] / "imagesTr" / "case_000.nii.gz"))
    image = np.asanyarray(img.dataobj).astype(np.float32)
    zoom = [n / s for n, s in zip(shape, image.shape[:3])]
    fine = np.stack([ndimage.zoom(image[..., c], zoom, order=1) for c in range(image.shape[-1])], axis=-1)
    return fine, lps_affine(spacing)


def test_label_maps_equal_the_whole_volume_computation(trained_run, tmp_path):
    """The slab-wise restore gives the old whole-volume label map and probabilities (float32 buffers), with
    or without probabilities; float16 sliding-window buffers change almost no voxel; through a real NIfTI."""
    image, affine = resampled_case(trained_run)
    write_nifti(tmp_path / "in" / "fine.nii.gz", image, affine)
    predictor = Predictor(trained_run["config"], trained_run["dir"])
    loaded = nib.load(str(tmp_path / "in" / "fine.nii.gz"))
    image = np.asanyarray(loaded.dataobj).astype(np.float32)
    reference, reference_probabilities = whole_volume_reference(predictor, image, loaded.affine)
    labels, probabilities, _ = predictor.predict_array(image, loaded.affine)
    assert probabilities.dtype == np.float32 and probabilities.shape == image.shape[:3] + (3,)
    np.testing.assert_array_equal(labels, reference)
    np.testing.assert_allclose(probabilities, reference_probabilities, atol=1e-6)
    case = InputCase("fine", str(tmp_path / "in" / "fine.nii.gz"))
    result = predictor.predict_file(case, tmp_path / "out")  # labels only: slab-wise argmax
    assert result.status == "ok" and result.peak_rss_mb > 0
    written = np.asanyarray(nib.load(str(tmp_path / "out" / "fine.nii.gz")).dataobj)
    np.testing.assert_array_equal(written, reference)
    assert (reference > 0).sum() > 100
    half = Predictor(trained_run["config"], trained_run["dir"], buffer_dtype="float16")
    assert half.predict_file(case, tmp_path / "half").status == "ok"
    written = np.asanyarray(nib.load(str(tmp_path / "half" / "fine.nii.gz")).dataobj)
    assert np.mean(written != reference) <= 1e-3


def test_roi_prediction(trained_run):
    """An ROI covering the image equals no ROI; a smaller ROI equals the whole prediction inside it away
    from its faces (a pointwise model: windows at other places give the same logits), background outside."""
    import tensorflow as tf

    image, affine = resampled_case(trained_run, shape=(60, 52, 44))
    predictor = Predictor(trained_run["config"], trained_run["dir"])
    whole, whole_probabilities, _ = predictor.predict_array(image, affine)
    covering, covering_probabilities, _ = predictor.predict_array(image, affine, roi=((0, 0, 0), image.shape[:3]))
    np.testing.assert_array_equal(covering, whole)
    np.testing.assert_array_equal(covering_probabilities, whole_probabilities)

    predictor._forward = (
        lambda w: tf.concat(  # a 1x1x1 "network": logits of each voxel from that voxel alone
            [w[..., :1], w[..., 1:2], 0.5 * (w[..., :1] + w[..., 1:2]) + 0.3], axis=-1
        )
    )
    whole, whole_probabilities, _ = predictor.predict_array(image, affine)
    assert len(np.unique(whole)) == 3
    start, stop = np.array([12, 10, 9]), np.array([50, 40, 35])
    labels, probabilities, _ = predictor.predict_array(image, affine, roi=(start, stop))
    inside = tuple(slice(a + 2, b - 2) for a, b in zip(start, stop))
    np.testing.assert_array_equal(labels[inside], whole[inside])
    np.testing.assert_allclose(probabilities[inside], whole_probabilities[inside], atol=1e-5)
    outside = np.ones(image.shape[:3], bool)
    outside[tuple(slice(a, b) for a, b in zip(start, stop))] = False
    assert not labels[outside].any() and np.all(probabilities[outside][:, 0] == 1)
    only_labels, none, _ = predictor.predict_array(image, affine, roi=(start, stop), probabilities=False)
    assert none is None
    np.testing.assert_array_equal(only_labels, labels)
    empty, _, device = predictor.predict_array(image, affine, roi=((0, 0, 0), (1, 1, 1)))
    assert not empty.any()


MEMORY_SCRIPT = r"""
import json
import sys

import numpy as np

from tfmis.config import load_config
from tfmis.inference.predictor import Predictor
from tfmis.hardware import peak_rss_mb, reset_peak_rss

sys.path.insert(0, sys.argv[4])
from test_predict import whole_volume_reference

config_path, checkpoint, path, _, which = sys.argv[1:6]
rng = np.random.default_rng(0)
image = rng.normal(100, 10, (256, 256, 192, 2)).astype(np.float32)
image[80:170, 70:190, 50:140, 0] += 30
affine = np.diag([0.75, 0.75, 1.0, 1.0])  # a finer grid than the training's 1.5 x 1.5 x 2 mm
predictor = Predictor(load_config(config_path), checkpoint)
predictor.predict_array(image[:40, :40, :40], affine)  # traces the model before the baseline
baseline = (reset_peak_rss(), peak_rss_mb())
if which == "old":
    whole_volume_reference(predictor, image, affine)
else:
    predictor.predict_array(image, affine, probabilities=False)
with open(path, "w") as f:
    json.dump({"reset": baseline[0], "over_baseline": peak_rss_mb() - baseline[1]}, f)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status and clear_refs are Linux")
@pytest.mark.slow
def test_label_only_prediction_needs_less_memory_than_the_whole_volume_way(trained_run, tmp_path):
    """Peak resident memory over the baseline on a 256x256x192x2 scan, in fresh subprocesses: the label-only
    path (slab-wise restore, normalisation in place) against the whole-volume computation of before (K float32
    maps on the original grid, stacked). Measured: 222 against 367 MiB (0.61); asserted below 0.8."""
    import json
    import os

    script = tmp_path / "memory.py"
    script.write_text(MEMORY_SCRIPT)
    over = {}
    for which in ("old", "new"):
        out = tmp_path / f"{which}.json"
        done = subprocess.run(
            [
                sys.executable,
                str(script),
                str(trained_run["dir"] / "config.yaml"),
                str(trained_run["dir"]),
                str(out),
                str(REPO / "tests"),
                which,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(out.read_text())
        if not report["reset"]:
            pytest.skip("this kernel does not let a process reset its peak RSS")
        over[which] = report["over_baseline"]
    assert over["new"] < 0.8 * over["old"], over


def _predict(trained_run, inputs, out, *extra) -> int:
    run = trained_run["dir"]
    return predict_main(
        ["--config", str(run / "config.yaml"), "--checkpoint", str(run / "best.weights.h5"), "--input", str(inputs)]
        + ["--output", str(out), "--quiet", *map(str, extra)]
    )


def test_mha_input_is_predicted_into_an_mha_with_its_direction_origin_and_spacing(trained_run, tmp_path):
    """An .mha scan (two channels as vector pixels, rotated 30 degrees about z, nonzero origin, anisotropic spacing)
    gives an .mha label map on its grid: same size, direction, origin and spacing, uint8; the same scan as NIfTI
    (written by SimpleITK) is predicted to the same labels."""
    sitk = pytest.importorskip("SimpleITK")
    data = np.asanyarray(nib.load(str(trained_run["source"] / "imagesTr" / "case_000.nii.gz")).dataobj)
    scan = sitk.GetImageFromArray(np.transpose(data, (2, 1, 0, 3)).astype(np.int16), isVector=True)
    t = np.deg2rad(30.0)
    scan.SetDirection([np.cos(t), -np.sin(t), 0.0, np.sin(t), np.cos(t), 0.0, 0.0, 0.0, 1.0])
    scan.SetOrigin((12.5, -30.25, 4.0))
    scan.SetSpacing((1.5, 1.25, 2.0))
    (tmp_path / "in").mkdir()
    sitk.WriteImage(scan, str(tmp_path / "in" / "scan.mha"))
    sitk.WriteImage(scan, str(tmp_path / "in" / "same.nii.gz"))
    assert _predict(trained_run, tmp_path / "in", tmp_path / "out") == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if "." in p.name and p.suffix != ".csv") == [
        "same.nii.gz",
        "scan.mha",
    ]
    labels = sitk.ReadImage(str(tmp_path / "out" / "scan.mha"))
    assert labels.GetSize() == scan.GetSize() and labels.GetPixelID() == sitk.sitkUInt8
    np.testing.assert_allclose(labels.GetDirection(), scan.GetDirection(), atol=1e-9)
    np.testing.assert_allclose(labels.GetOrigin(), scan.GetOrigin(), atol=1e-9)
    np.testing.assert_allclose(labels.GetSpacing(), scan.GetSpacing(), atol=1e-9)
    same = np.asanyarray(nib.load(str(tmp_path / "out" / "same.nii.gz")).dataobj)
    np.testing.assert_array_equal(np.transpose(sitk.GetArrayFromImage(labels), (2, 1, 0)), same)


@pytest.mark.parametrize("file_ending", [".nii.gz", ".mha"])
def test_nnunet_dataset_is_predicted_from_its_channel_files_as_the_msd_dataset_of_the_same_scans(
    trained_run, tmp_path, file_ending
):
    """`--input` an nnU-Net v2 raw dataset (NIfTI, MetaImage): its imagesTs cases (one file per channel) give the
    label maps the MSD dataset of the same scans gives, in the dataset's format."""
    from nnunet_layout import msd_to_nnunet

    nnunet = msd_to_nnunet(trained_run["source"], tmp_path / "Dataset099_Test", file_ending)
    assert _predict(trained_run, nnunet, tmp_path / "nnunet") == 0
    assert _predict(trained_run, trained_run["source"], tmp_path / "msd") == 0
    expected = np.asanyarray(nib.load(str(tmp_path / "msd" / "case_900.nii.gz")).dataobj)
    if file_ending == ".mha":
        sitk = pytest.importorskip("SimpleITK")
        got = np.transpose(sitk.GetArrayFromImage(sitk.ReadImage(str(tmp_path / "nnunet" / "case_900.mha"))), (2, 1, 0))
    else:
        got = np.asanyarray(nib.load(str(tmp_path / "nnunet" / "case_900.nii.gz")).dataobj)
    np.testing.assert_array_equal(got, expected)
