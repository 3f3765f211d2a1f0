"""Stages: full resolution alone, a low-resolution stage alone, or a coarse-to-fine cascade.

At real scan sizes (BraTS at 1 mm, abdominal CT at 0.8 mm in-plane) the patch a machine affords covers a few
percent of the image: the network never sees the organ's context. nnU-Net v2 then plans `3d_lowres` (the spacing
raised until the patch covers a quarter of the median image) and a `3d_cascade_fullres` stage. tfmis decides, from
the fingerprint and the affordable patch, and writes the numbers into the plan:

1. Plan full resolution (`ExperimentPlanner`). Its patch covers >= 25% of the median image (nnU-Net's
   `lowres_creation_threshold`): **fullres**, one stage.
2. Else the low-resolution spacing: nnU-Net's loop, +3% a step (the finer axes first) until the patch planned
   there covers 25% of the median image.
3. The smallest labelled structure (per class, the median over cases of its equivalent-sphere diameter) in
   low-resolution voxels: at least `MIN_VOXELS_ACROSS` across, the coarse grid draws every class well enough:
   **lowres** alone (trained coarse, predicted back onto the original grid: `restore_probabilities`).
4. Else, when the labelled region grown by `CASCADE_MARGIN_MM` is at most `MAX_ROI_FRACTION` of the median image,
   a **cascade**: the coarse stage on the whole scan locates the region, the fine stage
   (full resolution, trained on cases cropped to their labels' box + margin) segments only that box. Chosen over
   nnU-Net's cascade (the low-resolution probabilities as extra input channels of a full-resolution network that
   still slides over the whole scan) because the expensive network then sees only the region: prediction time
   and memory fall with the region's share of the scan.
5. Else (the labels fill most of the image and the small structures need full resolution): **fullres**.

Stages share the training budget (the CPU step budget, or `max_minutes`): the coarse stage `COARSE_SHARE`.

Example:
```python
staged = plan_stages(fingerprint_msd("data/Task03_Liver"), detect_hardware(), max_minutes=10)
print(staged.configuration, staged.decision)
staged.write()          # one plan.yaml per stage (+ the stages file for a cascade)
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tfmis.errors import UsageError
from tfmis.hardware import Hardware
from tfmis.planning.fingerprint import DatasetFingerprint
from tfmis.planning.plan_file import Plan, fmt_shape
from tfmis.planning.planner import (
    Decisions,
    ExperimentPlanner,
    default_dataset_dir,
    default_output_dir,
    roi_median_shape,
)
from tfmis.planning.rules import LOWRES_COVERAGE, equivalent_diameter_mm, fmt_mm, lowres_spacing, patch_coverage

MIN_VOXELS_ACROSS = 10.0  # the smallest structure at least this many low-resolution voxels across: lowres suffices
CASCADE_MARGIN_MM = 20.0  # kept around the coarse stage's box (and the labels' box in training)
MAX_ROI_FRACTION = 0.5  # a cascade pays when its region is at most half the image
COARSE_SHARE = 0.4  # of the training budget, for the coarse stage of a cascade
CONFIGURATIONS = ("fullres", "lowres", "cascade")


@dataclasses.dataclass
class StagedPlan:
    """The stages to train, in order, and why.

    Attributes:
        configuration: "fullres", "lowres" or "cascade".
        stages: (name, Plan) in training order; each a normal config with its own `output.dir`.
        decision: the reasons, in numbers (also in every stage plan's header).
        output_dir: the folder of the whole plan (the single stage's run folder, or the cascade's parent).
        gpu_fitted: some stage was planned with a GPU-fit measurement (`StagePlanner`'s `gpu_fit_for`).
    """

    configuration: str
    stages: list[tuple[str, Plan]]
    decision: list[str]
    output_dir: str
    gpu_fitted: bool = False

    @property
    def final(self) -> Plan:
        """The stage that predicts (the fine stage of a cascade)."""
        return self.stages[-1][1]

    def stage_paths(self) -> list[tuple[str, Path]]:
        return [(name, Path(plan.values["output.dir"]) / "plan.yaml") for name, plan in self.stages]

    def write(self, path: str | Path | None = None) -> Path:
        """Writes every stage's `plan.yaml` into its run folder; for a cascade also the stages file `path`
        (default `<output_dir>/plan.yaml`) naming them. Returns the file to train with (`--config`)."""
        from tfmis.config import write_stages

        paths = self.stage_paths()
        if len(self.stages) == 1:
            return self.final.write(path or paths[0][1])
        for (_, plan), (_, stage_path) in zip(self.stages, paths):
            plan.write(stage_path)
        return write_stages(Path(path or Path(self.output_dir) / "plan.yaml"), paths, self.decision)

    def table(self) -> str:
        lines = [f"  configuration  {self.configuration}"] + [f"    {line}" for line in self.decision]
        for name, plan in self.stages:
            lines += [f"  stage {name}:", plan.table()]
        return "\n".join(lines)


class StagePlanner:
    """Chooses fullres, lowres or a cascade and plans each stage with `ExperimentPlanner`; override a
    `determine_*` step to change one decision.

    Args:
        fingerprint, hardware: as `ExperimentPlanner`.
        source_dir, dataset_dir, output_dir, gpu_fit, split, seed: as `ExperimentPlanner` (the cascade's
            stages convert to `<dataset_dir>_lowres` / `<dataset_dir>_roi` and train in `<output_dir>/lowres`,
            `<output_dir>/fullres`; a single low-resolution stage converts to `<dataset_dir>_lowres`).
        max_minutes: a wall-clock training budget shared by the stages (null: the step budget only).
        configuration: force "fullres", "lowres" or "cascade" (the numbers are still written); a forced lowres or
            cascade whose low-resolution stage would have the full-resolution spacing is refused (`UsageError`).
        gpu_fit_for: `config -> the GPU-fit search's measured values for it, or None`: each stage whose config has
            a measurement is planned again with it (`ExperimentPlanner`'s `gpu_fit`).
    """

    def __init__(
        self,
        fingerprint: DatasetFingerprint,
        hardware: Hardware,
        *,
        source_dir: str | None = None,
        dataset_dir: str | None = None,
        output_dir: str | None = None,
        gpu_fit: dict | None = None,
        split=(0.7, 0.15, 0.15),
        seed: int = 0,
        max_minutes: float | None = None,
        configuration: str | None = None,
        gpu_fit_for: Callable[..., dict | None] | None = None,
    ):
        if configuration not in (None, *CONFIGURATIONS):
            raise UsageError(
                f"configuration must be one of {', '.join(CONFIGURATIONS)} (or None), got {configuration!r}"
            )
        self.fp, self.hardware = fingerprint, hardware
        self.source_dir = source_dir or fingerprint.source_dir
        self.dataset_dir = dataset_dir or (default_dataset_dir(self.source_dir) if self.source_dir else None)
        self.output_dir = output_dir or (default_output_dir(self.source_dir) if self.source_dir else None)
        self.common = {"source_dir": self.source_dir, "split": split, "seed": seed}
        self.gpu_fit, self.max_minutes, self.forced = gpu_fit, max_minutes, configuration
        self.gpu_fit_for = gpu_fit_for

    def plan(self) -> StagedPlan:
        full_args = {
            "dataset_dir": self.dataset_dir,
            "output_dir": self.output_dir,
            "gpu_fit": self.gpu_fit,
            "max_minutes": self.max_minutes,
        }
        decisions = ExperimentPlanner(self.fp, self.hardware, **full_args, **self.common).decide()
        configuration, decision, lowres = self.determine_configuration(decisions)
        fitted: list[dict] = []  # the GPU-fit measurements the stages were planned again with
        if configuration == "fullres":
            stages = [("fullres", self.plan_stage(full_args, fitted, decisions))]
        elif configuration == "lowres":
            stages = [("lowres", self.plan_stage(self.lowres_args(lowres, self.output_dir, 1.0), fitted))]
        else:
            coarse_dir = str(Path(self.output_dir) / "lowres")
            fine_args = {
                "dataset_dir": f"{self.dataset_dir}_roi",
                "output_dir": str(Path(self.output_dir) / "fullres"),
                "roi_margin_mm": CASCADE_MARGIN_MM,
                "coarse_run": coarse_dir,
                "training_share": 1 - COARSE_SHARE,
                "max_minutes": self._minutes(1 - COARSE_SHARE),
            }
            fine = self.plan_stage(fine_args, fitted)
            self.determine_fine_classes(fine, lowres)
            self.determine_regions(fine)
            coarse = self.plan_stage(self.lowres_args(lowres, coarse_dir, COARSE_SHARE), fitted)
            stages = [("lowres", coarse), ("fullres", fine)]
        for i, (name, plan) in enumerate(stages):
            plan.header[1:1] = [f"Stage {i + 1} of {len(stages)} ({name}) of a {configuration} plan:"] + [
                f"  {line}" for line in decision
            ]
            plan.summary["configuration"] = configuration
            plan.summary["stage"] = name
        return StagedPlan(configuration, stages, decision, str(self.output_dir), gpu_fitted=bool(fitted))

    def _minutes(self, share: float) -> float | None:
        return None if self.max_minutes is None else self.max_minutes * share

    def plan_stage(self, args: dict, fitted: list, decisions: Decisions | None = None) -> Plan:
        """The stage's plan (`ExperimentPlanner` with `args`; `decisions` already made for it, if any); with
        `gpu_fit_for`, planned again with the GPU-fit search's measurement of its config when there is one (added
        to `fitted`)."""
        plan = ExperimentPlanner(self.fp, self.hardware, **args, **self.common).plan(decisions)
        measured = self.gpu_fit_for(plan.config()) if self.gpu_fit_for is not None else None
        if measured is None:
            return plan
        fitted.append(measured)
        return ExperimentPlanner(self.fp, self.hardware, **{**args, "gpu_fit": measured}, **self.common).plan()

    def lowres_args(self, lowres: dict, output_dir: str, share: float) -> dict:
        """`ExperimentPlanner`'s arguments for a low-resolution stage at `lowres["spacing"]`."""
        return {
            "dataset_dir": f"{self.dataset_dir}_lowres",
            "output_dir": str(output_dir),
            "spacing": (lowres["spacing"], lowres["reason"]),
            "training_share": share,
            "max_minutes": self._minutes(share),
        }

    # ------------------------------------------------------------------ the decision

    def determine_configuration(self, full: Decisions) -> tuple[str, list[str], dict | None]:
        """(configuration, the reasons in numbers, the low-resolution stage's {spacing, reason} or None) from the
        full-resolution plan's decisions. A forced lowres or cascade whose low-resolution stage would keep the full
        spacing (the patch already covers `LOWRES_COVERAGE` of the median image) is refused."""
        spacing, median_shape, patch = full.data.spacing, full.data.median_shape, full.patch.patch
        coverage = patch_coverage(patch, median_shape)
        lines = [
            f"full resolution {fmt_mm(spacing)} mm: the affordable patch {fmt_shape(patch)} covers "
            f"{100 * coverage:.3g}% of the median image {fmt_shape(median_shape)}"
        ]
        if coverage >= LOWRES_COVERAGE and self.forced in (None, "fullres"):
            lines[0] += f" (>= {LOWRES_COVERAGE:.0%}: no low-resolution stage, as nnU-Net)"
            return "fullres", lines, None
        if coverage >= LOWRES_COVERAGE:
            stage = "the low-resolution stage" if self.forced == "lowres" else "the cascade's coarse stage"
            raise UsageError(
                f"--configuration {self.forced}: the full-resolution patch {fmt_shape(patch)} already covers "
                f"{100 * coverage:.3g}% of the median image {fmt_shape(median_shape)} at {fmt_mm(spacing)} mm (>= "
                f"{LOWRES_COVERAGE:.0%}, where nnU-Net plans no low-resolution stage), so {stage} would be planned at "
                f"that same spacing; drop --configuration or use --configuration fullres"
            )
        lowres = self.determine_lowres(full)
        lines.append(lowres["reason"])
        smallest = self.determine_smallest_structure()
        across = smallest["diameter_mm"] / float(np.max(lowres["spacing"]))
        lines.append(
            f"smallest structure: {smallest['name']}, median {smallest['volume_mm3'] / 1000:.3g} cm^3 "
            f"({smallest['diameter_mm']:.3g} mm across) = {across:.3g} low-resolution voxels"
        )
        roi_shape = roi_median_shape(self.fp, spacing, CASCADE_MARGIN_MM)
        roi_fraction = float(np.prod(roi_shape) / np.prod(median_shape))
        lines.append(
            f"labelled region + {CASCADE_MARGIN_MM:g} mm: median {fmt_shape(roi_shape)} voxels at full resolution, "
            f"{100 * roi_fraction:.3g}% of the median image"
        )
        regions = measure_regions(self.fp, CASCADE_MARGIN_MM)
        if regions is not None:  # the fine stage runs on a box per structure, not on one box around all of them
            counts, _, shares = regions
            roi_fraction = float(np.median(shares))
            lines.append(
                f"regions (a box per connected piece of the labels + {CASCADE_MARGIN_MM:g} mm, overlapping ones "
                f"merged): median {np.median(counts):g} per case, {100 * roi_fraction:.3g}% of the foreground crop"
            )
        if self.forced is not None:
            lines.append(f"configuration {self.forced}: forced")
            return self.forced, lines, lowres
        if across >= MIN_VOXELS_ACROSS:
            lines.append(
                f"lowres: >= {MIN_VOXELS_ACROSS:g} voxels across at low resolution, the coarse grid draws every "
                f"class; one stage gets the whole budget and predicts back onto the original grid"
            )
            return "lowres", lines, lowres
        if roi_fraction <= MAX_ROI_FRACTION:
            lines.append(
                f"cascade: < {MIN_VOXELS_ACROSS:g} voxels across needs full resolution, and the regions are "
                f"<= {MAX_ROI_FRACTION:.0%} of the image: the coarse stage locates them on the whole scan, the fine "
                f"stage segments only their boxes ({COARSE_SHARE:.0%} / {1 - COARSE_SHARE:.0%} of the budget)"
            )
            return "cascade", lines, lowres
        lines.append(
            f"fullres: < {MIN_VOXELS_ACROSS:g} voxels across needs full resolution and the labelled regions fill "
            f"more than {MAX_ROI_FRACTION:.0%} of the image, so a coarse stage cannot narrow them"
        )
        return "fullres", lines, None

    def determine_lowres(self, full: Decisions) -> dict:
        """nnU-Net's low-resolution spacing (`rules.lowres_spacing`) with the planner's own patch at each step (its
        `determine_patch` on its `determine_data` at that spacing)."""

        def patch_at(spacing, median_shape):
            planner = ExperimentPlanner(self.fp, self.hardware, spacing=(spacing, ""), **self.common)
            return planner.determine_patch(planner.determine_data()).patch

        spacing, shape, patch, steps = lowres_spacing(full.data.spacing, full.data.median_shape, patch_at)
        spacing = [float(round(s, 4)) for s in spacing]
        return {
            "spacing": spacing,
            "reason": (
                f"low resolution {fmt_mm(spacing)} mm (nnU-Net's rule: the spacing +3% a step, {steps} steps, until "
                f"the patch covers {LOWRES_COVERAGE:.0%}): the patch {fmt_shape(patch)} covers "
                f"{100 * patch_coverage(patch, shape):.3g}% of the median image {fmt_shape(shape)}"
            ),
        }

    def determine_fine_classes(self, fine: Plan, lowres: dict) -> None:
        """`cascade.fine_classes`: the classes under `MIN_VOXELS_ACROSS` low-resolution voxels across; the others the
        coarse stage draws from the context of the whole scan (a fine patch holds a small piece of a large organ)."""
        across = self.class_diameters_mm() / float(np.max(lowres["spacing"]))
        fine_classes = [k + 1 for k, n in enumerate(across) if n < MIN_VOXELS_ACROSS]
        if not fine_classes or len(fine_classes) == len(across):
            return
        names = ", ".join(f"{self.fp.labels[k + 1]} {n:.3g}" for k, n in enumerate(across))
        fine.set(
            "cascade.fine_classes",
            fine_classes,
            f"classes under {MIN_VOXELS_ACROSS:g} low-resolution voxels across come from this stage, the others from "
            f"the coarse stage (voxels across: {names})",
        )

    def determine_regions(self, fine: Plan) -> None:
        """`cascade.min_region_mm3` 0 (every piece the coarse stage finds gets a region), with the regions the
        training labels would give: per case, a box per connected piece grown by the margin, overlapping boxes
        merged (`measure_regions`); their number and volume, and their share of the foreground crop."""
        found = measure_regions(self.fp, CASCADE_MARGIN_MM)
        measured = "no label pieces in the fingerprint"
        if found is not None:
            counts, volumes, shares = found
            measured = (
                f"the training labels give {np.median(counts):g} region(s) per case (median; {min(counts)}-"
                f"{max(counts)}), {np.median(volumes) / 1000:.3g} ml = {100 * np.median(shares):.3g}% of the "
                f"foreground crop ({100 * min(shares):.3g}-{100 * max(shares):.3g}%)"
            )
            fine.summary["regions"] = {
                "per_case": [int(c) for c in counts],
                "volume_ml": [round(float(v) / 1000, 1) for v in volumes],
                "share_of_crop": [round(float(x), 4) for x in shares],
            }
        fine.set(
            "cascade.min_region_mm3",
            0.0,
            f"every connected piece the coarse stage finds gets its own region (+{CASCADE_MARGIN_MM:g} mm, "
            f"overlapping regions merged), small ones too: a lesion away from the organs is such a piece; {measured}",
        )

    def class_diameters_mm(self) -> np.ndarray:
        """Per foreground class, the median over cases (where present) of its equivalent-sphere diameter in mm."""
        fp = self.fp
        if fp.class_volumes_mm3 is not None:
            volumes = np.asarray(fp.class_volumes_mm3, dtype=np.float64)
            medians = [float(np.median(v[v > 0])) if (v > 0).any() else 0.0 for v in volumes.T[1:]]
        else:  # the total over the cases, per case, at the median spacing
            per_case = np.asarray(fp.class_voxels[1:], dtype=np.float64) / max(fp.num_cases, 1)
            medians = list(per_case * float(np.prod(fp.median_spacing)))
        return np.array([equivalent_diameter_mm(v) for v in medians])

    def determine_smallest_structure(self) -> dict:
        """The foreground class with the smallest median per-case volume: {name, volume_mm3, diameter_mm}."""
        fp = self.fp
        if fp.class_volumes_mm3 is not None:
            volumes = np.asarray(fp.class_volumes_mm3, dtype=np.float64)
            medians = [float(np.median(v[v > 0])) if (v > 0).any() else np.inf for v in volumes.T[1:]]
        else:  # the total over the cases, per case, at the median spacing
            per_case = np.asarray(fp.class_voxels[1:], dtype=np.float64) / max(fp.num_cases, 1)
            medians = list(per_case * float(np.prod(fp.median_spacing)))
        k = int(np.argmin(medians))
        volume = medians[k] if np.isfinite(medians[k]) else 0.0
        return {"name": fp.labels[k + 1], "volume_mm3": volume, "diameter_mm": equivalent_diameter_mm(volume)}


def measure_regions(fingerprint: DatasetFingerprint, margin_mm: float) -> tuple[list, list, list] | None:
    """Per case with labels, (number of regions, their volume in mm^3, their share of the foreground crop's volume)
    that a cascade would cut if its coarse stage found the labels: each piece of `fingerprint.label_pieces` grown by
    `margin_mm` (in whole cells, within the case's grid), overlapping boxes merged. None without label pieces."""
    from tfmis.inference.cascade import grow_box, merge_boxes

    if not fingerprint.label_pieces:
        return None
    counts, volumes, shares = [], [], []
    for i, case in enumerate(fingerprint.label_pieces):
        if not case or not case["pieces"]:
            continue
        cell = np.asarray(case["cell_mm"], dtype=np.float64)
        boxes = merge_boxes(
            [grow_box(a, b, np.diag([*cell, 1.0]), margin_mm, case["shape"]) for a, b in case["pieces"]]
        )
        volume = sum(float(np.prod([s.stop - s.start for s in b])) for b in boxes) * float(np.prod(cell))
        crop = float(np.prod(fingerprint.crop_shapes[i] * fingerprint.spacings[i]))
        counts.append(len(boxes))
        volumes.append(volume)
        shares.append(min(volume / crop, 1.0) if crop > 0 else 1.0)
    return (counts, volumes, shares) if counts else None


def plan_stages(fingerprint: DatasetFingerprint, hardware: Hardware, **kwargs) -> StagedPlan:
    """The `StagedPlan` of `StagePlanner(fingerprint, hardware, **kwargs)` (see its arguments)."""
    return StagePlanner(fingerprint, hardware, **kwargs).plan()
