"""Predicting with an exported model folder (`tfmis-export`) through any engine: the same prediction code, another
window function.

`ExportedPredictor(folder, engine)` is a `Predictor` whose settings come from the folder's `manifest.json` (it
replaces the run's `config.yaml` and `training_data.json`) and whose forward pass is the engine's
(`tfmis.inference.engines`): numpy windows in, numpy logits out. Everything else is `Predictor`'s own code: the
preprocessing, the sliding window and its blend buffers (so the memory bound of prediction holds for every engine),
the in-place activation, the restore to the scan's grid, the postprocessing, scoring and writing. Test-time
augmentation and the folds' ensemble are done around the engine in numpy exactly as `Predictor` does them in
TensorFlow: each network's logits averaged over the flips, then the logits of the networks' mean probabilities
(`mean_probability_logits_numpy`).

Example:
```python
predictor = ExportedPredictor("models/demo", engine="onnxruntime")
result = predictor.predict_file(InputCase("scan_01", "scan_01.nii.gz"), "predictions/")
```
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from tfmis.config import ConfigError, PostprocessingConfig, from_dict
from tfmis.errors import DataError
from tfmis.hardware import CPU
from tfmis.inference.buffers import check_buffer_dtype
from tfmis.inference.cascade import CascadePredictor
from tfmis.inference.engines import check_precision, load_network, require_engine
from tfmis.inference.ensemble import ConfigurationEnsemble
from tfmis.inference.manifest import ENGINE_FORMATS, MANIFEST_FILE, check_network_file, data_info, read_manifest
from tfmis.inference.outputs import score_columns
from tfmis.inference.placement import VolumePlacement
from tfmis.inference.predictor import ENSEMBLE_TINY, Predictor


def mean_probability_logits_numpy(logits: list, regions: bool = False) -> np.ndarray:
    """`tfmis.inference.predictor.mean_probability_logits` in numpy (float32): the logits whose softmax (or sigmoid)
    is the mean of the networks' probabilities; one network's logits as they are."""
    if len(logits) == 1:
        return logits[0]
    inside = outside = None
    for z in logits:
        if regions:
            p = 1.0 / (1.0 + np.exp(-z))
            q = 1.0 / (1.0 + np.exp(z))
            outside = q if outside is None else outside + q
        else:
            e = np.exp(z - z.max(axis=-1, keepdims=True))
            p = e / e.sum(axis=-1, keepdims=True)
        inside = p if inside is None else inside + p
    count = np.float32(len(logits))
    log_mean = np.log(np.maximum(inside / count, ENSEMBLE_TINY)).astype(np.float32)
    if not regions:
        return log_mean
    return log_mean - np.log(np.maximum(outside / count, ENSEMBLE_TINY)).astype(np.float32)


class EngineWindows:
    """The window function around one or more engine networks: float32 windows (n, X, Y, Z, C) to the logits the
    sliding window blends (n, X, Y, Z, K): each network's logits averaged over the test-time `flips` (lists of
    axes of the window batch, [] for none), then the logits of the networks' mean probabilities."""

    def __init__(self, networks: list, flips: list, regions: bool):
        self.networks, self.flips, self.regions = networks, flips, regions

    def __call__(self, windows) -> np.ndarray:
        windows = np.asarray(windows)
        windows = windows if windows.dtype == np.float32 else windows.astype(np.float32)  # a float16 volume
        logits = []
        for network in self.networks:
            total = None
            for axes in self.flips:
                x = np.ascontiguousarray(np.flip(windows, axes)) if axes else windows
                y = np.asarray(network(x), np.float32)
                y = np.flip(y, axes) if axes else y
                total = y if total is None else total + y
            logits.append(total / np.float32(len(self.flips)) if len(self.flips) > 1 else total)
        return np.ascontiguousarray(mean_probability_logits_numpy(logits, self.regions))


