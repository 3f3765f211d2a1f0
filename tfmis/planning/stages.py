"""Candidates: full resolution always, a low-resolution stage and a coarse-to-fine cascade where they pay; one of
them recommended.

At real scan sizes (BraTS at 1 mm, abdominal CT at 0.8 mm in-plane) the patch a machine affords covers a few
percent of the image: the network never sees the organ's context. nnU-Net v2 then plans `3d_lowres` (the spacing
raised until the patch covers a quarter of the median image) and a `3d_cascade_fullres` stage on it, keeps
`3d_fullres` always, and lets cross-validation choose. tfmis plans the same candidates from the fingerprint and
the affordable patch, writes the numbers into the plan, and recommends one:

1. **fullres** is always a candidate (`ExperimentPlanner`). Its patch covers >= 25% of the median image (nnU-Net's
   `lowres_creation_threshold`): the only candidate.
2. Else the low-resolution spacing: nnU-Net's loop, +3% a step (the finer axes first) until the patch planned
   there covers 25% of the median image. When the low-resolution median image has at least `MIN_LOWRES_SAVING`
   (2x) fewer voxels than the full-resolution one (nnU-Net drops `3d_lowres` otherwise), **lowres** and a
   **cascade** on it are candidates too: the coarse stage on the whole scan locates the labels, the fine stage
   (full resolution, trained on cases cropped to their labels' box + margin) segments only a box around each
   connected piece. Chosen over nnU-Net's cascade (the low-resolution probabilities as extra input channels of a
   full-resolution network that still slides over the whole scan) because the expensive network then sees only
   the regions: prediction time and memory fall with their share of the scan.
3. The recommendation (what `plan.yaml` trains; cross-validating `candidates.yaml` compares them all): the
   smallest labelled structure (per class, the median over cases of its equivalent-sphere diameter) at least
   `MIN_VOXELS_ACROSS` low-resolution voxels across: **lowres** (the coarse grid draws every class); else the
   regions at most `MAX_ROI_FRACTION` of the foreground crop: **cascade**; else **fullres**. With only the
   fullres candidate: fullres.

A recommended cascade shares the training budget (the CPU step budget, or `max_minutes`): the coarse stage
`COARSE_SHARE`, the fine stage the rest; every other stage has the whole budget. The low-resolution stage is one run
folder serving both the lowres candidate and the cascade's coarse stage.

Example:
```python
staged = plan_stages(fingerprint_msd("data/Task03_Liver"), detect_hardware(), max_minutes=10)
print(list(staged.candidates), staged.recommended, staged.decision)
staged.write()          # every candidate's stage plan, candidates.yaml, and plan.yaml (the recommended one)
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tfmis.errors import UsageError
from tfmis.hardware import Hardware
from tfmis.metrics.boxes import box_voxels, clip_box, grow_box, merge_boxes, pad_box
from tfmis.planning.data_steps import roi_median_shape
from tfmis.planning.decisions import Decisions
from tfmis.planning.fingerprint import DatasetFingerprint
from tfmis.planning.inputs import default_dataset_dir, default_output_dir
from tfmis.planning.plan_file import Plan, fmt_shape
from tfmis.planning.planner import ExperimentPlanner
from tfmis.planning.rules import LOWRES_COVERAGE, equivalent_diameter_mm, fmt_mm, lowres_spacing, patch_coverage

MIN_VOXELS_ACROSS = 10.0  # the smallest structure at least this many low-resolution voxels across: lowres suffices
CASCADE_MARGIN_MM = 20.0  # kept around the coarse stage's box (and the labels' box in training)
MAX_ROI_FRACTION = 0.5  # a cascade pays when its regions are at most half the foreground crop
COARSE_SHARE = 0.4  # of the training budget, for the coarse stage of a recommended cascade
MIN_LOWRES_SAVING = 2.0  # nnU-Net v2: 3d_lowres is dropped when its median image has < 2x fewer voxels than fullres
CONFIGURATIONS = ("fullres", "lowres", "cascade")
CANDIDATES_FILE = "candidates.yaml"  # in the plan's output folder: every candidate, a stages file
FINE_STAGE = "cascade"  # the name (and run folder) of a cascade's fine stage


@dataclasses.dataclass
class StagedPlan:
    """The candidate configurations, the recommended one and its stages to train, in order, and why.

    Attributes:
        configuration: the recommended configuration, "fullres", "lowres" or "cascade" (also `recommended`).
        stages: the recommended configuration's (name, Plan) in training order; each a normal config with its own
            `output.dir`.
        decision: the reasons, in numbers (also in every stage plan's header).
        output_dir: the folder of the whole plan (the single candidate's run folder, or the candidates' parent).
        gpu_fitted: some stage was planned with a GPU-fit measurement (`StagePlanner`'s `gpu_fit_for`).
        candidates: configuration name -> its (stage name, Plan) list in training order; "fullres" always, "lowres"
            and "cascade" where the low-resolution stage pays (a stage shared by two candidates is one Plan).
        reasons: configuration name -> one line: what it is and why it is a candidate; "recommended": why that one.
    """

    configuration: str
    stages: list[tuple[str, Plan]]
    decision: list[str]
    output_dir: str
    gpu_fitted: bool = False
    candidates: dict[str, list[tuple[str, Plan]]] = dataclasses.field(default_factory=dict)
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    candidates_file: Path | None = None  # where `write` put the candidates file (`candidates_path`)

    def __post_init__(self):
        if not self.candidates:
            self.candidates = {self.configuration: list(self.stages)}

    @property
    def recommended(self) -> str:
        return self.configuration

    @property
    def final(self) -> Plan:
        """The stage that predicts (the fine stage of a cascade)."""
        return self.stages[-1][1]

    @property
    def single(self) -> bool:
        """One candidate of one stage: its plan.yaml is the plain config (in `output_dir` itself), as before
        candidates were planned."""
        return len(self.candidates) == 1 and len(self.stages) == 1

    def stage_paths(self, stages: list[tuple[str, Plan]] | None = None) -> list[tuple[str, Path]]:
        """(stage name, its plan file in its run folder) of `stages` (default the recommended configuration's)."""
        stages = self.stages if stages is None else stages
        return [(name, Path(plan.values["output.dir"]) / "plan.yaml") for name, plan in stages]

    def candidates_path(self) -> Path:
        """The candidates file: beside the plan file `write` was given, else `<output_dir>/candidates.yaml`."""
        return self.candidates_file or Path(self.output_dir) / CANDIDATES_FILE

    def write(self, path: str | Path | None = None) -> Path:
        """Writes every candidate stage's `plan.yaml` into its run folder, the candidates file (a stages file naming
        them all: `tfmis-crossval --config` on it compares them; beside `path` when given, else
        `<output_dir>/candidates.yaml`) and the recommended configuration's plan at `path` (default
        `<output_dir>/plan.yaml`): the plain config of the single candidate, else a stages file naming the
        recommended configuration's stages. Returns the file to train with (`--config`)."""
        from tfmis.config import write_stages

        if path is not None:  # a plan file the user named: nothing of it goes into a folder they did not name
            self.candidates_file = Path(path).parent / CANDIDATES_FILE

        if self.single:
            plan_path = self.final.write(path or self.stage_paths()[0][1])
            write_stages(self.candidates_path(), [(self.configuration, plan_path)], self.candidates_comments())
            return plan_path
        listed: dict[Path, str] = {}  # stage plan -> stage name, each shared stage once, in training order
        for stages in self.candidates.values():
            for (name, plan), (_, stage_path) in zip(stages, self.stage_paths(stages)):
                if stage_path not in listed:
                    plan.write(stage_path)
                    listed[stage_path] = name
        write_stages(self.candidates_path(), [(n, p) for p, n in listed.items()], self.candidates_comments())
        return write_stages(Path(path or Path(self.output_dir) / "plan.yaml"), self.stage_paths(), self.decision)

    def candidates_comments(self) -> list[str]:
        return [
            "The candidate configurations of this plan, every stage once: compare them by cross-validation with",
            f"  tfmis-crossval --config {self.candidates_path()} --output <cv folder>",
            *[f"{name}: {self.reasons.get(name, '')}" for name in self.candidates],
            f"recommended: {self.recommended} ({self.reasons.get('recommended', '')})",
            *self.decision,
        ]

    def summary(self) -> dict:
        """The candidates (per configuration: its stages with run folder, spacing and patch) and the recommendation,
        JSON-friendly (`tfmis-plan` writes it into `plan_fingerprint.json`)."""
        return {
            "recommended": self.recommended,
            "recommendation": self.reasons.get("recommended", ""),
            "candidates": {
                name: {
                    "reason": self.reasons.get(name, ""),
                    "stages": [
                        {
                            "name": stage,
                            "output_dir": plan.values["output.dir"],
                            "spacing": plan.values["data.conversion.spacing"],
                            "patch": plan.values["pipeline.patch_size"],
                        }
                        for stage, plan in stages
                    ],
                }
                for name, stages in self.candidates.items()
            },
            "decision": list(self.decision),
        }

    def table(self) -> str:
        lines = ["  candidates (* recommended)"]
        for name, stages in self.candidates.items():
            mark = "*" if name == self.recommended else " "
            parts = [
                stage
                if stage != FINE_STAGE and stage != name
                else f"{fmt_mm(plan.values['data.conversion.spacing'])} mm, patch "
                f"{fmt_shape(plan.values['pipeline.patch_size'])}"
                for stage, plan in stages
            ]
            lines.append(f"  {mark} {name:<8} {' then '.join(parts)}: {self.reasons.get(name, '')}")
        lines.append(f"  recommended  {self.recommended}: {self.reasons.get('recommended', '')}")
        lines += [f"    {line}" for line in self.decision]
        for name, plan in self.stages:
            lines += [f"  stage {name} (recommended {self.recommended}):", plan.table()]
        return "\n".join(lines)


class StagePlanner:
    """Plans the candidates (fullres; lowres and a cascade where the low-resolution stage pays) with
    `ExperimentPlanner` and recommends one; override a `determine_*` step to change one decision.

    Args:
        fingerprint, hardware: as `ExperimentPlanner`.
        configuration: force the recommendation, "fullres", "lowres" or "cascade" (the numbers are still written);
            one that is not a candidate is refused (`UsageError`).
        configuration_reason: why `configuration` was forced (default "forced (--configuration)"; a pilot's result).
        gpu_fit_for: `config -> the GPU-fit search's measured values for it, or None`: each stage whose config has
            a measurement is planned again with it (`ExperimentPlanner`'s `gpu_fit`).
        **planning: `ExperimentPlanner`'s arguments (`PlanningInputs.resolve`), for every stage: a new planning
            argument reaches the stages without a change here. `dataset_dir`, `output_dir`, `gpu_fit` and
            `max_minutes` are the full-resolution stage's: with one candidate it trains in `output_dir` and converts
            to `dataset_dir`; with several, each stage has its own run folder: `<output_dir>/fullres` (converting to
            `<dataset_dir>`), `<output_dir>/lowres` (to `<dataset_dir>_lowres`; the lowres candidate and the
            cascade's coarse stage), `<output_dir>/cascade` (the cascade's fine stage, to `<dataset_dir>_roi`); a
            recommended cascade's stages share `max_minutes`. The stage arguments this planner sets itself
            (`spacing`, `roi_margin_mm`, `coarse_run`, `training_share`) are refused (`TypeError`).
    """

    # ExperimentPlanner's arguments set per stage here, and those given for the full-resolution stage only
    STAGE_ARGUMENTS = ("spacing", "roi_margin_mm", "coarse_run", "training_share")
    FULLRES_ARGUMENTS = ("dataset_dir", "output_dir", "gpu_fit", "max_minutes")

    def __init__(
        self,
        fingerprint: DatasetFingerprint,
        hardware: Hardware,
        *,
        configuration: str | None = None,
        gpu_fit_for: Callable[..., dict | None] | None = None,
        configuration_reason: str | None = None,
        **planning,
    ):
        if configuration not in (None, *CONFIGURATIONS):
            raise UsageError(
                f"configuration must be one of {', '.join(CONFIGURATIONS)} (or None), got {configuration!r}"
            )
        taken = sorted(set(planning) & set(self.STAGE_ARGUMENTS))
        if taken:
            raise TypeError(f"StagePlanner sets {', '.join(taken)} per stage itself; do not pass them")
        self.fp, self.hardware = fingerprint, hardware
        self.source_dir = planning.get("source_dir") or fingerprint.source_dir
        self.dataset_dir = planning.get("dataset_dir") or (
            default_dataset_dir(self.source_dir) if self.source_dir else None
        )
        self.output_dir = planning.get("output_dir") or (
            default_output_dir(self.source_dir) if self.source_dir else None
        )
        self.common = {k: v for k, v in planning.items() if k not in self.FULLRES_ARGUMENTS}
        self.common["source_dir"] = self.source_dir
        self.forced_reason = configuration_reason or "forced (--configuration)"
        self.gpu_fit, self.max_minutes = planning.get("gpu_fit"), planning.get("max_minutes")
        self.forced = configuration
        self.gpu_fit_for = gpu_fit_for

    def plan(self) -> StagedPlan:
        full_args = {
            "dataset_dir": self.dataset_dir,
            "output_dir": self.output_dir,
            "gpu_fit": self.gpu_fit,
            "max_minutes": self.max_minutes,
        }
        decisions = ExperimentPlanner(self.fp, self.hardware, **full_args, **self.common).decide()
        names, lines, lowres, reasons = self.determine_candidates(decisions)
        recommended, why = self.determine_recommendation(decisions, names, lowres, lines)
        reasons["recommended"] = why
        fitted: list[dict] = []  # the GPU-fit measurements the stages were planned again with
        if names == ["fullres"]:
            candidates = {"fullres": [("fullres", self.plan_stage(full_args, fitted, decisions))]}
        else:
            root = Path(self.output_dir)
            full = self.plan_stage({**full_args, "output_dir": str(root / "fullres")}, fitted)
            coarse_dir = str(root / "lowres")
            share = COARSE_SHARE if recommended == "cascade" else 1.0
            coarse = self.plan_stage(self.lowres_args(lowres, coarse_dir, share), fitted)
            fine_args = {
                "dataset_dir": f"{self.dataset_dir}_roi",
                "output_dir": str(root / FINE_STAGE),
                "roi_margin_mm": CASCADE_MARGIN_MM,
                "coarse_run": coarse_dir,
                "training_share": 1 - COARSE_SHARE,
                "max_minutes": self._minutes(1 - COARSE_SHARE),
            }
            fine = self.plan_stage(fine_args, fitted)
            self.determine_fine_classes(fine, lowres)
            self.determine_regions(fine)
            candidates = {
                "fullres": [("fullres", full)],
                "lowres": [("lowres", coarse)],
                "cascade": [("lowres", coarse), (FINE_STAGE, fine)],
            }
        roles: dict[int, list[str]] = {}  # a stage's plan -> what it is for each candidate it belongs to
        for name, stages in candidates.items():
            for stage, plan in stages:
                role = f"the {name} candidate" if stage in (name, FINE_STAGE) else f"the {name}'s coarse stage"
                roles.setdefault(id(plan), []).append(role)
        for name, stages in candidates.items():
            for stage, plan in stages:
                if "configuration" in plan.summary:  # shared with a candidate done before
                    continue
                plan.header[1:1] = [
                    f"Stage {stage}: {' and '.join(roles[id(plan)])} (candidates {', '.join(candidates)}; "
                    f"recommended {recommended}):"
                ] + [f"  {line}" for line in lines]
                plan.summary["configuration"] = name
                plan.summary["stage"] = stage
                plan.summary["candidates"] = list(candidates)
                plan.summary["recommended"] = recommended
        return StagedPlan(
            recommended,
            list(candidates[recommended]),
            lines,
            str(self.output_dir),
            gpu_fitted=bool(fitted),
            candidates=candidates,
            reasons=reasons,
        )

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

    # ------------------------------------------------------------------ the candidates and the recommendation

    def determine_candidates(self, full: Decisions) -> tuple[list[str], list[str], dict | None, dict[str, str]]:
        """(the candidate configurations, the reasons in numbers, the low-resolution stage's {spacing, reason,
        shape, ratio} or None, configuration -> why it is a candidate) from the full-resolution plan's decisions:
        fullres always; lowres and cascade when the full-resolution patch covers under `LOWRES_COVERAGE` of the
        median image and the low-resolution median image has at least `MIN_LOWRES_SAVING` times fewer voxels
        (nnU-Net v2's rules). A forced lowres or cascade that is not a candidate is refused."""
        spacing, median_shape, patch = full.data.spacing, full.data.median_shape, full.patch.patch
        coverage = patch_coverage(patch, median_shape)
        lines = [
            f"full resolution {fmt_mm(spacing)} mm: the affordable patch {fmt_shape(patch)} covers "
            f"{100 * coverage:.3g}% of the median image {fmt_shape(median_shape)}"
        ]
        reasons = {"fullres": "always a candidate (as nnU-Net's 3d_fullres)"}
        if coverage >= LOWRES_COVERAGE:
            if self.forced not in (None, "fullres"):
                stage = "the low-resolution stage" if self.forced == "lowres" else "the cascade's coarse stage"
                raise UsageError(
                    f"--configuration {self.forced}: the full-resolution patch {fmt_shape(patch)} already covers "
                    f"{100 * coverage:.3g}% of the median image {fmt_shape(median_shape)} at {fmt_mm(spacing)} mm (>= "
                    f"{LOWRES_COVERAGE:.0%}, where nnU-Net plans no low-resolution stage), so {stage} would be planned "
                    f"at that same spacing; drop --configuration or use --configuration fullres"
                )
            lines[0] += f" (>= {LOWRES_COVERAGE:.0%}: no low-resolution stage, as nnU-Net)"
            return ["fullres"], lines, None, reasons
        lowres = self.determine_lowres(full)
        lines.append(lowres["reason"])
        ratio = lowres["ratio"]
        if ratio < MIN_LOWRES_SAVING:
            lines.append(
                f"lowres dropped: {ratio:.3g}x fewer voxels than full resolution (< {MIN_LOWRES_SAVING:g}x, nnU-Net), "
                f"and with it the cascade"
            )
            if self.forced not in (None, "fullres"):
                raise UsageError(
                    f"--configuration {self.forced}: the low-resolution median image {fmt_shape(lowres['shape'])} at "
                    f"{fmt_mm(lowres['spacing'])} mm has only {ratio:.3g}x fewer voxels than the full-resolution one "
                    f"{fmt_shape(median_shape)} at {fmt_mm(spacing)} mm (< {MIN_LOWRES_SAVING:g}x, where nnU-Net drops "
                    f"3d_lowres), so there is no {self.forced} candidate; drop --configuration or use "
                    f"--configuration fullres"
                )
            return ["fullres"], lines, None, reasons
        lines.append(
            f"lowres and cascade offered: {ratio:.3g}x fewer voxels than full resolution (>= {MIN_LOWRES_SAVING:g}x, "
            f"nnU-Net)"
        )
        reasons["lowres"] = f"{ratio:.3g}x fewer voxels than full resolution (>= {MIN_LOWRES_SAVING:g}x)"
        reasons["cascade"] = (
            f"the lowres stage locates the labels, a full-resolution stage segments a box (+{CASCADE_MARGIN_MM:g} mm) "
            "around each piece it finds"
        )
        return ["fullres", "lowres", "cascade"], lines, lowres, reasons

    def determine_recommendation(
        self, full: Decisions, candidates: list[str], lowres: dict | None, lines: list[str]
    ) -> tuple[str, str]:
        """(the recommended candidate, why), appending the numbers it is made from to `lines`: a forced one; the only
        candidate; lowres when the smallest structure is at least `MIN_VOXELS_ACROSS` low-resolution voxels across;
        else the cascade when its regions are at most `MAX_ROI_FRACTION` of the foreground crop; else fullres."""
        if candidates == ["fullres"]:
            why = "the only candidate" if self.forced is None else f"{self.forced_reason} (the only candidate)"
            lines.append(f"recommended fullres: {why}")
            return "fullres", why
        smallest = self.determine_smallest_structure()
        across = smallest["diameter_mm"] / float(np.max(lowres["spacing"]))
        lines.append(
            f"smallest structure: {smallest['name']}, median {smallest['volume_mm3'] / 1000:.3g} cm^3 "
            f"({smallest['diameter_mm']:.3g} mm across) = {across:.3g} low-resolution voxels"
        )
        spacing, median_shape = full.data.spacing, full.data.median_shape
        roi_shape = roi_median_shape(self.fp, spacing, CASCADE_MARGIN_MM)
        roi_fraction = float(np.prod(roi_shape) / np.prod(median_shape))
        lines.append(
            f"labelled region + {CASCADE_MARGIN_MM:g} mm: median {fmt_shape(roi_shape)} voxels at full resolution, "
            f"{100 * roi_fraction:.3g}% of the median image"
        )
        window = self.fine_window_mm() if self.fp.label_pieces else None
        regions = measure_regions(self.fp, CASCADE_MARGIN_MM, window)
        if regions is not None:  # the fine stage runs on a box per structure, not on one box around all of them
            counts, _, shares = regions
            roi_fraction = float(np.median(shares))
            lines.append(
                f"regions (a box per connected piece of the labels + {CASCADE_MARGIN_MM:g} mm, at least the fine "
                f"stage's window, overlapping ones merged, clipped to the foreground crop): median "
                f"{np.median(counts):g} per case, "
                f"{100 * roi_fraction:.3g}% of the foreground crop"
            )
        smallest_is = f"the smallest structure is {across:.3g}"
        regions_are = f"the regions are {100 * roi_fraction:.3g}%"
        if self.forced is not None:
            name, why = self.forced, self.forced_reason
        elif across >= MIN_VOXELS_ACROSS:
            name = "lowres"
            why = (
                f"{smallest_is} >= {MIN_VOXELS_ACROSS:g} low-resolution voxels across: the coarse grid draws every "
                "class, one stage predicts back onto the original grid"
            )
        elif roi_fraction <= MAX_ROI_FRACTION:
            name = "cascade"
            why = (
                f"{smallest_is} < {MIN_VOXELS_ACROSS:g} low-resolution voxels across and {regions_are} <= "
                f"{MAX_ROI_FRACTION:.0%} of the foreground crop: the coarse stage locates them on the whole scan, the "
                f"fine stage segments only their boxes ({COARSE_SHARE:.0%} / {1 - COARSE_SHARE:.0%} of the budget)"
            )
        else:
            name = "fullres"
            why = (
                f"{smallest_is} < {MIN_VOXELS_ACROSS:g} low-resolution voxels across and {regions_are} > "
                f"{MAX_ROI_FRACTION:.0%} of the foreground crop: a coarse stage cannot narrow them"
            )
        lines.append(f"recommended {name}: {why}")
        return name, why

    def determine_lowres(self, full: Decisions) -> dict:
        """nnU-Net's low-resolution spacing (`rules.lowres_spacing`) with the planner's own patch at each step (its
        `determine_patch` on its `determine_data` at that spacing)."""

        def patch_at(spacing, median_shape):
            planner = ExperimentPlanner(self.fp, self.hardware, spacing=(spacing, ""), **self.common)
            return planner.determine_patch(planner.determine_data()).patch

        spacing, shape, patch, steps = lowres_spacing(full.data.spacing, full.data.median_shape, patch_at)
        spacing = [float(round(s, 4)) for s in spacing]
        # nnU-Net's check after its loop: the full-resolution median image's voxels over the low-resolution one's
        ratio = float(np.prod(np.asarray(full.data.median_shape, dtype=np.float64)) / np.prod(shape, dtype=np.float64))
        return {
            "spacing": spacing,
            "shape": [float(x) for x in shape],
            "ratio": ratio,
            "reason": (
                f"low resolution {fmt_mm(spacing)} mm (nnU-Net's rule: the spacing +3% a step, {steps} step(s), until "
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
        training labels would give: per case, a box per connected piece grown by the margin and to at least the fine
        stage's window (`fine`'s), overlapping boxes merged (`measure_regions`); their number and volume, and their
        share of the foreground crop."""
        found = measure_regions(self.fp, CASCADE_MARGIN_MM, self.fine_window_mm(fine))
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
            f"every connected piece the coarse stage finds gets its own region (+{CASCADE_MARGIN_MM:g} mm, at "
            f"least the fine stage's window, overlapping regions merged), small ones too: a lesion away from the "
            f"organs is such a piece; {measured}",
        )

    def fine_window_mm(self, fine: Plan | None = None) -> list[float]:
        """The fine stage's sliding window in mm along R, A, S (`validation.roi_size` at its spacing), to which
        prediction grows each region (`tfmis.inference.cascade.coarse_regions`): `fine`'s, or (before the fine stage
        is planned) that of the patch its planner decides."""
        if fine is not None:
            window = fine.values.get("validation.roi_size") or fine.values["pipeline.patch_size"]
            spacing = fine.values["data.conversion.spacing"]
        else:
            decisions = ExperimentPlanner(
                self.fp, self.hardware, roi_margin_mm=CASCADE_MARGIN_MM, **self.common
            ).decide()
            window, spacing = decisions.patch.patch, decisions.data.spacing
        return [float(n) * float(s) for n, s in zip(window, spacing)]

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


def measure_regions(
    fingerprint: DatasetFingerprint, margin_mm: float, min_size_mm=None
) -> tuple[list, list, list] | None:
    """Per case with labels, (number of regions, their volume in mm^3, their share of the foreground crop) that a
    cascade would cut if its coarse stage found the labels, counted on one grid, the case's label voxels.

    As prediction (`tfmis.inference.cascade.coarse_regions`): each piece of `fingerprint.label_pieces` (its labelled
    voxels' box) grown by `margin_mm` (ceil(margin / spacing) voxels per side), clipped to the scan, then grown about
    its centre to at least `min_size_mm` (mm along R, A, S: the fine stage's window, `validation.roi_size` at its
    spacing; None: not grown) where the scan allows, overlapping boxes merged; the fine stage then preprocesses each
    box cut from the scan, cropping it to its foreground, so what it sees lies in the case's foreground crop: each
    box is clipped to the crop, and the share is its voxels over the crop's. From a first pass the grid is the whole
    (RAS) image and the crop box is recorded on it; from a conversion the grid is the converted case, the crop
    itself. A conversion written before the voxel boxes were recorded is measured the same way on its ~4 mm cells.
    None without label pieces."""
    if not fingerprint.label_pieces:
        return None
    counts, volumes, shares = [], [], []
    for case in fingerprint.label_pieces:
        if not case or not case["pieces"]:
            continue
        grid = case.get("voxels") or {"spacing": case["cell_mm"], "shape": case["shape"], "pieces": case["pieces"]}
        spacing = np.asarray(grid["spacing"], dtype=np.float64)
        shape = [int(n) for n in grid["shape"]]
        crop_start, crop_stop = grid.get("crop") or ([0, 0, 0], shape)
        affine = np.diag([*spacing, 1.0])
        boxes = [grow_box(a, b, affine, margin_mm, shape) for a, b in grid["pieces"]]
        if min_size_mm is not None:  # the grid is RAS: its axes are R, A, S
            min_size = np.ceil(np.asarray(min_size_mm, dtype=np.float64) / spacing - 1e-9).astype(int)
            boxes = [pad_box(box, min_size, shape) for box in boxes]
        boxes = merge_boxes(boxes)
        voxels = sum(box_voxels(clip_box(box, crop_start, crop_stop)) for box in boxes)
        crop_voxels = box_voxels(clip_box(tuple(slice(0, n) for n in shape), crop_start, crop_stop))
        counts.append(len(boxes))
        volumes.append(voxels * float(np.prod(spacing)))
        shares.append(voxels / crop_voxels if crop_voxels > 0 else 1.0)
    return (counts, volumes, shares) if counts else None


def plan_stages(fingerprint: DatasetFingerprint, hardware: Hardware, **kwargs) -> StagedPlan:
    """The `StagedPlan` of `StagePlanner(fingerprint, hardware, **kwargs)` (see its arguments)."""
    return StagePlanner(fingerprint, hardware, **kwargs).plan()
