"""Inference engines for exported networks: each gives a window function, numpy windows in, numpy logits out.

`load_network(engine, path)` returns a callable `f(windows) -> logits`: `windows` (n, X, Y, Z, C) float32, `logits`
(n, X, Y, Z, K) float32, the network's raw output (`tfmis.inference.manifest`). The sliding window, blending,
test-time augmentation, ensembling and postprocessing around it are tfmis's own
(`tfmis.inference.deployed.ExportedPredictor`), the same for every engine:

- `tensorflow`: the SavedModel's `serving_default` signature (`tf.saved_model.load`);
- `onnxruntime`: the ONNX file in an `InferenceSession` on the CPU;
- `openvino`: the OpenVINO IR compiled for the CPU.

Each engine uses the cores this process may use (`tfmis.hardware.usable_cpu_count`). `precision` is `float32` (the
default, for every engine) or `bfloat16`: OpenVINO's `INFERENCE_PRECISION_HINT` bf16, or TensorFlow's oneDNN
auto-mixed-precision rewrite (both need a CPU with AVX-512 BF16 or AMX to be fast); onnxruntime's CPU provider runs
float32 only. OpenVINO's CPU plugin would choose bf16 by itself on such a CPU: float32 is asked for explicitly.

An engine whose package is not installed is one `UsageError` line naming the extra to install (exit 2).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tfmis.errors import UsageError
from tfmis.hardware import usable_cpu_count
from tfmis.inference.manifest import INPUT_NAME, OUTPUT_NAME

ENGINES = ("tensorflow", "onnxruntime", "openvino")
PRECISIONS = ("float32", "bfloat16")
DEPLOY_EXTRA = 'pip install "tfmis[deploy]"'


def require_engine(engine: str):
    """The engine's Python module; a `UsageError` naming the package and the extra when it is not installed."""
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine}: expected one of {', '.join(ENGINES)}")
    try:
        return importlib.import_module(engine)
    except ImportError as e:
        raise UsageError(
            f"--engine {engine}: the Python package {engine} is not installed ({e}); install it with {DEPLOY_EXTRA}"
        ) from None


def check_precision(engine: str, precision: str) -> str:
    """`precision` if `engine` can run it: float32 for all, bfloat16 for tensorflow and openvino."""
    if precision not in PRECISIONS:
        raise UsageError(f"--precision {precision}: expected one of {', '.join(PRECISIONS)}")
    if precision == "bfloat16" and engine == "onnxruntime":
        raise UsageError(
            "--precision bfloat16: onnxruntime's CPU provider runs float32 only; use --engine openvino or tensorflow "
            "for bfloat16, or --precision float32"
        )
    return precision


def load_network(engine: str, path: str | Path, precision: str = "float32") -> Callable[[np.ndarray], np.ndarray]:
    """The window function of the exported network at `path` (a SavedModel folder, an .onnx file or an OpenVINO
    .xml) run by `engine`: (n, X, Y, Z, C) float32 windows to (n, X, Y, Z, K) float32 logits."""
    require_engine(engine)
    check_precision(engine, precision)
    loader = {"tensorflow": _tensorflow, "onnxruntime": _onnxruntime, "openvino": _openvino}[engine]
    return loader(str(path), precision, usable_cpu_count())


def _tensorflow(path: str, precision: str, threads: int):
    import tensorflow as tf

    if precision == "bfloat16":  # oneDNN's graph rewrite of float32 ops to bfloat16 (a process-wide setting)
        tf.config.optimizer.set_experimental_options({"auto_mixed_precision_onednn_bfloat16": True})
    loaded = tf.saved_model.load(path)
    signature = loaded.signatures["serving_default"]

    def run(windows: np.ndarray) -> np.ndarray:
        outputs = signature(**{INPUT_NAME: tf.convert_to_tensor(np.asarray(windows, np.float32))})
        return outputs[OUTPUT_NAME].numpy()

    run.keep = loaded  # the signature's variables live as long as the loaded object
    return run


def _onnxruntime(path: str, precision: str, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # no busy-waiting between ops: on a shared or busy CPU the spinning threads took the cores from the work
    # (the demo network's window batch took 0.22-0.31 s spinning, 0.11-0.12 s without)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    def run(windows: np.ndarray) -> np.ndarray:
        return session.run([OUTPUT_NAME], {INPUT_NAME: np.ascontiguousarray(windows, np.float32)})[0]

    return run


def _openvino(path: str, precision: str, threads: int):
    """One compiled model per window-batch size, each with static shapes (the CPU plugin's dynamic-batch path was
    about 1.4 times slower on the demo network); the sliding window uses two sizes at most (full and last batch)."""
    import openvino as ov

    core = ov.Core()
    model = core.read_model(path)
    hint = {"float32": "f32", "bfloat16": "bf16"}[precision]
    settings = {"INFERENCE_PRECISION_HINT": hint, "INFERENCE_NUM_THREADS": threads}
    requests = {}

    def request_for(shape: tuple):
        if shape not in requests:
            static = model.clone()
            static.reshape({INPUT_NAME: list(shape)})
            compiled = core.compile_model(static, "CPU", settings)
            requests[shape] = (compiled.create_infer_request(), compiled.output(OUTPUT_NAME))
        return requests[shape]

    def run(windows: np.ndarray) -> np.ndarray:
        windows = np.ascontiguousarray(windows, np.float32)
        request, output = request_for(windows.shape)
        result = request.infer({INPUT_NAME: windows})
        return np.array(result[output], np.float32)  # a copy: the request reuses its output buffer

    return run
