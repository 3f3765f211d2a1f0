"""The pilot of `tfmis-train --source-dir --pilot` (`tfmis.crossvalidation.pilot`): successive halving's rungs and their
time, the candidates it compares (the planner's, plus a 64^3 patch target on a CPU), the refusals of bad arguments,
and one real command on generated NIfTI cases: short trainings scored on the validation cases, the best one planned
and trained with the time left, the whole command within its budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_cascade import CPU, fingerprint

from tests.conftest import lps_affine, make_msd_dataset
from tfmis.crossvalidation.pilot import (
    LARGER_CPU_PATCH_VOXELS,
    PILOT_FILE,
    pilot_candidates,
    rung_seconds,
    rung_sizes,
)
from tfmis.hardware import Hardware

ROOT = Path(__file__).resolve().parents[1]
H100 = Hardware(gpus=({"name": "NVIDIA H100 80GB HBM3", "compute_capability": (9, 0), "memory_mb": 81_559},))


def test_successive_halving_keeps_the_better_half_until_one_is_left():
    """Each rung trains ceil(half) of the one before, down to the rung of two that leaves one; a single candidate
    needs no rung."""
    assert rung_sizes(1) == []
    assert rung_sizes(2) == [2]
    assert rung_sizes(3) == [3, 2]
    assert rung_sizes(4) == [4, 2]
    assert rung_sizes(5) == [5, 3, 2]


@pytest.mark.parametrize("sizes", [[2], [3, 2], [5, 3, 2]])
def test_the_rungs_doubling_loops_and_their_overheads_fill_the_pilot_time(sizes):
    """With t from `rung_seconds`, rung r training each of its n_r candidates for t x 2^r seconds plus one overhead
    per run adds up to the pilot's seconds, and later rungs get twice the loop of the one before."""
    pilot, overhead = 600.0, 20.0
    t = rung_seconds(pilot, sizes, overhead)
    loops = [t * 2**r for r in range(len(sizes))]
    assert loops == sorted(loops) and all(b == 2 * a for a, b in zip(loops, loops[1:]))
    assert sum(n * (loop + overhead) for n, loop in zip(sizes, loops)) == pytest.approx(pilot)


def test_a_cpu_pilot_adds_the_larger_patch_target_and_compares_each_config_once(tmp_path):
    """On a CPU a brain-size set (1 mm, median 140x172x140) offers full and low resolution at 48^3 and a full
    resolution at 64^3 whose patch is larger: three distinct (spacing, patch) candidates, the planner's
    recommendation first; the cascade is not among them."""
    fp = fingerprint([1.0] * 3, [140, 172, 140], [3e6, 6e4, 2.5e4, 1.5e4], [70, 80, 60])
    args = {"source_dir": str(tmp_path), "output_dir": str(tmp_path / "run"), "dataset_dir": str(tmp_path / "d")}
    candidates = pilot_candidates(fp, CPU, args)
    keys = [
        (tuple(c.plan.values["data.conversion.spacing"]), tuple(c.plan.values["pipeline.patch_size"]))
        for c in candidates
    ]
    assert len(set(keys)) == len(keys) >= 3
    assert candidates[0].recommended and not any(c.recommended for c in candidates[1:])
    assert {c.configuration for c in candidates} <= {"fullres", "lowres"}
    larger = [c for c in candidates if c.cpu_patch_voxels == LARGER_CPU_PATCH_VOXELS]
    smaller = [c for c in candidates if c.cpu_patch_voxels != LARGER_CPU_PATCH_VOXELS]
    assert larger and smaller
    volumes = {c.name: int(np.prod(c.plan.values["pipeline.patch_size"])) for c in candidates}
    assert max(volumes[c.name] for c in larger) > max(volumes[c.name] for c in smaller)


def test_a_gpu_pilot_compares_only_the_planners_own_candidates(tmp_path):
    """On a GPU the patch comes from the GPU's memory: no second CPU patch target is tried."""
    fp = fingerprint([1.0] * 3, [140, 172, 140], [3e6, 6e4, 2.5e4, 1.5e4], [70, 80, 60])
    args = {"source_dir": str(tmp_path), "output_dir": str(tmp_path / "run"), "dataset_dir": str(tmp_path / "d")}
    candidates = pilot_candidates(fp, H100, args)
    assert candidates and all(c.cpu_patch_voxels != LARGER_CPU_PATCH_VOXELS for c in candidates)


def _train(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "tfmis.train", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env)


@pytest.mark.parametrize(
    "args, says",
    [
        (["--pilot"], "add --set training.max_minutes=M"),
        (["--pilot", "1.5", "--set", "training.max_minutes=5"], "between 0 and 1"),
    ],
)
def test_pilot_refusals_are_one_line_and_exit_2(tmp_path, args, says):
    """`--pilot` without a budget to take its time from, or with a share outside (0, 1): exit 2, one line naming the
    fix, before anything is planned; with --config instead of --source-dir the same."""
    source = make_msd_dataset(tmp_path / "ds", num_cases=2)
    result = _train("--source-dir", source, *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()  # nothing planned
    result = _train("--config", ROOT / "configs" / "demo.yaml", "--pilot", cwd=tmp_path)
    assert result.returncode == 2 and "with --source-dir only" in result.stderr


@pytest.mark.slow
def test_the_pilot_trains_both_patch_targets_and_trains_the_better_with_the_time_left(tmp_path):
    """`tfmis.train --source-dir D --pilot 0.8 --set training.max_minutes=2.5` on 8 generated cases of 64x64x48 at
    1.5x1.5x2 mm (a CPU: the 48^3 and the 64^3 targets give different patches): the pilot trains each candidate,
    scores its final weights on the validation case, plans the higher-scoring one (its patch in plan.yaml, the
    pilot's table in the header), and the command trains that config in the output folder, ending within 0.8-1.05x
    of the 2.5 minutes, the pilot included."""
    source = make_msd_dataset(
        tmp_path / "ds", num_cases=8, channels=1, shape=(64, 64, 48), affine=lps_affine((1.5, 1.5, 2.0))
    )
    out = tmp_path / "out"
    start = time.time()
    result = _train(
        "--source-dir", source, "--pilot", "0.8", "--set", "training.max_minutes=2.5", "--set", f"output.dir={out}",
        "--set", f"data.dataset_dir={tmp_path / 'tfr'}", cwd=tmp_path,
    )  # fmt: skip
    wall = time.time() - start
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((out / "pilot" / PILOT_FILE).read_text())
    runs = list(record["runs"].values())
    assert len(runs) == 2 and {r["rung"] for r in runs} == {1}
    assert all(0.0 <= r["dice"] <= 1.0 and r["epochs"] > 0 and r["validation_cases"] >= 1 for r in runs)
    best = max(runs, key=lambda r: r["dice"])
    assert record["chosen"] == best["candidate"]
    patch = [int(p) for p in best["candidate"].split()[1].split("x")]
    plan = (out / "plan.yaml").read_text()
    assert yaml.safe_load(plan)["pipeline"]["patch_size"] == patch
    assert "# Pilot (tfmis.crossvalidation.pilot" in plan and f"chosen: {best['candidate']}" in plan
    trained = yaml.safe_load((out / "config.yaml").read_text())
    assert trained["pipeline"]["patch_size"] == patch
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs"] > 0
    assert 0.8 * 150 <= wall <= 1.05 * 150, f"{wall:.0f} s for a 150 s budget"
