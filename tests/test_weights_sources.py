"""Every source of a run's weights loads into the inference model exactly as training saved it, for every kind of
model; another model's weights are refused in one line; and a `ckpt-N` predicts what the weights file of that epoch
predicts.

The sources are what `--checkpoint` takes, read as prediction reads them (`tfmis.inference.inputs.load_weights`):
`best.weights.h5`, the run folder (its best weights, and with weights="final" its final ones), `final.weights.h5`,
the `checkpoints/` folder (its latest) and every `ckpt-N` prefix. The reference is the trainer's model's weights at
the end of each epoch, recorded as training ran (tests/weights_sources.py: after the epoch's commit, which wrote
`ckpt-<epoch>` and, when the epoch improved, `best.weights.h5`): `best.weights.h5` and the run folder's best weights
are compared with the best epoch's, the final weights and `checkpoints/` with the last epoch's, `ckpt-N` with epoch
N's. Every weight of the inference model is first overwritten with a constant, so a weight a source left unread
shows.

The kinds of model (each a real 2-epoch training of a tiny network on the converted test dataset):
- deep_supervision (the default suite's): the demo's layer kinds, the checkpoint holding the model plus its heads;
- regions: `model.output: regions` (one sigmoid per label union);
- model_parallel_spatial / model_parallel_pipeline: trained over 2 logical CPU devices (in a fresh process, with deep
  supervision and recomputation), loaded and predicted on one device (`--model-parallel none`);
- cascade_coarse / cascade_fine: a plan of two stages, the coarse run (`<out>/lowres`) and the fine stage
  (`<out>/cascade`, `cascade.coarse_run` naming the coarse one, another network; trained on the same converted data:
  cropping its cases is the conversion's business), predicted through the cascade (`make_predictor`), the plan's
  folder too.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import tensorflow as tf
import yaml
from conftest import tiny_config
from weights_sources import Record, read_record, train_recording

from tfmis.config import save_config
from tfmis.errors import DataError
from tfmis.inference.cascade import CascadePredictor, make_predictor
from tfmis.inference.inputs import load_weights
from tfmis.task import SegmentationTask

TESTS = Path(__file__).parent
SENTINEL = 7.0  # every weight's value before a source is read: one left unread is seen

DEMO_LIKE_NETWORK = [  # the demo's layer kinds, small: deep supervision, residual units, MONAI's output upsampling
    "model.filters=[4,8,16]",
    "model.strides=[2,2,1]",
    "model.deep_supervision=2",
    "model.num_res_units=2",
    "model.output_upsampling=transposed_image",
    "loss.name=dice_ce",
]
REGIONS = ["model.output=regions", "loss.activation=sigmoid", "validation.regions={organ_all: [1, 2], inner: [2]}"]
MODEL_PARALLEL_NETWORK = [  # tests/test_model_parallel.py's training: deep supervision and recomputation
    "model.filters=[4,8,16]",
    "model.strides=[1,2,2]",
    "model.deep_supervision=1",
    "model.recompute=true",
]
ANOTHER_NETWORK = [
    "model.filters=[4,8,16]",
    "model.strides=[1,2,2]",
    "model.num_res_units=0",
    "model.deep_supervision=0",
]
ALWAYS = ["training.epochs=2", "training.keep_checkpoints=2", "runtime.distribution=none"]


@dataclasses.dataclass
class Kind:
    """A kind of model: the overrides of its config on the tiny one, and those of a model its weights must not load
    into (`other`, on top of them)."""

    overrides: list[str]
    other: list[str]
    subprocess: bool = False  # trained in a fresh process (logical devices)
    stage: str | None = None  # a cascade's stage: "coarse" or "fine"
    # the last checkpoint read into a new inference model by object position (what prediction did before it read the
    # weights by name) gives other weights: the test would see that mistake
    position_differs: bool = False


KINDS = {
    "deep_supervision": Kind(DEMO_LIKE_NETWORK, ANOTHER_NETWORK, position_differs=True),
    "regions": Kind([*DEMO_LIKE_NETWORK[:2], "model.deep_supervision=1", *REGIONS], ["model.output=classes"]),
    "model_parallel_spatial": Kind(
        [*MODEL_PARALLEL_NETWORK, "runtime.model_parallel.mode=spatial"], ["model.filters=[4,8,32]"], subprocess=True
    ),
    "model_parallel_pipeline": Kind(
        [*MODEL_PARALLEL_NETWORK, "runtime.model_parallel.mode=pipeline"], ["model.filters=[4,8,32]"], subprocess=True
    ),
    # the two stages are different networks (as a plan's lowres and full-resolution stages): each refuses the other's
    "cascade_coarse": Kind(DEMO_LIKE_NETWORK, ANOTHER_NETWORK, stage="coarse"),
    "cascade_fine": Kind(ANOTHER_NETWORK, DEMO_LIKE_NETWORK, stage="fine"),
}
SLOW = {"regions", "model_parallel_spatial", "model_parallel_pipeline", "cascade_coarse", "cascade_fine"}


@dataclasses.dataclass
class Run:
    config: object  # the config loading and prediction use (model parallelism off: one device)
    dir: Path
    record: Record


def _train_in_a_fresh_process(config, folder: Path) -> Record:
    """`config` trained by tests/weights_sources.py in a new process (the logical CPU devices of
    runtime.model_parallel must be made before TensorFlow initialises its devices)."""
    save_config(config, folder / "train.yaml")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(TESTS / "weights_sources.py"), str(folder / "train.yaml"), str(folder / "record.npz")],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    record = read_record(folder / "record.npz")
    assert record.parallel.startswith(config.runtime.model_parallel.mode), record.parallel
    return record


@pytest.fixture(scope="module")
def runs(converted_dataset, tmp_path_factory):
    """The trained runs by kind, each trained when a test first asks for it (the cascade's two stages at once)."""
    trained: dict[str, Run] = {}

    def get(kind_name: str) -> Run:
        if kind_name in trained:
            return trained[kind_name]
        kind = KINDS[kind_name]
        if kind.stage is not None:
            _train_cascade(converted_dataset, tmp_path_factory.mktemp("cascade"), trained)
            return trained[kind_name]
        folder = tmp_path_factory.mktemp(kind_name)
        config = tiny_config(converted_dataset, folder / "run", *ALWAYS, *kind.overrides)
        if kind.subprocess:
            record = _train_in_a_fresh_process(config, folder)
            config.runtime.model_parallel.mode = "none"  # predicted on one device (--model-parallel none)
        else:
            record = train_recording(config)
        trained[kind_name] = Run(config, folder / "run", record)
        return trained[kind_name]

    return get


def _train_cascade(dataset: Path, root: Path, trained: dict) -> None:
    """A plan of two stages at `root` (plan.yaml naming lowres and cascade, as `train --configuration cascade` leaves
    it): the coarse run in `root/lowres`, then the fine stage in `root/cascade` with `cascade.coarse_run`."""
    coarse = tiny_config(dataset, root / "lowres", *ALWAYS, *KINDS["cascade_coarse"].overrides)
    fine = tiny_config(dataset, root / "cascade", *ALWAYS, *KINDS["cascade_fine"].overrides)
    fine.cascade.coarse_run = str(root / "lowres")
    entries = []
    for name, config in (("lowres", coarse), ("cascade", fine)):
        save_config(config, root / f"{name}.yaml")
        entries.append({"name": name, "config": str(root / f"{name}.yaml")})
    (root / "plan.yaml").write_text(yaml.safe_dump({"stages": entries}))
    trained["cascade_coarse"] = Run(coarse, root / "lowres", train_recording(coarse))
    trained["cascade_fine"] = Run(fine, root / "cascade", train_recording(fine))


def sources(run: Run) -> list[tuple[str, Path, str, Path, int]]:
    """(name, checkpoint, weights, the file or prefix it reads, the epoch whose weights it holds) of every source."""
    d, best, last = run.dir, run.record.best_epoch, run.record.last_epoch
    found = [
        ("best.weights.h5", d / "best.weights.h5", "best", d / "best.weights.h5", best),
        ("run folder (best)", d, "best", d / "best.weights.h5", best),
        ("run folder (final)", d, "final", d / "final.weights.h5", last),
        ("final.weights.h5", d / "final.weights.h5", "best", d / "final.weights.h5", last),
        ("checkpoints/", d / "checkpoints", "best", d / "checkpoints" / f"ckpt-{last}", last),
    ]
    for n in sorted(run.record.epochs):
        found.append((f"ckpt-{n}", d / "checkpoints" / f"ckpt-{n}", "best", d / "checkpoints" / f"ckpt-{n}", n))
    return found


def assert_weights_are(model, expected: dict[str, np.ndarray], what: str) -> None:
    assert sorted(w.path for w in model.weights) == sorted(expected), what
    for w in model.weights:
        np.testing.assert_array_equal(w.numpy(), expected[w.path], err_msg=f"{what}: {w.path}")


def _case(config) -> tuple[np.ndarray, np.ndarray]:
    """The test dataset's test scan (conftest.converted_dataset: the MSD folder next to the TFRecords)."""
    image = nib.load(str(Path(config.data.dataset_dir).parent / "Task99_Test" / "imagesTs" / "case_900.nii.gz"))
    return np.asarray(image.dataobj, dtype=np.float32), image.affine


@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k for k in KINDS], ids=list(KINDS)
)
def test_every_weights_source_loads_as_training_saved_it_and_ckpt_n_predicts_as_the_weights_file(runs, kind):
    """For a 2-epoch run of `kind`: `load_weights` of best.weights.h5, the run folder (best and final),
    final.weights.h5, checkpoints/ and ckpt-1 and ckpt-2 gives the inference model every weight the trainer's model
    had at that source's epoch (best: the best epoch's); each source loaded into another model (`Kind.other`) is a
    `DataError` of one line naming the file or prefix it read; and the predictor built on `ckpt-<best epoch>` writes
    the label map of the one built on best.weights.h5 (probabilities within 1e-6) on the test scan. For deep
    supervision, ckpt-2 read by object position (prediction's old way) gives other weights: the test sees it."""
    run = runs(kind)
    record = run.record
    assert sorted(record.epochs) == [1, 2]
    first, second = record.epochs[1], record.epochs[2]
    assert any(not np.array_equal(first[p], second[p]) for p in first), "the epochs' weights cannot be told apart"
    task = SegmentationTask(run.config, data_info=_data_info(run))
    model = task.build_inference_model()
    for name, checkpoint, weights, read, epoch in sources(run):
        for w in model.weights:
            w.assign(np.full(w.shape, SENTINEL, w.dtype))
        assert load_weights(model, checkpoint, weights, task) == read, name
        assert_weights_are(model, record.epochs[epoch], f"{kind}, {name} (epoch {epoch})")
    if KINDS[kind].position_differs:
        by_position = task.build_inference_model()
        tf.train.Checkpoint(model=by_position).read(str(run.dir / "checkpoints" / "ckpt-2")).expect_partial()
        differ = [w.path for w in by_position.weights if not np.array_equal(w.numpy(), record.epochs[2][w.path])]
        assert differ, "reading by object position happened to match: the test no longer shows the mistake"

    other_config = tiny_config(
        run.config.data.dataset_dir, run.dir.parent / "other", *ALWAYS, *KINDS[kind].overrides, *KINDS[kind].other
    )
    other_task = SegmentationTask(other_config, data_info=_data_info(run))
    other = other_task.build_inference_model()
    for name, checkpoint, weights, read, _ in sources(run):
        with pytest.raises(DataError) as refused:
            load_weights(other, checkpoint, weights, other_task)
        message = str(refused.value)
        assert str(read) in message and "\n" not in message, f"{kind}, {name}: {message}"

    image, affine = _case(run.config)
    best = record.best_epoch
    # a Predictor, or for the fine stage a CascadePredictor (the coarse run's best weights first)
    from_checkpoint = make_predictor(run.config, run.dir / "checkpoints" / f"ckpt-{best}", device="cpu")
    from_file = make_predictor(run.config, run.dir / "best.weights.h5", device="cpu")
    labels, probabilities, _ = from_checkpoint.predict_array(image, affine)
    file_labels, file_probabilities, _ = from_file.predict_array(image, affine)
    np.testing.assert_array_equal(labels, file_labels)
    np.testing.assert_allclose(probabilities, file_probabilities, rtol=0, atol=1e-6)
    for predictor, name in ((from_checkpoint, f"ckpt-{best}"), (from_file, "best.weights.h5")):
        stage = predictor.fine if isinstance(predictor, CascadePredictor) else predictor  # the run's own network
        assert_weights_are(stage.model, record.epochs[best], f"{kind}: the predictor of {name}")