class ExportedPredictor(Predictor):
    """A `Predictor` of an exported model folder run by `engine` (tensorflow: its SavedModel; onnxruntime: its ONNX
    file; openvino: its OpenVINO IR), on the CPU.

    Args:
        folder: the exported model folder (its manifest.json is read and checked: `read_manifest`).
        engine: `tensorflow`, `onnxruntime` or `openvino` (`tfmis.inference.engines`); one not installed is a
            `UsageError` naming the extra.
        precision: `float32` (default) or `bfloat16` (tensorflow, openvino).
        sw_batch_size, overlap, mode, tta, tta_axes, buffer_dtype: as `Predictor`'s; the defaults are the
            manifest's `sliding_window`.
        stage: a cascade's coarse stage (`manifest["cascade"]["coarse"]`) or one of an ensemble's
            `manifest["configurations"]`: its preprocessing, sliding window, networks and training instead of the
            manifest's own (`exported_predictor` builds cascades and ensembles).
    """

    def __init__(
        self,
        folder,
        engine: str = "onnxruntime",
        precision: str = "float32",
        sw_batch_size: int | None = None,
        overlap: float | None = None,
        mode: str | None = None,
        tta: bool = False,
        tta_axes=(0, 1, 2),
        buffer_dtype: str = "float32",
        stage: dict | None = None,
    ):
        require_engine(engine)
        check_precision(engine, precision)
        self.folder = Path(folder)
        self.manifest = read_manifest(folder)
        manifest = self.manifest if stage is None else {**self.manifest, **stage}
        fmt = ENGINE_FORMATS[engine]
        if fmt not in manifest["formats"]:
            raise DataError(
                f"{self.folder}: exported as {', '.join(manifest['formats'])}, without the {fmt} network --engine "
                f"{engine} runs: export it with --format {fmt}, or predict with another --engine"
            )
        self.engine, self.precision = engine, precision
        self.buffer_dtype = check_buffer_dtype(buffer_dtype).name
        self._logits_dtype = "float32"
        self.index = data_info(manifest)
        self.config = self._training_config(manifest)
        from tfmis.data.preprocess import PreprocessConfig
        from tfmis.task import SegmentationTask

        self.task = SegmentationTask(self.config, data_info=self.index)
        self.preprocessing = PreprocessConfig.from_dict(manifest["preprocessing"])
        self.postprocessing = self._postprocessing(manifest)
        self.class_names = list(manifest["labels"])
        self.score_columns = score_columns(self.task.build_metrics())
        self.modalities = list(manifest["input"]["channels"])
        window = manifest["sliding_window"]
        self.roi_size = tuple(int(s) for s in window["roi_size"])
        self.sw_batch_size = sw_batch_size or int(window["sw_batch_size"])
        self.overlap = float(window["overlap"]) if overlap is None else overlap
        self.mode = mode or window["mode"]
        self.compute_device = CPU
        self.placement = VolumePlacement(
            "cpu", self.sw_batch_size, accelerator=CPU, accelerator_memory_mb=None, device_setting="--device"
        )
        self.tta_flips = (
            [list(c) for n in range(len(tta_axes) + 1) for c in itertools.combinations([a + 1 for a in tta_axes], n)]
            if tta
            else [[]]
        )  # +1: axis 0 is the window batch
        self.weights = manifest["source"]["weights"]
        self.checkpoints = [check_network_file(folder, n, fmt) for n in manifest["networks"]]
        self.models, self.parallels = [], []
        networks = [load_network(engine, path, precision) for path in self.checkpoints]
        self._forward = EngineWindows(networks, self.tta_flips, regions=self.task.paint_labels is not None)
        self.windows_as = "numpy"  # the engines take numpy windows: cut on the host, no tensor round trip

    def _training_config(self, manifest: dict):
        """The training run's `Config` (its metrics' settings score the predictions), from the manifest."""
        from tfmis.config import parse_config

        try:
            return parse_config(manifest["training"]["config"])
        except (ConfigError, KeyError, TypeError) as e:
            raise DataError(f"{self.folder / MANIFEST_FILE}: training.config is not a tfmis config ({e})") from None

    def _postprocessing(self, manifest: dict):
        if manifest["postprocessing"] is None:
            return None
        try:
            return from_dict(PostprocessingConfig, manifest["postprocessing"], "postprocessing.")
        except ConfigError as e:
            raise DataError(f"{self.folder / MANIFEST_FILE}: {e}") from None

    def describe(self) -> str:
        """One line: the folder, its networks and the engine."""
        count = len(self.manifest["networks"])
        what = "1 network" if count == 1 else f"the ensemble of {count} networks"
        return f"the exported model {self.folder} ({what}) with {self.engine} ({self.precision})"


class ExportedConfigurationEnsemble(ConfigurationEnsemble):
    """An exported cross-validation's ensemble of configurations (`manifest["configurations"]`), each an
    `ExportedPredictor` (or cascade) run by the engine, their probabilities averaged as `ConfigurationEnsemble`
    does."""

    def __init__(self, folder, manifest: dict, **kwargs):
        members = [_stage_predictor(folder, stage, **kwargs) for stage in manifest["configurations"]]
        super().__init__(members, [stage["name"] for stage in manifest["configurations"]])
        # each configuration's own stage (a cascade's fine stage): its networks, engine and precision
        self.stages = [m.fine if isinstance(m, CascadePredictor) else m for m in members]
        self.postprocessing = members[0].postprocessing
        self.folder, self.engine, self.precision = Path(folder), self.stages[0].engine, self.stages[0].precision

    def describe(self) -> str:
        names = " + ".join(
            f"{name} ({len(m.checkpoints)} network{'s' if len(m.checkpoints) > 1 else ''})"
            for name, m in zip(self.names, self.stages)
        )
        return f"the exported model {self.folder} (ensemble of {names}) with {self.engine} ({self.precision})"


def _stage_predictor(folder, stage: dict | None, **kwargs) -> ExportedPredictor | CascadePredictor:
    """The predictor of one exported configuration (`stage`, or the manifest's own): its networks run by the engine,
    or for a cascade (`manifest["cascade"]`) a `CascadePredictor` of two such stage predictors."""
    predictor = ExportedPredictor(folder, stage=stage, **kwargs)
    cascade = (stage or predictor.manifest).get("cascade")
    if not cascade:
        return predictor
    coarse = ExportedPredictor(folder, **kwargs, stage=cascade["coarse"])
    return CascadePredictor(predictor, coarse, cascade["margin_mm"], cascade["min_region_mm3"], cascade["fine_classes"])


def exported_predictor(folder, **kwargs):
    """The predictor of the exported model `folder`: an `ExportedConfigurationEnsemble` for an ensemble of
    configurations, a `CascadePredictor` of two `ExportedPredictor`s for a cascade, else an `ExportedPredictor`
    (kwargs: `ExportedPredictor`'s)."""
    manifest = read_manifest(folder)
    if manifest.get("configurations"):
        return ExportedConfigurationEnsemble(folder, manifest, **kwargs)
    return _stage_predictor(folder, None, **kwargs)
