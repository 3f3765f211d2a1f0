#!/usr/bin/env python3
"""tfmis's plan beside nnU-Net v2's own planner, on the same MSD folder: spacing, median shape, patch, pooling and
batch of every configuration each of them plans.

Two halves, each run in its own environment, and a driver that runs both and prints one markdown table per dataset:

- `nnunet` (runs in a virtual environment with nnU-Net v2; imports only nnunetv2, numpy, nibabel and json): converts
  the MSD folder to nnU-Net's raw format (`nnunetv2.dataset_conversion.convert_MSD_dataset`, which splits 4D images
  into `_0000`, `_0001`.. channel files), extracts the fingerprint once and plans the experiment with the default
  `ExperimentPlanner` at each GPU memory target of `--gpu-memory-target-gb` (default 8, nnU-Net's;
  `plan_and_preprocess_api.extract_fingerprints` and `plan_experiments`, what `nnUNetv2_extract_fingerprint -d ID`
  and `nnUNetv2_plan_experiment -d ID -gpu_memory_target GB` run; one plans file per target, `nnUNetPlans.json` for
  8, `nnUNetPlans_<GB>G.json` otherwise). No preprocessing, no training, no GPU: the planner estimates memory from
  the network's feature maps on the CPU. Writes the configurations of each plans file (2d, 3d_fullres, 3d_lowres,
  3d_cascade_fullres: which exist, spacing, patch, batch, stages and strides, median image size) as JSON.
- `tfmis` (runs in tfmis's environment): fingerprints the MSD folder once (`tfmis.planning.fingerprint_msd`) and
  plans it with `tfmis.planning.stages.plan_stages`: for the hardware this machine has (`detect_hardware()`:
  here a CPU, so 48^3 patches), and for one GPU of each `--gpu-memory-gb` (default 16: `Hardware` with one GPU of
  that memory and compute capability 8.0, so mixed_float16 as nnU-Net trains; the GPU's memory sets the patch and
  the batch: 85% of it after 1 GB for CUDA, as `--gpu-memory` does). Each plan is
  written as `python -m tfmis.plan` writes it and read back from its files: the stages of `plan.yaml` (a plain
  config, or a stages file naming the stage configs) and, when the planner writes one, the `candidates.yaml` stages
  file beside it (every candidate configuration's stages). `--cli` plans for this machine with
  `python -m tfmis.plan --source-dir DIR --output-dir SCRATCH` instead (a second fingerprint pass).
- `run` (in tfmis's environment): both halves per dataset (the nnU-Net half with `--nnunet-python` and the targets
  of `--nnunet-gpu-memory-target-gb`), then `table`.
- `table`: the markdown tables from the JSON of an output folder: one per dataset (nnU-Net's first target), and per
  dataset one of the targets both halves planned (nnU-Net's `-gpu_memory_target GB` beside tfmis's plan for one GPU
  of GB: patch, share of the median image, batch, U-Net stages, configurations, model parallelism).

All values are in the images' voxel axis order (x, y, z: the order tfmis writes). nnU-Net plans in its own order,
its array axes (z, y, x) transposed so the coarsest axis comes first (`transpose_forward` in the plans); this script
maps them back. nnU-Net's 2d configuration has no value along the axis it slices (shown as `-`).

The nnU-Net environment (`torch==2.13.0` is the CPU build: a plain `torch` would install gigabytes of CUDA wheels,
and the newest torchvision would pull them in again, so pin the torchvision of that torch):

    python -m venv /work/venv-nnunet
    /work/venv-nnunet/bin/pip install torch==2.13.0
    /work/venv-nnunet/bin/pip install nnunetv2 torch==2.13.0 torchvision==0.28.0

The demo datasets (outside the repo; `Task<NN>_<Name>` folders, the names nnU-Net's MSD conversion expects, though
any folder works: the script links it under such a name):

    python -m tfmis.data.demos.brain --output /work/data-bench/Task00_DemoBrain
    python -m tfmis.data.demos.brain --size brats --output /work/data-bench/Task01_DemoBraTS
    python -m tfmis.data.demos.ct --size full --output /work/data-bench/Task91_DemoCTFull
    python -m tfmis.data.demos.ct --size full --anatomy far --output /work/data-bench/Task92_DemoCTFar

Run (tfmis's python; about 2 minutes for the demo, 10-15 for each full-size CT on 2 cores, mostly reading the
scans: nnU-Net's conversion and fingerprint, tfmis's fingerprint):

    python benchmarks/nnunet_plans.py run /work/data-bench/Task00_DemoBrain /work/data-bench/Task01_DemoBraTS \\
        /work/data-bench/Task91_DemoCTFull /work/data-bench/Task92_DemoCTFar \\
        --nnunet-python /work/venv-nnunet/bin/python --output runs/nnunet_plans --scratch /tmp/nnunet_plans

Outputs in `--output`: per dataset `<name>/nnunet.json` and `<name>/tfmis.json`, and `tables.md` (the printed
tables). Scratch (`--scratch`, removed per dataset before each half runs): nnU-Net's raw, preprocessed (only the
fingerprint and `nnUNetPlans.json`) and results folders, and tfmis's plan files.

The halves alone:

    /work/venv-nnunet/bin/python benchmarks/nnunet_plans.py nnunet --source DIR --scratch S --output nnunet.json \\
        [--gpu-memory-target-gb 11 24 80]
    python benchmarks/nnunet_plans.py tfmis --source DIR --scratch S --output tfmis.json [--gpu-memory-gb 16 80]
    python benchmarks/nnunet_plans.py table --output runs/nnunet_plans

The target GPU's memory beside nnU-Net's `-gpu_memory_target` (the BraTS-size demo with 6 cases, about 2 minutes):

    python -m tfmis.data.demos.brain --size brats --cases 6 --test-cases 0 --output /work/data-bench/Task01_DemoBraTS
    python benchmarks/nnunet_plans.py run /work/data-bench/Task01_DemoBraTS \\
        --nnunet-python /work/venv-nnunet/bin/python --output runs/nnunet_targets --scratch /tmp/nnunet_targets \\
        --gpu-memory-gb 8 11 24 80 --nnunet-gpu-memory-target-gb 8 11 24 80
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

NNUNET_CONFIGURATIONS = ("2d", "3d_fullres", "3d_lowres", "3d_cascade_fullres")
DATASET_ID = 501  # nnU-Net's dataset id in the scratch folder (one dataset per scratch folder)


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def fresh(folder: Path) -> Path:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def pooling_per_axis(strides) -> list[int]:
    """Downsamplings per axis from per-level strides (an int or one per axis; the first level's is 1)."""
    counts = [0, 0, 0]
    for stride in strides:
        per_axis = stride if isinstance(stride, (list, tuple)) else [stride] * 3
        for axis, s in enumerate(per_axis):
            s = int(s)
            while s > 1:
                counts[axis] += 1
                s //= 2
    return counts


# ------------------------------------------------------------------------------------------------ nnU-Net's half


def nnunet_staging(source: Path, scratch: Path) -> Path:
    """The MSD folder under the name `convert_msd_dataset` needs (`Task<N>_<Name>`, one underscore) and with the
    `imagesTs` it asserts (empty if the source has none), as symbolic links."""
    name = re.sub(r"^Task\d+_", "", source.name)
    name = re.sub(r"[^A-Za-z0-9]", "", name) or "Data"
    staged = scratch / "msd" / f"Task{DATASET_ID}_{name}"
    staged.mkdir(parents=True)
    for entry in ("dataset.json", "imagesTr", "labelsTr", "imagesTs"):
        if (source / entry).exists():
            (staged / entry).symlink_to((source / entry).resolve())
        elif entry == "imagesTs":
            (staged / entry).mkdir()
    return staged


def to_voxel_order(values, transpose_forward) -> list:
    """nnU-Net's transposed values (its array axes z, y, x, coarsest first) in the images' x, y, z order; a 2d
    configuration's two values get None along the sliced (first transposed) axis."""
    values = list(values)
    if len(values) == 2:
        values = [None, *values]
    zyx = [None, None, None]
    for i, axis in enumerate(transpose_forward):
        zyx[axis] = values[i]
    return zyx[::-1]


def nnunet_configuration(plans: dict, name: str) -> dict:
    """One configuration of `nnUNetPlans.json`, with its `inherits_from` resolved, in the images' axis order."""
    configurations = plans["configurations"]
    if name not in configurations:
        return {"exists": False}
    config, chain = {}, [name]
    while "inherits_from" in configurations[chain[-1]]:
        chain.append(configurations[chain[-1]]["inherits_from"])
    for link in reversed(chain):
        config.update({k: v for k, v in configurations[link].items() if k != "inherits_from"})
    arch = config.get("architecture", {}).get("arch_kwargs", {})
    strides = arch.get("strides") or config.get("pool_op_kernel_sizes")  # 2.x before the architecture key
    features = arch.get("features_per_stage")
    if features is None and "UNet_base_num_features" in config:
        n = len(strides)
        features = [min(config["UNet_base_num_features"] * 2**i, config["unet_max_num_features"]) for i in range(n)]
    tf = plans["transpose_forward"]
    pool = pooling_per_axis(strides)[: len(strides[0])]  # 2d: two axes (the sliced one gets None)
    pool = to_voxel_order(pool, tf)
    return {
        "exists": True,
        "spacing": to_voxel_order(config["spacing"], tf),
        "median_shape": to_voxel_order(config["median_image_size_in_voxels"], tf),
        "patch": to_voxel_order(config["patch_size"], tf),
        "batch": int(config["batch_size"]),
        "n_stages": int(arch.get("n_stages", len(strides))),
        "strides": strides,
        "pooling_per_axis": pool,
        "features_per_stage": list(features) if features is not None else None,
        "previous_stage": config.get("previous_stage"),
        "next_stage": config.get("next_stage"),
        "raw": {k: config[k] for k in ("spacing", "patch_size", "median_image_size_in_voxels") if k in config},
    }


def nnunet_side(source: Path, scratch: Path, output: Path, processes: int, gpu_memory_gbs) -> dict:
    scratch = fresh(scratch)
    for var, sub in (("nnUNet_raw", "raw"), ("nnUNet_preprocessed", "preprocessed"), ("nnUNet_results", "results")):
        os.environ[var] = str((scratch / sub).resolve())
        (scratch / sub).mkdir()
    os.environ.setdefault("nnUNet_def_n_proc", str(processes))
    from importlib.metadata import version

    from nnunetv2.dataset_conversion.convert_MSD_dataset import convert_msd_dataset
    from nnunetv2.experiment_planning.plan_and_preprocess_api import extract_fingerprints, plan_experiments
    from nnunetv2.utilities.dataset_name_id_conversion import convert_id_to_dataset_name

    seconds = {}
    t = time.perf_counter()
    convert_msd_dataset(str(nnunet_staging(source, scratch)), overwrite_target_id=DATASET_ID, num_processes=processes)
    seconds["convert"] = time.perf_counter() - t
    t = time.perf_counter()
    extract_fingerprints([DATASET_ID], num_processes=processes, check_dataset_integrity=False, clean=True)
    seconds["fingerprint"] = time.perf_counter() - t
    folder = scratch / "preprocessed" / convert_id_to_dataset_name(DATASET_ID)
    targets = []
    for gb in gpu_memory_gbs:  # what `nnUNetv2_plan_experiment -d ID -gpu_memory_target GB` runs, one plans file each
        t = time.perf_counter()
        name = "nnUNetPlans" if gb == 8 else f"nnUNetPlans_{gb:g}G"
        plan_experiments([DATASET_ID], "ExperimentPlanner", gpu_memory_target_in_gb=gb, overwrite_plans_name=name)
        plans_file = folder / f"{name}.json"
        plans = json.loads(plans_file.read_text())
        targets.append(
            {
                "gpu_memory_target_gb": gb,
                "plans_file": str(plans_file),
                "configurations": {c: nnunet_configuration(plans, c) for c in NNUNET_CONFIGURATIONS},
                "seconds": round(time.perf_counter() - t, 1),
            }
        )
    seconds["plan"] = sum(target["seconds"] for target in targets)
    fingerprint = json.loads((folder / "dataset_fingerprint.json").read_text())
    result = {
        "side": "nnunet",
        "dataset": source.name,
        "source": str(source),
        "nnunetv2": version("nnunetv2"),
        "torch": version("torch"),
        "planner": plans.get("experiment_planner_used", "ExperimentPlanner"),
        "transpose_forward": plans["transpose_forward"],
        "num_cases": len(fingerprint.get("spacings", [])),
        "median_spacing": to_voxel_order(plans["original_median_spacing_after_transp"], plans["transpose_forward"]),
        "median_shape_after_crop": to_voxel_order(
            plans["original_median_shape_after_transp"], plans["transpose_forward"]
        ),
        # the first target's plans (the per-dataset table), and every target's (the targets table)
        "gpu_memory_target_gb": targets[0]["gpu_memory_target_gb"],
        "plans_file": targets[0]["plans_file"],
        "configurations": targets[0]["configurations"],
        "targets": targets,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
    }
    write_json(output, result)
    return result


# ------------------------------------------------------------------------------------------------ tfmis's half


def gpu_hardware(host, memory_gb: float):
    """`host` (this machine's `Hardware`) with one GPU of `memory_gb` and compute capability 8.0 (mixed_float16)."""
    import dataclasses

    gpu = {"name": f"GPU {memory_gb:g} GB (assumed)", "compute_capability": (8, 0), "memory_mb": memory_gb * 1024}
    return dataclasses.replace(host, gpus=(gpu,))


def header_text(path: Path) -> str:
    """A plan file's leading comment lines, joined (the header wraps long lines)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def tfmis_stage(name: str, path: Path, fingerprint) -> dict:
    """One stage config of a tfmis plan: its spacing, median shape (the header's; else the fingerprint's at that
    spacing), patch, strides, filters and batch."""
    import yaml

    config = yaml.safe_load(path.read_text())
    conversion = config["data"]["conversion"]
    spacing = [float(s) for s in conversion["spacing"]]
    roi_mm = conversion.get("crop_to_label_mm")
    match = re.search(r"median\s+shape at the target spacing ([\d.]+)x([\d.]+)x([\d.]+)", header_text(path))
    if match:
        median = [float(x) for x in match.groups()]
    elif roi_mm is not None:
        from tfmis.planning.data_steps import roi_median_shape

        median = [float(x) for x in roi_median_shape(fingerprint, spacing, roi_mm)]
    else:
        median = [float(x) for x in fingerprint.median_shape_at(spacing)]
    strides = config["model"]["strides"]
    return {
        "stage": name,
        "config": str(path),
        "spacing": spacing,
        "median_shape": median,
        "patch": [int(p) for p in config["pipeline"]["patch_size"]],
        "batch": int(config["pipeline"]["num_images_per_batch"]),
        "levels": len(strides),
        "strides": strides,
        "pooling_per_axis": pooling_per_axis(strides),
        "filters": config["model"]["filters"],
        "crop_to_label_mm": roi_mm,
        "precision": config.get("training", {}).get("precision"),
        "model_parallel": model_parallel_text(config),
    }


def model_parallel_text(config: dict) -> str | None:
    """`spatial x4 (axis 0)` (and `, 2 data groups`) when the stage splits its model over GPUs, else None."""
    mp = config.get("runtime", {}).get("model_parallel") or {}
    if mp.get("mode", "none") == "none":
        return None
    text = f"{mp['mode']} x{mp.get('devices', 1)}" + (f" (axis {mp['axis']})" if mp.get("axis") is not None else "")
    return text + (f", {mp['data']} data groups" if mp.get("data", 1) > 1 else "")


def read_tfmis_plan(folder: Path, fingerprint, staged=None) -> dict:
    """What a tfmis plan in `folder` offers, from its files: the stages `plan.yaml` trains (a plain config is one
    stage) and, where the planner writes it, every candidate's stages from `candidates.yaml`; with the `StagedPlan`
    (`staged`) also its grouping of stages into candidate configurations."""
    from tfmis.config import load_stages

    plan_path = folder / "plan.yaml"
    header = header_text(plan_path)
    found = re.search(r"of an? (\w+) plan", header)
    configuration = staged.configuration if staged is not None else (found.group(1) if found else None)
    trained = load_stages(plan_path) or [(configuration or "fullres", plan_path)]
    candidates_path = folder / "candidates.yaml"
    listed = load_stages(candidates_path) if candidates_path.is_file() else None
    recommended = None
    if listed is not None:
        found = re.search(r"recommended: (\w+)", header_text(candidates_path))
        recommended = found.group(1) if found else None
    stages, seen = [], {}
    for name, path in [*trained, *(listed or [])]:
        key = str(Path(path).resolve())
        if key in seen:
            continue
        seen[key] = len(stages)
        stage = tfmis_stage(name, Path(path), fingerprint)
        stage["trained_by_plan_yaml"] = any(str(Path(p).resolve()) == key for _, p in trained)
        stages.append(stage)
    candidates = None
    if staged is not None and getattr(staged, "candidates", None):
        candidates = {
            cand: [str((Path(plan.values["output.dir"]) / "plan.yaml").resolve()) for _, plan in cand_stages]
            for cand, cand_stages in staged.candidates.items()
        }
        candidates = {cand: [seen[p] for p in paths if p in seen] for cand, paths in candidates.items()}
    return {
        "configuration": configuration,
        "recommended": recommended or getattr(staged, "recommended", None) or configuration,
        "candidates_file": str(candidates_path) if listed is not None else None,
        "candidates": candidates,  # configuration -> indices into stages, when the planner names candidates
        "decision": list(staged.decision) if staged is not None else [],
        "plan": str(plan_path),
        "stages": stages,
    }


def tfmis_side(source: Path, scratch: Path, output: Path, gpu_memory_gbs, cli: bool) -> dict:
    from tfmis.hardware import detect_hardware
    from tfmis.planning import fingerprint_msd
    from tfmis.planning.stages import plan_stages

    scratch = fresh(scratch)
    t = time.perf_counter()
    fingerprint = fingerprint_msd(source, progress=False)
    seconds = {"fingerprint": time.perf_counter() - t}
    host = detect_hardware()
    runs = [("this machine", host)] + [(f"{gb:g} GB GPU", gpu_hardware(host, gb)) for gb in gpu_memory_gbs]
    plans = []
    for label, hardware in runs:
        folder = scratch / re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")
        t = time.perf_counter()
        staged = None
        if cli and not hardware.has_gpu:
            command = [sys.executable, "-m", "tfmis.plan", "--source-dir", str(source), "--output-dir", str(folder)]
            command += ["--target-dir", f"{folder}_tfrecords", "--quiet"]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        else:
            staged = plan_stages(
                fingerprint,
                hardware,
                source_dir=str(source),
                dataset_dir=f"{folder}_tfrecords",
                output_dir=str(folder),
            )
            staged.write()
        plan = read_tfmis_plan(folder, fingerprint, staged)
        plan.update(label=label, hardware=hardware.describe(), has_gpu=hardware.has_gpu)
        plan["seconds"] = round(time.perf_counter() - t, 1)
        plans.append(plan)
    result = {
        "side": "tfmis",
        "dataset": source.name,
        "source": str(source),
        "num_cases": fingerprint.num_cases,
        "modalities": list(fingerprint.modalities),
        "median_spacing": [float(s) for s in fingerprint.median_spacing],
        "plans": plans,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
    }
    write_json(output, result)
    return result


# ------------------------------------------------------------------------------------------------ tables


def fmt_values(values, fmt) -> str:
    return "x".join("-" if v is None else fmt(v) for v in values)


def fmt_mm(values) -> str:
    return fmt_values(values, lambda v: f"{v:.3g}")


def fmt_shape(values) -> str:
    return fmt_values(values, lambda v: f"{round(float(v), 1):g}")


def tfmis_role(stage: dict, plan: dict) -> str:
    """A stage's name with its place: a cascade's coarse or fine (labels' box) stage, a lone lowres stage."""
    name = stage["stage"]
    if stage["crop_to_label_mm"] is not None:
        return f"{name} (cascade's fine stage: the labels' box +{stage['crop_to_label_mm']:g} mm)"
    if plan["candidates"]:
        homes = [c for c, idx in plan["candidates"].items() if plan["stages"].index(stage) in idx]
        if homes and homes != [name]:
            return f"{name} (in {', '.join(homes)})"
    if plan["configuration"] == "cascade" and name == "lowres" and stage["trained_by_plan_yaml"]:
        return "lowres (cascade's coarse stage)"
    return name


def dataset_table(nnunet: dict | None, tfmis: dict | None) -> str:
    name = (nnunet or tfmis)["dataset"]
    lines = [f"### {name}", ""]
    facts = []
    if tfmis:
        facts.append(f"{tfmis['num_cases']} cases, {', '.join(tfmis['modalities'])}")
        facts.append(f"median spacing {fmt_mm(tfmis['median_spacing'])} mm")
    if nnunet:
        facts.append(f"median shape after nnU-Net's crop {fmt_shape(nnunet['median_shape_after_crop'])}")
    lines += ["; ".join(facts) + ". Axes x, y, z.", ""]
    lines += [
        "| planner | configuration | exists | spacing (mm) | median shape | patch | pooling per axis (levels) "
        "| filters | batch |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    if nnunet:
        who = f"nnU-Net v2 ({nnunet['gpu_memory_target_gb']:g} GB GPU target)"
        for config_name, c in nnunet["configurations"].items():
            if not c["exists"]:
                lines.append(f"| {who} | {config_name} | no | | | | | | |")
                continue
            features = c["features_per_stage"]
            filters = f"{features[0]}-{features[-1]}" if features else ""
            lines.append(
                f"| {who} | {config_name} | yes | {fmt_mm(c['spacing'])} | {fmt_shape(c['median_shape'])} | "
                f"{fmt_shape(c['patch'])} | {fmt_shape(c['pooling_per_axis'])} ({c['n_stages']}) | {filters} | "
                f"{c['batch']} |"
            )
    notes = []
    if tfmis:
        for plan in tfmis["plans"]:
            who = f"tfmis, {plan['label']}" + ("" if plan["has_gpu"] else " (CPU)")
            for stage in plan["stages"]:
                exists = "yes, plan.yaml" if stage["trained_by_plan_yaml"] else "yes, candidate"
                filters = f"{stage['filters'][0]}-{stage['filters'][-1]}"
                lines.append(
                    f"| {who} | {tfmis_role(stage, plan)} | {exists} | {fmt_mm(stage['spacing'])} | "
                    f"{fmt_shape(stage['median_shape'])} | {fmt_shape(stage['patch'])} | "
                    f"{fmt_shape(stage['pooling_per_axis'])} ({stage['levels']}) | {filters} | {stage['batch']} |"
                )
            decision = plan["decision"][1:] if len(plan["decision"]) > 1 else plan["decision"]
            text = f"- tfmis, {plan['label']}: **{plan['configuration']}**"
            if plan["recommended"] and plan["recommended"] != plan["configuration"]:
                text += f" (recommended {plan['recommended']})"
            if plan["candidates"]:
                text += f"; candidates {', '.join(plan['candidates'])}"
            notes.append(text + (f". {decision[-1]}" if decision else ""))
    return "\n".join(lines + [""] + notes) + "\n"


def coverage(patch, median) -> str:
    """The share of the median image's voxels one patch covers (a 2d patch: not given)."""
    if any(v is None for v in (*patch, *median)):
        return ""
    share = 1.0
    for p, m in zip(patch, median):
        share *= min(1.0, float(p) / float(m))
    return f"{100 * share:.0f} %"


def targets_table(nnunet: dict, tfmis: dict) -> str | None:
    """nnU-Net's 3d plans at each `-gpu_memory_target` beside tfmis's plan for one GPU of that memory (the targets
    both halves planned): patch, batch, U-Net stages (resolution levels), share of the median image, and which
    configurations each offers. None when no target is in both."""
    plans = {plan["label"]: plan for plan in tfmis["plans"]}
    targets = [t for t in nnunet.get("targets", []) if f"{t['gpu_memory_target_gb']:g} GB GPU" in plans]
    if not targets:
        return None
    lines = [
        f"#### {nnunet['dataset']}: the target GPU's memory",
        "",
        "| GPU memory | planner | configuration | spacing (mm) | patch | covers | batch | U-Net stages | "
        "model parallel |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for target in targets:
        gb = target["gpu_memory_target_gb"]
        for name in NNUNET_CONFIGURATIONS[1:]:  # tfmis plans no 2d configuration
            c = target["configurations"][name]
            if c["exists"]:
                lines.append(
                    f"| {gb:g} GB | nnU-Net v2, -gpu_memory_target {gb:g} | {name} | {fmt_mm(c['spacing'])} | "
                    f"{fmt_shape(c['patch'])} | {coverage(c['patch'], c['median_shape'])} | {c['batch']} | "
                    f"{c['n_stages']} | - |"
                )
        plan = plans[f"{gb:g} GB GPU"]
        for stage in plan["stages"]:
            role = tfmis_role(stage, plan)
            if stage["trained_by_plan_yaml"]:  # a stage of the recommended configuration
                role += ", recommended"
            lines.append(
                f"| {gb:g} GB | tfmis, one {gb:g} GB GPU ({stage['precision']}) | {role} | "
                f"{fmt_mm(stage['spacing'])} | {fmt_shape(stage['patch'])} | "
                f"{coverage(stage['patch'], stage['median_shape'])} | {stage['batch']} | {stage['levels']} | "
                f"{stage.get('model_parallel') or 'none'} |"
            )
    return "\n".join(lines) + "\n"


def tables(output: Path) -> str:
    parts, versions, targets = [], set(), []
    for folder in sorted(p for p in output.iterdir() if p.is_dir()):
        loaded = {}
        for side in ("nnunet", "tfmis"):
            path = folder / f"{side}.json"
            loaded[side] = json.loads(path.read_text()) if path.is_file() else None
        if not any(loaded.values()):
            continue
        if loaded["nnunet"]:
            versions.add(loaded["nnunet"]["nnunetv2"])
        parts.append(dataset_table(loaded["nnunet"], loaded["tfmis"]))
        if loaded["nnunet"] and loaded["tfmis"]:
            targets.append(targets_table(loaded["nnunet"], loaded["tfmis"]))
    head = f"nnunetv2 {', '.join(sorted(versions))}; " if versions else ""
    return head + "planned on " + processor() + "\n\n" + "\n".join(parts + [t for t in targets if t])


def processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "an unknown processor"


# ------------------------------------------------------------------------------------------------ driver


def run(args) -> int:
    output, scratch, script = Path(args.output), Path(args.scratch), str(Path(__file__).resolve())
    failed = []
    for source in map(Path, args.sources):
        name = source.name
        gpus = [str(g) for g in args.gpu_memory_gb]
        halves = {
            "nnunet": [args.nnunet_python, script, "nnunet", "--processes", str(args.processes)]
            + ["--gpu-memory-target-gb", *[str(g) for g in args.nnunet_gpu_memory_target_gb]],
            "tfmis": [sys.executable, script, "tfmis", "--gpu-memory-gb", *gpus] + (["--cli"] if args.cli else []),
        }
        for side, command in halves.items():
            result = output / name / f"{side}.json"
            if args.reuse and result.is_file():
                continue
            command += ["--source", str(source), "--scratch", str(scratch / name / side), "--output", str(result)]
            log = output / name / f"{side}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            t = time.perf_counter()
            with open(log, "w") as f:
                code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT).returncode
            print(
                f"{name}: {side} half {'done' if code == 0 else f'FAILED (exit {code}, see {log})'} "
                f"in {time.perf_counter() - t:.0f} s",
                file=sys.stderr,
            )
            if code:
                failed.append(f"{name} {side}")
    text = tables(output)
    (output / "tables.md").write_text(text)
    print(text)
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    n = sub.add_parser("nnunet", help="nnU-Net's half (in its own venv): convert, fingerprint, plan")
    t = sub.add_parser("tfmis", help="tfmis's half: fingerprint, plan for this machine and for a GPU")
    for half in (n, t):
        half.add_argument("--source", required=True, help="MSD folder (dataset.json, imagesTr, labelsTr)")
        half.add_argument("--scratch", required=True, help="scratch folder (emptied first)")
        half.add_argument("--output", required=True, help="JSON file to write")
    n.add_argument("--processes", type=int, default=2, help="nnU-Net's worker processes (default 2)")
    n.add_argument(
        "--gpu-memory-target-gb",
        type=float,
        nargs="+",
        default=[8.0],
        help="ExperimentPlanner's gpu_memory_target_in_gb, one plans file per value (default 8)",
    )
    t.add_argument("--gpu-memory-gb", type=float, nargs="*", default=[16.0], help="plan also for one GPU of each size")
    t.add_argument("--cli", action="store_true", help="plan for this machine with python -m tfmis.plan")
    r = sub.add_parser("run", help="both halves per dataset, then the tables")
    r.add_argument("sources", nargs="+", help="MSD folders")
    r.add_argument("--output", required=True, help="results folder: <dataset>/{nnunet,tfmis}.json, tables.md")
    r.add_argument("--scratch", required=True, help="scratch folder (nnU-Net's raw/preprocessed, tfmis's plans)")
    r.add_argument("--nnunet-python", required=True, help="the python of the nnU-Net venv")
    r.add_argument("--processes", type=int, default=2)
    r.add_argument("--gpu-memory-gb", type=float, nargs="*", default=[16.0], help="tfmis: one GPU of each size")
    r.add_argument(
        "--nnunet-gpu-memory-target-gb",
        type=float,
        nargs="+",
        default=[8.0],
        help="nnU-Net: -gpu_memory_target of each plan (default 8); the targets table pairs equal values",
    )
    r.add_argument("--cli", action="store_true")
    r.add_argument("--reuse", action="store_true", help="keep a half's JSON that exists")
    s = sub.add_parser("table", help="the markdown tables of a results folder")
    s.add_argument("--output", required=True)
    args = p.parse_args(argv)
    if args.mode == "nnunet":
        nnunet_side(Path(args.source), Path(args.scratch), Path(args.output), args.processes, args.gpu_memory_target_gb)
    elif args.mode == "tfmis":
        tfmis_side(Path(args.source), Path(args.scratch), Path(args.output), args.gpu_memory_gb, args.cli)
    elif args.mode == "run":
        return run(args)
    else:
        print(tables(Path(args.output)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
