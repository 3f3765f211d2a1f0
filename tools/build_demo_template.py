"""Builds `tfmis/data/assets/mni152_2mm.npz`, the anatomy behind `tfmis.data.demos.brain`.

The source is the MNI ICBM152 2009a nonlinear symmetric template (T1, grey-matter and
white-matter probability maps, 197x233x189 voxels of 1 mm, RAS, uint8) as shipped inside the
`nilearn` wheel (nilearn itself is BSD-3; the template keeps its own permissive MNI/McGill notice,
see `tfmis/data/assets/MNI152_LICENSE.txt`). nilearn is needed only to run this script once;
the toolkit itself never imports it.

What the asset holds (all arrays uint8, same shape, voxel axes = RAS, 2 mm):

* `t1`:    T1 intensity (0..255), averaged over brain voxels only and extended by two voxels
           past the brain edge, so that interpolating near the edge does not darken it;
* `gm`:    grey-matter probability x 255;
* `wm`:    white-matter probability x 255;
* `brain`: fraction of each 2 mm voxel inside the (skull-stripped) brain x 255;
* `affine`: float64 4x4 voxel-to-world (RAS mm) affine of the arrays above.

The 1 mm maps are block-averaged 2x2x2 to 2 mm and cropped to the brain's bounding box plus a
small margin; `np.savez_compressed` keeps the file around 1 MB.

Usage (only needed to regenerate the asset):

    pip download nilearn --no-deps -d /tmp/dl && unzip -q /tmp/dl/nilearn-*.whl -d /tmp/dl/nl
    python tools/build_demo_template.py --nilearn-data /tmp/dl/nl/nilearn/datasets/data

or, with nilearn installed, simply `python tools/build_demo_template.py`.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
from scipy import ndimage

TEMPLATE_FILES = {
    "t1": "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz",
    "gm": "mni_icbm152_gm_tal_nlin_sym_09a_converted.nii.gz",
    "wm": "mni_icbm152_wm_tal_nlin_sym_09a_converted.nii.gz",
}
DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "tfmis" / "data" / "assets" / "mni152_2mm.npz"
BLOCK = 2  # 1 mm -> 2 mm
MARGIN_VOXELS = 3  # kept around the brain's bounding box (at 2 mm)
T1_EXTENSION_VOXELS = 2


def default_nilearn_data_dir() -> Path:
    """The `datasets/data` folder of an importable nilearn; exits with a hint when there is none."""
    spec = importlib.util.find_spec("nilearn")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            "nilearn is not importable. Either `pip install nilearn`, or fetch the wheel without "
            "installing it:\n  pip download nilearn --no-deps -d /tmp/dl && "
            "unzip -q /tmp/dl/nilearn-*.whl -d /tmp/dl/nl\nand pass "
            "--nilearn-data /tmp/dl/nl/nilearn/datasets/data"
        )
    return Path(spec.submodule_search_locations[0]) / "datasets" / "data"


def load_template(data_dir: Path) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Reads the three 1 mm maps as float64 arrays; checks they share one RAS grid.

    Args:
        data_dir: folder holding the `mni_icbm152_*_converted.nii.gz` files.

    Returns:
        ({"t1": ..., "gm": ..., "wm": ...}, the 4x4 affine).
    """
    maps, affine = {}, None
    for key, name in TEMPLATE_FILES.items():
        path = data_dir / name
        if not path.is_file():
            sys.exit(f"{path} not found; --nilearn-data must point at nilearn's datasets/data folder")
        img = nib.load(str(path))
        if affine is not None and not np.allclose(img.affine, affine):
            sys.exit(f"{path}: affine differs from the other template files")
        affine = img.affine
        maps[key] = np.asarray(img.dataobj, dtype=np.float64)
    if nib.aff2axcodes(affine) != ("R", "A", "S") or not np.allclose(np.abs(np.diag(affine)[:3]), 1):
        sys.exit(f"expected a 1 mm RAS template, got axes {nib.aff2axcodes(affine)} and affine\n{affine}")
    return maps, affine


