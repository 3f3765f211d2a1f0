"""Whether TensorFlow runs its oneDNN CPU kernels (`runtime.onednn`: auto, on, off), and why.

Decided before TensorFlow is imported (tfmis/__init__.py applies `auto`; a command applies the config's
`runtime.onednn` as soon as it has read it): TensorFlow reads TF_ENABLE_ONEDNN_OPTS once, at import."""

from __future__ import annotations

import dataclasses
import os
import sys

from tfmis.errors import ConfigError
from tfmis.hardware.cpu import cpu_isa

ONEDNN_ENV = "TF_ENABLE_ONEDNN_OPTS"
ONEDNN_SETTINGS = ("auto", "on", "off")
# the value tfmis itself put in TF_ENABLE_ONEDNN_OPTS: a child process (a launcher's worker, a test's subprocess)
# inherits both and decides again, while a value that differs from it was set by the user and is respected
_DECIDED_ENV = "TFMIS_ONEDNN_DECIDED"
# measured on the README's demo step (benchmarks/cpu_kinds.py; docs/benchmarks.md, "Per CPU kind")
ONEDNN_MEASURED = "oneDNN's 3D convolutions trained the demo 17-21x faster than Eigen's (docs/benchmarks.md)"


@dataclasses.dataclass(frozen=True)
class OneDNNChoice:
    """Whether TensorFlow's oneDNN CPU kernels are on, and why.

    Args:
        enabled: True/False, or None when TensorFlow's own default stands (a CPU kind not measured).
        setting: `runtime.onednn` (auto, on, off).
        reason: why, in words (the setting, the user's environment variable, or the measured rule).
        users_variable: the user's `TF_ENABLE_ONEDNN_OPTS` decided it (tfmis leaves the variable as it is).
    """

    enabled: bool | None
    setting: str
    reason: str
    users_variable: bool = False

    def describe(self) -> str:
        state = {True: "on", False: "off", None: "TensorFlow's default"}[self.enabled]
        return f"oneDNN {state} ({self.reason})"


def onednn_choice(setting: str = "auto", env=None, isa: tuple[str, ...] | None = None, machine: str | None = None):
    """The `OneDNNChoice` for `runtime.onednn` on this machine (pure: reads `env`, sets nothing).

    `on`/`off` are the config's word. `auto` respects a `TF_ENABLE_ONEDNN_OPTS` the user set; otherwise it
    turns oneDNN on where it was measured faster for 3D convolutions (x86-64 with AVX2 and FMA; TensorFlow
    itself turns it on only for AVX512_VNNI / AVX512_BF16 / AMX CPUs, and leaves AVX2-only CPUs such as AMD EPYC
    Zen 2/3 on its Eigen kernels, many times slower there: docs/benchmarks.md, "Per CPU kind") and leaves
    TensorFlow's default elsewhere (ARM, x86-64 without AVX2: not measured).

    Example:
        >>> onednn_choice("auto", env={}, isa=("avx", "avx2", "fma"), machine="x86_64").enabled
        True
        >>> onednn_choice("auto", env={"TF_ENABLE_ONEDNN_OPTS": "0"}, isa=("avx2", "fma"), machine="x86_64").enabled
        False
        >>> onednn_choice("auto", env={}, isa=("asimd",), machine="aarch64").enabled is None
        True
    """
    if setting not in ONEDNN_SETTINGS:
        raise ConfigError(f"runtime.onednn: {setting!r} is not one of {list(ONEDNN_SETTINGS)}")
    env = os.environ if env is None else env
    if setting != "auto":
        return OneDNNChoice(setting == "on", setting, f"runtime.onednn: {setting}")
    user = env.get(ONEDNN_ENV)
    if user is not None and user != env.get(_DECIDED_ENV):
        on = user.strip().lower() in ("1", "true", "yes", "on")
        return OneDNNChoice(on, setting, f"{ONEDNN_ENV}={user} in the environment", users_variable=True)
    isa = cpu_isa() if isa is None else isa
    if machine is None:
        import platform

        machine = platform.machine()
    if machine.lower() in ("x86_64", "amd64"):
        if "avx2" in isa and "fma" in isa:
            return OneDNNChoice(True, setting, f"x86-64 with AVX2 and FMA: {ONEDNN_MEASURED}")
        return OneDNNChoice(None, setting, "x86-64 without AVX2: not measured, TensorFlow decides")
    return OneDNNChoice(None, setting, f"{machine} CPU: not measured, TensorFlow decides")


_onednn: OneDNNChoice | None = None


def apply_onednn(setting: str = "auto") -> OneDNNChoice:
    """Decides oneDNN for this process (`onednn_choice`) and sets `TF_ENABLE_ONEDNN_OPTS` for TensorFlow.

    Must run before TensorFlow is imported (tfmis/__init__.py runs it with `auto`; a command again with its
    config's `runtime.onednn`). After TensorFlow's import the state cannot change: the returned choice then says
    what TensorFlow is running with and that it was imported first.
    """
    global _onednn
    choice = onednn_choice(setting)
    if "tensorflow" in sys.modules:
        running = onednn_running()
        if running is not None and choice.enabled not in (None, running):
            choice = OneDNNChoice(
                running,
                setting,
                f"TensorFlow was imported before tfmis could set {ONEDNN_ENV}; import tfmis first "
                f"(wanted {'on' if choice.enabled else 'off'}: {choice.reason})",
            )
    elif choice.enabled is not None and not choice.users_variable:
        value = "1" if choice.enabled else "0"
        os.environ[ONEDNN_ENV] = value
        os.environ[_DECIDED_ENV] = value
    _onednn = choice
    return choice


def onednn_running() -> bool | None:
    """Whether the imported TensorFlow runs its oneDNN kernels (None before TensorFlow's import or if unknown)."""
    if "tensorflow" not in sys.modules:
        return None
    try:
        from tensorflow.python.util import _pywrap_util_port

        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return None


def current_onednn() -> OneDNNChoice:
    """The choice `apply_onednn` made last in this process (made now with `auto` if none was)."""
    return _onednn or apply_onednn("auto")
