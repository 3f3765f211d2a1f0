"""What fails one case of a prediction and what fails the command (`ScanPredictor.predict_file`'s per-case handler,
`tfmis.inference.predictor.CASE_ERRORS`): the case's data, its files and memory fail the case alone (its reason in
the table and predictions.csv, exit 3); a bare ValueError or another TensorFlow error is a bug and leaves
`predict_file` (a traceback, exit 1). The data errors nibabel and numpy raise as ValueErrors are CaseErrors at their
source. A fake predictor stands in for the model; the real command's bad cases are
`tests/test_predict.py::test_a_bad_case_never_stops_the_others`.
"""

import numpy as np
import pytest
import tensorflow as tf
from conftest import lps_affine, write_nifti

from tfmis.data.sources.errors import CaseError
from tfmis.errors import DataError
from tfmis.inference.inputs import InputCase
from tfmis.inference.predictor import ScanPredictor


class _FakePredictor(ScanPredictor):
    """A predictor whose `predict_image` raises `error` (or returns an all-background label map): the per-case
    handler of `predict_file` without a model."""

    modalities, class_names, postprocessing, events = ["t1"], ["background", "organ"], None, []

    def __init__(self, error=None):
        self.error = error

    def predict_image(self, holder, affine, case_id="", probabilities=True):
        if self.error is not None:
            raise self.error
        return np.zeros(holder.pop().shape[:3], np.uint8), None, "cpu"


@pytest.mark.parametrize(
    "error, reason",
    [
        (CaseError("scan", "image is empty"), "image is empty"),
        (DataError("label values outside the classes"), "DataError: label values outside the classes"),
        (MemoryError("numpy"), "MemoryError: numpy"),
        (tf.errors.ResourceExhaustedError(None, None, "OOM when allocating"), "OOM when allocating"),
        (FileNotFoundError(2, "No such file"), "No such file"),
    ],
    ids=["case", "data", "memory", "tensorflow oom", "os"],
)
def test_a_case_fails_alone_for_its_data_its_files_or_memory(tmp_path, error, reason):
    """Data errors (CaseError, DataError), OS errors and out-of-memory fail the one case with its reason."""
    image = write_nifti(tmp_path / "scan.nii.gz", np.ones((6, 6, 6)), lps_affine())
    result = _FakePredictor(error).predict_file(InputCase("scan", str(image)), tmp_path / "out")
    assert result.status == "failed" and reason in result.reason, result.reason


@pytest.mark.parametrize("error", [ValueError("a bug"), tf.errors.InvalidArgumentError(None, None, "shapes differ")])
def test_a_bare_value_error_or_another_tensorflow_error_is_not_a_failed_case_but_the_commands_error(tmp_path, error):
    """A bare ValueError (or TensorFlow's InvalidArgumentError) is a bug or a setting, not the case's data: it
    leaves `predict_file`, so the command ends with its traceback (exit 1) instead of exit 3 for every case."""
    image = write_nifti(tmp_path / "scan.nii.gz", np.ones((6, 6, 6)), lps_affine())
    with pytest.raises(type(error)):
        _FakePredictor(error).predict_file(InputCase("scan", str(image)), tmp_path / "out")


def test_a_corrupt_label_or_a_singular_affine_is_the_cases_failure_with_its_reason(tmp_path):
    """The data errors that nibabel and numpy raise as ValueErrors (or EOFError, zlib's) are CaseErrors at their
    source: a truncated label file (`read_label_map`) and an image whose affine is singular (`load_image`)."""
    image = write_nifti(tmp_path / "scan.nii.gz", np.ones((6, 6, 6)), lps_affine())
    label = write_nifti(tmp_path / "label.nii.gz", np.zeros((6, 6, 6)), lps_affine(), np.uint8)
    label.write_bytes(label.read_bytes()[:40])  # truncated
    result = _FakePredictor().predict_file(InputCase("scan", str(image), str(label)), tmp_path / "out")
    assert result.status == "failed" and result.reason.startswith(f"label file {label} cannot be read"), result.reason
    flat = write_nifti(tmp_path / "flat.nii", np.ones((6, 6, 6)), lps_affine())
    header = bytearray(flat.read_bytes())
    header[252:254] = np.int16(0).tobytes()  # no qform: the sform is the affine
    header[312:328] = np.zeros(4, "<f4").tobytes()  # its third row (srow_z) zero: a singular affine
    flat.write_bytes(bytes(header))
    result = _FakePredictor().predict_file(InputCase("flat", str(flat)), tmp_path / "out")
    assert result.status == "failed" and "is singular or not finite" in result.reason, result.reason
