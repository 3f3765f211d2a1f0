#!/usr/bin/env bash
# Builds a virtual environment for tfmis with Horovod (runtime.distribution: horovod).
#
# Usage:
#   tools/install_horovod.sh [VENV_DIR] [--gpu] [--cache]
#
#   VENV_DIR  where the environment goes (default: .venv-horovod, relative to the current directory)
#   --gpu     tensorflow[and-cuda]==2.16.2 and Horovod with NCCL (HOROVOD_GPU_OPERATIONS=NCCL);
#             default: tensorflow-cpu==2.16.2 (never downloads CUDA wheels).
#   --cache   build (or reuse) the environment in a cache outside the checkout, one folder per set of
#             versions (Python, TensorFlow, Keras, Horovod, MPI, CPU/GPU) under
#             ${TFMIS_CACHE_DIR:-~/.cache/tfmis}/horovod-<key>, and make VENV_DIR a symbolic link to it:
#             a new clone on the same machine reuses a finished build (CI: .ci/run). A lock keeps two
#             builds of one key apart.
#
# Controllers: Horovod is always built with Gloo (horovodrun --gloo), and also with MPI
# (HOROVOD_WITH_MPI=1: `mpirun -np N python -m tfmis.train ...` and `horovodrun --mpi`) when an MPI
# compiler wrapper (mpicxx or mpicc) is on PATH; without one it says how to get MPI (Debian/Ubuntu:
# apt-get install openmpi-bin libopenmpi-dev) and builds Gloo only. An environment built without MPI
# is rebuilt when MPI has appeared since.
#
# Why a separate environment: Horovod 0.28.1 (its last release) does not build against TensorFlow
# 2.17+, so this environment holds TensorFlow 2.16.2, a Keras 3 that works with it, Horovod 0.28.1
# built from source with TensorFlow + Gloo (+ MPI when present; no PyTorch, no MXNet), and tfmis itself (editable,
# with its `dev` extra; NOT the `cpu`/`gpu` extras, which would pull the newest TensorFlow).
#
# Needs: python3 3.10-3.12 (TensorFlow 2.16 has no wheels for 3.13), cmake >= 3.13, g++ with C++17.
# With --gpu also: the CUDA toolkit (nvcc) on PATH and NCCL; point Horovod at NCCL with
# HOROVOD_NCCL_HOME (or HOROVOD_NCCL_INCLUDE + HOROVOD_NCCL_LIB) if it is not in a system path.
# Other HOROVOD_* variables already set (HOROVOD_NCCL_HOME, HOROVOD_CUDA_HOME, ...) reach the build.
#
# Idempotent: each step is skipped when its result is already there (a rerun takes about 25 s, most of it
# horovodrun --check-build). The environment gets a .gitignore of its own (`*`).
# Set PYTHON to choose the interpreter that creates the environment (default: python3).
#
# Example:
#   tools/install_horovod.sh                      # CPU / loopback, .venv-horovod
#   tools/install_horovod.sh /opt/venvs/tfmis-hvd --gpu
#   .venv-horovod/bin/horovodrun -np 2 -H localhost:2 --gloo \
#       .venv-horovod/bin/python -m tfmis.train --config configs/demo.yaml --set runtime.distribution=horovod
set -euo pipefail

TF_VERSION=2.16.2
HOROVOD_VERSION=0.28.1
# A Keras 3 release that works with TensorFlow 2.16 (checked: tests/test_horovod.py, tfmis.train runs).
KERAS_SPEC="keras==3.15.1"

VENV_DIR=".venv-horovod"
GPU=0
CACHE=0
for arg in "$@"; do
    case "$arg" in
        --gpu) GPU=1 ;;
        --cache) CACHE=1 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) echo "install_horovod.sh: unknown option $arg (usage: tools/install_horovod.sh [VENV_DIR] [--gpu] [--cache])" >&2; exit 2 ;;
        *) VENV_DIR="$arg" ;;
    esac
done

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
START=$SECONDS
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"  # TensorFlow's start-up log lines hide the results
step() { printf '\n[install_horovod %3ds] %s\n' "$((SECONDS - START))" "$*"; }
die() { echo "install_horovod.sh: error: $*" >&2; exit 1; }

# ---- prerequisites: clear messages before anything is downloaded --------------------------------
command -v "$PYTHON" >/dev/null || die "$PYTHON not found; set PYTHON=/path/to/python3.11 (3.10-3.12)"
"$PYTHON" - <<'EOF' || die "tfmis needs Python >= 3.10 and TensorFlow 2.16 has wheels up to 3.12; set PYTHON=/path/to/python3.11"
import sys
sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 12) else 1)
EOF
command -v cmake >/dev/null || die "cmake not found: Horovod is compiled from source and needs cmake >= 3.13 (apt-get install cmake, or pip install cmake, or 'module load cmake' on a cluster)"
command -v g++ >/dev/null || die "g++ not found: Horovod is compiled from source and needs a C++17 compiler (apt-get install g++, or 'module load gcc' on a cluster)"
if [ "$GPU" = 1 ]; then
    command -v nvcc >/dev/null || die "--gpu: nvcc not found: building Horovod with NCCL needs the CUDA toolkit on PATH ('module load cuda' on a cluster)"
