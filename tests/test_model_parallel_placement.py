"""Where model parallelism (tfmis.networks.parallel) puts variables and tensors, read from the variables themselves
and from the traced graphs' op devices, on two logical CPU devices (a fresh process: they must exist before
TensorFlow initialises its devices):

- pipeline: each stage's variables, their Adam slots and their gradients live on the stage's device, and a
  checkpoint written after a step there restores into a one-device model (checkpoints store no devices);
- spatial: the labels are sliced where they are, so only each slab's rows travel to its device, and with the loss
  summed slab by slab the first device's memory count holds no whole-patch logits;
- the planner's memory estimates against the count (`tfmis.profiling.graph_memory.placed_memory`) of the step it
  plans: the network, patch, precision and loss of a plan for 4 GPUs of 80 GB (one GPU holds its patch; traced,
  never run, on 1 logical CPU device and split over 2 and 4 into uneven slabs) and of a plan for 4 GPUs of 8 GB
  (which splits its patch; traced as planned), compared per device with the planner's one-GPU and per-GPU figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

NET = dict(in_channels=1, num_classes=3, filters=(4, 8, 16), strides=(1, 2, 2), deep_supervision=1)

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

    import keras

    from tfmis.losses import DeepSupervisionLoss, build_loss
    from tfmis.networks.parallel import ModelParallel
    from tfmis.networks.devices import canonical_device
    from tfmis.networks.unet import UNetConfig
    from tfmis.profiling.graph_memory import op_devices, placed_memory, step_graph

    folder, net = sys.argv[1], json.loads(sys.argv[2])
    out = {}
    devices = ["/CPU:0", "/CPU:1"]

    def device_of(v):
        return canonical_device(v.value.device)

    # ---- pipeline: variables, slots and gradients on their stage's device; a step, then a checkpoint
    keras.utils.set_random_seed(0)
    config = UNetConfig(**net)
    model, training_model = config.build_for_training()
    patch = (16, 16, 16)
    pipeline = ModelParallel(training_model, "pipeline", [devices], config.strides, micro_batches=2,
                             patch_size=patch, in_channels=1)
    optimizer = keras.optimizers.Adam(1e-2)
    optimizer.build(training_model.trainable_variables)
    pipeline.place_optimizer(optimizer)
    stage_of = {}
    for layer in training_model.layers:
        for v in layer.variables:
            stage_of.setdefault(id(v), pipeline.stages.get(layer.name))
    def nbytes(v):
        return int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize

    out["variables"] = [[v.path, device_of(v), devices[stage_of[id(v)]], nbytes(v)] for v in training_model.variables]
    variables = training_model.trainable_variables
    out["slots"] = [[v.path, device_of(m), device_of(s), device_of(v)]
                    for v, m, s in zip(variables, optimizer._momentums, optimizer._velocities)]
    out["stage_table"] = pipeline.stage_table()
    loss_fn = DeepSupervisionLoss(build_loss("dice_ce"), [f for _, f in config.deep_supervision_levels])

    def loss_of(x, y):
        return pipeline.loss(loss_fn, y, x, training=True)

    @tf.function(autograph=False)
    def gradients(x, y):
        return ModelParallel.gradients(loss_of(x, y), variables)

    @tf.function(autograph=False)
    def step(x, y):
        loss = loss_of(x, y)
        optimizer.apply(ModelParallel.gradients(loss, variables), variables)
        return loss

    rng = np.random.default_rng(0)
    images = tf.constant(rng.normal(size=(2, *patch, 1)).astype("float32"))
    labels = tf.constant(rng.integers(0, 3, size=(2, *patch)).astype("int32"))
    function = gradients.get_concrete_function(images, labels)
    placed = op_devices(function.graph, "/CPU:0")
    made_on = []
    for v, g in zip(variables, function.structured_outputs):
        op = g.op
        while op.type == "Identity":  # the function's output identities: the gradient's own op is behind them
            op = op.inputs[0].op
        made_on.append([v.path, placed[op], op.type, device_of(v)])
    out["gradients"] = made_on
    def crossing_variables(graph):  # bytes of variable values read on another device than the variable's
        return sum(t.bytes for m in placed_memory(graph).values() for t in m.transfers_in if t.variable)

    out["variable_crossings"] = {"adam": crossing_variables(step.get_concrete_function(images, labels).graph)}
    sgd = keras.optimizers.SGD(1e-2, momentum=0.9, weight_decay=1e-4)
    sgd.build(variables)
    pipeline.place_optimizer(sgd)

    def sgd_step(x, y):
        sgd.apply(ModelParallel.gradients(loss_of(x, y), variables), variables)

    sgd_graph = tf.function(sgd_step, autograph=False).get_concrete_function(images, labels).graph
    out["variable_crossings"]["sgd_weight_decay"] = crossing_variables(sgd_graph)
    out["weight_bytes"] = sum(int(np.prod(v.shape)) * 4 for v in variables)
    step(images, labels)
    tf.train.Checkpoint(model=training_model, optimizer=optimizer).write(f"{folder}/ckpt")
    np.savez(f"{folder}/weights.npz", *[v.numpy() for v in training_model.variables])
    out["slot_sums"] = [float(np.abs(s.numpy()).sum()) for s in optimizer._velocities]

    # ---- spatial: labels sliced on their own device; the first device's count holds no whole-patch logits
    keras.utils.set_random_seed(0)
    demo = UNetConfig(in_channels=2, num_classes=4, filters=(8, 16, 32, 64), strides=(2, 2, 2, 1),
                      output_upsampling="transposed_image", deep_supervision=2, num_res_units=2, norm="instance")
    _, demo_model = demo.build_for_training()
    side = 48
    spatial = ModelParallel(demo_model, "spatial", [devices], demo.strides, patch_size=(side,) * 3, in_channels=2)
    sums_loss = DeepSupervisionLoss(build_loss("dice_ce"), [f for _, f in demo.deep_supervision_levels])

    class Joined:  # the same loss seen only whole: ModelParallel joins the slabs' outputs on the first device
        supports_partial_sums = False

        def __call__(self, y, outputs):
            return sums_loss(y, outputs)

    graph = step_graph(demo_model, sums_loss, 2, (side,) * 3, 2, parallel=spatial, gradients="colocated")
    memory = placed_memory(graph)
    label_input = graph.inputs[1]
    placed = op_devices(graph, "/CPU:0")
    out["label_consumers"] = sorted({(c.type, placed[c]) for c in label_input.consumers()})
    out["label_transfers"] = [[t.tensor, t.destination, t.bytes] for m in memory.values() for t in m.transfers_in
                              if t.tensor == label_input.name]
    out["label_bytes"] = int(label_input.shape.num_elements()) * 4
    slices = {t.name for c in label_input.consumers() for t in c.outputs}
    out["label_slab_transfers"] = [[t.destination, t.bytes] for m in memory.values() for t in m.transfers_in
                                   if t.tensor in slices]
    out["sums_peaks"] = {d: m.peak_bytes for d, m in memory.items()}
    joined = placed_memory(step_graph(demo_model, Joined(), 2, (side,) * 3, 2, parallel=spatial,
                                      gradients="colocated"))
    out["joined_peaks"] = {d: m.peak_bytes for d, m in joined.items()}
    out["logits_bytes"] = 2 * side**3 * 4 * 4
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def placement(tmp_path_factory):
    folder = tmp_path_factory.mktemp("placement")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(folder), json.dumps(NET)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return folder, json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_pipeline_stage_variables_their_adam_slots_and_gradients_live_on_the_stages_device(placement):
    """Every variable of a 2-stage pipeline (trainable and not) is on its stage's device, both stages own some,
    each Adam slot is on its variable's device, each gradient (the op that makes it in the traced `tf.gradients`,
    micro-batch sums included) runs there, the optimizer's step (Adam; SGD with momentum and weight decay) reads
    no weight or slot on another device, and the stage table's parameter column is the bytes of the variables whose
    value lives on that stage's device (read from each variable)."""
    _, out = placement
    assert out["variables"] and all(device == stage for _, device, stage, _ in out["variables"])
    assert {device for _, device, _, _ in out["variables"]} == {"/CPU:0", "/CPU:1"}
    assert all(m == s == v for _, m, s, v in out["slots"])
    assert len(out["gradients"]) == len(out["slots"])
    assert all(made == device for _, made, _, device in out["gradients"]), out["gradients"]
    # with the updates placed (`place_optimizer`), only scalars (learning rate, step count) cross devices in
    # Adam's step and in SGD's with momentum and weight decay, not weights, slots or gradients
    assert all(crossed < 1024 for crossed in out["variable_crossings"].values()), out["variable_crossings"]
    assert out["weight_bytes"] > 100_000
    for stage, device in enumerate(("/CPU:0", "/CPU:1")):  # the bytes of the variables whose value is there
        held = sum(nbytes for _, placed, _, nbytes in out["variables"] if placed == device)
        line = out["stage_table"].splitlines()[1 + stage]
        assert f"parameters on it {held / 2**20:.2f} MiB" in line
    assert all(s > 0 for s in out["slot_sums"])  # the step ran and updated every slot


