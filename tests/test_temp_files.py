"""One temp-file discipline (`tfmis.utils.io`): per-writer temporary names carrying host and pid, atomic writes
that leave no temporary when they fail, NIfTI saved through the same writer, and the removal of dead writers'
temporaries by the holder of a folder's lock (`tfmis.utils.lock.folder_lock`). Real files and processes."""

from __future__ import annotations

import errno
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from tfmis.utils.io import (
    TempName,
    atomic_path,
    atomic_save_nifti,
    host_name,
    parse_temp_name,
    temp_path,
)

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

# saves image K (a function of K) to `path` N times
NIFTI_WRITER = """
import sys
import nibabel as nib, numpy as np
from tfmis.utils.io import atomic_save_nifti
path, k, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = np.random.default_rng(k).integers(0, 200, (48, 48, 48), dtype=np.uint8)
img = nib.Nifti1Image(data, np.diag([1.0, 1.0, 2.0, 1.0]))
img.set_data_dtype(np.uint8)
for _ in range(n):
    atomic_save_nifti(img, path)
"""

# the rise of this process's peak RSS while a 64 MiB uint8 image is saved as .nii.gz, by atomic_save_nifti
# ("atomic") or by compressing the whole file in memory ("in-memory"), as a fraction of the data's size
SAVE_MEMORY = """
import gzip, sys
import nibabel as nib, numpy as np
from tfmis.hardware import peak_rss_mb, reset_peak_rss
from tfmis.utils.io import atomic_save_nifti
how, path = sys.argv[1], sys.argv[2]
data = np.ones((256, 256, 1024), np.uint8)
data[::7] = 3
img = nib.Nifti1Image(data, np.eye(4))
img.set_data_dtype(np.uint8)
# the kernel's high-water mark from now (ru_maxrss would carry the forking parent's peak over exec)
assert reset_peak_rss()
before = peak_rss_mb()
if how == "atomic":
    atomic_save_nifti(img, path)
else:
    with open(path, "wb") as f:
        f.write(gzip.compress(img.to_bytes(), 1))
rise = (peak_rss_mb() - before) * 2**20
print(rise / data.nbytes)
"""

# under a 1 MiB file size limit (SIGXFSZ ignored, so a write past it fails with EFBIG, as on a full disk)
# atomic_save_nifti writes a 4 MiB image over `path`; prints the errno it met
FILE_SIZE_LIMIT = """
import resource, signal, sys
import nibabel as nib, numpy as np
from tfmis.utils.io import atomic_save_nifti
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
img = nib.Nifti1Image(np.arange(1 << 20, dtype=np.float32).reshape(128, 128, 64), np.eye(4))
try:
    atomic_save_nifti(img, sys.argv[1])
except OSError as e:
    print(e.errno)
"""


def _python(script: str, *args, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], env=ENV, text=True, **popen)


def test_temp_name_carries_host_and_pid_and_is_parsed_back(tmp_path):
    """`temp_path` names `<name>.<host>.<pid>.<random>.tmp[<suffix>]` in the target's folder and
    `parse_temp_name` reads target, host, pid and suffix back; the host is the first label of the host name with
    unsafe characters replaced; other names (targets, older temporary styles) are not temporaries."""
    target = tmp_path / "demo_000.nii.gz"
    tmp = temp_path(target)
    assert tmp.parent == tmp_path
    assert re.fullmatch(rf"demo_000\.nii\.gz\.{re.escape(host_name())}\.{os.getpid()}\.[0-9a-f]{{8}}\.tmp", tmp.name)
    assert parse_temp_name(tmp.name) == TempName("demo_000.nii.gz", host_name(), os.getpid(), "")
    weights = temp_path(tmp_path / "best.staged.weights.h5", suffix=".weights.h5")
    assert weights.name.endswith(".tmp.weights.h5")
    assert parse_temp_name(weights.name) == TempName("best.staged.weights.h5", host_name(), os.getpid(), ".weights.h5")
    assert temp_path(target) != tmp, "two writes of one file share a temporary"

    assert host_name() == host_name(socket.gethostname()) and "." not in host_name()
    assert host_name("node-07.cluster.example.org") == "node-07"
    assert host_name("gpu node/7") == "gpu-node-7"
    for name in ("demo_000.nii.gz", "d.json.tmp", "best.tmp.weights.h5", ".tmp-123-demo_000.nii.gz", "x.nii.tmp.gz"):
        assert parse_temp_name(name) is None, name