fi

# MPI: built in when an MPI compiler wrapper is there (Horovod's CMake finds MPI through it)
if command -v mpicxx >/dev/null || command -v mpicc >/dev/null; then
    MPI=1
    MPI_NOTE="MPI $(mpirun --version 2>/dev/null | head -1 || echo '(mpirun not found)') via $(command -v mpicxx || command -v mpicc)"
else
    MPI=0
    MPI_NOTE="no MPI compiler wrapper (mpicxx/mpicc) on PATH: Horovod gets Gloo only (horovodrun --gloo); for mpirun and horovodrun --mpi install MPI first (Debian/Ubuntu: apt-get install openmpi-bin libopenmpi-dev; a cluster: 'module load openmpi') and rerun this script"
fi

# ---- 0. --cache: the environment lives in a cache keyed by its versions, VENV_DIR links to it -------
if [ "$CACHE" = 1 ]; then
    PY_TAG=$("$PYTHON" -c 'import sys; print(f"py{sys.version_info[0]}.{sys.version_info[1]}")')
    MPI_TAG=$([ "$MPI" = 1 ] && (mpirun --version 2>/dev/null | head -1 | tr -cs 'A-Za-z0-9.' '-' | sed 's/-*$//') || echo nompi)
    KEY="$PY_TAG-tf$TF_VERSION-${KERAS_SPEC#keras==}-hvd$HOROVOD_VERSION-$([ "$GPU" = 1 ] && echo gpu || echo cpu)-${MPI_TAG:-mpi}"
    CACHE_ROOT="${TFMIS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tfmis}"
    CACHED="$CACHE_ROOT/horovod-$KEY"
    mkdir -p "$CACHE_ROOT"
    if [ -e "$VENV_DIR" ] && [ ! -L "$VENV_DIR" ]; then
        die "--cache: $VENV_DIR exists and is not a link to the cache; remove it or name another VENV_DIR"
    fi
    ln -sfn "$CACHED" "$VENV_DIR"
    step "cached environment $CACHED (key: $KEY)"
    exec 9>"$CACHED.lock"
    flock -w 3600 9 || die "--cache: another build of $CACHED holds $CACHED.lock for over an hour"
    VENV_DIR="$CACHED"
fi

# ---- 1. the virtual environment -------------------------------------------------------------------
if [ -x "$VENV_DIR/bin/python" ]; then
    step "virtual environment $VENV_DIR exists"
else
    step "creating virtual environment $VENV_DIR"
    "$PYTHON" -m venv "$VENV_DIR"
    "$VENV_DIR/bin/python" -m pip install -q --upgrade pip
fi
VENV_DIR="$(cd "$VENV_DIR" && pwd)"
# git ignores the environment even inside a checkout (as `python -m venv` does itself from Python 3.13)
[ -f "$VENV_DIR/.gitignore" ] || echo '*' > "$VENV_DIR/.gitignore"
PY="$VENV_DIR/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

if [ "$GPU" = 1 ]; then TF_SPEC="tensorflow[and-cuda]==$TF_VERSION"; TF_DIST=tensorflow; else TF_SPEC="tensorflow-cpu==$TF_VERSION"; TF_DIST=tensorflow-cpu; fi
# Every later install keeps TensorFlow (and the Keras that matches it) where they are.
CONSTRAINTS="$VENV_DIR/tfmis-horovod-constraints.txt"
printf '%s\n' "$TF_DIST==$TF_VERSION" "$KERAS_SPEC" "numpy<2" > "$CONSTRAINTS"

dist_version() { "$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1"; }

# ---- 2. TensorFlow 2.16 + Keras 3 -----------------------------------------------------------------
if [ "$(dist_version "$TF_DIST")" = "$TF_VERSION" ] && [ "$(dist_version keras)" = "${KERAS_SPEC#keras==}" ]; then
    step "$TF_DIST $TF_VERSION and $KERAS_SPEC already installed"
else
    # tensorflow and tensorflow-cpu both install the `tensorflow` module: never keep both
    OTHER_TF=$([ "$TF_DIST" = tensorflow ] && echo tensorflow-cpu || echo tensorflow)
    if [ -n "$(dist_version "$OTHER_TF")" ]; then
        step "removing $OTHER_TF (switching to $TF_DIST)"
        "${PIP[@]}" uninstall -y "$OTHER_TF"
    fi
    step "installing $TF_SPEC and $KERAS_SPEC"
    "${PIP[@]}" install "$TF_SPEC" "$KERAS_SPEC" -c "$CONSTRAINTS"
fi