def block_mean(volume: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """Averages non-overlapping `block`^3 cubes; odd edges are zero-padded first.

    Example:
        >>> block_mean(np.ones((3, 4, 4))).shape
        (2, 2, 2)
    """
    pad = [(0, (-n) % block) for n in volume.shape]
    padded = np.pad(volume, pad)
    nx, ny, nz = (n // block for n in padded.shape)
    return padded.reshape(nx, block, ny, block, nz, block).mean(axis=(1, 3, 5))


def extend_outwards(values: np.ndarray, inside: np.ndarray, voxels: int) -> np.ndarray:
    """Copies the nearest inside value to outside voxels up to `voxels` away, zero beyond."""
    distance, nearest = ndimage.distance_transform_edt(~inside, return_indices=True)
    extended = values[tuple(nearest)]
    extended[distance > voxels] = 0
    return extended


def downsample(maps: dict[str, np.ndarray], affine: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """1 mm maps -> 2 mm maps (float, 0..255) and the matching affine.

    The T1 is averaged over brain voxels only: a plain average would blend the brain edge with
    the zero background and leave a dark rim that is not in real skull-stripped scans.
    """
    brain_1mm = (maps["t1"] > 0).astype(np.float64)
    brain = block_mean(brain_1mm)
    t1_sum = block_mean(maps["t1"] * brain_1mm)
    t1 = np.divide(t1_sum, brain, out=np.zeros_like(t1_sum), where=brain > 0)
    t1 = extend_outwards(t1, brain > 0, T1_EXTENSION_VOXELS)
    out = {"t1": t1, "gm": block_mean(maps["gm"]), "wm": block_mean(maps["wm"]), "brain": brain * 255.0}
    new_affine = affine.copy()
    new_affine[:3, :3] = affine[:3, :3] * BLOCK
    # A 2 mm voxel's centre is the midpoint of the two 1 mm voxel centres it covers.
    new_affine[:3, 3] = affine[:3, :3] @ np.full(3, (BLOCK - 1) / 2) + affine[:3, 3]
    return out, new_affine


def crop_to_brain(maps: dict[str, np.ndarray], affine: np.ndarray, margin: int = MARGIN_VOXELS):
    """Crops every map to the bounding box of anything non-zero, plus `margin` voxels."""
    occupied = np.zeros(maps["brain"].shape, dtype=bool)
    for volume in maps.values():
        occupied |= volume > 0
    coords = np.argwhere(occupied)
    start = np.maximum(coords.min(axis=0) - margin, 0)
    stop = np.minimum(coords.max(axis=0) + 1 + margin, occupied.shape)
    box = tuple(slice(a, b) for a, b in zip(start, stop))
    new_affine = affine.copy()
    new_affine[:3, 3] = affine[:3, :3] @ start + affine[:3, 3]
    return {k: v[box] for k, v in maps.items()}, new_affine


def to_uint8(volume: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(volume), 0, 255).astype(np.uint8)


def build(data_dir: Path, output: Path) -> Path:
    maps, affine = load_template(data_dir)
    maps, affine = downsample(maps, affine)
    maps, affine = crop_to_brain(maps, affine)
    arrays = {k: to_uint8(v) for k, v in maps.items()}
    output.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(output, affine=affine.astype(np.float64), **arrays)
    shape = arrays["t1"].shape
    print(
        f"wrote {output} ({output.stat().st_size / 1e6:.2f} MB): {len(arrays)} maps of shape {shape} at "
        f"{BLOCK} mm, origin {affine[:3, 3].tolist()} mm, brain voxels (>50%) "
        f"{int((arrays['brain'] > 127).sum())}"
    )
    return output


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--nilearn-data",
        type=Path,
        default=None,
        help="nilearn's datasets/data folder (default: that of an importable nilearn)",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"default: {DEFAULT_OUTPUT}")
    args = parser.parse_args(argv)
    build(args.nilearn_data or default_nilearn_data_dir(), args.output)


if __name__ == "__main__":
    main()
