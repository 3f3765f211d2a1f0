"""Memory per device of a placed TensorFlow graph, counted from its tensors: the estimate for devices that have no
memory accounting of their own.

TensorFlow's `tf.config.experimental.get_memory_info` is documented as GPU/TPU-only. On TensorFlow 2.21 it raises
for a CPU device ("Allocator stats not available") unless oneDNN's allocator is on (`TF_ENABLE_ONEDNN_OPTS=1`),
and then it gives the process-wide CPU allocator's numbers: every logical CPU device
(`tf.config.set_logical_device_configuration`) reports the same `current` and `peak` (allocating 64 MiB on
/CPU:0 and then 128 MiB on /CPU:1 gives current 192 MiB for both). So on logical CPU devices, the memory a
model-parallel step (`tfmis.networks.parallel.ModelParallel`) needs per device is counted here from the traced
graph instead: which tensors each op makes, on which device, and how long they must live. On one device the
count can be checked against that allocator (tests/test_graph_memory.py; the figures: docs/model-parallel.md,
"Memory per device").

- `placed_memory(graph)`: per device, the peak of simultaneously live tensor bytes when the graph's ops run one
  after another in `graph.get_operations()` order, the bytes it receives from and sends to other devices, and the
  bytes of everything allocated there.
- `parameter_bytes(variables)`: weights + gradients + Adam's two slots, counted apart from the graph.
- `step_graph(...)`: the traced graph of one training step (forward, loss, gradient), never run; the gradient by
  `tape.gradient` (TensorFlow runs its backward ops, which get no device, all on the default device) or by
  `tf.gradients` (each backward op colocated with its forward op, as the trainer takes model-parallel gradients).
- `summary(memory)`, `spatial_halo(graph, memory)`: the largest peak and the transfers; the halo exchange of a
  spatially partitioned step.

Example:
    >>> import tensorflow as tf

from tfmis.networks.devices import canonical_device
    >>> def chain(x):
    ...     y = x * 2.0  # 4 KiB, like x
    ...     return tf.reduce_sum(y)
    >>> graph = tf.function(chain).get_concrete_function(tf.TensorSpec([1024], tf.float32)).graph
    >>> memory = placed_memory(graph)
    >>> memory["/CPU:0"].peak_bytes  # while the product runs: x, y and the constant 2.0 (4 bytes)
    8196
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import tensorflow as tf

from tfmis.networks.devices import canonical_device

# ops whose output is a view of their input's buffer (no new allocation): its lifetime extends the input's
ALIAS_OPS = frozenset(
    {"Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient", "Snapshot", "EnsureShape",
     "PreventGradient", "Bitcast", "CheckNumerics"}
)  # fmt: skip
# ops that read only their input's shape: with a fully defined static shape Grappler's constant folding makes them
# constants, so they neither keep the input alive nor need it on their device
SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank", "ZerosLike", "OnesLike"})
# the value of a resource variable: TensorFlow hands out the variable's own buffer (counted by `parameter_bytes`)
VARIABLE_READS = frozenset({"ReadVariableOp"})
# the name scopes GradientTape and tf.gradients give the ops of the backward pass
BACKWARD_SCOPES = ("gradient_tape", "gradients")


@dataclasses.dataclass
class Transfer:
    """One tensor copied to another device (TensorFlow's Send/Recv pair of one graph edge).

    Attributes:
        tensor: the source tensor's name.
        source, destination: canonical devices ("/CPU:0").
        bytes: its size.
        backward: its first consumer on the destination belongs to the backward pass (`BACKWARD_SCOPES`).
        variable: it is a variable's value (a ReadVariableOp output).
        consumer: the name of its first consumer on the destination.
    """

    tensor: str
    source: str
    destination: str
    bytes: int
    backward: bool
    variable: bool
    consumer: str = ""


@dataclasses.dataclass
class DeviceMemory:
    """What one device holds during the graph (see `placed_memory`).

    Attributes:
        device: canonical device name ("/CPU:1").
        peak_bytes: the largest sum of live tensor bytes at one op (its inputs, outputs and everything still
            needed later), copies received from other devices included.
        tensor_bytes: the bytes of every tensor allocated on the device (each buffer once; copies included).
        transfer_in_bytes / transfer_out_bytes: bytes received from / sent to other devices.
        peak_op: the op running at the peak; peak_step: its index in `graph.get_operations()`.
        peak_breakdown: bytes live at the peak made by forward ops, by backward ops (`BACKWARD_SCOPES`), and
            received copies.
        peak_tensors: the largest buffers live at the peak, (tensor name, bytes), largest first.
        transfers_in: every copy received.
        unknown_shape_tensors: outputs placed here whose static shape is not fully defined (not counted).
    """

    device: str
    peak_bytes: int = 0
    tensor_bytes: int = 0
    transfer_in_bytes: int = 0
    transfer_out_bytes: int = 0
    peak_op: str = ""
    peak_step: int = -1
    peak_breakdown: dict = dataclasses.field(default_factory=lambda: {"forward": 0, "backward": 0, "copies": 0})
    peak_tensors: list = dataclasses.field(default_factory=list)
    transfers_in: list = dataclasses.field(default_factory=list)
    unknown_shape_tensors: int = 0


def _tensor_bytes(tensor) -> int | None:
    """Bytes of a tensor with a fully defined static shape; 0 for resource/variant/string handles; None if unknown."""
    dtype = tensor.dtype
    if dtype in (tf.resource, tf.variant, tf.string):
        return 0
    if not tensor.shape.is_fully_defined():
        return None
    return int(tensor.shape.num_elements()) * dtype.size


def _is_backward(op, scopes: Sequence[str]) -> bool:
    return any(part in scopes for part in op.name.split("/"))


class _Buffer:
    __slots__ = ("name", "device", "bytes", "start", "end", "kind")

    def __init__(self, name: str, device: str, nbytes: int, start: int, kind: str):
        self.name, self.device, self.bytes, self.start, self.end, self.kind = name, device, nbytes, start, start, kind


def op_devices(graph, default: str) -> dict:
    """The device each op runs on, as TensorFlow's placer decides for a graph traced with `tf.device` scopes:
    - an op reading a resource (a variable) is colocated with it (the captured handle's device);
    - an op with an explicit device runs there; one without a device but with a colocation constraint
      (`_class: loc:@other`, as `tf.gradients` gives the backward ops) runs with that op;
    - any other op runs on `default` (the placer's default device). So the backward ops `tape.gradient` makes
      outside every `tf.device` scope all run there (TensorFlow 2.21's placement log shows it; the known
      behaviour of tensorflow/tensorflow#54460), whereas `tf.gradients` colocates each with its forward op;
    - an op without inputs or device whose consumers all run on one device is placed with them (the placer's
      "generator" heuristic: the constants an op reads are made where it runs).
    """
    resource_device = {}
    for external, internal in getattr(graph, "captures", ()):
        if internal.dtype == tf.resource and getattr(external, "device", ""):
            resource_device[internal.name] = canonical_device(external.device, default)
    devices, by_name = {}, {}
    for op in graph.get_operations():
        placed = next((resource_device[t.name] for t in op.inputs if t.name in resource_device), None)
        if placed is None and not op.device:
            for group in _colocation_groups(op):
                other = by_name.get(group)
                if other is not None and other is not op:
                    placed = devices[other]
                    break
        devices[op] = placed or canonical_device(op.device, default)
        by_name[op.name] = op
    for op in graph.get_operations():
        if op.inputs or op.device or op.type == "Placeholder" or _colocation_groups(op):
            continue
        consumers = {devices[c] for out in op.outputs for c in out.consumers()}
        if len(consumers) == 1:
            devices[op] = consumers.pop()
    return devices


def _colocation_groups(op) -> list[str]:
    """The names of the ops `op` must be colocated with (its `_class: loc:@name` attribute), itself excluded."""
    try:
        groups = op.colocation_groups()
    except (ValueError, AttributeError):
        return []
    names = [g.decode() if isinstance(g, bytes) else str(g) for g in groups]
    return [n[len("loc:@") :] for n in names if n.startswith("loc:@") and n[len("loc:@") :] != op.name]


def placed_memory(
    graph,
    default_device: str = "/CPU:0",
    keep_outputs: bool = True,
    backward_scopes: Sequence[str] = BACKWARD_SCOPES,
    top: int = 8,
) -> dict[str, DeviceMemory]:
    """Memory per device of a traced graph (e.g. a training step's concrete function: forward + `tape.gradient`),
    simulated from its tensors in the graph's operation order.

    What is counted: every op of the top-level graph runs once, in `graph.get_operations()` order (the order the
    ops were made in: a topological order), on the device TensorFlow's placer gives it (`op_devices`: its
    `tf.device`, its variable's device, its colocation; ops without any go to `default_device`, which is where
    `tape.gradient`'s backward ops run). Each output with a fully defined static shape is allocated on the op's
    device when the op runs, and freed after its last consumer on that device has run (graph outputs, with
    `keep_outputs`, live to the end: the caller holds them); an output nobody consumes lives only while its op
    runs. A tensor consumed on another device also occupies a copy there from its first to its last consumer on
    that device: a transfer of its bytes from the producer's device to that device (once per tensor and
    destination), and the producer keeps the tensor until the copy is made. Ops that read only a static shape
    (`SHAPE_OPS`: Shape, ShapeN, Size, Rank, ZerosLike, OnesLike) are not consumers: Grappler folds them into
    constants. Identity-like ops (`ALIAS_OPS`: Identity, Reshape, ExpandDims, ...) allocate nothing: their output
    shares the input's buffer. A variable's value (ReadVariableOp) is the variable's own buffer on the variable's
    device (counted by `parameter_bytes`, not here), but a copy on any other device that reads it is counted
    there, as a transfer.

    The result is an estimate of the allocator's peak for this order of the ops. TensorFlow's executor runs
    ready ops in its own order (in parallel, so more may be live at once; or later, so less), Grappler rewrites
    the graph first (fusing ops, removing some, rewriting layouts), kernels forward an input's buffer to their
    output in place, and kernels allocate scratch space (e.g. convolution workspaces) that no tensor shows.

    Ignored: resource, variant and string tensors, so the captured variables' placeholders and the variables
    themselves (see `parameter_bytes`); tensors whose static shape is not fully defined (counted in
    `unknown_shape_tensors`); control edges; and the bodies of functional control flow and function-call ops
    (While, If, PartitionedCall): such an op's outputs are counted as those of any op, its internal tensors are
    not.

    Args:
        graph: a `tf.Graph` (a ConcreteFunction's `.graph`).
        default_device: where ops without a device run (TensorFlow's default: the first GPU, else /CPU:0).
        keep_outputs: graph outputs (`graph.outputs`) stay live until the last op.
        backward_scopes: the name scopes that mark the backward pass's ops (for `Transfer.backward` and
            `DeviceMemory.peak_breakdown`).
        top: how many of the largest buffers live at each device's peak `peak_tensors` lists.

    Returns:
        {canonical device: DeviceMemory}, one entry per device that runs an op.
    """
    default_device = canonical_device(default_device)
    ops = graph.get_operations()
    run = _PlacedRun(op_devices(graph, default_device), backward_scopes)
    for step, op in enumerate(ops):
        run.receive_inputs(step, op)
        run.allocate_outputs(step, op)
    if keep_outputs:
        run.keep_until(graph.outputs, len(ops) - 1)
    for entry in run.memory.values():
        _find_peak(entry, run.buffers, ops, top)
    return run.memory


class _PlacedRun:
    """The buffers of a graph's ops run one after another (`placed_memory`): what each device allocates, the copies
    it receives, and how long each buffer lives (its first and last step).

    Attributes:
        memory: {device: DeviceMemory}, in the order the devices are first met (a transfer's source included).
        buffers: every buffer allocated, in order.
        located: (tensor name, device) -> the buffer holding the tensor there.
        home: tensor name -> (its device, its bytes, is a variable's value).
    """

    def __init__(self, devices: dict, backward_scopes: Sequence[str]):
        self.devices, self.backward_scopes = devices, backward_scopes
        self.memory: dict[str, DeviceMemory] = {}
        self.buffers: list[_Buffer] = []
        self.located: dict[tuple[str, str], _Buffer] = {}
        self.home: dict[str, tuple[str, int, bool]] = {}

    def device_memory(self, device: str) -> DeviceMemory:
        """The device's entry, made when first asked for."""
        if device not in self.memory:
            self.memory[device] = DeviceMemory(device)
        return self.memory[device]

    def receive_inputs(self, step: int, op) -> None:
        """`op`'s inputs stay live until it runs; an input made on another device arrives as a copy (a transfer) at
        its first consumer here, and its producer holds it until it is sent. Static-shape reads are not uses."""
        device = self.devices[op]
        entry = self.device_memory(device)
        backward = _is_backward(op, self.backward_scopes)
        for tensor in op.inputs:
            if tensor.name not in self.home or (op.type in SHAPE_OPS and tensor.shape.is_fully_defined()):
                continue
            source, nbytes, variable = self.home[tensor.name]
            buffer = self.located.get((tensor.name, device))
            if buffer is None:  # first consumer on another device: a copy arrives here
                buffer = _Buffer(tensor.name, device, nbytes, step, "copies")
                self.buffers.append(buffer)
                self.located[tensor.name, device] = buffer
                transfer = Transfer(tensor.name, source, device, nbytes, backward, variable, op.name)
                entry.transfers_in.append(transfer)
                entry.transfer_in_bytes += nbytes
                self.device_memory(source).transfer_out_bytes += nbytes
                origin = self.located.get((tensor.name, source))
                if origin is not None:  # the producer holds it until it is sent
                    origin.end = max(origin.end, step)
            buffer.end = max(buffer.end, step)

    def allocate_outputs(self, step: int, op) -> None:
        """`op`'s outputs with a static shape get a buffer on its device (an alias op's share its input's; a
        variable read's is the variable's own, 0 bytes here); the others are counted as unknown."""
        device = self.devices[op]
        entry = self.device_memory(device)
        backward = _is_backward(op, self.backward_scopes)
        alias = op.type in ALIAS_OPS
        for index, tensor in enumerate(op.outputs):
            nbytes = _tensor_bytes(tensor)
            if nbytes is None:
                entry.unknown_shape_tensors += 1
                continue
            if nbytes == 0 and tensor.dtype in (tf.resource, tf.variant, tf.string):
                continue
            variable = op.type in VARIABLE_READS
            source = op.inputs[0 if op.type != "IdentityN" else index] if alias and op.inputs else None
            shared = self.located.get((source.name, device)) if source is not None else None
            if shared is not None:
                variable = self.home[source.name][2]
                buffer = shared
            else:
                kind = "backward" if backward else "forward"
                buffer = _Buffer(tensor.name, device, 0 if variable else nbytes, step, kind)
                self.buffers.append(buffer)
            self.located[tensor.name, device] = buffer
            self.home[tensor.name] = (device, nbytes, variable)

    def keep_until(self, tensors, last_step: int) -> None:
        """The buffers of `tensors` (the graph's outputs: the caller holds them) live until `last_step`."""
        for tensor in tensors:
            source = self.home.get(tensor.name)
            if source is not None:
                self.located[tensor.name, source[0]].end = last_step


def _find_peak(entry: DeviceMemory, buffers: list[_Buffer], ops, top: int) -> None:
    """Sets `entry`'s tensor bytes and its peak (bytes, step, op, breakdown, largest `top` buffers) from the live
    bytes per step of its device's buffers: +bytes at a buffer's start, -bytes after its end."""
    own = [b for b in buffers if b.device == entry.device and b.bytes]
    entry.tensor_bytes = sum(b.bytes for b in own)
    delta = [0] * (len(ops) + 1)
    for b in own:
        delta[b.start] += b.bytes
        delta[b.end + 1] -= b.bytes
    live, peak, peak_step = 0, 0, -1
    for step in range(len(ops)):
        live += delta[step]
        if live > peak:
            peak, peak_step = live, step
    entry.peak_bytes, entry.peak_step = peak, peak_step
    if peak_step >= 0:
        entry.peak_op = ops[peak_step].name
        at_peak = sorted((b for b in own if b.start <= peak_step <= b.end), key=lambda b: -b.bytes)
        for b in at_peak:
            entry.peak_breakdown[b.kind] += b.bytes
        entry.peak_tensors = [(b.name, b.bytes) for b in at_peak[:top]]


def parameter_bytes(variables: Sequence, optimizer_slots: int = 2, gradients: bool = True) -> int:
    """Bytes of the trainable `variables` as float32 weights, plus (with `gradients`) one float32 gradient each,
    plus `optimizer_slots` float32 slots each (Adam's first and second moments: 2; SGD with momentum: 1). Mixed
    precision keeps float32 weights, gradients and slots, so the count is the same.

    Example:
        >>> import keras
        >>> parameter_bytes([keras.Variable(keras.ops.zeros((10, 10)))])  # 100 weights x 4 bytes x (1 + 1 + 2)
        1600
    """
    count = sum(math.prod(int(d) for d in v.shape) for v in variables)
    return count * 4 * (1 + int(bool(gradients)) + int(optimizer_slots))


GRADIENTS = ("tape", "colocated")


def step_graph(
    training_model,
    loss_fn: Callable,
    batch: int,
    patch: Sequence[int],
    in_channels: int,
    parallel=None,
    gradients: str = "tape",
    label_dtype=tf.int32,
):
    """The graph of one training step, traced with static shapes and never run: the loss and its gradient with
    respect to the model's trainable variables, which the graph returns.

    Args:
        training_model: the Keras model the optimizer trains (with deep supervision: `build_for_training()[1]`).
        loss_fn: `loss_fn(labels, outputs)`, e.g. a `DeepSupervisionLoss`.
        batch, patch, in_channels: the images' static shape (batch, *patch, in_channels); labels (batch, *patch).
        parallel: None for one device (`loss_fn(labels, training_model(images, training=True))`), or a
            `tfmis.networks.parallel.ModelParallel` over `training_model` (`parallel.loss(loss_fn, labels,
            images)`).
        gradients: "tape": `tf.GradientTape().gradient` outside every `tf.device` scope
            (its backward ops get no device, so TensorFlow runs them all on the default device); "colocated":
            `tf.gradients`, which in TensorFlow 2 colocates each backward op with its forward op (the same
            values; the backward pass of each slab or stage on its own device: the trainer's way).
        label_dtype: the labels' dtype.

    Returns:
        the `tf.Graph` of the step's concrete function (for `placed_memory`).
    """
    if gradients not in GRADIENTS:
        raise ValueError(f"gradients must be one of {GRADIENTS}, got {gradients!r}")
    variables = training_model.trainable_variables

    def loss_of(images, labels):
        if parallel is None:
            return loss_fn(labels, training_model(images, training=True))
        return parallel.loss(loss_fn, labels, images, training=True)

    def step(images, labels):
        if gradients == "colocated":
            loss = loss_of(images, labels)
            return loss, tf.gradients(loss, [getattr(v, "value", v) for v in variables])
        with tf.GradientTape() as tape:
            loss = loss_of(images, labels)
        return loss, tape.gradient(loss, variables)

    specs = (
        tf.TensorSpec((batch, *patch, in_channels), tf.float32),
        tf.TensorSpec((batch, *patch), label_dtype),
    )
    return tf.function(step, autograph=False).get_concrete_function(*specs).graph


def summary(memory: dict[str, DeviceMemory]) -> dict:
    """The largest peak over devices and the transfers of a `placed_memory` result, in bytes: {"peak_bytes",
    "peak_device", "transfer_bytes" (all copies), "forward_transfer_bytes", "backward_transfer_bytes",
    "variable_transfer_bytes" (variables' values, also in the forward or backward figure),
    "busiest_link_bytes" (the largest of any device's bytes in and bytes out)}."""
    transfers = [t for entry in memory.values() for t in entry.transfers_in]
    peak = max(memory.values(), key=lambda entry: entry.peak_bytes)
    return {
        "peak_bytes": peak.peak_bytes,
        "peak_device": peak.device,
        "transfer_bytes": sum(t.bytes for t in transfers),
        "forward_transfer_bytes": sum(t.bytes for t in transfers if not t.backward),
        "backward_transfer_bytes": sum(t.bytes for t in transfers if t.backward),
        "variable_transfer_bytes": sum(t.bytes for t in transfers if t.variable),
        "busiest_link_bytes": max(max(e.transfer_in_bytes, e.transfer_out_bytes) for e in memory.values()),
    }


def _one_axis_slice(whole, part) -> bool:
    """`part` is `whole` cut along exactly one axis (both 5-D with static shapes): a slab's rows, not a statistic."""
    a, b = whole.shape, part.shape
    if a.rank != 5 or b.rank != 5 or not (a.is_fully_defined() and b.is_fully_defined()):
        return False
    return sum(x != y for x, y in zip(a.as_list(), b.as_list())) == 1


def spatial_halo(graph, memory: dict[str, DeviceMemory]) -> dict:
    """The halo exchange of a spatially partitioned step (`ModelParallel(mode="spatial")`) among its transfers, in
    bytes: {"forward", "backward", "busiest_device"}.

    Forward: the rows a neighbour slices from its own slab on its own device and sends (`Slabs.gather_range`: a
    StridedSlice cutting one axis of a 5-D tensor, whose output crosses devices); slices of the graph's inputs
    (the batch cut into slabs: of a Placeholder or its Split) are not halos. Backward: those rows' gradients sent
    back (a transfer whose first consumer is the StridedSliceGrad of such a slice); with `tape.gradient` the
    backward pass runs on one device and sends none, and rows of the image need no gradient. busiest_device: the
    largest halo bytes one device sends or receives (an inner slab has two neighbours). Not counted: a
    neighbour's whole slab, sent unsliced when a halo spans it (slabs thinner than the halo).
    """
    sent: dict[str, int] = {}
    received: dict[str, int] = {}
    totals = {"forward": 0, "backward": 0}
    for entry in memory.values():
        for t in entry.transfers_in:
            source = graph.get_operation_by_name(t.tensor.rsplit(":", 1)[0])
            consumer = graph.get_operation_by_name(t.consumer)
            if (
                not t.backward
                and source.type == "StridedSlice"
                and source.inputs[0].op.type not in ("Placeholder", "Split", "SplitV")
                and _one_axis_slice(source.inputs[0], source.outputs[0])
            ):
                kind = "forward"
            elif (
                t.backward
                and consumer.type == "StridedSliceGrad"
                and _one_axis_slice(consumer.outputs[0], consumer.inputs[4])
            ):
                kind = "backward"
            else:
                continue
            totals[kind] += t.bytes
            sent[t.source] = sent.get(t.source, 0) + t.bytes
            received[t.destination] = received.get(t.destination, 0) + t.bytes
    busiest = max([*sent.values(), *received.values(), 0])
    return {**totals, "busiest_device": busiest}
