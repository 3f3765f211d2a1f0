"""Ensembles at prediction: the folds of a configuration (`Predictor` over several runs), two configurations of a
cross-validation (`ConfigurationEnsemble`), what `--checkpoint` names (`resolve_checkpoint`) and the command's
`--folds`, errors and postprocessing.

The runs are real: tiny models trained for two steps each on the session's converted dataset (different seeds, so
their predictions differ), laid out as a cross-validation's folders `<cv>/a/fold_k` and `<cv>/b/fold_k` (b a wider
network). Every expected value is computed here from the single runs' own predictions.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tracemalloc

import nibabel as nib
import numpy as np
import pytest
import tensorflow as tf
from conftest import lps_affine, tiny_config, write_nifti

from tfmis.config import load_config, save_config
from tfmis.data.preprocess import preprocess
from tfmis.data.sources.image_io import load_image
from tfmis.engine.trainer import Trainer
from tfmis.inference.cascade import CascadePredictor
from tfmis.inference.ensemble import ConfigurationEnsemble, build_predictor, resolve_checkpoint
from tfmis.inference.predictor import Predictor, mean_probability_logits
from tfmis.inference.restore import paint_regions
from tfmis.predict import main as predict_main

FOLDS = 3


@pytest.fixture(scope="module")
def runs(converted_dataset, tmp_path_factory):
    """{"a": [fold run folders], "b": [...], "image": a test scan}: configuration a (filters 4, 8) and b (6, 12),
    three folds each, trained for 2 steps with seeds 0-5."""
    root = tmp_path_factory.mktemp("ensemble_runs")
    folders = {}
    for name, filters, first_seed in (("a", "[4,8]", 0), ("b", "[6,12]", FOLDS)):
        folders[name] = []
        for fold in range(FOLDS):
            out = root / name / f"fold_{fold}"
            overrides = [f"model.filters={filters}", "training.epochs=1", f"training.seed={first_seed + fold}"]
            Trainer(tiny_config(converted_dataset, out, *overrides)).fit()
            folders[name].append(out)
    folders["image"] = converted_dataset.parent / "Task99_Test" / "imagesTs" / "case_900.nii.gz"
    return folders


def write_crossval(folder, runs, chosen, postprocessing=None, folds=FOLDS):
    """A cross-validation folder as tfmis-crossval writes it (crossval.json naming the runs where they are)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "version": 1,
        "folds": list(range(folds)),
        "configurations": {
            name: {"folds": {str(k): str(run) for k, run in enumerate(runs[name])}} for name in ("a", "b")
        },
        "chosen": {"configurations": chosen, "postprocessing": postprocessing or {}},
    }
    (folder / "crossval.json").write_text(json.dumps(data, indent=1))
    return folder


def config_of(run, roi=None):
    config = load_config(run / "config.yaml")
    if roi is not None:
        config = dataclasses.replace(config, validation=dataclasses.replace(config.validation, roi_size=list(roi)))
    return config


def scan(runs):
    image, affine, _ = load_image(runs["image"], 2, "case_900", integers=True)
    return image, affine


def softmax(logits):
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_mean_probability_logits_give_the_mean_softmax_and_the_mean_sigmoid_even_at_extreme_logits():
    """The window logits of an ensemble: their softmax is the mean of the models' softmaxes, their sigmoid the mean
    of the models' sigmoids (regions), to float32 rounding, with logits up to +-200 (where a probability underflows
    in float32 or 1 - p cancels); one model's logits come back unchanged."""
    rng = np.random.default_rng(0)
    logits = [rng.normal(0, 5, (4, 6, 6, 6, 3)).astype(np.float32) for _ in range(3)]
    logits[0][0, 0, 0, 0] = [200.0, -200.0, 0.0]
    logits[1][0, 0, 0, 0] = [-200.0, 200.0, 0.0]
    mean = np.mean([softmax(z.astype(np.float64)) for z in logits], axis=0)
    got = tf.nn.softmax(mean_probability_logits([tf.constant(z) for z in logits]), axis=-1).numpy()
    np.testing.assert_allclose(got, mean, atol=2e-6, rtol=0)
    mean_sigmoid = np.mean([1 / (1 + np.exp(-z.astype(np.float64))) for z in logits], axis=0)
    got = tf.sigmoid(mean_probability_logits([tf.constant(z) for z in logits], regions=True)).numpy()
    np.testing.assert_allclose(got, mean_sigmoid, atol=2e-6, rtol=0)
    # a region all models call certain: the mean 1 - p (about 1e-87 in float64) stays a finite large logit
    certain = mean_probability_logits([tf.constant([200.0]), tf.constant([250.0])], regions=True).numpy()
    assert np.isfinite(certain).all() and certain[0] > 60
    single = tf.constant(logits[0])
    assert mean_probability_logits([single]) is single


