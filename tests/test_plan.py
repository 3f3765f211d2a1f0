"""Auto-configuration (tfmis.planning, python -m tfmis.plan, python -m tfmis.train --source-dir).

The planner's rules are checked against nnU-Net v2's formulas, written out again here independently
(nnunetv2 ExperimentPlanner.determine_fullres_target_spacing and get_pool_and_conv_props); the
commands run in real subprocesses on real MSD folders (the demo brain and the CT-like generator), with
a real conversion and real training.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import yaml

from tfmis.config import load_config
from tfmis.data.demos.ct import make_ct_dataset
from tfmis.hardware import Hardware, cpu_flags, hardware_warnings, recommended_precision, resolve_precision
from tfmis.networks.architecture import check_patch_size, required_divisor
from tfmis.planning import DatasetFingerprint, fingerprint_from_conversion, fingerprint_msd, make_plan
from tfmis.planning.rules import pool_and_conv_props, target_spacing, training_memory_mb

REPO = Path(__file__).resolve().parents[1]
CPU = Hardware(cpu_name="test cpu", cpu_count=2, host_memory_mb=16000, host_available_mb=12000)
GPU_80 = Hardware(
    gpus=({"name": "A100", "compute_capability": (8, 0), "memory_mb": 81920},),
    cpu_count=16,
    host_memory_mb=256000,
    host_available_mb=200000,
)


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}


# ---------------------------------------------------------------- nnU-Net v2's formulas, written out independently


def nnunet_target_spacing(spacings, sizes):
    """nnunetv2 ExperimentPlanner.determine_fullres_target_spacing (anisotropy_threshold 3)."""
    target = np.percentile(np.vstack(spacings), 50, 0)
    target_size = np.percentile(np.vstack(sizes), 50, 0)
    worst_spacing_axis = np.argmax(target)
    other_axes = [i for i in range(len(target)) if i != worst_spacing_axis]
    other_spacings = [target[i] for i in other_axes]
    other_sizes = [target_size[i] for i in other_axes]
    has_aniso_spacing = target[worst_spacing_axis] > (3 * max(other_spacings))
    has_aniso_voxels = target_size[worst_spacing_axis] * 3 < min(other_sizes)
    if has_aniso_spacing and has_aniso_voxels:
        spacings_of_that_axis = np.vstack(spacings)[:, worst_spacing_axis]
        target_spacing_of_that_axis = np.percentile(spacings_of_that_axis, 10)
        if target_spacing_of_that_axis < max(other_spacings):
            target_spacing_of_that_axis = max(max(other_spacings), target_spacing_of_that_axis) + 1e-5
        target[worst_spacing_axis] = target_spacing_of_that_axis
    return target


def nnunet_get_pool_and_conv_props(spacing, patch_size, min_feature_map_size, max_numpool):
    """nnunetv2.experiment_planning.experiment_planners.network_topology.get_pool_and_conv_props (pooling part)."""
    dim = len(spacing)
    current_spacing = copy.deepcopy(list(spacing))
    current_size = copy.deepcopy(list(patch_size))
    pool_op_kernel_sizes = [[1] * len(spacing)]
    num_pool_per_axis = [0] * dim
    while True:
        valid_axes_for_pool = [i for i in range(dim) if current_size[i] >= 2 * min_feature_map_size]
        if len(valid_axes_for_pool) < 1:
            break
        spacings_of_axes = [current_spacing[i] for i in valid_axes_for_pool]
        min_spacing_of_valid = min(spacings_of_axes)
        valid_axes_for_pool = [i for i in valid_axes_for_pool if current_spacing[i] / min_spacing_of_valid < 2]
        valid_axes_for_pool = [i for i in valid_axes_for_pool if num_pool_per_axis[i] < max_numpool]
        if len(valid_axes_for_pool) == 1:
            if current_size[valid_axes_for_pool[0]] >= 3 * min_feature_map_size:
                pass
            else:
                break
        if len(valid_axes_for_pool) < 1:
            break
        other_axes = [i for i in range(dim) if i not in valid_axes_for_pool]
        pool_kernel_sizes = [0] * dim
        for v in valid_axes_for_pool:
            pool_kernel_sizes[v] = 2
            num_pool_per_axis[v] += 1
            current_spacing[v] *= 2
            current_size[v] = np.ceil(current_size[v] / 2)
        for nv in other_axes:
            pool_kernel_sizes[nv] = 1
        pool_op_kernel_sizes.append(pool_kernel_sizes)
    must_be_divisible_by = [2**n for n in num_pool_per_axis]
    patch = [int(np.ceil(p / d) * d) for p, d in zip(patch_size, must_be_divisible_by)]  # pad_shape
    return num_pool_per_axis, pool_op_kernel_sizes, patch, must_be_divisible_by


@pytest.mark.parametrize(
    "spacings, sizes, kind",
    [
        ([[2.5, 2.5, 2.5]] * 5, [[60, 70, 60]] * 5, "isotropic: the median"),
        (
            [[0.8, 0.8, 2.5], [0.7, 0.7, 2.5], [0.9, 0.9, 3.0], [0.8, 0.8, 2.0]],
            [[110, 100, 40]] * 4,
            "3.1x anisotropic with many slices: the median, kept anisotropic",
        ),
        (
            [[0.78, 0.78, 5.0], [0.7, 0.7, 1.5], [0.8, 0.8, 5.0], [0.9, 0.9, 7.5], [0.75, 0.75, 1.25], [0.8, 0.8, 5.0]],
            [[400, 380, 90], [420, 400, 300], [380, 380, 80], [400, 400, 60], [410, 400, 320], [390, 390, 90]],
            "thick slices and few of them: z at its 10th percentile",
        ),
        (
            [[5.0, 0.8, 0.8], [4.0, 0.7, 0.7], [6.0, 0.9, 0.9]],
            [[30, 300, 300]] * 3,
            "coarse axis 0 with few voxels: its 10th percentile",
        ),
    ],
)
def test_target_spacing_is_nnunet_v2s_rule(spacings, sizes, kind):
    """tfmis.planning.rules.target_spacing returns nnU-Net v2's full-resolution spacing (formula written out
    above) for isotropic, mildly and strongly anisotropic data; the reason names the rule that applied."""
    spacing, reason = target_spacing(spacings, sizes)
    np.testing.assert_allclose(spacing, nnunet_target_spacing(spacings, sizes), rtol=0, atol=1e-9)
    if "10th" in kind:
        thick = int(np.argmax(np.median(spacings, axis=0)))
        assert spacing[thick] < np.median(np.array(spacings)[:, thick]) and "10th percentile" in reason
    elif "kept anisotropic" in kind:
        assert "kept anisotropic because 3.1x" in reason and spacing.tolist() == [0.8, 0.8, 2.5]
    else:
        assert "median per axis" in reason and "10th" not in reason


@pytest.mark.parametrize(
    "spacing, patch",
    [
        ([1.0, 1.0, 1.0], [128, 128, 128]),
        ([2.5, 2.5, 2.5], [58, 74, 62]),
        ([0.8, 0.8, 2.5], [80, 80, 40]),
        ([0.79, 0.79, 5.0], [192, 160, 56]),
        ([3.0, 0.7, 0.7], [40, 224, 192]),
        ([1.5, 1.5, 2.0], [96, 96, 96]),
        ([0.5, 0.5, 0.5], [256, 256, 256]),  # would pool 6 times: capped at 5
        ([1.0, 1.0, 1.0], [12, 100, 100]),
    ],
)
def test_pooling_is_nnunet_get_pool_and_conv_props(spacing, patch):
    """Per-axis poolings, strides, padded patch and divisor equal nnU-Net's get_pool_and_conv_props (feature
    map >= 4 voxels, spacing < 2x the finest, at most 5 per axis); a thin axis is not pooled at level 1 while
    the others are; the padded patch fits tfmis's U-Net (check_patch_size)."""
    pools, strides, padded, divisor = pool_and_conv_props(spacing, patch)
    ref_pools, ref_kernels, ref_patch, ref_divisor = nnunet_get_pool_and_conv_props(spacing, patch, 4, 5)
    assert pools == ref_pools and [list(s) for s in strides] == ref_kernels
    assert padded == ref_patch and list(divisor) == ref_divisor
    assert max(pools) <= 5 and required_divisor(strides) == tuple(divisor)
    assert check_patch_size(padded, strides) == tuple(divisor)
    if max(spacing) / min(spacing) >= 2:
        thick = int(np.argmax(spacing))
        assert strides[1][thick] == 1 and all(strides[1][a] == 2 for a in range(3) if a != thick)


