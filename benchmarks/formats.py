#!/usr/bin/env python3
"""Dataset layouts and formats: the same scans as an MSD dataset and as an nnU-Net v2 raw dataset through
`tfmis-convert`, and a 512 x 512 x 600 CT as NIfTI and as a DICOM series through `tfmis-predict`.

Two measurements (subcommands), each command a fresh process of this checkout's tfmis (`PYTHONPATH` set to it):

`convert`: each MSD folder (`--datasets`; default the demo and the CT demo) is rewritten in nnU-Net v2 raw layout
(`write_nnunet`: 4D images split into `<case>_0000`, `<case>_0001`... files written with nibabel with the source's
affine, header and on-disk type; a dataset.json with `channel_names`, `labels` name -> value, `file_ending`), then
both folders are converted with `tfmis-convert --source-dir DIR --target-dir OUT --quiet` (`--convert-args` adds the
same options to both), `--rounds` times, alternating layouts (MSD, nnU-Net, MSD, nnU-Net). Printed per dataset and
layout: the source's bytes, each round's wall time of the command, the output's bytes (sum of the file sizes) and
records; then whether every round's records equal the first MSD round's (the decoded image and label arrays
bit-identical per case, the geometry, the preprocessing parameters and each case's split).

`dicom`: the NIfTI scan (`--scan`, int16 HU) is written as a DICOM series (`write_series`: one CT Image Storage file
per slice with pydicom, int16 pixels HU + 1024 with RescaleSlope 1 and RescaleIntercept -1024,
ImageOrientationPatient / ImagePositionPatient / PixelSpacing from the NIfTI affine, as many digits as DICOM's
16-character decimal strings hold, or `--ds-digits N` significant digits) in `--scratch`/dicom/<case>, then
`tfmis-predict --checkpoint RUN --device cpu --quiet` predicts it `--rounds` times, alternating three arms, each in a
fresh process: `nifti` (the NIfTI file, NIfTI out), `dicom-seg` (the series folder, `--output-format dicom-seg`) and
`dicom-nifti` (the series folder, NIfTI out). Per run: wall time of the command, the case's seconds (predictions.csv:
reading, preprocessing, sliding window, restoring, writing), peak RSS of the command's process (`ru_maxrss` from
`wait4`, or the summed RSS of its process tree polled every 0.2 s if higher) and that peak as a multiple of the scan's
float32 size (X*Y*Z*4 bytes), and the output's bytes. `--baseline SCAN` first predicts a small scan once: its peak RSS
(interpreter, TensorFlow, model) is subtracted in the column `above small scan`. Then the voxels whose label differs
from the first `nifti` run's: every other run's label map (the SEG decoded with `tfmis.inference.dicom_seg.
read_segmentation` over the series), and the largest difference of the NIfTI outputs' affines.

With `--ds-digits 10` (what tests/dicom_files.py writes) the affine read back from the series differs from the
NIfTI's by about 1e-8 mm; on the 512 x 512 x 600 CT that moved 180 resampled float16 voxels by one step and one
voxel of the label map. With 16 characters the preprocessed volumes, and the label maps, are identical.

Examples (about 2 minutes for `convert`, 13 minutes for `dicom` on 2 busy cores):
    nice python benchmarks/formats.py convert --datasets /work/bench/data/demo/Task00_DemoBrain \\
        /work/bench/data/Task90_DemoCT --scratch /tmp/formats_convert
    nice python benchmarks/formats.py dicom --scan /tmp/Task91_CT600/imagesTr/ct_000.nii.gz \\
        --run /work/bench/pvs_ct/single --baseline /work/bench/data/Task90_DemoCT/imagesTs/ct_900.nii.gz \\
        --scratch /tmp/formats_dicom

The 512 x 512 x 600 CT is `python -m tfmis.data.demos.ct --size full` style (benchmarks/conversion_size.py makes such
cases); any int16 NIfTI CT whose affine is right-handed in LPS (slices along the cross product of rows and columns,
as DICOM's) works.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}  # the commands run this checkout's tfmis
INTERCEPT = -1024.0  # DICOM pixels are HU - INTERCEPT


def command(name: str) -> list[str]:
    """The console script `name` (tfmis-convert, tfmis-predict) beside this interpreter, else `python -m`."""
    script = Path(sys.executable).parent / name
    return [str(script)] if script.is_file() else [sys.executable, "-m", name.replace("-", ".")]


def processor() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def measured_run(cmd: list[str]) -> dict:
    """Runs `cmd`: wall seconds, exit code, peak RSS in bytes (the larger of the process's ru_maxrss and its process
    tree's summed RSS polled every 0.2 s)."""
    import psutil

    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    polled = [0]

    def poll():
        try:
            root = psutil.Process(proc.pid)
            while proc.returncode is None:
                tree = [root, *root.children(recursive=True)]
                total = 0
                for p in tree:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                polled[0] = max(polled[0], total)
                time.sleep(0.2)
        except psutil.Error:
            pass

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    thread.join()
    return {
        "cmd": cmd,
        "code": proc.returncode,
        "seconds": seconds,
        "maxrss": usage.ru_maxrss * 1024,
        "polled_rss": polled[0],
        "peak_rss": max(usage.ru_maxrss * 1024, polled[0]),
        "output": output[-3000:],
    }


# ---------------------------------------------------------------- convert: MSD against nnU-Net v2 layout


def nnunet_name(msd_root: Path) -> str:
    """Task90_DemoCT -> Dataset090_DemoCT (nnU-Net v2's folder name)."""
    match = re.fullmatch(r"Task(\d+)_(.+)", msd_root.name)
    return f"Dataset{int(match[1]):03d}_{match[2]}" if match else f"Dataset999_{msd_root.name}"


def write_like(img, data: np.ndarray, path: Path) -> None:
    """`data` as NIfTI with the affine, header fields and on-disk type of the nibabel image `img`."""
    import nibabel as nib

    path.parent.mkdir(parents=True, exist_ok=True)
    out = nib.Nifti1Image(np.asarray(data), img.affine, img.header.copy())
    out.set_data_dtype(img.get_data_dtype())
    nib.save(out, str(path))


def write_nnunet(msd_root: Path, root: Path) -> Path:
    """The MSD dataset `msd_root` rewritten in nnU-Net v2 raw layout at `root` (same cases, voxels and geometry;
    NIfTI files)."""
    import nibabel as nib

    meta = json.loads((msd_root / "dataset.json").read_text())
    for folder, entries in (("imagesTr", meta["training"]), ("imagesTs", meta.get("test", []))):
        for entry in entries:
            image = entry["image"] if isinstance(entry, dict) else entry
            case_id = Path(image).name.removesuffix(".nii.gz")
            img = nib.load(str(msd_root / image))
            data = np.asanyarray(img.dataobj)
            data = data[..., np.newaxis] if data.ndim == 3 else data
            for c in range(data.shape[-1]):
                write_like(img, data[..., c], root / folder / f"{case_id}_{c:04d}.nii.gz")
            if isinstance(entry, dict):
                label = nib.load(str(msd_root / entry["label"]))
                write_like(label, np.asanyarray(label.dataobj), root / "labelsTr" / f"{case_id}.nii.gz")
    dataset = {
        "name": meta["name"],
        "channel_names": meta["modality"],
        "labels": {name: int(value) for value, name in meta["labels"].items()},
        "numTraining": len(meta["training"]),
        "file_ending": ".nii.gz",
    }
    (root / "dataset.json").write_text(json.dumps(dataset, indent=1))
    return root


def all_records(target: Path) -> dict:
    """{case id: (split, image, label, geometry)} of every record of every split, decoded by tfmis's record reader."""
    from tfmis.data.records import load_index, read_record, split_cases

    index = load_index(target)
    out = {}
    for split in index["splits"]:
        for sample in range(len(split_cases(index, split))):
            record = read_record(target, split, sample)
            out[record["case_id"]] = (split, record["image"], record["label"], record["metadata"]["geometry"])
    return out


def compare_records(reference: Path, other: Path) -> str:
    """'equal' when `other` holds the records of `reference` (bit-identical arrays), else what differs."""
    from tfmis.data.records import load_index

    expected, got = all_records(reference), all_records(other)
    problems = []
    if sorted(expected) != sorted(got):
        problems.append(f"cases {sorted(set(expected) ^ set(got))} in one only")
    for case_id in sorted(set(expected) & set(got)):
        (s0, i0, l0, g0), (s1, i1, l1, g1) = expected[case_id], got[case_id]
        for what, same in (
            ("split", s0 == s1),
            ("image", i0.dtype == i1.dtype and i0.shape == i1.shape and np.array_equal(i0, i1)),
            ("label", l0.dtype == l1.dtype and l0.shape == l1.shape and np.array_equal(l0, l1)),
            ("geometry", g0 == g1),
        ):
            if not same:
                problems.append(f"{case_id} {what}")
    if load_index(reference)["preprocessing"] != load_index(other)["preprocessing"]:
        problems.append("preprocessing parameters")
    return f"equal ({len(expected)} cases)" if not problems else "DIFFER: " + ", ".join(problems)


def run_convert(args) -> int:
    scratch = args.scratch
    scratch.mkdir(parents=True, exist_ok=True)
    print(f"processor: {processor()}", flush=True)
    tables = []
    for msd in args.datasets:
        msd = msd.resolve()
        nnunet = scratch / nnunet_name(msd)
        if nnunet.exists():
            shutil.rmtree(nnunet)
        start = time.perf_counter()
        write_nnunet(msd, nnunet)
        print(f"{msd.name}: nnU-Net v2 layout written to {nnunet} in {time.perf_counter() - start:.1f} s", flush=True)
        sources = {"MSD": msd, "nnU-Net v2": nnunet}
        runs = {layout: [] for layout in sources}
        for r in range(args.rounds):
            for layout, source in sources.items():
                target = scratch / f"{msd.name}_tfr" / f"{'msd' if layout == 'MSD' else 'nnunet'}_r{r + 1}"
                if target.exists():
                    shutil.rmtree(target)
                cmd = command("tfmis-convert") + ["--source-dir", str(source), "--target-dir", str(target), "--quiet"]
                result = measured_run(cmd + args.convert_args)
                if result["code"] != 0:
                    print(result["output"], file=sys.stderr)
                    raise SystemExit(f"{' '.join(cmd)} exited with {result['code']}")
                index = json.loads((target / "index.json").read_text())
                shards = sum(f.stat().st_size for f in target.glob("*.tfrecord*"))
                result.update(target=target, bytes=folder_bytes(target), shards=shards, records=len(index["cases"]))
                runs[layout].append(result)
                print(f"  {layout} round {r + 1}: {result['seconds']:.1f} s, {result['bytes']} bytes", flush=True)
        reference = runs["MSD"][0]["target"]
        lines = [
            f"{msd.name} ({runs['MSD'][0]['records']} cases converted; {' '.join(args.convert_args) or 'defaults'})",
            "",
            "| layout | source MB | wall s (round 1, round 2, ...) | output bytes | of which shards "
            "| records vs MSD round 1 |",
            "| --- | ---: | --- | ---: | ---: | --- |",
        ]
        for layout, source in sources.items():
            seconds = ", ".join(f"{r['seconds']:.1f}" for r in runs[layout])
            sizes = sorted({r["bytes"] for r in runs[layout]})
            checks = [compare_records(reference, r["target"]) for r in runs[layout] if r["target"] != reference]
            verdict = "; ".join(sorted(set(checks))) if checks else "(the reference)"
            if layout == "MSD":
                verdict = f"round 2..: {verdict}" if checks else verdict
            size = " / ".join(f"{s:,}" for s in sizes)
            shards = " / ".join(f"{s:,}" for s in sorted({r["shards"] for r in runs[layout]}))
            lines.append(f"| {layout} | {mb(folder_bytes(source))} | {seconds} | {size} | {shards} | {verdict} |")
        tables.append("\n".join(lines))
        print(flush=True)
    print("\n\n".join(tables))
    print(f"\nprocessor: {processor()}")
    return 0


# ---------------------------------------------------------------- dicom: NIfTI against a DICOM series


def write_series(image_path: Path, folder: Path, digits: int | None = None) -> Path:
    """The int16 HU NIfTI `image_path` written as a CT series in `folder`, one file per slice (z), with the geometry
    of its affine (RAS to DICOM's LPS; the affine's third column must be the cross product of the first two in LPS),
    its numbers with `digits` significant digits (tests/dicom_files.py writes 10), or as many as DICOM's 16-character
    decimal strings hold (None)."""
    import nibabel as nib
    import pydicom
    from pydicom.dataset import FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid
    from pydicom.valuerep import format_number_as_ds

    img = nib.load(str(image_path))
    volume = np.asanyarray(img.dataobj)
    if not np.issubdtype(volume.dtype, np.integer):
        raise SystemExit(f"{image_path}: {volume.dtype} voxels, expected integer HU")
    lps = np.diag([-1.0, -1.0, 1.0, 1.0]) @ img.affine.astype(np.float64)
    dx, dy = np.linalg.norm(lps[:3, 0]), np.linalg.norm(lps[:3, 1])
    row, column = lps[:3, 0] / dx, lps[:3, 1] / dy
    if np.dot(np.cross(row, column), lps[:3, 2]) <= 0:
        raise SystemExit(f"{image_path}: its slices run against DICOM's slice normal (a left-handed LPS affine)")

    def ds_text(value: float) -> str:  # as many digits as DICOM's decimal strings hold (16 characters)
        return format_number_as_ds(float(value)) if digits is None else f"{value:.{digits}g}"

    study, frame, series = generate_uid(), generate_uid(), generate_uid()
    folder.mkdir(parents=True, exist_ok=True)
    for z in range(volume.shape[2]):
        ds = pydicom.Dataset()
        ds.file_meta = FileMetaDataset()
        ds.file_meta.MediaStorageSOPClassUID = CTImageStorage
        ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
        ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds.SOPClassUID, ds.SOPInstanceUID = CTImageStorage, ds.file_meta.MediaStorageSOPInstanceUID
        ds.PatientName, ds.PatientID, ds.PatientBirthDate, ds.PatientSex = "Bench^Phantom", "BENCH01", "19700101", "O"
        ds.StudyInstanceUID, ds.FrameOfReferenceUID, ds.StudyID = study, frame, "1"
        ds.StudyDate, ds.StudyTime, ds.AccessionNumber, ds.ReferringPhysicianName = "20260101", "", "", ""
        ds.SeriesInstanceUID, ds.SeriesNumber, ds.SeriesDescription = series, 1, "tfmis benchmark CT"
        ds.Modality, ds.Manufacturer, ds.InstanceNumber = "CT", "tfmis benchmarks", z + 1
        ds.ImageType = ["ORIGINAL", "PRIMARY", "AXIAL"]
        ds.PositionReferenceIndicator = ""
        ds.ImageOrientationPatient = [ds_text(v) for v in (*row, *column)]
        ds.ImagePositionPatient = [ds_text(v) for v in lps[:3] @ np.array([0.0, 0.0, z, 1.0])]
        ds.PixelSpacing = [ds_text(dy), ds_text(dx)]  # between rows, between columns
        ds.SliceThickness = ds_text(np.linalg.norm(lps[:3, 2]))
        ds.Rows, ds.Columns = volume.shape[1], volume.shape[0]
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 1
        ds.RescaleSlope, ds.RescaleIntercept, ds.RescaleType = "1", f"{INTERCEPT:g}", "HU"
        pixels = volume[:, :, z].T.astype(np.int32) - int(INTERCEPT)  # (rows, columns) = (y, x)
        if pixels.min() < -(2**15) or pixels.max() >= 2**15:
            raise SystemExit(f"{image_path}: slice {z} holds HU beyond int16 after the intercept {INTERCEPT:g}")
        ds.PixelData = pixels.astype("<i2").tobytes()
        ds.save_as(folder / f"IM{z + 1:05d}.dcm", enforce_file_format=True)
    return folder


ARMS = ("nifti", "dicom-seg", "dicom-nifti")


def label_map(arm: str, out: Path, case: str, series: Path, names: list[str]) -> tuple[np.ndarray, np.ndarray | None]:
    """(labels, affine or None) of one run's output (a SEG's segments mapped to the classes `names` by label)."""
    import nibabel as nib

    if arm == "dicom-seg":
        from tfmis.data.sources.dicom_series import read_series
        from tfmis.inference.dicom_seg import read_segmentation

        return read_segmentation(out / f"{case}.seg.dcm", read_series(series), names), None
    img = nib.load(str(out / f"{case}.nii.gz"))
    return np.asanyarray(img.dataobj), img.affine


def predictions_row(out: Path) -> dict:
    import csv

    with open(out / "predictions.csv") as f:
        return next(csv.DictReader(f))


def run_dicom(args) -> int:
    import nibabel as nib

    print(f"processor: {processor()}", flush=True)
    scan = args.scan.resolve()
    case = scan.name.removesuffix(".gz").removesuffix(".nii")
    shape = nib.load(str(scan)).shape[:3]
    float32_bytes = int(np.prod(shape)) * 4
    series = args.scratch / ("dicom" if args.ds_digits is None else f"dicom_{args.ds_digits}digits") / case
    shutil.rmtree(series, ignore_errors=True)  # written anew each time (seconds), with fresh UIDs
    start = time.perf_counter()
    write_series(scan, series, args.ds_digits)
    print(f"wrote {shape[2]} DICOM files to {series} in {time.perf_counter() - start:.1f} s", flush=True)
    predict = command("tfmis-predict") + ["--checkpoint", str(args.run), "--device", "cpu", "--quiet"]
    inputs = {"nifti": (scan, []), "dicom-seg": (series, ["--output-format", "dicom-seg"]), "dicom-nifti": (series, [])}
    baseline = None
    if args.baseline:
        out = args.scratch / "pred" / "baseline"
        shutil.rmtree(out, ignore_errors=True)
        baseline = measured_run(predict + ["--input", str(args.baseline), "--output", str(out)])
        if baseline["code"] != 0:
            print(baseline["output"], file=sys.stderr)
            raise SystemExit(f"the small scan's prediction exited with {baseline['code']}")
        print(f"small scan {args.baseline.name}: {baseline['seconds']:.1f} s, peak {mb(baseline['peak_rss'])} MB")
    runs = []
    for r in range(args.rounds):
        for arm in args.arms:
            out = args.scratch / "pred" / f"{arm}_r{r + 1}"
            shutil.rmtree(out, ignore_errors=True)
            source, extra = inputs[arm]
            result = measured_run(predict + ["--input", str(source), "--output", str(out), *extra])
            if result["code"] != 0:
                print(result["output"], file=sys.stderr)
                raise SystemExit(f"{arm} round {r + 1} exited with {result['code']}")
            row = predictions_row(out)
            written = Path(row["output"])
            result.update(arm=arm, round=r + 1, out=out, case_seconds=float(row["seconds"]))
            result["bytes"] = written.stat().st_size
            runs.append(result)
            print(
                f"  {arm} round {r + 1}: {result['seconds']:.1f} s (case {result['case_seconds']:.1f} s), peak "
                f"{mb(result['peak_rss'])} MB (ru_maxrss {mb(result['maxrss'])}, polled {mb(result['polled_rss'])}), "
                f"{written.name} {result['bytes']} bytes",
                flush=True,
            )
    reference = next(r for r in runs if r["arm"] == "nifti")
    from tfmis.config import load_config
    from tfmis.data.records import load_index

    names = list(load_index(load_config(args.run / "config.yaml").data.dataset_dir)["source"]["labels"])
    ref_labels, ref_affine = label_map("nifti", reference["out"], case, series, names)
    for result in runs:
        labels, affine = label_map(result["arm"], result["out"], case, series, names)
        result["differ"] = int(np.count_nonzero(labels != ref_labels)) if labels.shape == ref_labels.shape else -1
        result["affine_diff"] = None if affine is None else float(np.abs(affine - ref_affine).max())
        result["foreground"] = int(np.count_nonzero(labels))
    lines = [
        f"{case}: {' x '.join(map(str, shape))} voxels, float32 size {mb(float32_bytes)} MB; "
        f"run {args.run}; {len(runs)} runs, arms alternating",
        "",
        "| input -> output | round | wall s | case s | peak RSS MB | x float32 scan "
        "| above small scan MB (x float32) | output | output bytes | voxels differing from nifti round 1 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |",
    ]
    names = {"nifti": "NIfTI -> NIfTI", "dicom-seg": "DICOM -> DICOM SEG", "dicom-nifti": "DICOM -> NIfTI"}
    for r in runs:
        above = r["peak_rss"] - baseline["peak_rss"] if baseline else None
        above = "" if above is None else f"{mb(above)} ({above / float32_bytes:.2f}x)"
        affine = "" if r["affine_diff"] is None else f" (affine max diff {r['affine_diff']:.2g})"
        differ = "reference" if r is reference else f"{r['differ']}{affine}"
        output = "SEG" if r["arm"] == "dicom-seg" else "NIfTI"
        lines.append(
            f"| {names[r['arm']]} | {r['round']} | {r['seconds']:.1f} | {r['case_seconds']:.1f} "
            f"| {mb(r['peak_rss'])} | {r['peak_rss'] / float32_bytes:.2f} | {above} | {output} | {r['bytes']:,} "
            f"| {differ} |"
        )
    lines.append("")
    digits = "16-character" if args.ds_digits is None else f"{args.ds_digits}-significant-digit"
    lines.append(
        f"- DICOM series: {shape[2]} files, {mb(folder_bytes(series))} MB ({digits} geometry strings); NIfTI "
        f"{mb(scan.stat().st_size)} MB"
    )
    lines.append(f"- label map foreground voxels (nifti round 1): {reference['foreground']:,}")
    if baseline:
        lines.append(
            f"- small scan {args.baseline.name} ({' x '.join(map(str, nib.load(str(args.baseline)).shape[:3]))}): "
            f"{baseline['seconds']:.1f} s, peak RSS {mb(baseline['peak_rss'])} MB"
        )
    lines.append(f"- processor: {processor()}")
    table = "\n".join(lines)
    print("\n" + table)
    if args.json:
        keep = ("arm", "round", "seconds", "case_seconds", "maxrss", "polled_rss", "peak_rss", "bytes", "differ")
        data = {"runs": [{k: r[k] for k in keep} for r in runs], "float32_bytes": float32_bytes, "table": table}
        args.json.write_text(json.dumps(data, indent=1))
    return 0


# ---------------------------------------------------------------- command line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="MSD against nnU-Net v2 layout through tfmis-convert: time, bytes, records")
    c.add_argument("--datasets", type=Path, nargs="+", required=True, help="MSD folders (Task<NN>_<Name>)")
    c.add_argument("--scratch", type=Path, default=Path("/tmp/formats_convert"), help="nnU-Net copies, outputs")
    c.add_argument("--rounds", type=int, default=2)
    c.add_argument("--convert-args", nargs=argparse.REMAINDER, default=[], help="more tfmis-convert options (last)")
    d = sub.add_parser("dicom", help="a CT as NIfTI and as a DICOM series through tfmis-predict: time, RSS, labels")
    d.add_argument("--scan", type=Path, required=True, help="an int16 HU NIfTI CT")
    d.add_argument("--run", type=Path, required=True, help="a trained CT run folder (tfmis-predict --checkpoint)")
    d.add_argument("--baseline", type=Path, default=None, help="a small scan predicted once first (fixed RSS)")
    d.add_argument("--scratch", type=Path, default=Path("/tmp/formats_dicom"), help="the series and the outputs")
    d.add_argument("--rounds", type=int, default=2)
    d.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    d.add_argument("--ds-digits", type=int, default=None, help="significant digits of the geometry (default 16 chars)")
    d.add_argument("--json", type=Path, default=None, help="also write the runs as JSON")
    args = p.parse_args(argv)
    return run_convert(args) if args.command == "convert" else run_dicom(args)


if __name__ == "__main__":
    sys.exit(main())
