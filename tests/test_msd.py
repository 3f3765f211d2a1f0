import json

import numpy as np
import pytest
from conftest import lps_affine, make_msd_dataset, update_dataset_json, write_nifti

from tfmis.data.sources.cases import load_case
from tfmis.data.sources.errors import CaseError, DatasetError
from tfmis.data.sources.msd import MSDDataset


def test_dataset_json_is_parsed(msd_dataset):
    ds = MSDDataset(msd_dataset)
    assert ds.modalities == ["MR0", "MR1"] and ds.num_channels == 2
    assert ds.labels == ["background", "organ", "core"] and ds.num_classes == 3
    assert [c.case_id for c in ds.training] == [f"case_{i:03d}" for i in range(6)]
    assert ds.training[0].label == "./labelsTr/case_000.nii.gz"
    assert [c.case_id for c in ds.test] == ["case_900"] and ds.test[0].label is None
    assert not ds.is_ct


@pytest.mark.parametrize(
    "change, message",
    [
        ({"labels": {"1": "organ"}}, "labels"),
        ({"labels": {"0": "bg", "2": "x"}}, "labels"),
        ({"modality": {}}, "modality"),
        ({"training": [{"image": "./imagesTr/a.nii.gz"}]}, "training[0]"),
        ({"training": []}, "training"),
    ],
)
def test_malformed_dataset_json_names_the_key(msd_dataset, change, message):
    update_dataset_json(msd_dataset, **change)
    with pytest.raises(DatasetError, match=message.replace("[", r"\[").replace("]", r"\]")):
        MSDDataset(msd_dataset)


def test_missing_and_invalid_dataset_json(tmp_path):
    with pytest.raises(DatasetError, match="dataset.json"):
        MSDDataset(tmp_path)
    (tmp_path / "dataset.json").write_text("{not json")
    with pytest.raises(DatasetError, match="not valid JSON"):
        MSDDataset(tmp_path)


def test_duplicate_case_ids_are_refused(msd_dataset):
    meta = json.loads((msd_dataset / "dataset.json").read_text())
    update_dataset_json(msd_dataset, training=meta["training"] + meta["training"][:1])
    with pytest.raises(DatasetError, match="case_000"):
        MSDDataset(msd_dataset)


def test_3d_single_modality_case(tmp_path):
    root = make_msd_dataset(tmp_path / "ct", num_cases=1, channels=1, modalities={"0": "CT"})
    ds = MSDDataset(root)
    case = load_case(ds.training[0], ds)
    assert ds.is_ct
    assert case.image.shape == (20, 22, 18, 1) and case.image.dtype == np.float32
    assert case.label.shape == (20, 22, 18) and case.label.dtype == np.uint8


@pytest.mark.parametrize("dtype", ["uint8", "int16", ">i2", "<f4", ">f4", "float64", ">i4"])
def test_any_dtype_is_read_exactly(tmp_path, dtype):
    """4D multi-modal images of any on-disk dtype, big-endian included, come back as their values."""
    root = make_msd_dataset(tmp_path / "ds", num_cases=1)
    values = np.random.default_rng(1).integers(0, 200, (20, 22, 18, 2)).astype(np.float32)
    write_nifti(root / "imagesTr" / "case_000.nii.gz", values, lps_affine(), dtype)
    ds = MSDDataset(root)
    case = load_case(ds.training[0], ds)
    assert case.header_dtype == np.dtype(dtype).str
    assert case.image.dtype == np.float32 and case.image.dtype.isnative
    np.testing.assert_array_equal(case.image, values)


def test_only_referenced_files_are_read(msd_dataset):
    """macOS `._*` junk next to the images (as in the real MSD tarballs) is never opened."""
    (msd_dataset / "imagesTr" / "._case_000.nii.gz").write_bytes(b"\x00\x05\x16\x07junk")
    (msd_dataset / "labelsTr" / "._case_000.nii.gz").write_bytes(b"junk")
    ds = MSDDataset(msd_dataset)
    assert len(ds.training) == 6
    assert load_case(ds.training[0], ds).image.shape == (20, 22, 18, 2)


def test_path_outside_dataset_folder_is_refused(msd_dataset, tmp_path):
    write_nifti(tmp_path / "outside.nii.gz", np.zeros((20, 22, 18, 2)), lps_affine())
    meta = json.loads((msd_dataset / "dataset.json").read_text())
    meta["training"][0]["image"] = "../outside.nii.gz"
    (msd_dataset / "dataset.json").write_text(json.dumps(meta))
    ds = MSDDataset(msd_dataset)
    with pytest.raises(CaseError, match="outside the dataset folder") as err:
        load_case(ds.training[0], ds)
    assert err.value.case_id == "outside"


def test_wrong_channel_count_names_case(msd_dataset):
    write_nifti(msd_dataset / "imagesTr" / "case_001.nii.gz", np.ones((20, 22, 18, 3)), lps_affine())
    ds = MSDDataset(msd_dataset)
    with pytest.raises(CaseError, match="case_001: image has 3 channel"):
        load_case(ds.training[1], ds)