@pytest.mark.slow
def test_a_pipeline_checkpoint_restores_into_a_one_device_model_with_equal_weights(placement):
    """The checkpoint written after a pipeline step over 2 devices restores into a model built in this process
    (one device, no model parallelism): equal weights, every variable on this process's /CPU:0."""
    import keras

    from tfmis.networks.unet import UNetConfig

    folder, _ = placement
    _, training_model = UNetConfig(**NET).build_for_training()
    optimizer = keras.optimizers.Adam(1e-2)
    optimizer.build(training_model.trainable_variables)
    tf.train.Checkpoint(model=training_model, optimizer=optimizer).read(str(folder / "ckpt")).assert_consumed()
    saved = np.load(folder / "weights.npz")
    assert len(saved.files) == len(training_model.variables)
    for i, v in enumerate(training_model.variables):
        np.testing.assert_array_equal(v.numpy(), saved[f"arr_{i}"], err_msg=v.path)
        assert tf.DeviceSpec.from_string(v.value.device).device_index in (None, 0)


@pytest.mark.slow
def test_spatial_labels_are_sliced_where_they_are_and_only_slabs_travel(placement):
    """In the traced spatial step the labels feed only slicing ops on their own device (/CPU:0), the whole label
    tensor is never copied to /CPU:1: /CPU:1 receives its slab's rows of them (half of the 48 rows), once."""
    _, out = placement
    assert out["label_consumers"] and all(device == "/CPU:0" for _, device in out["label_consumers"])
    assert out["label_transfers"] == []
    assert out["label_slab_transfers"] == [["/CPU:1", out["label_bytes"] // 2]]


@pytest.mark.slow
def test_spatial_loss_summed_by_slab_keeps_the_whole_patch_logits_off_the_first_device(placement):
    """The graph count of the demo U-Net's spatial step (48³, batch 2) over 2 devices: with the loss summed slab by
    slab the first device's peak is within 10% of the second's, while joining the outputs for the loss (a loss
    without partial sums) adds more than the whole patch's logits to the first device's peak."""
    _, out = placement
    first, second = out["sums_peaks"]["/CPU:0"], out["sums_peaks"]["/CPU:1"]
    assert first <= 1.1 * second
    assert out["joined_peaks"]["/CPU:0"] - first > out["logits_bytes"]


PLANNED_STEP = textwrap.dedent(
    """
    import json, sys
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)

    from tfmis.config import load_config
    from tfmis.networks.parallel import ModelParallel
    from tfmis.profiling.graph_memory import placed_memory, step_graph
    from tfmis.task import SegmentationTask

    config, info, cuts = load_config(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
    task = SegmentationTask(config, data_info=info)  # the trainer's network, precision and loss for this plan
    task.set_precision_policy()
    _, training_model = task.build_training_model()
    loss = task.build_loss()
    patch, strides = config.pipeline.patch_size, config.model.strides
    out = {"precision": task.precision, "peaks": {}, "slabs": {}}
    for n, axis in cuts:
        parallel = None
        if n > 1:
            devices = [[f"/CPU:{i}" for i in range(n)]]
            parallel = ModelParallel(training_model, "spatial", devices, strides, axis=axis, patch_size=patch,
                                     in_channels=task.in_channels)
            out["slabs"][n] = parallel.describe()
        graph = step_graph(training_model, loss, 2, patch, task.in_channels, parallel=parallel, gradients="colocated")
        out["peaks"][n] = {d: m.peak_bytes for d, m in placed_memory(graph).items()}
    print(json.dumps(out))
    """
)

CT = ([[1.0, 1.0, 1.0]] * 10, [[192, 160, 128]] * 10)  # a CT fingerprint of 192x160x128 voxels at 1 mm, 3 classes


def _count_planned_step(folder, gpus: int, gpu_mb: float, cuts) -> tuple:
    """Plans the CT fingerprint for `gpus` GPUs of `gpu_mb` and traces (never runs) the plan's training step
    (network, patch, mixed precision, Dice + CE at batch 2; the gradient taken as the trainer takes it) on one
    logical CPU device and split over N along an axis for each [N, axis] of `cuts`, in a fresh process: (the plan's
    config, its planner, {"peaks": {N: {device: bytes}}, "slabs": {N: placement}})."""
    from test_model_parallel import _gpus
    from test_plan import _fingerprint

    from tfmis.planning import make_plan
    from tfmis.planning.planner import ExperimentPlanner

    fp = _fingerprint(*CT)
    plan = make_plan(fp, _gpus(gpus, gpu_mb), output_dir=str(folder / "run"), dataset_dir=str(folder / "data"))
    path = plan.write(folder / "plan.yaml")
    info = {"source": {"labels": list(fp.labels), "modalities": list(fp.modalities)}}
    result = subprocess.run(
        [sys.executable, "-c", PLANNED_STEP, str(path), json.dumps(info), json.dumps(cuts)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    counted = json.loads(result.stdout.strip().splitlines()[-1])
    counted["peaks"] = {int(n): peaks for n, peaks in counted["peaks"].items()}
    counted["slabs"] = {int(n): text for n, text in counted["slabs"].items()}
    return plan.config(), ExperimentPlanner(fp, _gpus(gpus, gpu_mb)), counted


@pytest.fixture(scope="module")
def planned_step(tmp_path_factory):
    """The CT planned for 4 GPUs of 80 GB (one GPU holds the patch 192x192x128 its median image wants: no split),
    its step traced on 1 device and split along axis 0 over 2 and 4 (192 rows cut at multiples of 32: 96/96 and
    64/64/32/32, the uneven slabs whose busiest device the planner must count)."""
    return _count_planned_step(tmp_path_factory.mktemp("planned_step"), 4, 81920, [[1, None], [2, 0], [4, 0]])


@pytest.fixture(scope="module")
def planned_split(tmp_path_factory):
    """The CT planned for 4 GPUs of 8 GB, whose 85% of 7 GB cannot hold nnU-Net's patch at its default 8 GB target:
    the plan splits that patch over N of them; its step traced on 1 device and as planned (N, the planned axis)."""
    folder = tmp_path_factory.mktemp("planned_split")
    from test_model_parallel import _gpus
    from test_plan import _fingerprint

    from tfmis.planning import make_plan

    mp = make_plan(_fingerprint(*CT), _gpus(4, 8192)).config().runtime.model_parallel
    assert mp.mode == "spatial"
    return _count_planned_step(folder, 4, 8192, [[1, None], [mp.devices, mp.axis]])


def _planner_split(config, planner, axis=None):
    """(the planner's weights term, its one-GPU activations, per N its busiest GPU's activations) in MiB for the
    planned patch, from its own memory model (`training_memory_mb`, `spatial_mb`), the slabs cut along `axis` (None:
    the planner's choice)."""
    from tfmis.planning.rules import training_memory_mb

    patch, strides = list(config.pipeline.patch_size), list(config.model.strides)
    memory = training_memory_mb(
        patch,
        strides,
        list(config.model.filters),
        config.model.num_res_units,
        planner.inputs.in_channels,
        planner.inputs.num_classes,
        2,
        planner.inputs.precision,
    )
    fixed = memory["fixed_mb"]
    per_gpu = {n: planner.topology.spatial_mb(patch, strides, n, axis)[0] - fixed for n in (2, 4)}
    return fixed, memory["total_mb"] - fixed, per_gpu


@pytest.mark.slow
def test_planner_one_gpu_estimate_of_the_planned_step_is_within_15_percent_of_its_count(planned_step):
    """The plan for 4 x 80 GB (mixed precision; the patch 192x192x128 on one GPU, no split): the planner's
    activation memory of its step on one GPU (its estimate at batch 2 less its weights term) is within 15% of the
    counted peak of that step traced on one device."""
    config, planner, counted = planned_step
    assert config.training.precision == counted["precision"] == "mixed_float16"
    assert list(config.pipeline.patch_size) == [192, 192, 128] and config.runtime.model_parallel.mode == "none"
    _, activations, _ = _planner_split(config, planner)
    one_device = counted["peaks"][1]["/CPU:0"] / 2**20
    assert activations == pytest.approx(one_device, rel=0.15), (activations, one_device)


@pytest.mark.slow
def test_planner_per_gpu_estimate_of_a_spatial_split_is_within_15_percent_of_the_busiest_devices_count(planned_step):
    """The patch 192x192x128 split along axis 0 over 2 and 4 devices (slabs of 96/96 and 64/64/32/32 rows: cut at
    multiples of 32, so at N = 4 the busiest device holds a third of the patch, not a quarter): the planner's
    per-GPU activation memory (the largest slab's, with its gathered inputs and halos) as a share of its one-GPU
    activations is within 15% of the counted peak of the busiest device as a share of the one-device count."""
    config, planner, counted = planned_step
    assert "slabs [(0, 96), (96, 192)]" in counted["slabs"][2]
    assert "slabs [(0, 64), (64, 128), (128, 160), (160, 192)]" in counted["slabs"][4]
    _, activations, per_gpu = _planner_split(config, planner, axis=0)
    one_device = counted["peaks"][1]["/CPU:0"]
    counted_share = {n: max(counted["peaks"][n].values()) / one_device for n in (2, 4)}
    for n in (2, 4):
        assert per_gpu[n] / activations == pytest.approx(counted_share[n], rel=0.15), (n, counted_share, per_gpu)


@pytest.mark.slow
def test_a_planned_spatial_split_fits_the_target_gpus_budget_by_the_count(planned_split):
    """The plan for 4 x 8 GB splits nnU-Net's 8 GB-target patch over N GPUs: the busiest device's counted peak, as a
    share of the one-device count, applied to the planner's one-GPU activations plus its weights term, is within
    the target GPU's budget (85% of 8 GB after the reserved 1 GB), and the planner's own per-GPU estimate along the
    planned axis is within 15% of that count."""
    from tfmis.hardware import GPU_RESERVED_MB

    config, planner, counted = planned_split
    mp = config.runtime.model_parallel
    assert mp.mode == "spatial" and mp.devices in (2, 4) and mp.axis is not None
    fixed, activations, _ = _planner_split(config, planner)
    patch, strides = list(config.pipeline.patch_size), list(config.model.strides)
    planned = planner.topology.spatial_mb(patch, strides, mp.devices, mp.axis)[0] - fixed
    counted_share = max(counted["peaks"][mp.devices].values()) / counted["peaks"][1]["/CPU:0"]
    assert planned / activations == pytest.approx(counted_share, rel=0.15), (counted_share, counted["slabs"])
    assert fixed + counted_share * activations <= 0.85 * (8192 - GPU_RESERVED_MB), counted_share