def _data_info(run: Run) -> dict:
    from tfmis.data.records import load_training_data_info

    return load_training_data_info(run.dir, run.config.data.dataset_dir)


@pytest.mark.slow
def test_a_cascade_predicts_with_the_fine_stages_source_and_the_coarse_runs_weights(runs):
    """Through the cascade (`make_predictor` on the fine stage's run folder, ckpt-N or weights file, and the plan's
    folder as `predict --checkpoint <folder>` resolves it), the fine model has the weights of the fine stage's source
    and the coarse model the coarse run's best weights (its final ones with weights="final")."""
    from tfmis.inference.ensemble import build_predictor, resolve_checkpoint
    from tfmis.predict import final_stage

    coarse, fine = runs("cascade_coarse"), runs("cascade_fine")
    for name, checkpoint, weights, _, epoch in sources(fine):
        predictor = make_predictor(fine.config, checkpoint, weights=weights, device="cpu")
        assert isinstance(predictor, CascadePredictor)
        assert_weights_are(predictor.fine.model, fine.record.epochs[epoch], f"the fine stage from {name}")
        coarse_epoch = coarse.record.last_epoch if weights == "final" else coarse.record.best_epoch
        assert_weights_are(predictor.coarse.model, coarse.record.epochs[coarse_epoch], f"the coarse stage ({name})")
    plan_folder = fine.dir.parent
    for weights in ("best", "final"):
        source = resolve_checkpoint(final_stage(str(plan_folder)), weights=weights)
        predictor = build_predictor(source, device="cpu")
        assert isinstance(predictor, CascadePredictor)
        pick = {"best": "best_epoch", "final": "last_epoch"}[weights]
        assert_weights_are(
            predictor.fine.model, fine.record.epochs[getattr(fine.record, pick)], f"plan folder, {weights}"
        )
        assert_weights_are(
            predictor.coarse.model, coarse.record.epochs[getattr(coarse.record, pick)], f"plan folder, {weights}"
        )