def _fingerprint(
    spacings, crop_shapes, modalities=("CT",), class_voxels=(9_000_000, 300_000, 2_000), ct_window=(-57.0, 164.0)
):
    n = len(spacings)
    return DatasetFingerprint(
        name="TaskXX",
        modalities=list(modalities),
        labels=["background", "organ", "lesion"][: len(class_voxels)],
        case_ids=[f"c{i}" for i in range(n)],
        spacings=np.array(spacings, float),
        crop_shapes=np.array(crop_shapes, float),
        class_voxels=list(class_voxels),
        ct_window=ct_window if "CT" in modalities else None,
        intensity=[],
        cases_without_foreground=[],
        skipped={},
        source="test",
        source_dir="/data/TaskXX",
    )


@pytest.mark.parametrize("hardware", [CPU, GPU_80], ids=["cpu", "gpu"])
def test_planned_network_fits_its_patch_and_budget(hardware):
    """On an anisotropic CT fingerprint: the patch is a multiple of the stride products and no larger than the
    padded median shape, z is not pooled at level 1, the budget holds (CPU: <= 48^3 voxels; GPU: estimated
    training peak at batch 2 <= 85% of the 80 GB GPU after its reserved 1 GB), filters follow the rule (CPU 8..,
    GPU 32.. capped at 320), the CT window and the small-class crop ratio are planned, and the plan loads as a
    Config."""
    fp = _fingerprint([[0.8, 0.8, 2.5]] * 10, [[400, 300, 100]] * 10)
    plan = make_plan(fp, hardware)
    config = plan.config()
    patch, strides = config.pipeline.patch_size, config.model.strides
    divisor = check_patch_size(patch, strides)
    assert all(p % d == 0 for p, d in zip(patch, divisor))
    # z is not pooled at the first pooling: level 1 on a GPU (nnU-Net's layout), the first convolution on a CPU
    # (the CPU recipe's layout: the first convolution takes the first pooling, the last level pools nothing)
    if hardware.has_gpu:
        assert strides[0] == 1 and strides[1] == (2, 2, 1)
    else:
        assert strides[0] == (2, 2, 1) and strides[-1] == 1
        assert config.model.output_upsampling == "transposed_image" and config.model.deep_supervision == 2
    median = fp.median_shape_at(config.data.conversion.spacing)
    median[:2] = max(median[:2])  # square in-plane: both sides from the in-plane medians' geometric mean
    assert all(p <= m + d for p, m, d in zip(patch, median, divisor))
    assert patch[0] == patch[1] and config.pipeline.augment.rot90_prob == 0.5  # x, y medians within 1.5x
    memory = training_memory_mb(
        patch, strides, config.model.filters, config.model.num_res_units, 1, 3, 2, config.training.precision
    )
    if hardware.has_gpu:
        assert memory["total_mb"] <= 0.85 * (80 * 1024 - 1024)
        assert config.model.filters == tuple(min(32 * 2**i, 320) for i in range(len(strides)))
        assert config.pipeline.num_images_per_batch >= 2 and config.optimizer.name == "sgd"
        assert config.training.precision == "mixed_float16" and config.validation.overlap == 0.5
    else:
        assert np.prod(patch) <= 48**3
        assert config.model.filters == tuple(min(8 * 2**i, 128) for i in range(len(strides)))
        assert config.pipeline.num_images_per_batch == 2 and config.validation.validation_data_device == "cpu"
        assert config.training.precision == "float32"
    assert config.data.conversion.ct_window == (-57.0, 164.0) and config.data.conversion.ct_normalization == "zscore"
    assert config.pipeline.class_ratios == [1, 1, 2]  # lesion: 0.02% of the voxels
    assert config.validation.roi_size == patch and config.training.jit_compile is False


