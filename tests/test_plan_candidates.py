"""The plan's candidates (tfmis.planning.stages): full resolution always; low resolution and a cascade on it only
when the full-resolution patch covers under 25% of the median image and the low-resolution median image has at
least 2x fewer voxels (nnU-Net v2's rules); one recommended, never the others deleted; every candidate written to
`candidates.yaml` for cross-validation; the cascade's regions the plan counts equal to those cascade prediction cuts.

Real fingerprints come from the demo generators (the demo brain, the CT-like demo) and from labelled NIfTI cases
written here; the BraTS-size and CT-size fingerprints are the synthetic ones of test_cascade.py (a real BraTS-size
demo takes minutes to write).
"""

from __future__ import annotations

import json
import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest
from test_cascade import CPU, fingerprint
from test_plan import _env

from tfmis.config import load_stages
from tfmis.crossvalidation.experiment import parse_configurations
from tfmis.errors import UsageError
from tfmis.planning import fingerprint_msd
from tfmis.planning.stages import CANDIDATES_FILE, MIN_VOXELS_ACROSS, measure_regions, plan_stages
from tfmis.run_plans import load_stages as training_stages

BRATS_LIKE = fingerprint([1.0] * 3, [140, 172, 140], [3e6, 6e4, 2.5e4, 1.5e4], [70, 80, 60])
CT_LIKE = fingerprint([0.8, 0.8, 2.5], [480, 360, 240], [5e7, 3e6, 2e3], [120, 90, 80])


