"""What a segmentation experiment is made of, built from a `Config`: the one place that turns the config's
sections into TensorFlow objects (tensorflow/models' `Task`).

The trainer (`tfmis.engine.trainer`), the predictor (`tfmis.inference.predictor`) and the GPU-fit trial
(`tfmis.tuning.fit.trial`, through the trainer) receive their parts from here, so that the network a run
trains is the network it predicts with, in the same precision, and the GPU-fit search measures exactly
what training will run:

- the numeric precision (`training.precision: auto` resolved for this machine) and its Keras policy;
- the U-Net (`model`), for training (with its deep-supervision heads) or for inference, and what its output
  channels mean: classes (softmax, argmax) or, with `model.output: regions`, the label unions of
  `validation.regions` (one sigmoid each, painted into a label map: `label_map`);
- the loss (`loss`, wrapped for deep supervision), the optimizer and its learning-rate schedule
  (`optimizer`, scaled with the global batch, with loss scaling under mixed_float16);
- the input pipelines (`pipeline`, `data`) and the metrics (`validation`).

Example:
```python
task = SegmentationTask(load_config("configs/demo.yaml"))
task.set_precision_policy()
model = task.build_inference_model()
loss = task.build_loss()
```
"""

from __future__ import annotations

import dataclasses
import sys

import keras
import tensorflow as tf

from tfmis.config import region_paint_labels
from tfmis.data.pipeline import build_train_dataset, build_val_dataset
from tfmis.data.records import load_index
from tfmis.errors import ConfigError
from tfmis.hardware import resolve_precision
from tfmis.losses import DeepSupervisionLoss, build_loss
from tfmis.metrics.segmentation import SegmentationMetrics, check_regions
from tfmis.networks.architecture import check_patch_size
from tfmis.networks.parallel import ModelParallel
from tfmis.networks.unet import UNetConfig
from tfmis.optimizers import batch_scaled_learning_rate, build_optimizer, build_schedule
from tfmis.optimizers.schedules import OncePerStep, ScheduleLength


