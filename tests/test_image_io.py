"""tfmis.data.sources.image_io: NRRD and MetaImage files read in tfmis's convention (X, Y, Z order, RAS affine as
nibabel gives for the same image as NIfTI), written back with their geometry, and one line when SimpleITK is missing."""

from __future__ import annotations

import sys

import nibabel as nib
import numpy as np
import pytest

from tfmis.data.sources.errors import UnreadableImage
from tfmis.data.sources.image_io import load_image, read_affine, read_image, write_image

sitk = pytest.importorskip("SimpleITK")  # the formats extra (in dev)


def rotated_image(channels: int = 0):
    """An int16 SimpleITK image of 5x6x7 voxels, rotated 30 degrees about z, nonzero origin, anisotropic spacing."""
    shape = (7, 6, 5) + ((channels,) if channels else ())  # SimpleITK's (z, y, x[, c])
    array = (np.arange(np.prod(shape)) - 50).reshape(shape).astype(np.int16)
    img = sitk.GetImageFromArray(array, isVector=bool(channels))
    t = np.deg2rad(30.0)
    rotation = np.array([[np.cos(t), -np.sin(t), 0.0], [np.sin(t), np.cos(t), 0.0], [0.0, 0.0, 1.0]])
    img.SetDirection(rotation.ravel().tolist())
    img.SetOrigin((12.5, -30.25, 4.0))
    img.SetSpacing((0.75, 1.5, 3.0))
    return img


@pytest.mark.parametrize("suffix", [".mha", ".nrrd", ".mhd"])
def test_itk_file_reads_as_nibabel_reads_the_same_image_written_as_nifti_by_simpleitk(tmp_path, suffix):
    img = rotated_image()
    sitk.WriteImage(img, str(tmp_path / f"scan{suffix}"))
    sitk.WriteImage(img, str(tmp_path / "scan.nii.gz"))
    nifti = nib.load(str(tmp_path / "scan.nii.gz"))
    read = read_image(tmp_path / f"scan{suffix}")
    assert read.array.shape == (5, 6, 7) and read.array.dtype == np.int16 and read.disk_dtype == "<i2"
    np.testing.assert_array_equal(read.array, np.asanyarray(nifti.dataobj))
    np.testing.assert_allclose(read.affine, nifti.affine, atol=1e-6, rtol=0)
    np.testing.assert_allclose(read_affine(tmp_path / f"scan{suffix}"), read.affine, atol=0, rtol=0)


@pytest.mark.parametrize("suffix", [".mha", ".nrrd", ".mhd"])
def test_read_write_read_keeps_array_and_direction_origin_spacing(tmp_path, suffix):
    img = rotated_image()
    sitk.WriteImage(img, str(tmp_path / f"in{suffix}"))
    first = read_image(tmp_path / f"in{suffix}")
    write_image(first.array, first.affine, tmp_path / f"out{suffix}", first.array.dtype)
    second = read_image(tmp_path / f"out{suffix}")
    np.testing.assert_array_equal(second.array, first.array)
    assert second.array.dtype == first.array.dtype
    np.testing.assert_allclose(second.affine, first.affine, atol=1e-6, rtol=0)
    back = sitk.ReadImage(str(tmp_path / f"out{suffix}"))
    np.testing.assert_allclose(back.GetDirection(), img.GetDirection(), atol=1e-9)
    np.testing.assert_allclose(back.GetOrigin(), img.GetOrigin(), atol=1e-9)
    np.testing.assert_allclose(back.GetSpacing(), img.GetSpacing(), atol=1e-9)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == (
        ["out.mhd", "out.raw"] if suffix == ".mhd" else [f"out{suffix}"]
    )


def test_vector_mha_is_channels_last_and_keeps_ints_for_load_image(tmp_path):
    """A 2-component MetaImage is (X, Y, Z, 2); `load_image(integers=True)` keeps its int16 as for a NIfTI CT."""
    img = rotated_image(channels=2)
    sitk.WriteImage(img, str(tmp_path / "two.mha"))
    image, affine, disk_dtype = load_image(tmp_path / "two.mha", 2, "two", integers=True)
    expected = np.transpose(sitk.GetArrayFromImage(img), (2, 1, 0, 3))
    assert image.shape == (5, 6, 7, 2) and image.dtype == np.int16 and disk_dtype == "<i2"
    np.testing.assert_array_equal(image, expected)
    write_image(image, affine, tmp_path / "copy.nrrd", np.int16)
    np.testing.assert_array_equal(read_image(tmp_path / "copy.nrrd").array, expected)


def test_corrupt_itk_file_is_one_line_naming_it(tmp_path):
    sitk.WriteImage(rotated_image(), str(tmp_path / "scan.mha"))
    data = (tmp_path / "scan.mha").read_bytes()
    (tmp_path / "scan.mha").write_bytes(data[: len(data) // 2])
    with pytest.raises(UnreadableImage) as raised:
        read_image(tmp_path / "scan.mha")
    message = str(raised.value)
    assert "scan.mha cannot be read" in message and "\n" not in message


def test_without_simpleitk_an_mha_is_one_line_naming_the_formats_extra(tmp_path, monkeypatch):
    sitk.WriteImage(rotated_image(), str(tmp_path / "scan.mha"))
    monkeypatch.setitem(sys.modules, "SimpleITK", None)  # as if the formats extra were not installed
    for call in (
        lambda: read_image(tmp_path / "scan.mha"),
        lambda: write_image(np.zeros((2, 2, 2)), np.eye(4), tmp_path / "o.nrrd", np.uint8),
    ):
        with pytest.raises(UnreadableImage, match=r"tfmis\[formats\]") as raised:
            call()
        assert "\n" not in str(raised.value)