def test_patch_is_square_in_plane_only_when_the_in_plane_medians_are_close():
    """x, y medians within 1.5x (same spacing): a square in-plane patch (quarter turns on); further apart:
    nnU-Net's aspect-ratio patch without quarter turns; both divisible by the stride products."""
    close = make_plan(_fingerprint([[1.0, 1.0, 1.0]] * 4, [[120, 90, 100]] * 4), CPU).config()
    apart = make_plan(_fingerprint([[1.0, 1.0, 1.0]] * 4, [[200, 60, 100]] * 4), CPU).config()
    assert close.pipeline.patch_size[0] == close.pipeline.patch_size[1] and close.pipeline.augment.rot90_prob == 0.5
    assert apart.pipeline.patch_size[0] > apart.pipeline.patch_size[1] and apart.pipeline.augment.rot90_prob == 0.0
    for config in (close, apart):
        check_patch_size(config.pipeline.patch_size, config.model.strides)


def test_precision_rules_and_warnings():
    """recommended_precision: fp16 on GPUs from compute capability 7, float32 below and on every CPU (bf16 flags
    or not: bf16 trained no faster than float32 on the development CPU); resolve_precision passes explicit names
    through and resolves auto for this machine; hardware_warnings flags mixed_float16 and XLA on a CPU-only machine (one
    line each, naming the faster setting) and nothing for the recommended settings."""

    def gpu(cc):
        return Hardware(gpus=({"name": "g", "compute_capability": cc, "memory_mb": 16000},))

    assert recommended_precision(gpu((9, 0)))[0] == "mixed_float16"
    assert recommended_precision(gpu((8, 6)))[0] == "mixed_float16"
    assert recommended_precision(gpu((7, 0)))[0] == "mixed_float16"
    assert recommended_precision(gpu((6, 1)))[0] == "float32"
    assert recommended_precision(Hardware(cpu_flags=("avx512_bf16",)))[0] == "float32"
    assert recommended_precision(Hardware(cpu_flags=("amx_bf16", "avx512_bf16")))[0] == "float32"
    assert recommended_precision(Hardware(cpu_flags=()))[0] == "float32"
    assert cpu_flags("flags\t\t: fpu avx512f avx512_bf16 amx_tile\n") == ("avx512_bf16",)
    assert cpu_flags("flags : fpu sse2\n") == ()
    assert resolve_precision("mixed_float16") == "mixed_float16"
    assert resolve_precision("auto", Hardware(cpu_flags=())) == "float32"
    assert resolve_precision("auto") in ("float32", "mixed_float16", "mixed_bfloat16")
    with pytest.raises(ValueError, match="not one of"):
        resolve_precision("fp16")

    bad = load_config(None, ["training.precision=mixed_float16", "training.jit_compile=true"]).training
    lines = hardware_warnings(bad, Hardware(cpu_flags=()))
    assert len(lines) == 2
    assert "mixed_float16" in lines[0] and "training.precision=auto" in lines[0] and "(here: float32)" in lines[0]
    assert "jit_compile" in lines[1] and "training.jit_compile=false" in lines[1]
    assert hardware_warnings(load_config(None).training, Hardware(cpu_flags=())) == []
    assert hardware_warnings(bad, gpu((8, 0))) == []
    assert load_config(None).training.precision == "auto"