def _plan(args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "tfmis.plan", *args, "--quiet", "--workers", "1"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def ct_demos(tmp_path_factory):
    """The CT-like demo at 160x160x64 (the low-resolution stage would save 1.81x: dropped) and at 192x192x64 (2.99x:
    three candidates), 6 cases each."""
    from tfmis.data.demos.ct import make_ct_dataset

    root = tmp_path_factory.mktemp("ct_demos")
    small = make_ct_dataset(root / "ct160", num_cases=6, num_test=0, shape=(160, 160, 64))
    large = make_ct_dataset(root / "ct192", num_cases=6, num_test=0, shape=(192, 192, 64))
    return small, large


def test_the_demo_brain_offers_only_full_resolution_in_its_own_run_folder(tmp_path):
    """The demo brain (2.5 mm): the full-resolution patch covers >= 25% of the median image, so fullres is the only
    candidate and the recommendation; its plan.yaml is the plain config training in the output folder itself (as
    before candidates), and candidates.yaml names that one plan, which parse_configurations reads as `fullres`."""
    from tfmis.data.demos.brain import make_demo_dataset

    source = make_demo_dataset(tmp_path / "Task00_DemoBrain", num_training=12, num_test=0)
    staged = plan_stages(fingerprint_msd(source, workers=1, progress=False), CPU, output_dir=str(tmp_path / "run"))
    assert list(staged.candidates) == ["fullres"] and staged.recommended == "fullres" and staged.single
    assert "(>= 25%: no low-resolution stage, as nnU-Net)" in staged.decision[0]
    assert staged.reasons["recommended"] == "the only candidate"
    path = staged.write()
    assert path == tmp_path / "run" / "plan.yaml" and load_stages(path) is None
    assert staged.final.values["output.dir"] == str(tmp_path / "run")
    assert load_stages(tmp_path / "run" / CANDIDATES_FILE) == [("fullres", path)]
    [configuration] = parse_configurations([str(tmp_path / "run" / CANDIDATES_FILE)])
    assert (configuration.name, configuration.coarse) == ("fullres", None)


def test_lowres_is_dropped_when_it_saves_less_than_2x_the_voxels():
    """3 mm images of median 72x80x78: the 48^3 patch covers 24.6% (< 25%), nnU-Net's loop stops after one 3% step
    at 3.09 mm, whose median image has 1.03^3 = 1.09x fewer voxels (< 2x): fullres is the only candidate, and the
    decision says why in numbers."""
    fp = fingerprint([3.0] * 3, [72, 80, 78], [3e6, 6e4, 2.5e4, 1.5e4], [70, 80, 60])
    staged = plan_stages(fp, CPU)
    assert list(staged.candidates) == ["fullres"] and staged.recommended == "fullres"
    assert "covers 24.6% of the median image 72x80x78" in staged.decision[0]
    assert "low resolution 3.09x3.09x3.09 mm" in staged.decision[1] and "1 step(s)" in staged.decision[1]
    assert f"{1.03**3:.3g}" == "1.09"
    assert staged.decision[2] == (
        "lowres dropped: 1.09x fewer voxels than full resolution (< 2x, nnU-Net), and with it the cascade"
    )


@pytest.mark.slow
def test_a_real_ct_demo_whose_lowres_saves_under_2x_refuses_a_forced_lowres_in_one_line(ct_demos, tmp_path):
    """The CT-like demo at 160x160x64: the low-resolution stage saves 1.81x (< 2x), so fullres is the only candidate;
    `tfmis-plan --configuration lowres` (and cascade, through the API) is one error line naming the saving, exit 2,
    nothing written; --configuration fullres plans."""
    small, _ = ct_demos
    fp = fingerprint_msd(small, workers=1, progress=False)
    staged = plan_stages(fp, CPU)
    assert list(staged.candidates) == ["fullres"]
    assert any(line.startswith("lowres dropped: 1.81x fewer voxels") for line in staged.decision)
    for forced in ("lowres", "cascade"):
        with pytest.raises(UsageError, match=f"^--configuration {forced}: .* only 1.81x fewer voxels .* no {forced} "):
            plan_stages(fp, CPU, configuration=forced)
    out = tmp_path / "run"
    done = _plan(["--source-dir", str(small), "--output-dir", str(out), "--configuration", "lowres"], tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "only 1.81x fewer voxels than the full-resolution one" in errors[0]
    assert errors[0].endswith("so there is no lowres candidate; drop --configuration or use --configuration fullres")
    assert not out.exists()
    assert plan_stages(fp, CPU, configuration="fullres").recommended == "fullres"


@pytest.mark.parametrize(
    "fp, recommended, why",
    [
        (BRATS_LIKE, "lowres", f">= {MIN_VOXELS_ACROSS:g} low-resolution voxels across: the coarse grid draws"),
        (CT_LIKE, "cascade", "of the foreground crop: the coarse stage locates them on the whole scan"),
    ],
    ids=["brats-size", "ct-size"],
)
def test_brats_and_ct_sizes_offer_three_candidates_in_their_own_folders_and_recommend_one(
    fp, recommended, why, tmp_path
):
    """BraTS at 1 mm and abdominal CT at 0.8 mm: fullres, lowres and cascade are all candidates (lowres saves >= 2x,
    its ratio in the reason equal to the product of the spacing ratios); each stage has its own run folder, the
    lowres one shared by the lowres candidate and the cascade's coarse stage (one Plan); the recommendation (lowres
    for BraTS's large tumour classes, a cascade for the CT's small lesion) says why, and its stages are the
    candidate's. With a 10-minute budget each stage has all of it, but a recommended cascade's stages share it."""
    out = tmp_path / "run"
    staged = plan_stages(fp, CPU, output_dir=str(out), dataset_dir=str(tmp_path / "data"), max_minutes=10)
    assert list(staged.candidates) == ["fullres", "lowres", "cascade"] and not staged.single
    assert staged.recommended == recommended and staged.stages == staged.candidates[recommended]
    assert why in staged.reasons["recommended"] and staged.decision[-1].startswith(f"recommended {recommended}: ")
    [(_, full)], [(_, low)] = staged.candidates["fullres"], staged.candidates["lowres"]
    (_, coarse), (fine_name, fine) = staged.candidates["cascade"]
    assert coarse is low and fine_name == "cascade"
    assert full.values["output.dir"] == str(out / "fullres")
    assert full.values["data.dataset_dir"] == str(tmp_path / "data")
    assert low.values["output.dir"] == str(out / "lowres") and low.values["data.dataset_dir"].endswith("data_lowres")
    assert fine.values["output.dir"] == str(out / "cascade") and fine.values["data.dataset_dir"].endswith("data_roi")
    assert fine.values["cascade.coarse_run"] == str(out / "lowres")
    ratio = float(np.prod(np.array(low.values["data.conversion.spacing"]) / full.values["data.conversion.spacing"]))
    assert ratio >= 2 and f"{ratio:.3g}x fewer voxels than full resolution (>= 2x)" == staged.reasons["lowres"]
    # the time budget: the whole of it for each stage, but a recommended cascade's stages share it (40% / 60%)
    minutes = [plan.values["training.max_minutes"] for plan in (full, low, fine)]
    assert minutes == ([10.0, 4.0, 6.0] if recommended == "cascade" else [10.0, 10.0, 6.0])
    table = staged.table()
    assert f"* {recommended}" in table and "candidates (* recommended)" in table


def test_the_candidates_file_cross_validates_every_candidate_and_plan_yaml_trains_the_recommended(tmp_path):
    """write() on the CT-size plan: candidates.yaml is a stages file of fullres, lowres and cascade (each stage once),
    which parse_configurations turns into configurations fullres, lowres and cascade with coarse stage lowres; plan.yaml
    names the recommended cascade's stages (lowres, cascade). A recommended single stage (lowres for BraTS) is a
    one-stage stages file whose stage trains in <output.dir>/lowres under --set output.dir, the other overrides
    applied too."""
    out = tmp_path / "ct"
    staged = plan_stages(CT_LIKE, CPU, output_dir=str(out), dataset_dir=str(tmp_path / "data"))
    plan = staged.write()
    candidates = out / CANDIDATES_FILE
    assert load_stages(candidates) == [(n, out / n / "plan.yaml") for n in ("fullres", "lowres", "cascade")]
    assert load_stages(plan) == [("lowres", out / "lowres" / "plan.yaml"), ("cascade", out / "cascade" / "plan.yaml")]
    configurations = parse_configurations([str(candidates)])
    assert [(c.name, c.coarse) for c in configurations] == [("fullres", None), ("lowres", None), ("cascade", "lowres")]
    assert "tfmis-crossval --config" in candidates.read_text() and "recommended: cascade" in candidates.read_text()

    brats = plan_stages(BRATS_LIKE, CPU, output_dir=str(tmp_path / "brats")).write()
    assert load_stages(brats) == [("lowres", tmp_path / "brats" / "lowres" / "plan.yaml")]
    [stage] = training_stages(brats, [f"output.dir={tmp_path / 'elsewhere'}", "training.epochs=3"])
    assert stage.config.output.dir == str(tmp_path / "elsewhere" / "lowres") and stage.config.training.epochs == 3


@pytest.mark.slow
def test_plan_command_on_a_ct_demo_with_three_candidates_prints_and_writes_them(ct_demos, tmp_path):
    """`tfmis-plan` on the CT-like demo at 192x192x64: prints the three candidates with the recommended one marked and
    its reason, writes plan.yaml (the recommended stages), candidates.yaml (all three) and the candidates and the
    recommendation into plan_fingerprint.json."""
    _, large = ct_demos
    out = tmp_path / "run"
    done = _plan(["--source-dir", str(large), "--output-dir", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "plan_fingerprint.json").read_text())["plan"]
    recommended = summary["recommended"]
    assert list(summary["candidates"]) == ["fullres", "lowres", "cascade"]
    assert "x fewer voxels than full resolution" in summary["candidates"]["lowres"]["reason"]
    assert [s["output_dir"] for s in summary["candidates"]["cascade"]["stages"]] == [
        str(out / "lowres"),
        str(out / "cascade"),
    ]
    assert f"* {recommended}" in done.stdout
    assert f"recommended  {recommended}: {summary['recommendation']}" in done.stdout
    assert f"tfmis-crossval --config {out / CANDIDATES_FILE}" in done.stdout
    assert [n for n, _ in load_stages(out / CANDIDATES_FILE)] == ["fullres", "lowres", "cascade"]
    stages = [s["name"] for s in summary["candidates"][recommended]["stages"]]
    assert [n for n, _ in load_stages(out / "plan.yaml")] == stages


def test_planned_region_share_is_the_share_of_the_crop_cascade_prediction_feeds_the_fine_stage(tmp_path):
    """Three cases of 216x166x40 voxels at 1x1x2 mm: a body (the foreground crop, 200x150x32) holding an organ block
    (shifted one voxel a case) and two 6x6x3-voxel lesions in far corners, one whose region reaches past the crop.
    The planner's regions (`StagePlanner.determine_regions` on the fine stage's plan, whose window is its patch:
    count and share of the crop per case) against a real cascade prediction of each case (`CascadePredictor`:
    coarse 2x2x4 mm and fine run folders with the planned patch and margin, both networks a fixed intensity
    classifier that finds the labels, as in tests/test_cascade_regions.py): the same number of regions, and a share
    within 5% of the voxels the fine stage is given (its inputs recorded as they pass, over the crop counted from
    the image). Prediction grows each region to at least the fine window; the lesions' boxes + 20 mm are smaller
    than it, so without that growth the count (`measure_regions` with no window) is under half that share."""
    from test_cascade_regions import COARSE_SPACING, make_run, threshold_network

    from tfmis.config import load_config
    from tfmis.inference.cascade import make_predictor
    from tfmis.planning.planner import ExperimentPlanner
    from tfmis.planning.stages import CASCADE_MARGIN_MM, StagePlanner

    shape, spacing = (216, 166, 40), (1.0, 1.0, 2.0)
    body = [(8, 208), (8, 158), (4, 36)]
    lesions = [[(190, 196), (140, 146), (26, 29)], [(190, 196), (14, 20), (6, 9)]]
    root = tmp_path / "corners"
    cases, images = [], []
    for i in range(3):
        label = np.zeros(shape, np.uint8)
        label[14 + i : 40 + i, 14:40, 10:18] = 1  # the organ
        for box in lesions:
            label[tuple(slice(a, b) for a, b in box)] = 2
        image = np.zeros(shape, np.float32)
        image[tuple(slice(a, b) for a, b in body)] = 0.25  # foreground, below the classifier's 0.5
        image[label > 0] = label[label > 0]  # the classifier's class 1 from 0.5, class 2 from 1.5
        images.append(image)
        for folder, array in (("imagesTr", image), ("labelsTr", label)):
            (root / folder).mkdir(parents=True, exist_ok=True)
            nib.save(nib.Nifti1Image(array, np.diag([*spacing, 1.0])), str(root / folder / f"c_{i}.nii.gz"))
        cases.append({"image": f"./imagesTr/c_{i}.nii.gz", "label": f"./labelsTr/c_{i}.nii.gz"})
    (root / "dataset.json").write_text(
        json.dumps(
            {
                "name": "corners",
                "modality": {"0": "MR"},
                "labels": {"0": "background", "1": "organ", "2": "lesion"},
                "training": cases,
                "test": [],
                "numTraining": 3,
            }
        )
    )
    fp = fingerprint_msd(root, workers=1, progress=False)
    coarse_dir, fine_dir = tmp_path / "coarse", tmp_path / "fine"
    fine = ExperimentPlanner(
        fp, CPU, roi_margin_mm=CASCADE_MARGIN_MM, coarse_run=str(coarse_dir), output_dir=str(tmp_path / "run")
    ).plan()
    planner = StagePlanner(fp, CPU)
    planner.determine_regions(fine)
    planned = fine.summary["regions"]
    window, fine_spacing = fine.values["validation.roi_size"], fine.values["data.conversion.spacing"]
    assert fine_spacing == list(spacing)
    assert planner.fine_window_mm() == planner.fine_window_mm(fine)  # the recommendation's count uses that window
    grown = [b - a + 2 * 20 for a, b in lesions[0][:2]]  # a lesion's box + 20 mm in-plane, in voxels of 1 mm
    assert all(w > g for w, g in zip(window[:2], grown)), (window, grown)

    make_run(coarse_dir, COARSE_SPACING, (16, 16, 8))
    make_run(fine_dir, tuple(spacing), window, coarse_run=str(coarse_dir), margin_mm=CASCADE_MARGIN_MM)
    predictor = make_predictor(load_config(fine_dir / "config.yaml"), fine_dir, device="cpu")
    predictor.fine.model, predictor.coarse.model = threshold_network(), threshold_network()
    given = []  # the shape of each volume the fine stage predicts (at the scan's spacing: its voxels)
    fine_stage = predictor.fine.preprocessed_prediction

    def recorded(holder, geometry, case_id, roi):
        given.append(holder[0].shape[:3])
        return fine_stage(holder, geometry, case_id, roi)

    predictor.fine.preprocessed_prediction = recorded
    counts, shares = [], []
    for image in images:
        given.clear()
        predictor.predict_array(image[..., None], np.diag([*spacing, 1.0]), probabilities=False)
        where = np.argwhere(image != 0)
        crop_voxels = float(np.prod(where.max(axis=0) + 1 - where.min(axis=0)))
        counts.append(len(predictor.last_boxes))
        shares.append(sum(float(np.prod(g)) for g in given) / crop_voxels)
    assert planned["per_case"] == counts == [3, 3, 3], (planned, counts)
    np.testing.assert_allclose(planned["share_of_crop"], shares, rtol=0.05)
    unwindowed = measure_regions(fp, CASCADE_MARGIN_MM)[2]
    assert max(unwindowed) < 0.5 * min(shares), (unwindowed, shares)
