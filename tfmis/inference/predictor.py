"""Whole-scan prediction: NIfTI in → the training preprocessing → sliding window → NIfTI out.

The prediction is mapped back through the recorded geometry (crop, resampling, reorientation), so
the written label map has the input's shape, affine and orientation. Logits are blended across
windows (and averaged over flips with test-time augmentation); probabilities are resampled to the
original grid before the argmax, as nnU-Net does. A model trained on regions (`model.output: regions`)
has one sigmoid per region: its region probabilities are resampled and painted into labels instead
(`tfmis.inference.restore.paint_regions`).

Several runs of one configuration (the folds of a cross-validation) predict as one: `Predictor(config,
[fold_0, fold_1, ...])` builds one model per run, and each window batch goes through all of them, one after the
other (each with its test-time augmentation); their probabilities are averaged and the window returns the logits
of that mean (`mean_probability_logits`), so the sliding window blends one sum buffer as for one model. With one
run it is exactly the one-model prediction.

Memory safety is training validation's policy (`tfmis.inference.placement.VolumePlacement`, as
MONAI's `SlidingWindowInfererAdapt`): the whole volume and the blending buffers live on the
accelerator unless that runs out of memory; then the case is retried with them on the CPU, then
with smaller sliding-window batches, and what failed is remembered for later cases. One case that
cannot be predicted for its data, its files or memory (`CASE_ERRORS`) is reported, never fatal to the rest; any
other error is a bug and ends the command.

Example:
```python
predictor = Predictor(load_config("runs/demo/config.yaml"), "runs/demo/best.weights.h5", tta=True)
result = predictor.predict_file(InputCase("scan_01", "scan_01.nii.gz"), "predictions/")
```
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import tensorflow as tf

from tfmis.data.preprocess import Geometry, PreprocessConfig, crop_box_in_original_voxels, preprocess
from tfmis.data.records import load_training_data_info
from tfmis.data.sources.errors import CaseError
from tfmis.data.sources.image_io import load_image, output_suffix, read_geometry
from tfmis.data.sources.label_maps import read_label_map, save_like
from tfmis.errors import DataError, UsageError
from tfmis.hardware import CPU, accelerator_device, model_parallel_devices, peak_rss_mb, reset_peak_rss
from tfmis.inference.buffers import check_buffer_dtype
from tfmis.inference.dicom_seg import SEG_SUFFIX, read_dicom_case, write_segmentation
from tfmis.inference.inputs import (
    InputCase,
    check_same_training_data,
    find_run_dir,
    load_weights,
)
from tfmis.inference.outputs import (
    CaseResult,
    score_columns,
    score_keys,
)
from tfmis.inference.placement import VolumePlacement, aggregation_bytes
from tfmis.inference.restore import (
    paint_regions,
    preprocessed_box,
    restore_labels,
    sigmoid_in_place,
    softmax_in_place,
)
from tfmis.inference.sliding_window import sliding_window_inference
from tfmis.postprocessing import apply_postprocessing, describe_postprocessing, postprocessing_enabled
from tfmis.task import SegmentationTask


@dataclasses.dataclass
class GridPrediction:
    """A prediction on the preprocessed grid and how to map it back to the image's grid.

    `probabilities` (x, y, z, K, the sliding window's buffer dtype) cover the preprocessed grid from `offset`; None
    when the requested box holds no foreground (all background). `box`: the (start, stop) original voxels to fill,
    None for the whole preprocessing crop.
    """

    probabilities: np.ndarray | None
    geometry: Geometry
    offset: np.ndarray
    box: tuple | None
    channels: int
    device: str
    paint_labels: list | None = None  # None: class probabilities (argmax); else the label each region paints

    def grid_labels(self) -> np.ndarray:
        """uint8 label map on (the box of) the preprocessed grid: the argmax, or the regions painted."""
        if self.paint_labels is None:
            return np.argmax(self.probabilities, axis=-1).astype(np.uint8)
        return paint_regions(self.probabilities, self.paint_labels)

    def restore(self, probabilities: bool = False, within: tuple | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """(uint8 label map, float32 (X, Y, Z, channels) probabilities or None) on the original grid, or only on its
        box `within` ((start, stop) original voxels: arrays of that box's shape, the same values)."""
        if self.probabilities is None:
            shape = tuple(self.geometry.original_shape) if within is None else tuple(np.subtract(within[1], within[0]))
            restored = np.zeros((*shape, self.channels), np.float32) if probabilities else None
            if restored is not None and self.paint_labels is None:
                restored[..., 0] = 1.0
            return np.zeros(shape, np.uint8), restored
        return restore_labels(
            self.probabilities,
            self.geometry,
            offset=self.offset,
            box=self.box,
            probabilities_out=probabilities,
            paint_labels=self.paint_labels,
            within=within,
        )


# what fails one case, not the command: the case's data (an unreadable or corrupt file, a wrong channel count or
# label: `DataError`, `CaseError` among them), a file that cannot be read or written, and running out of memory
# (`VolumeOutOfMemory` after the placement policy's fallbacks). Anything else (a bare ValueError, another TensorFlow
# error) is a bug or a setting, and ends the command with its traceback or its config error.
CASE_ERRORS = (DataError, OSError, MemoryError, tf.errors.ResourceExhaustedError)


class ScanPredictor:
    """Predicts NIfTI files (`predict_file`) with a subclass's `predict_image`, postprocesses and scores them.

    A subclass sets `task`, `class_names`, `modalities`, `score_columns`, `postprocessing` (a `PostprocessingConfig`
    applied to each label map, or None) and `events` (what its placement policy did, in order), and after each case
    `last_region` (a cascade's boxes, else ""). `output_format` says how label maps are written.
    """

    last_region = ""
    output_format = "nifti"  # or "dicom-seg" (`tfmis.inference.dicom_seg.OUTPUT_FORMATS`): how label maps are written
    new_study_uid = False  # a DICOM SEG of a series without StudyInstanceUID gets a new one (else the case fails)

    def predict_image(self, holder: list, affine: np.ndarray, case_id: str = "", probabilities: bool = True):
        raise NotImplementedError

    def predict_file(self, case: InputCase, output_dir: str | Path, probabilities: bool = False) -> CaseResult:
        """Predicts one image and writes its label map `<case_id><suffix>` in the input's format and geometry (an
        `.mha` input gives an `.mha` with its direction, origin and spacing; a NIfTI keeps its header), and with
        `probabilities` `<case_id>_probabilities.nii.gz` (NIfTI whatever the input: uint8 scaled, one channel per
        class or region). A DICOM series folder (`case.series`) is read by `tfmis.data.sources.dicom_series` and its
        label map written as `<case_id>.nii.gz`, or with `output_format` "dicom-seg" as `<case_id>.seg.dcm`, a DICOM SEG
        referencing the series (`tfmis.inference.dicom_seg`).

        The label map is postprocessed (`postprocessing`) before it is written and scored; the probabilities are
        the prediction's, as nnU-Net writes them.

        The result's `peak_rss_mb` is the process' peak resident memory during the case (the kernel's
        high-water mark, reset at the start of the case where Linux allows it, else since the start).
        """
        start = time.perf_counter()
        output_dir = Path(output_dir)
        reset_peak_rss()
        try:
            dicom = None  # a DICOM series' DicomVolume (its slices' headers, for a DICOM SEG)
            if case.series is not None:
                image, affine, header, dicom = read_dicom_case(case, len(self.modalities))
                suffix = ".nii.gz"
            else:
                image, affine, _ = load_image(case.image, len(self.modalities), case.case_id, integers=True)
                header = read_geometry(case.first_file)[1]  # a NIfTI's own header is written back (None otherwise)
                suffix = output_suffix(case.first_file)
            shape = tuple(image.shape[:3])
            holder = [image]
            del image  # predict_image lets it go once preprocessed
            label_map, probs, device = self.predict_image(holder, affine, case.case_id, probabilities)
            removed = self._postprocess(label_map)
            if self.output_format == "dicom-seg":  # a DICOM SEG referencing the series (tfmis.inference.dicom_seg)
                out = write_segmentation(
                    label_map,
                    dicom,
                    self.class_names,
                    output_dir / f"{case.case_id}{SEG_SUFFIX}",
                    new_study_uid=self.new_study_uid,
                )
            else:
                out = output_dir / f"{case.case_id}{suffix}"
                save_like(label_map, affine, header, out, np.uint8)
            if probabilities:
                # NIfTI-1 has no float16: uint8 with a scale factor (readers get floats, step 1/255)
                save_like(probs, affine, header, output_dir / f"{case.case_id}_probabilities.nii.gz", np.uint8)
                del probs
            result = CaseResult(case.case_id, "ok", shape, 0.0, int(np.count_nonzero(label_map)), device, str(out))
            result.region = self.last_region
            if removed is not None:
                result.postprocessing, result.removed_voxels = describe_postprocessing(self.postprocessing), removed
            if case.label is not None:
                result.dice, result.scores = self._dice(case, label_map, affine)
        except CASE_ERRORS as e:
            reason = e.reason if isinstance(e, CaseError) else f"{type(e).__name__}: {e}"
            result = CaseResult(case.case_id, "failed", reason=reason.splitlines()[0][:300])
        result.seconds = time.perf_counter() - start
        result.peak_rss_mb = peak_rss_mb()
        return result

    def _dice(self, case: InputCase, prediction: np.ndarray, affine: np.ndarray) -> tuple[dict, dict]:
        """Dice per foreground class against the case's label map, as MONAI `compute_dice` (ignore_empty): NaN for
        a class absent from the label, whatever the prediction holds; and the `score_columns` (regions, HD95,
        NSD as `SegmentationMetrics` scores them, in mm on the input's grid).

        The label is read as uint8 (`read_label_map`, no float64 copy) and scored without whole-volume copies
        (`tfmis.metrics.segmentation`): the scan's label map and the prediction are the only full-size arrays."""
        label = read_label_map(case.label, len(self.class_names), case.case_id, prediction.shape)
        metrics = self.task.build_metrics()
        entry = metrics.update(prediction, label, spacing=nib.affines.voxel_sizes(affine))
        del label
        dice = dict(zip(self.class_names[1:], (float(s) for s in entry["dice_per_class"])))
        return dice, {column: entry[key] for column, key in score_keys(metrics).items()}

    def _postprocess(self, labels: np.ndarray) -> int | None:
        """Applies `postprocessing` to the uint8 label map in place: the foreground voxels it removed (set to
        background), None when nothing is configured."""
        if not postprocessing_enabled(self.postprocessing):
            return None
        foreground = np.count_nonzero(labels)  # no whole-scan temporary
        apply_postprocessing(labels, self.postprocessing)
        return int(foreground - np.count_nonzero(labels))


ENSEMBLE_TINY = 1e-30  # floor of a mean probability before its log: a class every model rules out stays finite


def mean_probability_logits(logits: list, regions: bool = False) -> tf.Tensor:
    """Logits whose softmax (or, for `regions`, sigmoid) is the mean of the models' probabilities.

    `logits`: one (..., K) tensor per model (each after its test-time augmentation). Classes: log(mean softmax), and
    softmax(log m) = m / sum(m) = m since the mean of distributions sums to 1. Regions: logit(mean sigmoid) =
    log(mean sigmoid(z)) - log(mean sigmoid(-z)); 1 - p is summed as the models' sigmoid(-z), so a probability near 1
    keeps its precision (no 1 - p cancellation in float32). Each mean is floored at `ENSEMBLE_TINY` (1e-30) before
    its log, so a class whose probability underflowed to 0 in every model gets a finite logit (about -69) instead of
    -inf. One model's logits are returned as they are.

    Example:
    ```python
    z = mean_probability_logits([logits_fold_0, logits_fold_1])  # tf.nn.softmax(z) == (softmax(l0) + softmax(l1)) / 2
    ```
    """
    if len(logits) == 1:
        return logits[0]
    inside = outside = None  # sums of p (and, for regions, of 1 - p) over the models
    for z in logits:
        p = tf.sigmoid(z) if regions else tf.nn.softmax(z, axis=-1)
        inside = p if inside is None else inside + p
        if regions:
            q = tf.sigmoid(-z)
            outside = q if outside is None else outside + q
    count = float(len(logits))
    log_mean = tf.math.log(tf.maximum(inside / count, ENSEMBLE_TINY))
    if not regions:
        return log_mean
    return log_mean - tf.math.log(tf.maximum(outside / count, ENSEMBLE_TINY))


class Predictor(ScanPredictor):
    """Predicts whole scans with a trained model (or the fold ensemble of several), exactly as it was trained to
    see them.

    Args:
        config: the training run's `Config` (its `config.yaml`).
        checkpoint: `best.weights.h5`, a run folder, or a tf.train checkpoint; or a list of them: the runs of one
            configuration (e.g. the folds of a cross-validation, all with `config`'s model and the same
            preprocessing), predicted as one ensemble. Per window batch each model's output (after its test-time
            augmentation) becomes probabilities (softmax, or sigmoid for a region run), the K probabilities are
            averaged, and the window returns the logits of the mean (`mean_probability_logits`); the sliding window,
            the in-place softmax and the restore to the scan's grid are those of one model, so the memory is one
            model's: one whole-volume sum buffer whatever K, never K whole-scan maps (the K models' weights and the
            K outputs of the current window batch are the only additions; the models run one after the other, so
            one model's activations are held at a time); the time is K times the forward passes. Overlapping
            windows blend these logits (log mean probabilities), as for one model: exactly the mean of the models'
            probabilities where one window covers a voxel, a normalised geometric blend of the windows' means
            where several do. nnU-Net v2 averages the folds' logits instead, each fold's whole sliding window at a
            time (`nnUNetPredictor.predict_logits_from_preprocessed_data`, nnunetv2/inference/
            predict_from_raw_data.py: a running sum of `predict_sliding_window_return_logits` over
            `list_of_parameters`, then divided by their number); tfmis averages probabilities, as `nnUNetv2_ensemble`
            does between configurations (nnunetv2/ensembling/ensemble.py, `average_probabilities`).
        sw_batch_size, overlap, mode: sliding-window settings (default: the config's validation ones).
        device: "gpu" (the placement policy's `auto`: the accelerator, falling back to the CPU and
            to smaller sliding-window batches on out-of-memory) or "cpu"; None = gpu if one is visible.
        tta: average the logits over flips along `tta_axes` (all 2^n combinations).
        accelerator_memory_mb: optional budget for the whole-volume buffers on the accelerator,
            checked before allocating: a volume needing more goes to the CPU without being tried
            there. Useful to keep headroom on a shared GPU.
        buffer_dtype: dtype of the sliding window's whole-volume sum buffer (and of the logits):
            `float32` (the default: the label maps and probabilities of the whole-volume computation)
            or `float16` (half that memory, probabilities rounded to about 1e-3: for large
            preprocessed volumes, e.g. a training spacing near the scan's).
        weights: which weights of a run folder: "best" (`best.weights.h5`, the best validation epoch's) or "final"
            (`final.weights.h5`, the weights training ended with); a weights file or a checkpoint is read as given.
    """

    windows_as = "tensor"  # what the window function takes (`sliding_window_inference`): numpy for an engine

    def __init__(
        self,
        config,
        checkpoint,
        sw_batch_size: int | None = None,
        overlap: float | None = None,
        mode: str | None = None,
        device: str | None = None,
        tta: bool = False,
        tta_axes=(0, 1, 2),
        accelerator_memory_mb: float | None = None,
        buffer_dtype: str = "float32",
        weights: str = "best",
    ):
        self.config = config
        self.buffer_dtype = check_buffer_dtype(buffer_dtype).name
        self._logits_dtype = "float32"
        v = config.validation
        checkpoints = list(checkpoint) if isinstance(checkpoint, (list, tuple)) else [checkpoint]
        if not checkpoints:
            raise UsageError("Predictor: no checkpoint given (an empty list of runs)")
        # preprocessing, channels and classes from the run folder (the TFRecords may be gone)
        self.index = load_training_data_info(find_run_dir(checkpoints[0]), config.data.dataset_dir)
        for other in checkpoints[1:]:
            check_same_training_data(self.index, other, checkpoints[0], config.data.dataset_dir)
        self.postprocessing = config.postprocessing if postprocessing_enabled(config.postprocessing) else None
        self.task = SegmentationTask(config, data_info=self.index)
        self.preprocessing = PreprocessConfig.from_dict(self.index["preprocessing"])
        self.class_names = self.task.class_names
        # predictions.csv's columns after the class Dice (validation.regions, .hd95, .nsd), and the regions'
        # labels checked against the classes before any case is predicted
        self.score_columns = score_columns(self.task.build_metrics())
        self.modalities = list(self.index["source"]["modalities"])
        self.roi_size = tuple(v.roi_size or config.pipeline.patch_size)
        self.sw_batch_size = sw_batch_size or v.num_sw_batch_size
        self.overlap = v.overlap if overlap is None else overlap
        self.mode = mode or v.mode
        if device not in (None, "gpu", "cpu"):
            raise UsageError(f"device must be 'gpu' or 'cpu', got {device!r}")
        mp = config.runtime.model_parallel
        # one model over several devices (runtime.model_parallel), set up before anything touches a device
        parallel_devices = model_parallel_devices(mp.devices) if mp.enabled else None
        self.compute_device = CPU if device == "cpu" else accelerator_device()
        # on a machine without an accelerator, "gpu" is the CPU itself, and the fallbacks still apply
        # (a smaller sliding-window batch is what frees memory there). Not seeded with the config's
        # validation.cpu_from_voxels: that size did not fit next to training, prediction has more room.
        self.placement = VolumePlacement(
            "cpu" if device == "cpu" else "auto",
            self.sw_batch_size,
            accelerator=self.compute_device,
            accelerator_memory_mb=accelerator_memory_mb,
            device_setting="--device",
        )
        self.tta_flips = (
            [list(c) for n in range(len(tta_axes) + 1) for c in itertools.combinations([a + 1 for a in tta_axes], n)]
            if tta
            else [[]]
        )  # +1: axis 0 is the window batch
        self.task.set_precision_policy()
        with tf.device(self.compute_device):
            self.models = [self.task.build_inference_model() for _ in checkpoints]
        self.weights = weights
        self.checkpoints = [load_weights(model, c, weights, self.task) for model, c in zip(self.models, checkpoints)]
        self.parallels = [
            None if parallel_devices is None else self.task.build_model_parallel(m, parallel_devices, training=False)
            for m in self.models
        ]
        self._forward = tf.function(self._window_output, reduce_retracing=True)

    @property
    def events(self) -> list:
        """The placement policy's events (what ran out of memory, and what worked), in order."""
        return self.placement.events

    @property
    def model(self):
        """The (first) model; with one run, the model."""
        return self.models[0]

    @model.setter
    def model(self, model) -> None:
        self.models[0] = model

    def _tta_logits(self, network, windows):
        """`network`'s logits of a float32 window batch, averaged over the test-time flips."""
        total = None
        for axes in self.tta_flips:
            x = tf.reverse(windows, axes) if axes else windows
            y = tf.cast(network(x, training=False), tf.float32)
            y = tf.reverse(y, axes) if axes else y
            total = y if total is None else total + y
        return total / len(self.tta_flips)

    def _window_output(self, windows):
        """What the sliding window blends for a window batch: the model's logits, or for several models the logits
        of their mean probabilities (`mean_probability_logits`)."""
        windows = tf.cast(windows, tf.float32)  # the volume may be stored in float16
        logits = []
        for parallel, model in zip(self.parallels, self.models):
            inputs = windows
            if logits:  # one model at a time (not K at once in the graph): one model's activations are held
                with tf.control_dependencies([logits[-1]]):
                    inputs = tf.identity(windows)
            logits.append(self._tta_logits(parallel or model, inputs))
        return mean_probability_logits(logits, regions=self.task.paint_labels is not None)

    def _window_logits(self, volume: np.ndarray, device: str, sw_batch_size: int) -> np.ndarray:
        """Blended logits with the volume and buffers on `device`; numpy, so the attempt is finished.
        The sum buffer's dtype is `logits`'s `buffer_dtype` of the current call."""
        return sliding_window_inference(
            volume[None],
            self.roi_size,
            sw_batch_size,
            self._forward,
            overlap=self.overlap,
            mode=self.mode,
            sw_device=self.compute_device,
            device=device,
            buffer_dtype=self._logits_dtype,
            output="numpy",  # the host buffer itself, writable for the in-place softmax: no copy of the logits
            windows_as=self.windows_as,
        )[0]

    def logits(self, volume: np.ndarray, case_id: str = "", buffer_dtype: str = "float32") -> tuple[np.ndarray, str]:
        """Blended logits (x, y, z, K) in `buffer_dtype` of a preprocessed volume (x, y, z, C), and where they were
        aggregated (the `Placement` description, e.g. "gpu:0" or "cpu (fallback after out-of-memory)"). K is the
        model's output channels: the classes, or with `model.output: regions` the regions."""
        self._logits_dtype = check_buffer_dtype(buffer_dtype).name
        logits, placement = self.placement.run(
            lambda device, sw_batch_size: self._window_logits(volume, device, sw_batch_size),
            int(np.prod(volume.shape[:3])),
            case_id,
            buffer_bytes=aggregation_bytes(
                volume.shape[:3], volume.shape[-1], self.task.out_channels, buffer_dtype, volume.dtype
            ),
        )
        return logits, str(placement)

    def predict_array(
        self,
        image: np.ndarray,
        affine: np.ndarray,
        case_id: str = "",
        roi=None,
        probabilities: bool = True,
    ) -> tuple[np.ndarray, np.ndarray | None, str]:
        """Predicts one image: (label map, probabilities, device) on the grid of `image` / `affine`.

        Args:
            image: (X, Y, Z, C) in the file's voxel order, float32 or integers (`load_image(..., integers=True)`);
                `affine` its 4x4 affine.
            case_id: names the case in the placement policy's events.
            roi: None (the whole image), or a box ((x0, y0, z0), (x1, y1, z1)) in the voxel indices of
                `image` (start inclusive, stop exclusive; clipped to the image), e.g. a coarse stage's
                organ box plus a margin. The image is preprocessed whole (same grid and normalisation as
                without `roi`), the sliding window runs only on the part of the preprocessed volume
                that the box needs (grown to at least one window where the volume allows), and only
                the box is resampled back: voxels outside it are background (label 0, background
                probability 1). Inside the box the prediction equals the whole-image one except near
                the box's faces, where the windows see less context.
            probabilities: also return the (X, Y, Z, K) float32 probabilities (else None: faster and
                smaller, the argmax is taken slab by slab); with `model.output: regions` the (X, Y, Z, R)
                region probabilities (0 outside what was predicted).

        Returns:
            (uint8 label map (X, Y, Z), float32 probabilities (X, Y, Z, K) or None, device description).

        Example:
        ```python
        coarse, _, _ = predictor.predict_array(image, affine, probabilities=False)
        box = np.argwhere(coarse == 1)
        labels, _, _ = fine.predict_array(image, affine, roi=(box.min(0) - 10, box.max(0) + 11), probabilities=False)
        ```
        """
        if roi is None:
            return self.predict_image([image], affine, case_id, probabilities)
        volume, _, geometry = preprocess(image, None, affine, self.preprocessing)
        return self._predict_preprocessed([volume], geometry, case_id, roi, probabilities)

    def predict_image(
        self, holder: list, affine: np.ndarray, case_id: str = "", probabilities: bool = True
    ) -> tuple[np.ndarray, np.ndarray | None, str]:
        """`predict_array` of the whole image in `holder` ([image]), which is emptied as soon as the image is no
        longer needed (only the preprocessed volume is held from then on)."""
        image = holder.pop()
        volume, _, geometry = preprocess(image, None, affine, self.preprocessing)
        del image
        return self._predict_preprocessed([volume], geometry, case_id, None, probabilities)

    def _predict_preprocessed(
        self, holder: list, geometry, case_id: str, roi, probabilities: bool
    ) -> tuple[np.ndarray, np.ndarray | None, str]:
        """`predict_array` after the preprocessing; `holder` is [volume], emptied once the logits exist."""
        grid = self.preprocessed_prediction(holder, geometry, case_id, roi)
        return (*grid.restore(probabilities), grid.device)

    def grid_prediction(self, image: np.ndarray, affine: np.ndarray, case_id: str = "") -> GridPrediction:
        """The probabilities (softmax, or the regions' sigmoids) of the whole `image` on the preprocessed grid,
        before `predict_array` maps them back to the image's grid: for a caller that needs less than every voxel (a
        cascade's coarse stage finds its region on this grid and restores labels only when it needs them). `image`
        is left as it is."""
        volume, _, geometry = preprocess(image, None, affine, self.preprocessing)
        return self.preprocessed_prediction([volume], geometry, case_id, None)

    def preprocessed_prediction(self, holder: list, geometry, case_id: str, roi) -> GridPrediction:
        """The probabilities of the preprocessed volume in `holder` ([volume], emptied once the logits exist) of
        `geometry` (`tfmis.data.preprocess.Geometry`), within `roi` (a box of the original grid, or None): what
        `grid_prediction` returns after its preprocessing, for a cascade that preprocesses its regions itself."""
        volume = holder.pop()
        box = None
        region = (np.zeros(3, int), np.array(volume.shape[:3]))
        if roi is not None:
            shape = np.array(geometry.original_shape)
            box = (np.clip(np.asarray(roi[0], int), 0, shape), np.clip(np.asarray(roi[1], int), 0, shape))
            start, stop = crop_box_in_original_voxels(geometry)
            region = preprocessed_box(
                np.maximum(start, box[0]), np.minimum(stop, box[1]), geometry, volume.shape, min_size=self.roi_size
            )
        if region is None:  # the box holds no foreground of the preprocessing: all background
            return GridPrediction(
                None, geometry, np.zeros(3, int), box, self.task.out_channels, "-", self.task.paint_labels
            )
        low, high = region
        volume = volume[tuple(slice(a, b) for a, b in zip(low, high))]
        logits, device = self.logits(volume, case_id, self.buffer_dtype)
        del volume  # the preprocessed image is no longer needed
        paint_labels = self.task.paint_labels  # None: classes (softmax, argmax); else regions (sigmoid, painting)
        (softmax_in_place if paint_labels is None else sigmoid_in_place)(logits)
        return GridPrediction(logits, geometry, low, box, self.task.out_channels, device, paint_labels)