def test_ct_generator_writes_integer_hu_with_anisotropic_varying_spacing(tmp_path):
    """make_ct_dataset: an MSD folder with modality CT, int16 HU images (air -1000, body tissue, bone > 500),
    labels spleen + lesion with HU ~100 and ~30, anisotropic spacing varying per case, deterministic."""
    root = make_ct_dataset(tmp_path / "Task90_DemoCT", num_cases=3, shape=(48, 48, 20))
    meta = json.loads((root / "dataset.json").read_text())
    assert meta["modality"] == {"0": "CT"} and meta["labels"]["1"] == "spleen" and len(meta["training"]) == 3
    spacings = []
    for entry in meta["training"]:
        img, lab = nib.load(str(root / entry["image"])), nib.load(str(root / entry["label"]))
        image, label = np.asarray(img.dataobj), np.asarray(lab.dataobj)
        assert img.get_data_dtype() == np.int16 and image.dtype == np.int16
        spacings.append([float(z) for z in img.header.get_zooms()])
        assert spacings[-1][2] / spacings[-1][0] > 2
        assert image.min() == -1024 and (np.abs(image + 1000) < 40).sum() > 100  # padding and air
        assert image.max() > 500  # bone
        assert 80 < np.median(image[label == 1]) < 120
        if (label == 2).any():
            assert 15 < np.median(image[label == 2]) < 45
    assert len({tuple(s) for s in spacings}) > 1
    again = make_ct_dataset(tmp_path / "again", num_cases=1, shape=(48, 48, 20))
    np.testing.assert_array_equal(
        np.asarray(nib.load(str(again / meta["training"][0]["image"])).dataobj),
        np.asarray(nib.load(str(root / meta["training"][0]["image"])).dataobj),
    )


