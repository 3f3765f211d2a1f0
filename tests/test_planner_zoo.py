"""The planner zoo (benchmarks/planner_zoo.py, benchmarks/zoo): every dataset kind writes a valid small MSD dataset
with its documented spacing, shape and class shares, and the zoo's scorer gives the Dice written out by hand."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import planner_zoo  # noqa: E402
from benchmarks.zoo import KINDS, TEST_FIRST, hand_patch, make_dataset  # noqa: E402
from benchmarks.zoo.real_anatomy import label_maps_dir  # noqa: E402


def _label_maps_present() -> bool:
    try:
        label_maps_dir()
    except FileNotFoundError:
        return False
    return True


def _kind_params():
    for name in KINDS:
        marks = []
        if name == "real_anatomy":
            marks = [
                pytest.mark.ci_may_skip("needs the 12 brain label maps of shared/data/brain_label_maps"),
                pytest.mark.skipif(not _label_maps_present(), reason="no brain label maps (shared/data)"),
            ]
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", list(_kind_params()))
def test_every_kind_writes_a_small_msd_dataset_with_its_documented_geometry_and_shares(tmp_path, name):
    """One training and one held-out test case of each kind (seed 0): dataset.json lists them, the images have the
    kind's channels, the labels its classes; spacing, shape and every foreground class's share are as documented."""
    kind = KINDS[name]
    root = tmp_path / name
    info = make_dataset(root, kind, seed=0, num_train=1, num_test=1)
    meta = json.loads((root / "dataset.json").read_text())
    assert meta["modality"] == {str(i): m for i, m in enumerate(kind.modalities)}
    assert meta["labels"] == {str(i): n for i, n in enumerate(kind.labels)}
    assert [e["image"] for e in meta["training"]] == [f"./imagesTr/{kind.case_name(0)}.nii.gz"]
    assert meta["test"] == [f"./imagesTs/{kind.case_name(TEST_FIRST)}.nii.gz"]
    for image_rel, label_path in (
        (meta["training"][0]["image"], root / meta["training"][0]["label"]),
        (meta["test"][0], root / "labelsTs" / Path(meta["test"][0]).name),
    ):
        image, label = nib.load(root / image_rel), nib.load(label_path)
        assert np.allclose(image.affine, label.affine)
        channels = image.shape[3] if len(image.shape) == 4 else 1
        assert channels == len(kind.modalities)
        assert image.shape[:3] == label.shape
        values = np.unique(np.asarray(label.dataobj))
        assert values.min() >= 0 and values.max() < len(kind.labels)
        spacing = nib.affines.voxel_sizes(image.affine)
        np.testing.assert_allclose(spacing, kind.spacing, rtol=kind.spacing_tolerance)
        np.testing.assert_allclose(label.shape, kind.shape, rtol=kind.shape_tolerance + 1e-9)
    for case in info["cases"]:
        for cls, (low, high) in kind.shares.items():
            assert low <= case["shares"][cls] <= high, (case["case"], cls, case["shares"][cls])
    assert make_dataset(root, kind, seed=0, num_train=1, num_test=1) == info  # cached: nothing rewritten
    with pytest.raises(ValueError, match="choose another folder"):
        make_dataset(root, kind, seed=1, num_train=1, num_test=1)


def test_a_case_is_a_deterministic_function_of_its_seed():
    kind = KINDS["tiny_structure"]
    a, b, c = kind.generate(1, 0), kind.generate(1, 0), kind.generate(1, 1)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert a[0].shape != c[0].shape or not np.array_equal(a[0], c[0])
    assert (a[1] == 2).sum() >= 20  # every tiny_structure case holds its lesion


def test_hand_patch_shrinks_each_axis_to_the_data_in_multiples_of_8():
    assert hand_patch((128, 104, 31), (3.2, 3.2, 3.0)) == (48, 48, 24)  # the 3 mm CT recipe
    assert hand_patch((128, 128, 24), (0.5, 0.5, 5.0)) == (48, 48, 24)
    assert hand_patch((96, 96, 62), (2.5, 2.5, 2.5)) == (48, 48, 48)
    assert hand_patch((20, 60, 5), (1.0, 1.0, 1.0)) == (16, 48, 8)
    assert hand_patch((128, 128, 30), (1.0, 1.0, 1.0), median_spacing=(2.0, 2.0, 2.0)) == (48, 48, 8)


def test_the_scorer_gives_the_dice_written_out_by_hand():
    """A 4 x 4 x 1 pair of label maps, Dice counted by hand: class 1 2|P∩G|/(|P|+|G|) = 2*3/(4+3), class 2
    2*1/(2+3), class 3 absent from the target: NaN, left out of the means."""
    target = np.array([[1, 1, 1, 0], [2, 2, 2, 0], [0, 0, 0, 0], [0, 0, 0, 0]], np.uint8)[..., None]
    prediction = np.array([[1, 1, 1, 1], [2, 0, 0, 0], [2, 0, 0, 0], [0, 0, 0, 3]], np.uint8)[..., None]
    kind = KINDS["brats_like"]  # labels 0-3 and regions {1, 2, 3}, {2, 3}, {3}
    scores = planner_zoo.score_case(prediction, target, kind)
    class_1, class_2 = 2 * 3 / (4 + 3), 2 * 1 / (2 + 3)
    assert scores["edema"] == pytest.approx(class_1)
    assert scores["non-enhancing tumor"] == pytest.approx(class_2)
    assert math.isnan(scores["enhancing tumour"])
    # whole tumour {1, 2, 3}: prediction 7 voxels, target 6, overlap 4; core {2, 3}: 3 vs 3, overlap 1
    assert scores["whole_tumour"] == pytest.approx(2 * 4 / (7 + 6))
    assert scores["tumour_core"] == pytest.approx(2 * 1 / (3 + 3))
    assert math.isnan(scores["enhancing_tumour"])
    perfect = planner_zoo.score_case(target, target, kind)
    summary = planner_zoo.aggregate({"a": scores, "b": perfect}, kind)
    assert summary["per_class"]["edema"] == pytest.approx((class_1 + 1.0) / 2)
    assert summary["per_class"]["enhancing tumour"] is None  # absent from every target
    assert summary["mean_dice"] == pytest.approx(((class_1 + 1.0) / 2 + (class_2 + 1.0) / 2) / 2)


def test_the_scorer_scores_label_files_against_labels_ts(tmp_path):
    kind = KINDS["tiny_structure"]
    root = tmp_path / "data"
    (root / "imagesTs").mkdir(parents=True)
    (root / "labelsTs").mkdir()
    target = np.zeros((4, 4, 2), np.uint8)
    target[0, :2, 0] = 1
    target[3, 3, 1] = 2
    nib.save(nib.Nifti1Image(target, np.eye(4)), root / "labelsTs" / "x_1000.nii.gz")
    (root / "dataset.json").write_text(json.dumps({"test": ["./imagesTs/x_1000.nii.gz"]}))
    predictions = tmp_path / "pred"
    predictions.mkdir()
    prediction = target.copy()
    prediction[0, 2, 0] = 1  # one false positive of class 1: 2*2/(3+2)
    nib.save(nib.Nifti1Image(prediction, np.eye(4)), predictions / "x_1000.nii.gz")
    result = planner_zoo.score_folder(predictions, root, kind)
    assert result["per_class"] == {"spleen": pytest.approx(0.8), "lesion": 1.0}
    assert result["mean_dice"] == pytest.approx(0.9)


def test_history_stats_time_to_fractions_of_the_best_dice_over_stages(tmp_path):
    """Two stages (as a cascade plan writes them): the second's times follow the first's; 0.8 and 0.9 of the best
    (0.9) are 0.72 and 0.81."""
    coarse, fine = tmp_path / "run" / "lowres", tmp_path / "run" / "cascade"
    for folder, records in (
        (coarse, [{"epoch": 1, "elapsed_seconds": 10.0, "val_mean_dice": 0.5}, {"epoch": 2, "elapsed_seconds": 20.0}]),
        (fine, [{"epoch": 1, "elapsed_seconds": 5.0, "val_mean_dice": 0.75}, {"epoch": 2, "elapsed_seconds": 9.0,
                                                                                 "val_mean_dice": 0.9}]),
    ):  # fmt: skip
        folder.mkdir(parents=True)
        (folder / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    import os

    os.utime(coarse / "history.jsonl", (1, 1))  # written first
    stats = planner_zoo.history_stats(tmp_path / "run")
    assert stats["wall_seconds"] == 29.0 and stats["epochs"] == 4 and stats["best_val_dice"] == 0.9
    assert stats["time_to_fraction_of_best"] == {"0.8": 25.0, "0.9": 29.0}


def test_verdict_per_kind_and_report():
    """The verdict averages each arm's test Dice over the seeds and says yes only when no config reaches both the hand
    recipe and MONAI's (a tie counts); an arm without results makes it incomplete."""
    dice = {("noconfig", 0): 0.8, ("noconfig", 1): 0.7, ("hand", 0): 0.7, ("hand", 1): 0.7, ("monai", 0): 0.6}
    dice[("monai", 1)] = 0.9
    results = [
        {"kind": "k", "arm": a, "seed": s, "status": "ok", "budget_seconds": 18, "test": {"mean_dice": d}}
        for (a, s), d in dice.items()
    ]
    v = planner_zoo.verdicts(results, ["k"], ["noconfig", "hand", "monai"])
    assert v["k"]["means"] == {
        "noconfig": pytest.approx(0.75),
        "hand": pytest.approx(0.7),
        "monai": pytest.approx(0.75),
    }
    assert v["k"]["verdict"] == "yes"  # 0.75 >= 0.7 and 0.75 >= 0.75
    results[-1]["test"]["mean_dice"] = 0.95  # MONAI's seed 1: its mean 0.775 > 0.75
    assert planner_zoo.verdicts(results, ["k"], ["noconfig", "hand", "monai"])["k"]["verdict"] == "no"
    missing = [*results[:4], {"kind": "k", "arm": "monai", "seed": 0, "status": "missing", "budget_seconds": 18}]
    assert planner_zoo.verdicts(missing, ["k"], list(planner_zoo.ARMS))["k"]["verdict"].startswith("incomplete")


def test_a_variants_planning_arguments_are_ones_tfmis_plan_parses(monkeypatch):
    """The zoo plans a variant's data before its clock with `tfmis-plan` and the variant's arguments less the ones
    only `tfmis-train` takes (`--set` pairs, `--pilot [SHARE]`): tfmis-plan's real parser accepts what is left, and
    tfmis-train's parser the whole variant."""
    from tfmis.plan import build_parser as plan_parser
    from tfmis.train import build_parser as train_parser

    monkeypatch.setattr(planner_zoo, "VARIANTS", {})
    planner_zoo.VARIANTS.update(
        planner_zoo.variant_arms(
            ["pilot=--pilot 0.4 --cpu-patch 64 --set training.epochs=3", "bare=--pilot --configuration fullres"]
        )
    )
    for arm, expected in (("noconfig_pilot", ["--cpu-patch", "64"]), ("noconfig_bare", ["--configuration", "fullres"])):
        planning = planner_zoo.plan_arguments(arm)
        assert planning == expected
        plan_parser().parse_args(["--source-dir", "D", *planning])
        train_parser().parse_args(["--source-dir", "D", *planner_zoo.VARIANTS[arm]])