def test_fold_ensemble_probabilities_are_the_mean_of_the_folds_probabilities_where_one_window_covers_the_scan(runs):
    """One 32^3 window covers the preprocessed scan (no blending): the fold ensemble's probabilities on the
    preprocessed grid and on the scan's grid equal the mean of the three single runs' probabilities (each with its
    own flip test-time augmentation) to 1e-5, and its labels are their argmax; the folds differ from each other
    by far more than that. One run in a list is the single run's prediction, bit for bit."""
    image, affine = scan(runs)
    config = config_of(runs["a"][0], roi=(32, 32, 32))
    options = dict(device="cpu", tta=True, tta_axes=(0,))
    ensemble = Predictor(config, runs["a"], **options)
    singles = [Predictor(config, run, **options) for run in runs["a"]]
    assert len(ensemble.models) == FOLDS and [c.parent for c in ensemble.checkpoints] == runs["a"]
    grid = ensemble.grid_prediction(image, affine)
    assert max(grid.probabilities.shape[:3]) <= 32  # one window
    each = [s.grid_prediction(image, affine).probabilities for s in singles]
    assert min(np.abs(each[i] - each[j]).max() for i in range(3) for j in range(i)) > 1e-2
    np.testing.assert_allclose(grid.probabilities, np.mean(each, axis=0), atol=1e-5, rtol=0)

    labels, probabilities, _ = ensemble.predict_array(image, affine, probabilities=True)
    mean = np.mean([s.predict_array(image, affine, probabilities=True)[1] for s in singles], axis=0)
    np.testing.assert_allclose(probabilities, mean, atol=1e-5, rtol=0)
    top2 = np.sort(mean, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 1e-4  # voxels whose mean is not a near-tie
    np.testing.assert_array_equal(labels[clear], np.argmax(mean, axis=-1)[clear])

    volume, _, _ = preprocess(image, None, affine, ensemble.preprocessing)
    one = Predictor(config, [runs["a"][1]], **options).logits(volume)[0]
    np.testing.assert_array_equal(one, singles[1].logits(volume)[0])


@pytest.mark.slow
def test_fold_ensemble_of_region_runs_averages_the_regions_sigmoids(converted_dataset, runs, tmp_path):
    """Two folds trained on regions (`model.output: regions`, one sigmoid per region), one window over the scan:
    the ensemble's region probabilities are the mean of the two runs' sigmoids (1e-5) and its label map paints
    that mean (each region where it exceeds 0.5, in order)."""
    regions = ["model.output=regions", "loss.activation=sigmoid", "validation.regions={lesion: [1, 2], core_only: [2]}"]
    folds = []
    for fold in range(2):
        out = tmp_path / f"fold_{fold}"
        Trainer(tiny_config(converted_dataset, out, *regions, "training.epochs=1", f"training.seed={fold}")).fit()
        folds.append(out)
    image, affine = scan(runs)
    config = config_of(folds[0], roi=(32, 32, 32))
    ensemble = Predictor(config, folds, device="cpu")
    assert ensemble.task.paint_labels is not None  # sigmoids painted into labels
    grid = ensemble.grid_prediction(image, affine).probabilities
    each = [Predictor(config, run, device="cpu").grid_prediction(image, affine).probabilities for run in folds]
    assert np.abs(each[0] - each[1]).max() > 1e-2
    mean = np.mean(each, axis=0)
    np.testing.assert_allclose(grid, mean, atol=1e-5, rtol=0)
    labels, probabilities, _ = ensemble.predict_array(image, affine, probabilities=True)
    restored = np.mean([Predictor(config, run, device="cpu").predict_array(image, affine)[1] for run in folds], 0)
    np.testing.assert_allclose(probabilities, restored, atol=1e-5, rtol=0)
    clear = (np.abs(restored - 0.5) > 1e-4).all(axis=-1)
    np.testing.assert_array_equal(labels[clear], paint_regions(restored, ensemble.task.paint_labels)[clear])


@pytest.mark.slow
def test_fold_ensemble_with_overlapping_windows_is_close_to_the_mean_of_the_folds(runs):
    """16^3 windows overlapping by half: the windows blend log-mean-probabilities, so the ensemble is a normalised
    blend of the windows' means, not exactly the mean of the folds' blended probabilities; on this scan it stays
    within 0.05 of it and gives the same label on at least 99% of the voxels."""
    image, affine = scan(runs)
    config = config_of(runs["a"][0], roi=(16, 16, 16))
    ensemble = Predictor(config, runs["a"], device="cpu", overlap=0.5)
    singles = [Predictor(config, run, device="cpu", overlap=0.5) for run in runs["a"]]
    grid = ensemble.grid_prediction(image, affine).probabilities
    assert max(grid.shape[:3]) > 16  # several windows
    mean = np.mean([s.grid_prediction(image, affine).probabilities for s in singles], axis=0)
    difference = np.abs(grid - mean).max()
    assert difference < 0.05, difference
    assert np.mean(np.argmax(grid, -1) == np.argmax(mean, -1)) >= 0.99


def test_two_chosen_configurations_average_their_fold_ensembles_probabilities(runs, tmp_path, capsys):
    """crossval.json choosing a and b: the prediction's probabilities are the mean of a's fold ensemble and b's
    fold ensemble, each predicted here on its own (to 1e-6); the labels are that mean's argmax. Through the command,
    the header names both configurations and the written label map is the same."""
    image, affine = scan(runs)
    cv = write_crossval(tmp_path / "cv", runs, ["a", "b"])
    source = resolve_checkpoint(cv)
    assert [m.name for m in source.members] == ["a", "b"] and source.models == 2 * FOLDS
    predictor = build_predictor(source, device="cpu")
    assert isinstance(predictor, ConfigurationEnsemble)
    labels, probabilities, _ = predictor.predict_image([image.copy()], affine, probabilities=True)
    pa = Predictor(config_of(runs["a"][0]), runs["a"], device="cpu").predict_array(image, affine)[1]
    pb = Predictor(config_of(runs["b"][0]), runs["b"], device="cpu").predict_array(image, affine)[1]
    assert np.abs(pa - pb).max() > 1e-2
    mean = (pa + pb) / 2
    np.testing.assert_allclose(probabilities, mean, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(labels, np.argmax(mean, axis=-1))

    code = predict_main(["--checkpoint", str(cv), "--input", str(runs["image"]), "--output", str(tmp_path / "out")])
    assert code == 0
    out = capsys.readouterr().out
    assert f"Predicting with ensemble of a (3 folds) + b (3 folds) of {cv} (crossval.json's choice)" in out
    assert "Postprocessing: none (crossval.json's choice)" in out
    written = np.asanyarray(nib.load(str(tmp_path / "out" / "case_900.nii.gz")).dataobj)
    np.testing.assert_array_equal(written, labels)


def test_folds_subset_predicts_with_those_folds_only(runs, tmp_path, capsys):
    """`--folds 0,2` on a folder of folds: the ensemble of folds 0 and 2 (the written labels equal a `Predictor`
    over those two runs), named in the header."""
    folder = runs["a"][0].parent
    assert resolve_checkpoint(folder, [0, 2]).members[0].runs == [runs["a"][0], runs["a"][2]]
    output = tmp_path / "out"
    args = ["--checkpoint", str(folder), "--folds", "0,2", "--input", str(runs["image"]), "--output", str(output)]
    assert predict_main(args) == 0
    assert f"Predicting with ensemble of folds 0, 2 of {folder}" in capsys.readouterr().out
    image, affine = scan(runs)
    expected = Predictor(config_of(runs["a"][0]), [runs["a"][0], runs["a"][2]], device="cpu")
    written = np.asanyarray(nib.load(str(output / "case_900.nii.gz")).dataobj)
    np.testing.assert_array_equal(written, expected.predict_array(image, affine, probabilities=False)[0])


def test_a_missing_or_unfinished_fold_is_one_error_line_and_exit_1(runs, tmp_path, capsys):
    """Through the command: an unfinished fold (no final.weights.h5, the folds' default weights, or best.weights.h5
    with --weights best) of a folder of folds and a fold crossval.json
    expects that is not there each end in exit 1 with one line naming the fold; --folds naming a fold that does
    not exist, --folds for one run and a training split (`--subset split:val`, one run's) for an ensemble are
    arguments that do not fit the checkpoint: exit 2 with one line; --folds that is not a list of numbers is
    argparse's usage error (exit 2)."""
    folder = tmp_path / "a"
    shutil.copytree(runs["a"][0], folder / "fold_0")
    (folder / "fold_1").mkdir()
    shutil.copy(runs["a"][1] / "config.yaml", folder / "fold_1" / "config.yaml")  # training never finished
    cv = write_crossval(tmp_path / "cv", runs, ["a"], folds=4)  # fold 3 was never trained
    common = ["--input", str(runs["image"]), "--output", str(tmp_path / "out")]
    cases = [
        (["--checkpoint", str(folder)], f"fold 1 of a: {folder / 'fold_1'} has no final.weights.h5", 1),
        (
            ["--checkpoint", str(folder), "--weights", "best"],
            f"fold 1 of a: {folder / 'fold_1'} has no best.weights.h5",
            1,
        ),
        (["--checkpoint", str(cv)], f"fold 3 of a: {cv / 'a' / 'fold_3'} is missing", 1),
        (["--checkpoint", str(runs["a"][0].parent), "--folds", "0,5"], "has no fold 5 (its folds: 0, 1, 2)", 2),
        (["--checkpoint", str(runs["a"][0]), "--folds", "0"], "is one run, not a folder of folds", 2),
        (["--checkpoint", str(runs["a"][0].parent), "--subset", "split:val"], "3 runs predict, each trained on", 2),
    ]
    for args, message, code in cases:
        assert predict_main(args + common) == code
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("error: ") and message in err, err
    assert "rerun tfmis-crossval" in resolve_error(folder) and "--folds 0" in resolve_error(folder)
    with pytest.raises(SystemExit) as exit_info:
        predict_main(["--checkpoint", str(folder), "--folds", "0,x"] + common)
    assert exit_info.value.code == 2


def resolve_error(checkpoint) -> str:
    with pytest.raises(FileNotFoundError) as e:
        resolve_checkpoint(checkpoint)
    return str(e.value)


@pytest.mark.slow
def test_configurations_of_different_classes_cannot_be_averaged(runs, tmp_path):
    """A chosen configuration whose runs have other classes: one error naming it, before any case."""
    other = tmp_path / "cv" / "b"
    for k, run in enumerate(runs["b"]):
        shutil.copytree(run, other / f"fold_{k}")
        data = json.loads((other / f"fold_{k}" / "training_data.json").read_text())
        data["source"]["labels"] = ["background", "organ", "lesion"]
        (other / f"fold_{k}" / "training_data.json").write_text(json.dumps(data))
    moved = {"a": runs["a"], "b": [other / f"fold_{k}" for k in range(FOLDS)]}
    cv = write_crossval(tmp_path / "cv", moved, ["a", "b"])
    with pytest.raises(ValueError, match="configuration b: its classes .* differ from a's .* same classes"):
        build_predictor(resolve_checkpoint(cv), device="cpu")


@pytest.mark.slow
def test_a_cascade_configurations_coarse_stage_is_the_ensemble_of_its_folds_coarse_runs(runs, tmp_path, capsys):
    """A cascade configuration's folds, each naming its coarse fold (cascade.coarse_run = <cv>/b/fold_k): the
    coarse stage is the fold ensemble of those coarse runs, the fine stage of the folds themselves, and the case is
    predicted through both (the table's fine-stage column). A coarse fold without weights is named."""
    fine = tmp_path / "fine"
    for k, run in enumerate(runs["a"]):
        shutil.copytree(run, fine / f"fold_{k}")
        config = load_config(fine / f"fold_{k}" / "config.yaml")
        config.cascade.coarse_run = str(runs["b"][k])
        save_config(config, fine / f"fold_{k}" / "config.yaml")
    source = resolve_checkpoint(fine)
    assert source.members[0].coarse_folder == runs["b"][0].parent
    predictor = build_predictor(source, device="cpu")
    assert isinstance(predictor, CascadePredictor)
    assert [c.parent for c in predictor.coarse.checkpoints] == runs["b"]
    assert [c.parent for c in predictor.fine.checkpoints] == [fine / f"fold_{k}" for k in range(FOLDS)]
    args = ["--checkpoint", str(fine), "--input", str(runs["image"]), "--output", str(tmp_path / "out"), "--quiet"]
    assert predict_main(args) == 0
    out = capsys.readouterr().out
    assert f"a cascade after the same folds of {runs['b'][0].parent}" in out and "fine stage on" in out
    config = load_config(fine / "fold_1" / "config.yaml")
    config.cascade.coarse_run = str(tmp_path / "gone")
    save_config(config, fine / "fold_1" / "config.yaml")
    with pytest.raises(FileNotFoundError, match=f"the coarse run of fold 1 of fine: {tmp_path / 'gone'} is missing"):
        resolve_checkpoint(fine)


@pytest.mark.slow
def test_k_folds_add_no_whole_scan_buffer(runs, tmp_path):
    """Memory: the fold ensemble runs the sliding window once, with one sum buffer, whatever K. On an 80x80x40 scan
    (a float32 map of its 3 classes on the preprocessed grid: 3.1 MB) the peak of the host allocations while
    predicting (tracemalloc: numpy's buffers: the preprocessed volume, the blend, the restore) with 3 folds is
    within half such a map of the peak with 1 fold (they differ by about 0.5 MB either way between runs); K
    whole-scan maps would add 2 maps."""
    rng = np.random.default_rng(1)
    image = rng.normal(100, 10, (80, 80, 40, 2)).astype(np.float32)
    path = write_nifti(tmp_path / "big.nii.gz", image, lps_affine(), "int16")
    image, affine, _ = load_image(path, 2, "big", integers=True)
    config = config_of(runs["a"][0])
    peaks = {}
    for k in (1, 3):
        predictor = Predictor(config, runs["a"][:k], device="cpu")
        predictor.predict_array(image, affine, probabilities=False)  # traced once, outside the measurement
        tracemalloc.start()
        labels = predictor.predict_array(image, affine, probabilities=False)[0]
        peaks[k] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del labels
    volume, _, _ = preprocess(image, None, affine, predictor.preprocessing)
    scan_map = int(np.prod(volume.shape[:3])) * 3 * 4
    assert peaks[1] > scan_map  # the measurement sees the sum buffer
    assert abs(peaks[3] - peaks[1]) < scan_map / 2, (peaks, scan_map)


def test_postprocessing_chosen_in_crossval_removes_the_specks(runs, tmp_path, capsys):
    """crossval.json's postprocessing (the largest component of class 1) is applied to the label map before it is
    written: the written map is the prediction without postprocessing (`--no-postprocessing`) with every class-1
    piece smaller than the largest (26-connected) set to background, computed here with scipy; the prediction had
    such specks; the header, the table and predictions.csv say what was applied and how many voxels it removed."""
    import csv

    from scipy import ndimage

    cv = write_crossval(tmp_path / "cv", runs, ["a"], postprocessing={"largest_component_labels": [[1]]})
    common = ["--checkpoint", str(cv), "--input", str(runs["image"]), "--quiet"]
    assert predict_main(common + ["--output", str(tmp_path / "raw"), "--no-postprocessing"]) == 0
    assert "Postprocessing: none (--no-postprocessing)" in capsys.readouterr().out
    assert predict_main(common + ["--output", str(tmp_path / "post")]) == 0
    out = capsys.readouterr().out
    assert "Postprocessing: largest component of 1 (crossval.json's choice)" in out
    assert "postprocessing removed" in out
    raw = np.asanyarray(nib.load(str(tmp_path / "raw" / "case_900.nii.gz")).dataobj)
    post = np.asanyarray(nib.load(str(tmp_path / "post" / "case_900.nii.gz")).dataobj)
    pieces, count = ndimage.label(raw == 1, structure=np.ones((3, 3, 3), bool))
    sizes = np.bincount(pieces.ravel())[1:]
    assert count > 1 and (sizes < sizes.max()).any()  # the prediction has specks to remove
    kept = np.isin(pieces, np.flatnonzero(sizes == sizes.max()) + 1)  # every piece as large as the largest stays
    np.testing.assert_array_equal(post, np.where((raw == 1) & ~kept, 0, raw))
    row = next(csv.DictReader(open(tmp_path / "post" / "predictions.csv")))
    assert row["postprocessing"] == "largest component of 1"
    assert int(row["postprocessing_removed_voxels"]) == int(np.count_nonzero(raw) - np.count_nonzero(post)) > 0
    assert "postprocessing" not in next(csv.DictReader(open(tmp_path / "raw" / "predictions.csv")))