# ---------------------------------------------------------------- the commands, in real subprocesses


def _planned_keys(text: str) -> list[tuple[str, bool]]:
    """(dotted key, has a reason comment) for every leaf key of a plan file."""
    out, stack, previous = [], [], ""
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            previous = line
            continue
        indent = (len(line) - len(line.lstrip())) // 2
        key, _, rest = line.strip().partition(":")
        stack = stack[:indent] + [key]
        if rest.strip():
            out.append((".".join(stack), "#" in rest or previous.lstrip().startswith("#")))
        previous = line
    return out


@pytest.fixture(scope="module")
def demo_brain(tmp_path_factory):
    from tfmis.data.demos.brain import make_demo_dataset

    return make_demo_dataset(tmp_path_factory.mktemp("demo") / "Task00_DemoBrain", num_training=12, num_test=0)


def test_plan_command_on_the_demo_brain(demo_brain, tmp_path):
    """python -m tfmis.plan on the demo dataset: writes a config that load_config reads, with a reason comment
    on every planned key, prints the table, and plans the demo recipe's network for this CPU (filters 8-64,
    strides 1,2,2,2, a square 48^3 patch with quarter turns, z-score normalisation, the lesion oversampled by
    class ratios 1,1,1,2). Given `--output` and no `--output-dir`, every file it writes is beside that plan file
    (the candidates file too), none in the working directory's `runs/`; the plan trains into the default run folder
    `runs/<dataset folder>`."""
    out = tmp_path / "plans" / "plan.yaml"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "tfmis.plan", "--source-dir", str(demo_brain), "--output", str(out), "--quiet"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        cwd=cwd,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "patch" in result.stdout and f"--config {out}" in result.stdout
    text = out.read_text()
    keys = _planned_keys(text)
    assert len(keys) > 25 and all(has for _, has in keys), [k for k, has in keys if not has]
    config = load_config(out)
    assert config.model.filters == (8, 16, 32, 64) and config.model.strides == (2, 2, 2, 1)
    assert config.pipeline.patch_size == [48, 48, 48] and config.pipeline.augment.rot90_prob == 0.5
    assert config.pipeline.class_ratios == [1, 1, 1, 2] and config.training.precision == "float32"
    assert config.data.conversion.spacing == (2.5, 2.5, 2.5) and config.data.conversion.ct_window is None
    assert "z-score" in text and "square in-plane" in text
    # oneDNN: decided on the machine that trains, with this machine's decision and its reason in the comment
    assert config.runtime.onednn == "auto"
    flat = " ".join(line.strip().lstrip("#").strip() for line in text.splitlines())  # comments are wrapped
    assert "onednn: auto" in text and "here: oneDNN " in flat and "Hardware: CPU only" in flat
    assert config.output.dir == str(Path("runs") / demo_brain.name)
    assert json.loads((out.parent / "plan_fingerprint.json").read_text())["labels"][3] == "lesion"
    assert (out.parent / "candidates.yaml").is_file() and not list(cwd.iterdir())