# ---- 3. Horovod, compiled against that TensorFlow -------------------------------------------------
horovod_ok() {  # importing horovod.tensorflow fails when Horovod was built without TensorFlow ops
    "$PY" - "$GPU" "$MPI" <<'EOF' 2>/dev/null
import sys
import horovod.tensorflow as hvd
gpu, mpi = sys.argv[1] == "1", sys.argv[2] == "1"
sys.exit(0 if hvd.gloo_built() and (not gpu or hvd.nccl_built()) and (not mpi or hvd.mpi_built()) else 1)
EOF
}
CONTROLLERS="Gloo"
[ "$MPI" = 1 ] && CONTROLLERS="$CONTROLLERS + MPI"
[ "$GPU" = 1 ] && CONTROLLERS="$CONTROLLERS + NCCL"
step "controllers: $MPI_NOTE"
if [ "$(dist_version horovod)" = "$HOROVOD_VERSION" ] && horovod_ok; then
    step "horovod $HOROVOD_VERSION with TensorFlow ops and $CONTROLLERS already built"
else
    step "building horovod $HOROVOD_VERSION against TensorFlow $TF_VERSION with $CONTROLLERS (compiles C++: minutes)"
    # no build isolation: Horovod's build imports the TensorFlow installed above, so its own build
    # requirements must be in the environment first
    "${PIP[@]}" install -q "setuptools<70" wheel cffi cloudpickle psutil pyyaml packaging -c "$CONSTRAINTS"
    export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
    if [ "$MPI" = 1 ]; then
        export HOROVOD_WITH_MPI=1; unset HOROVOD_WITHOUT_MPI || true
    else
        export HOROVOD_WITHOUT_MPI=1; unset HOROVOD_WITH_MPI || true
    fi
    if [ "$GPU" = 1 ]; then export HOROVOD_GPU_OPERATIONS=NCCL; else unset HOROVOD_GPU_OPERATIONS || true; fi
    export MAKEFLAGS="${MAKEFLAGS:--j$(nproc 2>/dev/null || echo 2)}"
    # --no-cache-dir: never reuse a wheel cached from a build with other flags (CPU vs GPU)
    reinstall=()
    [ -n "$(dist_version horovod)" ] && reinstall=(--force-reinstall --no-deps)
    BUILD_LOG="$VENV_DIR/horovod-build.log"
    echo "  full build log: $BUILD_LOG"
    set +e
    "${PIP[@]}" install -v --no-build-isolation --no-cache-dir "${reinstall[@]}" \
        "horovod==$HOROVOD_VERSION" -c "$CONSTRAINTS" > "$BUILD_LOG" 2>&1 &
    pip_pid=$!
    while kill -0 "$pip_pid" 2>/dev/null; do  # progress: the last compile percentage every 30 s
        sleep 30
        pct=$(grep -oE '\[ *[0-9]+%\]' "$BUILD_LOG" | tail -1)
        printf '  [%3ds] compiling horovod %s\n' "$((SECONDS - START))" "${pct:-(configuring)}"
    done
    wait "$pip_pid"; rc=$?
    set -e
    if [ "$rc" != 0 ]; then
        tail -40 "$BUILD_LOG" >&2
        die "building horovod $HOROVOD_VERSION failed (pip exit $rc); full log: $BUILD_LOG"
    fi
    horovod_ok || die "horovod $HOROVOD_VERSION was not built with TensorFlow + $CONTROLLERS; rerun with 'pip install -v' output: $PY -m pip install -v --no-build-isolation --no-cache-dir --force-reinstall --no-deps horovod==$HOROVOD_VERSION"
fi

# ---- 4. tfmis itself (editable, dev extra; TensorFlow stays at 2.16) ------------------------------
# checked from / : in REPO_ROOT the interpreter would import ./tfmis through the current directory even when
# the environment's editable install points at another (perhaps deleted) clone that shared this cache
if (cd / && "$PY" - "$REPO_ROOT" <<'EOF' 2>/dev/null
import importlib.metadata as m, pathlib, sys
import pytest, tfmis  # noqa: F401
m.version("tfmis")
sys.exit(0 if pathlib.Path(tfmis.__file__).resolve().parent == pathlib.Path(sys.argv[1]) / "tfmis" else 1)
EOF
)
then
    step "tfmis (editable, $REPO_ROOT) already installed"
else
    step "installing tfmis (editable, dev extra) from $REPO_ROOT"
    "${PIP[@]}" install -e "$REPO_ROOT[dev]" -c "$CONSTRAINTS"
fi

# ---- 5. check -------------------------------------------------------------------------------------
step "versions"
"$PY" -c "import tensorflow as tf, keras, horovod; print(f'tensorflow {tf.__version__}, keras {keras.__version__}, horovod {horovod.__version__}')" 2>/dev/null
step "horovodrun --check-build"
"$VENV_DIR/bin/horovodrun" --check-build
echo "(check-build ticks PyTorch whenever the horovod.torch Python package imports; no PyTorch ops were built)"
step "done in $(( (SECONDS - START) / 60 )) min $(( (SECONDS - START) % 60 )) s; activate with: source $VENV_DIR/bin/activate"
