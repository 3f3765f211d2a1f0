"""Test helpers: nnU-Net v2 raw datasets written from the MSD folders of `conftest.make_msd_dataset`, file by file
with nibabel (NIfTI) or SimpleITK (other formats): 4D images split into `<case>_0000`, `<case>_0001`... files, a
dataset.json with `channel_names`, `labels` name -> value and `file_ending`."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np


def msd_to_nnunet(msd_root: Path, root: Path, file_ending: str = ".nii.gz", channel_names=None) -> Path:
    """The MSD dataset `msd_root` rewritten in nnU-Net v2 layout at `root` (same cases, voxels and geometry)."""
    meta = json.loads((msd_root / "dataset.json").read_text())
    for folder, entries in (("imagesTr", meta["training"]), ("imagesTs", meta["test"])):
        for entry in entries:
            image = entry["image"] if isinstance(entry, dict) else entry
            case_id = Path(image).name.removesuffix(".nii.gz")
            img = nib.load(str(msd_root / image))
            data = np.asanyarray(img.dataobj)
            data = data[..., np.newaxis] if data.ndim == 3 else data
            for c in range(data.shape[-1]):
                write_like(img, data[..., c], root / folder / f"{case_id}_{c:04d}{file_ending}")
            if isinstance(entry, dict):
                label = nib.load(str(msd_root / entry["label"]))
                write_like(label, np.asanyarray(label.dataobj), root / "labelsTr" / f"{case_id}{file_ending}")
    modalities = meta["modality"]
    dataset = {
        "name": meta["name"],
        "channel_names": channel_names or modalities,
        "labels": {name: int(value) for value, name in meta["labels"].items()},
        "numTraining": len(meta["training"]),
        "file_ending": file_ending,
    }
    (root / "dataset.json").write_text(json.dumps(dataset, indent=1))
    return root


def write_like(img, data: np.ndarray, path: Path) -> None:
    """`data` written with the affine and on-disk type of the nibabel image `img`: NIfTI by nibabel, other formats
    by SimpleITK from that NIfTI (SimpleITK's own NIfTI reader makes the geometry)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = img.header.copy()
    out = nib.Nifti1Image(np.asarray(data), img.affine, header)
    out.set_data_dtype(img.get_data_dtype())
    if path.name.endswith((".nii.gz", ".nii")):
        nib.save(out, str(path))
        return
    import SimpleITK as sitk

    nifti = path.with_name(path.name.split(".")[0] + ".tmp.nii.gz")
    nib.save(out, str(nifti))
    read = sitk.ReadImage(str(nifti))
    plain = sitk.GetImageFromArray(sitk.GetArrayFromImage(read))  # the voxels and geometry, no NIfTI header fields
    plain.CopyInformation(read)
    sitk.WriteImage(plain, str(path))
    nifti.unlink()


def msd_in_format(msd_root: Path, root: Path, suffix: str) -> Path:
    """The MSD dataset `msd_root` with its images and labels as `suffix` files (NRRD, MetaImage) written by SimpleITK:
    every channel read by SimpleITK from a 3D NIfTI, composed into vector pixels."""
    import SimpleITK as sitk

    meta = json.loads((msd_root / "dataset.json").read_text())
    root.mkdir(parents=True)
    for entry in meta["training"]:
        for key in ("image", "label"):
            img = nib.load(str(msd_root / entry[key]))
            data = np.asanyarray(img.dataobj)
            channels = [data] if data.ndim == 3 else [data[..., c] for c in range(data.shape[-1])]
            parts = []
            for c, channel in enumerate(channels):
                write_like(img, channel, root / "tmp" / f"{c}.nii.gz")
                parts.append(sitk.ReadImage(str(root / "tmp" / f"{c}.nii.gz")))
            image = parts[0] if len(parts) == 1 else sitk.Compose(parts)
            plain = sitk.GetImageFromArray(sitk.GetArrayFromImage(image), isVector=len(parts) > 1)
            plain.CopyInformation(image)
            entry[key] = entry[key].replace(".nii.gz", suffix)
            (root / entry[key]).parent.mkdir(parents=True, exist_ok=True)
            sitk.WriteImage(plain, str(root / entry[key]))
    meta["test"] = []
    (root / "dataset.json").write_text(json.dumps(meta, indent=1))
    return root