@pytest.fixture(scope="module")
def tiny_ct_run(tmp_path_factory):
    """python -m tfmis.train --source-dir on a tiny CT-like dataset: plan, real conversion, 1 epoch of training."""
    root = tmp_path_factory.mktemp("ct")
    source = make_ct_dataset(root / "Task91_TinyCT", num_cases=5, shape=(48, 48, 20))
    run = root / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfmis.train",
            "--source-dir",
            str(source),
            "--set",
            f"output.dir={run}",
            "--set",
            "training.epochs=1",
            "--set",
            "training.steps_per_epoch=2",
            "--set",
            "optimizer.warmup_epochs=0",
            "--set",
            "output.progress=false",
            "--set",
            "output.tensorboard=false",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
        cwd=root,
    )
    return {"source": source, "run": run, "result": result, "dataset_dir": root / "Task91_TinyCT_tfrecords"}


@pytest.mark.slow
def test_train_from_source_dir_plans_converts_and_trains(tiny_ct_run):
    """python -m tfmis.train --source-dir (no --config) on a CT-like dataset: writes plan.yaml in the run folder
    and says how to rerun with it, converts with the planned anisotropic spacing and CT window, trains an epoch
    (a validation Dice in history.jsonl) with the precision resolved for this machine (never 'auto')."""
    result, run = tiny_ct_run["result"], tiny_ct_run["run"]
    assert result.returncode == 0, result.stderr[-4000:]
    plan_path = run / "plan.yaml"
    assert f"edit it and rerun with --config {plan_path}" in result.stderr
    plan = load_config(plan_path)
    assert all(has for _, has in _planned_keys(plan_path.read_text()))
    # z (2.5 mm) is >= 2x the in-plane spacing: not pooled at the first pooling, which the CPU recipe's layout gives
    # the first convolution
    assert plan.model.strides[0] == (2, 2, 1) and plan.model.output_upsampling == "transposed_image"
    assert plan.data.conversion.ct_window is not None and plan.data.dataset_dir == str(tiny_ct_run["dataset_dir"])
    index = json.loads((tiny_ct_run["dataset_dir"] / "index.json").read_text())
    assert (
        index["preprocessing"]["normalization"] == ["ct_zscore"] and plan.data.conversion.ct_normalization == "zscore"
    )
    assert len(index["preprocessing"]["ct_mean_std"]) == 2 and index["preprocessing"]["ct_mean_std"][1] > 0
    assert index["preprocessing"]["spacing"] == list(plan.data.conversion.spacing)
    assert index["preprocessing"]["ct_window"] == list(plan.data.conversion.ct_window)
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert history and history[-1].get("val_mean_dice") is not None
    used = yaml.safe_load((run / "config.yaml").read_text())["training"]["precision"]
    assert used == resolve_precision("auto") and used != "auto"