class SegmentationTask:
    """Builds a segmentation experiment's parts from a `Config`.

    Args:
        config: a `tfmis.config.Config`.
        data_info: what the parts need to know of the data, in `index.json`'s keys (`source.modalities`,
            `source.labels`, `preprocessing`, `cases`): the converted dataset's index (the default, read
            from `data.dataset_dir`) or a run folder's `training_data.json` (prediction, when the
            TFRecords may be gone).
        train_dataset_fn: `fn(config, input_context, seed_offset)` building one input pipeline's training
            stream (default `tfmis.data.pipeline.build_train_dataset`; e.g. another pipeline to compare with).

    Attributes:
        class_names: the label names, background first.
        in_channels: the image channels (modalities).
        precision: the Keras mixed-precision policy name (`auto` resolved for this machine).
        regions: with `model.output: regions`, the label unions the network predicts, in painting order
            ({name: labels}, `validation.regions`); None when it predicts the classes.
        paint_labels: with regions, the label each region paints (`tfmis.config.region_paint_labels`); else None.
        out_channels: the network's output channels: one per class, or one per region.

    Raises:
        ValueError: `model.output: regions` with regions that leave a foreground class out (it could never be
            predicted) or name labels that are not classes of the dataset.
    """

    def __init__(self, config, data_info: dict | None = None, train_dataset_fn=None):
        self.config = config
        self.data_info = data_info if data_info is not None else load_index(config.data.dataset_dir)
        self.class_names = list(self.data_info["source"]["labels"])
        self.in_channels = len(self.data_info["source"]["modalities"])
        self.precision = resolve_precision(config.training.precision)
        self.train_dataset_fn = train_dataset_fn or build_train_dataset
        self.regions = self.paint_labels = None
        if config.model.output == "regions":
            self.regions = self._check_output_regions(config.validation.regions)
            self.paint_labels = region_paint_labels(self.regions)
        self.out_channels = len(self.regions) if self.regions is not None else len(self.class_names)

    def _check_output_regions(self, regions: dict) -> dict[str, tuple[int, ...]]:
        """`validation.regions` as the network's outputs: labels of this dataset, every foreground class in one."""
        checked = check_regions(regions, len(self.class_names), self.class_names)
        missing = sorted(set(range(1, len(self.class_names))) - {k for labels in checked.values() for k in labels})
        if missing:
            names = ", ".join(f"{k} ({self.class_names[k]})" for k in missing)
            raise ConfigError(
                f"model.output is regions but no region of validation.regions holds the label {names}: it could "
                "never be predicted. Add it to a region (the largest holds every foreground label, e.g. BraTS's "
                "whole_tumour: [1, 2, 3]), or set model.output=classes"
            )
        return checked

    def set_precision_policy(self) -> str:
        """Sets Keras' global mixed-precision policy to `precision` (before any layer is built); returns it."""
        keras.mixed_precision.set_global_policy(self.precision)
        return self.precision

    def check_sizes(self) -> None:
        """Fails now, not after data loading, when the patch or the validation window does not fit the strides."""
        strides = self.config.model.strides
        check_patch_size(self.config.pipeline.patch_size, strides)
        check_patch_size(self.config.validation.roi_size or self.config.pipeline.patch_size, strides)

    # ------------------------------------------------------------------ the network

    def _unet(self, **changes) -> UNetConfig:
        return UNetConfig(self.in_channels, self.out_channels, **{**dataclasses.asdict(self.config.model), **changes})

    def build_training_model(self) -> tuple[keras.Model, keras.Model]:
        """(model, training model): the model validates, predicts and is saved as best weights; the training
        model is what the optimizer trains: the same object, or with deep supervision the model plus its
        lower-resolution heads."""
        return self._unet().build_for_training()

    def build_model_parallel(self, model: keras.Model, devices: list[str], training: bool = True):
        """`model` run over `devices` as `runtime.model_parallel` says (`tfmis.networks.parallel.ModelParallel`), or
        None when it is off. `devices` are the `data` groups' devices one group after another; `training: false`
        (validation and prediction windows) runs one group, and a pipeline without micro-batches."""
        mp = self.config.runtime.model_parallel
        if not mp.enabled:
            return None
        groups = [devices[g * mp.devices : (g + 1) * mp.devices] for g in range(mp.data if training else 1)]
        return ModelParallel(
            model,
            mp.mode,
            groups,
            strides=self.config.model.strides,
            axis=mp.axis,
            micro_batches=mp.micro_batches if training else 1,
            patch_size=self.config.pipeline.patch_size
            if training
            else self.config.validation.roi_size or self.config.pipeline.patch_size,
            in_channels=self.in_channels,
            place_variables=training,  # the training run's stages own the variables; validation reads them
        )

    def build_inference_model(self) -> keras.Model:
        """The model without what only training needs (recomputation saves memory only in a backward pass)."""
        return self._unet(recompute=False).build()

    def label_map(self, logits):
        """Integer (int32) labels (...) of blended logits (..., out_channels): the argmax over the classes, or with
        regions each region painted in order with its label where its sigmoid exceeds 0.5 (logit > 0), starting
        from background (nnU-Net's `regions_class_order`)."""
        if self.regions is None:
            return tf.argmax(logits, axis=-1, output_type=tf.int32)
        labels = tf.zeros(tf.shape(logits)[:-1], tf.int32)
        for channel, label in enumerate(self.paint_labels):
            labels = tf.where(logits[..., channel] > 0, label, labels)
        return labels

    # ------------------------------------------------------------------ loss and optimizer

    def build_loss(self):
        """The `loss` section's loss; with `model.deep_supervision`, summed over the heads with nnU-Net's weights."""
        lc = self.config.loss
        loss = build_loss(
            lc.name,
            include_background=lc.include_background,
            activation=lc.activation,
            regions=None if self.regions is None else [list(labels) for labels in self.regions.values()],
            batch=lc.batch,
            squared_pred=lc.squared_pred,
            **({"lambda_dice": lc.lambda_dice} if lc.name != "dice" else {}),
            **({"lambda_ce": lc.lambda_ce} if lc.name == "dice_ce" else {}),
            **({"lambda_focal": lc.lambda_focal, "gamma": lc.gamma} if lc.name == "dice_focal" else {}),
        )
        m = self.config.model
        if m.deep_supervision:
            loss = DeepSupervisionLoss(loss, [factor for _, factor in m.deep_supervision_levels])
        return loss

    def learning_rates(self, global_batch: int) -> tuple[float, float]:
        """(learning rate, minimum learning rate) for `global_batch` images per optimizer step, scaled as
        `optimizer.lr_scaling` says against `optimizer.lr_reference_batch` (default: one replica's batch)."""
        o, tc = self.config.optimizer, self.config.training
        reference = o.lr_reference_batch or self.config.pipeline.num_images_per_batch * tc.accumulation_steps
        return tuple(
            batch_scaled_learning_rate(rate, o.lr_scaling, global_batch, reference)
            for rate in (o.learning_rate, o.min_learning_rate)
        )

    def build_schedule_length(self, steps_per_epoch: int) -> ScheduleLength:
        """The schedule's length in a variable (`tfmis.optimizers.ScheduleLength`): `training.epochs` x
        `steps_per_epoch` steps, warm-up (`optimizer.warmup_epochs`) included, until the trainer sets it (a time
        budget fits it to the measured epoch time). Build it in the distribution backend's scope."""
        o, tc = self.config.optimizer, self.config.training
        total, warmup = tc.epochs * steps_per_epoch, int(o.warmup_epochs * steps_per_epoch)
        if o.schedule != "constant" and warmup >= total:  # a short first try (training.epochs=1) must still run
            shorter = total // 2
            print(
                f"optimizer.warmup_epochs={o.warmup_epochs:g} ({warmup} steps) is not shorter than the {total}-step "
                f"schedule of training.epochs={tc.epochs}: the warm-up is cut to {shorter} step{'s' * (shorter != 1)}, "
                "half of it",
                file=sys.stderr,
            )
            warmup = shorter
        return ScheduleLength(total, warmup_steps=warmup)

    def build_optimizer(self, global_batch: int, steps_per_epoch: int, length: ScheduleLength | None = None):
        """The optimizer with its schedule over `training.epochs` x `steps_per_epoch` steps (warm-up first), or
        over the steps `length` holds when given (`build_schedule_length`: the trainer may set it later); under
        mixed_float16 wrapped in a `LossScaleOptimizer` (float16 gradients underflow without it). Build it in
        the distribution backend's scope."""
        o = self.config.optimizer
        learning_rate, min_learning_rate = self.learning_rates(global_batch)
        length = length if length is not None else self.build_schedule_length(steps_per_epoch)
        schedule = build_schedule(
            o.schedule,
            learning_rate,
            total_steps=length,
            warmup_steps=length.warmup_steps,
            power=o.power,
            min_learning_rate=min_learning_rate,
        )
        # OncePerStep: Keras would evaluate the schedule once per variable in every step
        optimizer = build_optimizer(
            o.name,
            OncePerStep(schedule),
            weight_decay=o.weight_decay,
            momentum=o.momentum,
            nesterov=o.nesterov,
            beta_1=o.beta_1,
            beta_2=o.beta_2,
            clipnorm=o.clipnorm,
        )
        if self.precision == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        return optimizer

    # ------------------------------------------------------------------ data and metrics

    def build_train_dataset(self, input_context=None, seed_offset: int = 0):
        """One input pipeline's training stream (`tf.distribute.InputContext` says which part is its own)."""
        return self.train_dataset_fn(self.config, input_context, seed_offset)

    def build_val_dataset(self, cached: bool = True):
        """The validation volumes, one whole case at a time: (image (1, X, Y, Z, C), label, metadata)."""
        return build_val_dataset(self.config, cached=cached)

    def build_metrics(self) -> SegmentationMetrics:
        """Per-class Dice (and HD95 with `validation.hd95`, NSD with `validation.nsd`), and the same of the label
        unions in `validation.regions`, as MONAI computes them; ValueError naming the key when a region's labels
        are not classes of the dataset.

        The distances are in mm on the grid the maps are given on: validation (`Trainer.evaluate`) scores the
        preprocessed grid with its spacing ("NSD on the preprocessed grid": `val_nsd`, `val_mean_nsd`),
        `Predictor` the scan's own grid with the file's spacing ("NSD on the original grid": predictions.csv's
        `nsd_<class>`); the two agree when preprocessing does not resample (docs/training.md)."""
        v = self.config.validation
        return SegmentationMetrics(
            len(self.class_names),
            class_names=self.class_names,
            hd95=v.hd95,
            regions=v.regions,
            nsd=v.nsd,
            nsd_tolerance_mm=v.nsd_tolerance_mm,
        )
