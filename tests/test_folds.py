"""Cross-validation folds in the data layer: `data.split` in the config, one K-fold conversion (stratified by the
classes each case holds, or read from an nnU-Net v2 splits_final.json), joined split names ("fold0+fold1") read by
every reader, and a real training on a fold's joined training split."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from conftest import make_msd_dataset, tiny_config

from tfmis.config import ConfigError, load_config, save_config, to_dict
from tfmis.convert import main as convert_main
from tfmis.data.conversion_options import ConversionConfig
from tfmis.data.convert import PLAN_FILE, ParametersChanged, convert
from tfmis.data.folds import SPLITS_FILE, assign_splits
from tfmis.data.records import (
    load_index,
    record_dataset,
    shard_paths,
    split_cases,
    split_entry,
    training_data_info,
)

NUM_CASES = 10
RARE_CASES = ("case_003", "case_007")  # the only cases holding label 3 (lesion)
LABELS = {"0": "background", "1": "organ", "2": "core", "3": "lesion"}


def make_rare_class_dataset(root: Path) -> Path:
    """10 cases holding labels 1 and 2, and label 3 in only `RARE_CASES` (a blob inside the foreground)."""
    source = make_msd_dataset(root, num_cases=NUM_CASES, labels=LABELS)
    for case in RARE_CASES:
        path = source / "labelsTr" / f"{case}.nii.gz"
        img = nib.load(str(path))
        label = np.asarray(img.dataobj).astype(np.uint8)
        label[10:13, 10:13, 9:11] = 3
        nib.save(nib.Nifti1Image(label, img.affine, img.header), str(path))
    return source


def fold_conversion(source: Path, target: Path, **options) -> dict:
    return convert(
        ConversionConfig(str(source), str(target), shards=1, workers=1, progress=False, **({"folds": 5} | options))
    )


@pytest.fixture(scope="module")
def folds_data(tmp_path_factory) -> dict:
    """The rare-class dataset converted once into 5 stratified folds."""
    root = tmp_path_factory.mktemp("folds")
    source = make_rare_class_dataset(root / "Task98_Rare")
    index = fold_conversion(source, root / "stratified")
    return {"root": root, "source": source, "target": root / "stratified", "index": index}


def val_folds(index: dict) -> list[list[str]]:
    return [sorted(index["splits"][f"fold{k}"]["cases"]) for k in range(len(index["splits"]))]


def test_stratified_conversion_spreads_a_class_of_two_cases_over_two_folds(folds_data):
    """A real 5-fold conversion: the 2 cases holding label 3 validate in different folds, so every fold's training
    part (the other 4 folds) holds label 3; the folds partition the 10 cases in 2s; splits_final.json says the same
    in nnU-Net's format (train = the other folds' cases, sorted)."""
    folds = val_folds(folds_data["index"])
    assert sorted(c for fold in folds for c in fold) == [f"case_{i:03d}" for i in range(NUM_CASES)]
    assert [len(f) for f in folds] == [2] * 5
    homes = [k for k, fold in enumerate(folds) for c in fold if c in RARE_CASES]
    assert len(set(homes)) == 2, f"the two lesion cases share fold {homes}"
    for k in range(5):
        training = {c for j, fold in enumerate(folds) if j != k for c in fold}
        assert training & set(RARE_CASES), f"fold {k}'s training part has no lesion case"
    written = json.loads((folds_data["target"] / SPLITS_FILE).read_text())
    assert [entry["val"] for entry in written] == folds
    for k, entry in enumerate(written):
        assert entry["train"] == sorted(c for j, fold in enumerate(folds) if j != k for c in fold)
    index = folds_data["index"]
    assert index["split"]["fold_assignment"] == "stratified" and index["requested"]["fold_assignment"] == "stratified"


def test_stratified_folds_keep_every_class_in_every_training_part():
    """assign_splits over 40 cases whose classes are held by 2 to 40 cases, for 30 seeds: every class held by >= 2
    cases is in every fold's training part, a class of 2..5 cases has them in as many different folds, the sizes
    differ by at most one, and the same seed gives the same folds."""
    rng = np.random.default_rng(0)
    ids = [f"c{i:02d}" for i in range(40)]
    holders = {1: 40, 2: 25, 3: 9, 4: 5, 5: 3, 6: 2, 7: 2}  # label -> how many cases hold it
    classes = {c: set() for c in ids}
    for label, count in holders.items():
        for c in rng.choice(ids, count, replace=False):
            classes[c].add(label)
    for seed in range(30):
        folds = assign_splits(ids, None, 5, seed, classes)
        assert folds == assign_splits(ids, None, 5, seed, classes)
        assert sorted(len(v) for v in folds.values()) == [8] * 5
        for label, count in holders.items():
            homes = [k for k, cases in enumerate(folds.values()) for c in cases if label in classes[c]]
            if count <= 5:
                assert len(set(homes)) == count, (seed, label, homes)
            for k in range(5):
                assert any(home != k for home in homes), (seed, label, k)
    assert assign_splits(ids, None, 5, 0, classes) != assign_splits(ids, None, 5, 1, classes)


def training_parts_see_every_class(assignment: dict[str, int], classes: dict[str, set[int]], folds: int) -> bool:
    """Every class held by >= 2 cases has a case outside each fold (assignment: case -> fold)."""
    for label in {c for labels in classes.values() for c in labels}:
        homes = [assignment[case] for case, labels in classes.items() if label in labels]
        if len(homes) >= 2 and len(set(homes)) == 1:
            return False
    return True


def test_stratified_folds_find_an_assignment_whenever_one_exists():
    """For 400 random small class layouts (4-8 cases, 2-3 folds): whenever some split into equal-size folds (all of
    them enumerated) keeps every class of >= 2 cases in every fold's training part, assign_splits finds one too."""
    rng = np.random.default_rng(7)
    for trial in range(400):
        n, folds = int(rng.integers(4, 9)), int(rng.integers(2, 4))
        ids = [f"c{i}" for i in range(n)]
        classes = {c: {label for label in range(1, 6) if rng.random() < 0.35} for c in ids}
        found = assign_splits(ids, None, folds, trial, classes)
        assignment = {case: k for k, cases in enumerate(found.values()) for case in cases}
        if training_parts_see_every_class(assignment, classes, folds):
            continue
        sizes = sorted(n // folds + (k < n % folds) for k in range(folds))
        for combo in itertools.product(range(folds), repeat=n):
            if sorted(np.bincount(combo, minlength=folds)) == sizes:
                assert not training_parts_see_every_class(dict(zip(ids, combo)), classes, folds), (classes, found)


def test_more_folds_than_cases_is_refused():
    """A fold needs one case at least: 3 cases in 5 folds is one clear error."""
    with pytest.raises(ValueError, match="5 folds need at least 5 cases"):
        assign_splits(["a", "b", "c"], None, 5, 0)


def test_the_split_is_planned_once_and_older_fold_conversions_are_not_reused(folds_data, tmp_path, monkeypatch):
    """A finished fold conversion rerun takes its folds from conversion.json: no label is read again (the label
    reader made to fail changes nothing); a fold conversion without the fold assignment in its parameters (made
    before stratification, with other folds) is refused as other parameters."""
    import shutil

    from tfmis.data import convert as conversion

    target = tmp_path / "stratified"
    shutil.copytree(folds_data["target"], target)
    plan = json.loads((target / PLAN_FILE).read_text())
    assert plan["resolved"]["splits"] == {k: v["cases"] for k, v in folds_data["index"]["splits"].items()}

    def no_label_reads(task):
        raise AssertionError(f"label of {task[0].case_id} read again")

    monkeypatch.setattr(conversion, "label_classes", no_label_reads)
    assert fold_conversion(folds_data["source"], target)["splits"] == folds_data["index"]["splits"]
    del plan["requested"]["fold_assignment"]
    (target / PLAN_FILE).write_text(json.dumps(plan))
    with pytest.raises(ParametersChanged, match="fold_assignment: None -> 'stratified'"):
        fold_conversion(folds_data["source"], target)


def nnunet_generate_crossval_split(identifiers: list[str], seed: int = 12345, n_splits: int = 5) -> list[dict]:
    """nnU-Net v2's `generate_crossval_split` written out: sklearn's KFold(n_splits, shuffle=True, random_state=seed)
    over the sorted identifiers (indices shuffled by RandomState(seed), then consecutive folds, the first
    n % n_splits one larger)."""
    identifiers = sorted(identifiers)
    indices = np.arange(len(identifiers))
    np.random.RandomState(seed).shuffle(indices)
    sizes = np.full(n_splits, len(identifiers) // n_splits)
    sizes[: len(identifiers) % n_splits] += 1
    splits, start = [], 0
    for size in sizes:
        val = set(indices[start : start + size].tolist())
        splits.append(
            {
                "train": [identifiers[i] for i in range(len(identifiers)) if i not in val],
                "val": [identifiers[i] for i in range(len(identifiers)) if i in val],
            }
        )
        start += size
    return splits


def test_an_nnunet_splits_final_json_gives_its_folds(folds_data, tmp_path):
    """A splits_final.json as nnU-Net v2 writes it for this dataset (identifiers: the label file names without
    .nii.gz, as nnU-Net's MSD conversion names them; 3 folds) converted by tfmis-convert --splits-file: fold k
    holds exactly nnU-Net's val list k, and the index names the file and its assignment."""
    identifiers = [p.name[: -len(".nii.gz")] for p in (folds_data["source"] / "labelsTr").glob("*.nii.gz")]
    nnunet = nnunet_generate_crossval_split(identifiers, n_splits=3)
    splits_file = tmp_path / "splits_final.json"
    splits_file.write_text(json.dumps(nnunet, indent=4))
    target = tmp_path / "from_nnunet"
    argv = ["--source-dir", str(folds_data["source"]), "--target-dir", str(target), "--splits-file", str(splits_file)]
    assert convert_main([*argv, "--shards", "1", "--workers", "1", "--quiet"]) == 0
    index = load_index(target)
    assert val_folds(index) == [sorted(fold["val"]) for fold in nnunet]
    assert index["split"]["folds"] == 3 and index["split"]["fold_assignment"] == "splits_file"
    assert json.loads((target / SPLITS_FILE).read_text()) == nnunet


def test_a_written_splits_file_round_trips_and_its_content_identifies_the_conversion(folds_data, tmp_path):
    """The splits_final.json of the stratified conversion, given to another conversion, gives the same folds; the
    same folds written differently (indented, lists reordered) are the same conversion (a rerun is a no-op), other
    folds in the file are other parameters; the file's path is no parameter."""
    written = json.loads((folds_data["target"] / SPLITS_FILE).read_text())
    first = tmp_path / "a" / "splits.json"
    first.parent.mkdir()
    first.write_text(json.dumps(written))
    target = tmp_path / "from_file"
    index = fold_conversion(folds_data["source"], target, folds=None, splits_file=str(first))
    assert index["splits"] == folds_data["index"]["splits"]
    assert "splits_file" not in index["requested"] and len(index["requested"]["splits_file_sha256"]) == 64
    reformatted = tmp_path / "b" / "splits_final.json"
    reformatted.parent.mkdir()
    reformatted.write_text(json.dumps([{"val": e["val"][::-1], "train": e["train"][::-1]} for e in written], indent=2))
    shard = next(target.glob("fold0-*.tfrecord*"))
    before = shard.stat().st_mtime_ns
    assert (
        fold_conversion(folds_data["source"], target, folds=None, splits_file=str(reformatted))["splits"]
        == (index["splits"])
    )
    assert shard.stat().st_mtime_ns == before, "the same folds: nothing written again"
    swapped = tmp_path / "swapped.json"
    swapped.write_text(json.dumps([written[1], written[0], *written[2:]]))
    with pytest.raises(ParametersChanged, match="splits_file_sha256"):
        fold_conversion(folds_data["source"], target, folds=None, splits_file=str(swapped))


def nnunet_style(folds: list[list[str]]) -> list[dict]:
    return [
        {"train": sorted(c for j, f in enumerate(folds) if j != k for c in f), "val": sorted(fold)}
        for k, fold in enumerate(folds)
    ]


GOOD_FOLDS = [["case_000", "case_001", "case_002"], ["case_003", "case_004", "case_005"], ["case_006", "case_007"]]


@pytest.mark.parametrize(
    "entries, message",
    [
        (
            nnunet_style([["case_000", "case_001", "case_003"], ["case_003", "case_004"], ["case_005"]]),
            r"fold 1's val list holds case 'case_003' also in fold 0's val list",
        ),
        (
            [*nnunet_style(GOOD_FOLDS)[:2], {"train": ["case_000"], "val": GOOD_FOLDS[2]}],
            r"fold 2's train list lacks case 'case_001' \(in fold 0's val list, and 4 more\)",
        ),
        ([{"train": [], "val": ["case_000"]}], r"expected a list of at least 2 folds"),
        ([{"train": ["case_001"], "val": "case_000"}, {"train": [], "val": []}], r"fold 0 is not \{\"train\""),
    ],
    ids=["overlap", "train-not-the-other-folds", "one-fold", "not-lists"],
)
def test_a_bad_splits_file_is_one_line_naming_the_fold_and_case(tmp_path, entries, message):
    """A splits file with a case in two val lists, a train list that is not the other folds' cases, one fold, or
    no lists: refused at config load (data.split.file) and by the conversion, one line naming the file, the fold
    and the case."""
    path = tmp_path / "splits_final.json"
    path.write_text(json.dumps(entries))
    with pytest.raises(ConfigError, match=rf"^data.split.file: {re.escape(str(path))}: .*{message}") as raised:
        load_config(None, [f"data.split.file={path}"])
    assert "\n" not in str(raised.value)
    with pytest.raises(ValueError, match=message):
        ConversionConfig("S", "T", splits_file=str(path))


def test_a_splits_file_naming_an_unknown_or_missing_case_is_refused(folds_data, tmp_path):
    """Against dataset.json: a case the dataset does not have, or a training case in no fold, is one line naming
    the file, the fold and the case (and how case ids are formed); a missing file names the file."""
    unknown = [*GOOD_FOLDS[:2], ["case_006", "case_007", "case_008", "case_009", "hippocampus_001"]]
    path = tmp_path / "unknown.json"
    path.write_text(json.dumps(nnunet_style(unknown)))
    pattern = r"fold 2's val list names case 'hippocampus_001', which .*dataset.json does not list for training"
    with pytest.raises(ValueError, match=pattern):
        fold_conversion(folds_data["source"], tmp_path / "t1", folds=None, splits_file=str(path))
    path.write_text(json.dumps(nnunet_style(GOOD_FOLDS)))  # case_008, case_009 in no fold
    with pytest.raises(ValueError, match=r"case 'case_008' of .*dataset.json is in no fold's val list \(and 1 more\)"):
        fold_conversion(folds_data["source"], tmp_path / "t2", folds=None, splits_file=str(path))
    with pytest.raises(ValueError, match=r"splits file .*nowhere.json does not exist"):
        ConversionConfig("S", "T", splits_file=str(tmp_path / "nowhere.json"))


def test_data_split_derives_the_conversion_and_the_joined_splits(tmp_path):
    """data.split.folds=5, fold=2: 5 folds converted, trained on fold0+fold1+fold3+fold4, validated on fold2; saved
    and reloaded the same; another fold on the saved config re-derives; K comes from data.split.file (and is kept
    when the file has gone); bad values name the key and the fix."""
    config = load_config(None, ["data.split.folds=5", "data.split.fold=2"])
    assert (config.data.train_split, config.data.val_split) == ("fold0+fold1+fold3+fold4", "fold2")
    assert config.data.conversion.folds == 5 and config.data.conversion.split is None
    save_config(config, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml").data == config.data
    other = load_config(tmp_path / "config.yaml", ["data.split.fold=0"])
    assert (other.data.train_split, other.data.val_split) == ("fold1+fold2+fold3+fold4", "fold0")
    save_config(load_config(None), tmp_path / "plain.yaml")  # data.split: null in the file
    assert load_config(tmp_path / "plain.yaml", ["data.split.fold=4"]).data.val_split == "fold4"
    assert load_config(None).data.split is None and load_config(None).data.train_split == "train"

    splits_file = tmp_path / "splits_final.json"
    splits_file.write_text(json.dumps(nnunet_style(GOOD_FOLDS)))
    with_file = load_config(None, [f"data.split.file={splits_file}", "data.split.fold=1"])
    assert with_file.data.split.folds == 3 and with_file.data.conversion.folds == 3
    assert (with_file.data.train_split, with_file.data.val_split) == ("fold0+fold2", "fold1")
    save_config(with_file, tmp_path / "with_file.yaml")
    splits_file.unlink()
    assert load_config(tmp_path / "with_file.yaml").data == with_file.data

    for overrides, message in [
        (["data.split.fold=5"], r"data.split.fold=5 is out of range for 5 folds: set data.split.fold to 0..4"),
        (["data.split.folds=1"], r"data.split.folds must be at least 2"),
        (
            ["data.split.fold=0", "data.conversion.split=[0.8, 0.2]"],
            r"data.conversion.split=\[0.8, 0.2\] .* set data.conversion.split=null",
        ),
        (["data.split.fold=0", "data.conversion.folds=3"], r"data.conversion.folds=3 but data.split makes 5 folds"),
        (["data.split.fold=0", "data.val_split=test"], r"data.val_split='test' conflicts with data.split"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)


def test_joined_split_names_read_the_union_in_order(folds_data):
    """split_entry / split_cases / shard_paths / record_dataset take "fold3+fold0": the two folds' cases, records and
    shards in that order, the records read from the real TFRecords (and a run's training_data.json, which holds only
    the case lists, gives the same cases); an unknown part is a KeyError naming it and the available splits."""
    target, index = folds_data["target"], folds_data["index"]
    entry = split_entry(index, "fold3+fold0")
    assert entry["cases"] == index["splits"]["fold3"]["cases"] + index["splits"]["fold0"]["cases"]
    assert entry["num_records"] == 4 and len(entry["shards"]) == 2
    assert split_entry(training_data_info(index, target), "fold3+fold0") == {"cases": entry["cases"]}
    assert [c["case_id"] for c in split_cases(index, "fold3+fold0")] == entry["cases"]
    assert [Path(p).name for p in shard_paths(target, "fold3+fold0")] == [s["file"] for s in entry["shards"]]
    read = [meta["case_id"].numpy().decode() for _, _, meta in record_dataset(target, "fold3+fold0")]
    assert read == entry["cases"]
    with pytest.raises(
        KeyError, match=r"split 'fold7' \(in 'fold0\+fold7'\) not in this dataset; available: \['fold0'"
    ):
        split_entry(index, "fold0+fold7")
    with pytest.raises(ValueError, match="names 'fold1' twice"):
        split_entry(index, "fold1+fold1")


def test_a_training_with_data_split_reads_the_folds_conversion_of_crossval(tmp_path):
    """`tfmis-train --config configs/demo.yaml --set data.split.folds=5 --set data.split.fold=0` reads the 5-fold
    conversion `tfmis-crossval --folds 5` writes for that config (`<dataset_dir>-folds5`), not the train/val/test
    conversion in data.dataset_dir; the run folder's config.yaml loads back to the same folder, and a config that
    says its folder holds the folds (data.conversion.folds) keeps it."""
    from tfmis.crossvalidation.experiment import Configuration, job_config

    demo = Path(__file__).parent.parent / "configs" / "demo.yaml"
    base = load_config(demo)
    config = load_config(demo, ["data.split.folds=5", "data.split.fold=0"])
    assert config.data.dataset_dir == f"{base.data.dataset_dir}-folds5"
    cv_fold = job_config(tmp_path / "cv", Configuration("demo", to_dict(base)), 0, 5, None)
    assert cv_fold.data.dataset_dir == config.data.dataset_dir
    save_config(config, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml").data.dataset_dir == config.data.dataset_dir
    kept = load_config(demo, ["data.conversion.split=null", "data.conversion.folds=5", "data.split.fold=0"])
    assert kept.data.dataset_dir == base.data.dataset_dir


def test_training_on_a_fold_reads_the_other_folds_and_validates_on_its_own(folds_data, tmp_path):
    """A real training (1 epoch, 2 steps) of fold 2 of 5 with data.source_dir: the stratified conversion is found
    finished (nothing converted again), the run's saved config holds the joined training split, the training
    pipeline's volumes are the 8 cases of the other folds and the validation the 2 of fold 2."""
    from tfmis.data.pipeline import build_val_dataset, volume_order
    from tfmis.data.prepare import prepare_dataset
    from tfmis.engine.trainer import Trainer

    config = tiny_config(
        folds_data["target"],
        tmp_path / "run",
        f"data.source_dir={folds_data['source']}",
        "data.conversion.folds=5",  # this folder holds the 5 folds (else data.split reads <dataset_dir>-folds5)
        "data.split.fold=2",
        "data.conversion.shards=1",
        "data.conversion.workers=1",
        "training.epochs=1",
    )
    folds = val_folds(folds_data["index"])
    shard = next(folds_data["target"].glob("fold0-*.tfrecord*"))
    before = shard.stat().st_mtime_ns
    prepare_dataset(config.data, progress=False)
    assert shard.stat().st_mtime_ns == before, "the finished conversion is used as it is"
    summary = Trainer(config).fit()
    assert summary["epochs"] == 1 and summary["best_mean_dice"] is not None
    saved = load_config(tmp_path / "run" / "config.yaml")
    assert saved.data.train_split == "fold0+fold1+fold3+fold4" and saved.data.val_split == "fold2"
    index = load_index(folds_data["target"])
    trained = volume_order(index, folds_data["target"], saved.data.train_split)
    assert sorted(trained) == sorted(c for k, fold in enumerate(folds) if k != 2 for c in fold)
    validated = [meta["case_id"].numpy().decode() for _, _, meta in build_val_dataset(saved, cached=False)]
    assert sorted(validated) == folds[2]
