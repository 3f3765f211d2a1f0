"""Out of memory: how TensorFlow, numpy, cuDNN/cuBLAS and the CUDA driver say it, in one place.

Used by the sliding-window placement policy (fallback on OOM) and by the GPU-fit trials (a failed
trial's reason). No TensorFlow import here: the GPU-fit trial child imports this before it
configures its GPU.
"""

from __future__ import annotations

import re
import sys

# Messages of out-of-memory failures that do not arrive as ResourceExhaustedError: cuDNN/cuBLAS
# cannot create their handles or workspaces when the GPU is full, a host-to-device copy into an
# allocation that failed ("Dst tensor is not initialized"), XLA's and the CUDA driver's own words.
OOM_SIGNATURES = (
    "OOM when allocating",
    "failed to allocate",
    "Dst tensor is not initialized",
    "CUDNN_STATUS_NOT_INITIALIZED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUBLAS_STATUS_NOT_INITIALIZED",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDA_ERROR_OUT_OF_MEMORY",
    "Out of memory while trying to allocate",
)


def is_out_of_memory(error: BaseException | str) -> bool:
    """True if an exception (or an error message) means the device or the host ran out of memory.

    Recognised: `tf.errors.ResourceExhaustedError`, `MemoryError`, and messages naming an allocation
    failure (`OOM_SIGNATURES`: "OOM when allocating", "failed to allocate", "Dst tensor is not
    initialized", CUDNN/CUBLAS_STATUS_NOT_INITIALIZED or _ALLOC_FAILED, ...). The exception's cause
    and context are checked too (an error raised while handling an OOM is still an OOM).

    Args:
        error: an exception, or the text of an error message or log line.

    Example:
        >>> is_out_of_memory("Could not create cudnn handle: CUDNN_STATUS_NOT_INITIALIZED")
        True
        >>> is_out_of_memory(ValueError("patch size (50, 50, 50) does not fit strides"))
        False
    """
    if isinstance(error, str):
        return has_oom_signature(error)
    tf = sys.modules.get("tensorflow")  # a TensorFlow error implies TensorFlow is imported
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, MemoryError) or (tf is not None and isinstance(error, tf.errors.ResourceExhaustedError)):
            return True
        if has_oom_signature(str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False


def has_oom_signature(message: str) -> bool:
    lowered = message.lower()
    return any(signature.lower() in lowered for signature in OOM_SIGNATURES)


def error_line(message: str, limit: int = 400) -> str:
    """The informative line of a (TensorFlow) error message, for a one-line reason.

    TensorFlow wraps the actual error in "Graph execution error:", a "Detected at node" traceback
    and hints; this keeps the line naming the failure (an allocation failure first, else a line
    like "ValueError: ...", else the first other line).

    Example:
        >>> error_line('Graph execution error:\\n\\nDetected at node ones defined at (most recent call last):\\n'
        ...            '  File "x.py", line 3, in f\\n\\nOOM when allocating tensor with shape[512]\\n'
        ...            '\\t [[{{node ones}}]]')
        'OOM when allocating tensor with shape[512]'
    """
    kept = []
    code_indent = None  # inside a traceback entry: its source lines are indented deeper than "File"
    for raw in message.splitlines():
        line = raw.strip()
        indent = len(raw) - len(raw.lstrip())
        if not line:
            continue
        if line.startswith('File "'):
            code_indent = indent
            continue
        if code_indent is not None and indent > code_indent:
            continue
        code_indent = None
        if line in ("Graph execution error:", "in user code:") or line.startswith(
            ("Detected at node", "Hint:", "[[{{node", "[Op:", "Traceback (most recent call last)")
        ):
            continue
        line = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", line)
        line = re.sub(r"\s*\[Op:[^\]]*\](\s*name:.*)?$", "", line)
        if line:
            kept.append(line)
    chosen = (
        next((line for line in kept if has_oom_signature(line)), None)
        or next((line for line in kept if re.match(r"^[\w.]*(Error|Exception)\b[^:]*:", line)), None)
        or (kept[0] if kept else message.strip() or "(no message)")
    )
    return chosen if len(chosen) <= limit else chosen[: limit - 3] + "..."