@pytest.mark.slow
def test_train_from_source_dir_onto_a_conversion_with_other_parameters_is_one_error_line(tiny_ct_run, tmp_path):
    """--source-dir whose planned target holds a conversion made with another spacing (here: the tiny CT
    conversion, asked for with its planned spacing doubled): exit 1 with one `error:` line naming the folder, the
    changed parameter and the fixes, no traceback; nothing trained."""
    run = tmp_path / "run"
    planned = load_config(tiny_ct_run["run"] / "plan.yaml").data.conversion.spacing
    doubled = "[" + ",".join(str(2 * s) for s in planned) + "]"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfmis.train",
            "--source-dir",
            str(tiny_ct_run["source"]),
            "--set",
            f"output.dir={run}",
            "--set",
            f"data.dataset_dir={tiny_ct_run['dataset_dir']}",
            "--set",
            f"data.conversion.spacing={doubled}",
            "--set",
            "output.progress=false",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and str(tiny_ct_run["dataset_dir"]) in error[0] and "spacing: " in error[0]
    assert "use another --target-dir, or --overwrite" in error[0]
    assert not (run / "history.jsonl").exists()


@pytest.mark.slow
def test_first_pass_fingerprint_predicts_the_conversion(tiny_ct_run):
    """The first-pass fingerprint (no conversion) predicts each case's converted shape exactly and the CT window
    the conversion measured; the fingerprint read back from the conversion gives the same spacing and patch."""
    assert tiny_ct_run["result"].returncode == 0, tiny_ct_run["result"].stderr[-3000:]
    first = fingerprint_msd(tiny_ct_run["source"], workers=1, progress=False)
    converted = json.loads((tiny_ct_run["dataset_dir"] / "fingerprint.json").read_text())
    resolved = json.loads((tiny_ct_run["dataset_dir"] / "conversion.json").read_text())["resolved"]
    assert list(first.ct_window) == resolved["ct_window"]
    predicted = dict(zip(first.case_ids, first.shapes_at(resolved["spacing"]).tolist()))
    assert {cid: c["shape"] for cid, c in converted["cases"].items()} == predicted
    again = fingerprint_from_conversion(tiny_ct_run["dataset_dir"])
    a, b = make_plan(first, CPU).config(), make_plan(again, CPU).config()
    assert a.data.conversion.spacing == b.data.conversion.spacing
    assert a.pipeline.patch_size == b.pipeline.patch_size and a.model.strides == b.model.strides


@pytest.mark.skipif(
    bool(__import__("tensorflow").config.list_physical_devices("GPU")), reason="the warnings are for CPU-only machines"
)
def test_a_memory_no_trainable_patch_fits_is_one_resource_error_naming_the_memory_and_the_fix():
    """With 40 MB available (a small cgroup) the planner's patch shrinks until no network of 2 levels fits: a
    ResourceError naming the available memory and --host-memory, not the config check's "filters needs at least 2
    levels" after it; 12 GB available plans the same dataset."""
    from tfmis.errors import ResourceError

    fingerprint = _fingerprint([[0.8, 0.8, 2.5]] * 4, [[512, 512, 300]] * 4)
    tiny = Hardware(cpu_name="test cpu", cpu_count=2, host_memory_mb=760, host_available_mb=40)
    with pytest.raises(ResourceError) as error:
        make_plan(fingerprint, tiny)
    message = str(error.value)
    assert message.startswith("no patch of a network with 2 or more levels fits 40 MB of available memory"), message
    assert "at most 20 MB (half the available)" in message and "--host-memory 16GB" in message
    assert make_plan(fingerprint, CPU).config().pipeline.patch_size


def test_train_warns_once_about_slow_settings_on_a_cpu(tmp_path):
    """python -m tfmis.train with mixed_float16 and jit_compile on a CPU-only machine prints one warning for each,
    naming the faster setting, before anything else happens (here the missing dataset then stops the run)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfmis.train",
            "--config",
            str(REPO / "configs" / "spleen.yaml"),
            "--set",
            "training.precision=mixed_float16",
            "--set",
            "training.jit_compile=true",
            "--set",
            "data.source_dir=null",
            "--set",
            f"data.dataset_dir={tmp_path / 'missing'}",
            "--set",
            f"output.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        cwd=tmp_path,
    )
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: training.")]
    assert len(warnings) == 2, result.stderr[-3000:]
    assert "use --set training.precision=auto" in warnings[0] and "training.jit_compile=false" in warnings[1]
    assert result.returncode == 1 and "holds no converted dataset" in result.stderr