def test_a_full_disk_inside_atomic_path_leaves_the_old_version_and_no_temporary(tmp_path):
    """A writer given `atomic_path`'s temporary writes half its file, then meets a real ENOSPC (a write to
    /dev/full): the OSError reaches the caller, `path` keeps its old version, no temporary stays."""
    if not os.access("/dev/full", os.W_OK):
        pytest.skip("no writable /dev/full")
    path = tmp_path / "best.weights.h5"
    path.write_bytes(b"old")
    with pytest.raises(OSError) as raised, atomic_path(path, suffix=".weights.h5") as tmp:
        tmp.write_bytes(b"half of the weights")
        with open("/dev/full", "wb", buffering=0) as full:
            full.write(b"the other half")
    assert raised.value.errno == errno.ENOSPC
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["best.weights.h5"]


def test_a_nifti_save_past_the_file_size_limit_fails_with_efbig_and_leaves_no_temporary(tmp_path):
    """`atomic_save_nifti` of a 4 MiB image under a 1 MiB file size limit: the write fails with EFBIG inside
    nibabel (as a full disk fails it), `path` keeps its old version, no temporary stays."""
    path = tmp_path / "case.nii.gz"
    path.write_bytes(b"old")
    proc = _python(FILE_SIZE_LIMIT, path, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.strip() == str(errno.EFBIG)
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["case.nii.gz"]


@pytest.mark.parametrize("name", ["case.nii", "case.nii.gz"])
@pytest.mark.parametrize("dtype", ["uint8", ">i2", "float32"])
def test_atomic_save_nifti_round_trips_and_writes_what_nibabel_save_writes(tmp_path, name, dtype):
    """Data, affine and on-disk dtype read back equal, uncompressed and gzipped, and the file's bytes are those
    `nibabel.save` writes; only the target is left in the folder."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 100, (17, 19, 23)).astype(dtype)
    affine = np.array([[-1.5, 0, 0, 10], [0, -1.5, 0, 20], [0, 0, 2.5, -30], [0, 0, 0, 1]])
    header = nib.Nifti1Header(endianness=">" if dtype.startswith(">") else "<")
    img = nib.Nifti1Image(data, affine, header)
    img.set_data_dtype(data.dtype)
    path = tmp_path / "out" / name
    atomic_save_nifti(img, path)
    back = nib.load(path)
    assert back.get_data_dtype() == np.dtype(dtype)
    np.testing.assert_array_equal(np.asanyarray(back.dataobj), data)
    np.testing.assert_array_equal(back.affine, affine)
    nib.save(img, tmp_path / name)
    assert path.read_bytes() == (tmp_path / name).read_bytes()
    assert [p.name for p in path.parent.iterdir()] == [name]


def test_atomic_save_nifti_refuses_a_name_that_is_not_nifti(tmp_path):
    img = nib.Nifti1Image(np.zeros((2, 2, 2), np.uint8), np.eye(4))
    with pytest.raises(ValueError, match=r"\.nii or \.nii\.gz"):
        atomic_save_nifti(img, tmp_path / "case.img")
    assert list(tmp_path.iterdir()) == []


def test_atomic_save_nifti_streams_the_image_without_a_second_copy_in_memory(tmp_path):
    """Saving a 64 MiB uint8 image as .nii.gz raises the process's peak memory by under a quarter of the image's
    size, while compressing the file in memory (the way it avoids) raises it by at least half of it."""
    rises = {}
    for how in ("atomic", "in-memory"):
        proc = _python(SAVE_MEMORY, how, tmp_path / f"{how}.nii.gz", stdout=subprocess.PIPE)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        rises[how] = float(out)
    assert rises["atomic"] < 0.25 and rises["in-memory"] >= 0.5, rises


def test_two_processes_saving_one_nifti_at_once_leave_one_whole_image(tmp_path):
    """Two processes save their own image to one .nii.gz path 15 times each while this process reads it in a
    loop: every read and the final file are one writer's whole image, and no temporary is left."""
    path = tmp_path / "case.nii.gz"
    images = [np.random.default_rng(k).integers(0, 200, (48, 48, 48), dtype=np.uint8) for k in range(2)]
    writers = [_python(NIFTI_WRITER, path, k, 15) for k in range(2)]
    reads, stop = [], threading.Event()

    def read():
        while not stop.is_set():
            if path.exists():
                data = np.asanyarray(nib.load(path).dataobj)
                reads.append(next(k for k, image in enumerate(images) if np.array_equal(data, image)))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert [w.wait(timeout=120) for w in writers] == [0, 0]
    finally:
        stop.set()
        reader.join()
    final = np.asanyarray(nib.load(path).dataobj)
    assert any(np.array_equal(final, image) for image in images)
    assert reads, "the reader never saw the file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["case.nii.gz"]
