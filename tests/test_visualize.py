"""tools/visualize.py and tfmis.viz: real converted datasets, real NIfTI files, real subprocess runs."""

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import lps_affine, make_msd_dataset, write_nifti
from PIL import Image

from tfmis.data.conversion_options import ConversionConfig
from tfmis.data.convert import convert
from tfmis.data.records import load_index, read_record, record_dataset, split_cases
from tfmis.visualize import main, nifti_case, orthogonal_figure
from tfmis.viz import PLANES, class_color, plot_orthogonal_planes, render_rgb, write_slice_sweep_gif

REPO = Path(__file__).resolve().parents[1]
CLASS_NAMES = ["background", "organ", "core", "tumour"]


def run_tool(*args, cwd=None, timeout=120):
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "visualize.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def written_path(result) -> Path:
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip().splitlines()[-1])


def assert_clean_error(result, *fragments):
    """Exit status 1 and a one-line `error: ...` naming the problem, not a traceback."""
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    message = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert message, result.stderr
    for fragment in fragments:
        assert fragment in message[0], message[0]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """Three cases, uncompressed, one shard: record offsets in index.json are byte offsets in the file."""
    root = tmp_path_factory.mktemp("viz")
    source = make_msd_dataset(root / "Task99_Test", num_cases=3)
    target = root / "out"
    convert(
        ConversionConfig(
            str(source), str(target), split=(1.0,), shards=1, workers=1, progress=False, compression="NONE"
        )
    )
    return target


def test_png_of_the_orthogonal_mid_planes(converted):
    case_id = split_cases(load_index(converted), "train")[1]["case_id"]
    path = written_path(run_tool("--dataset-dir", converted, "--sample", 1))
    assert path == converted / "visualize" / f"train_001_{case_id}.png"
    with Image.open(path) as png:
        assert png.format == "PNG" and png.mode in ("RGB", "RGBA")
        assert 500 <= png.width <= 2000 and 350 <= png.height <= 1500, png.size


@pytest.mark.slow
def test_gif_sweeps_every_axial_slice(converted, tmp_path):
    num_slices = read_record(converted, "train", 0)["image"].shape[2]
    path = written_path(
        run_tool("--dataset-dir", converted, "--sample", 0, "--no-screen", "--output", tmp_path / "sweep.gif")
    )
    assert path == tmp_path / "sweep.gif"
    with Image.open(path) as gif:
        assert gif.format == "GIF" and gif.is_animated
        assert gif.n_frames == num_slices
        assert gif.info["loop"] == 0


def test_long_sweeps_are_thinned_to_max_frames(tmp_path):
    image = np.random.default_rng(0).normal(size=(12, 10, 40, 1)).astype(np.float32)
    assert write_slice_sweep_gif(tmp_path / "a.gif", image, axis=2, max_frames=7) == 7
    assert write_slice_sweep_gif(tmp_path / "b.gif", image, axis=0) == 12
    with Image.open(tmp_path / "a.gif") as gif:
        assert gif.n_frames == 7


def test_nifti_image_and_label_in_lps(tmp_path):
    rng = np.random.default_rng(1)
    data = rng.normal(100, 10, (16, 18, 12, 2)).astype(np.float32)
    label = np.zeros((16, 18, 12), np.uint8)
    label[2:6, 3:9, 4:8] = 2
    write_nifti(tmp_path / "scan.nii.gz", data, lps_affine(), np.int16)
    write_nifti(tmp_path / "seg.nii.gz", label, lps_affine(), np.uint8)
    work = tmp_path / "work"
    work.mkdir()
    result = run_tool(
        "--image",
        tmp_path / "scan.nii.gz",
        "--label",
        tmp_path / "seg.nii.gz",
        "--class-names",
        "background,liver,tumour",
        cwd=work,
    )
    assert (work / written_path(result)).resolve() == (work / "scan.png").resolve()
    with Image.open(work / "scan.png") as png:
        assert png.format == "PNG" and png.width >= 500
    # LPS on disk → both in-plane axes flipped for display; spacing read from the affine
    case = nifti_case(tmp_path / "scan.nii.gz", tmp_path / "seg.nii.gz", class_names=["background", "liver", "tumour"])
    np.testing.assert_array_equal(case.label, label[::-1, ::-1, :])
    np.testing.assert_array_equal(case.image, data.astype(np.int16)[::-1, ::-1, :])
    assert case.spacing == (1.5, 1.5, 2.0) and case.class_names[2] == "tumour"


@pytest.mark.slow
def test_reads_only_the_requested_record(converted, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(converted, damaged)
    first, second = split_cases(load_index(damaged), "train")[:2]
    assert first["file"] == second["file"]  # one shard holds both
    # Zero the whole payload of record 0 (its middle included): zeroing only image bytes would still
    # parse, and a parser must reject this. The framing (length header) is left as it was.
    with open(damaged / first["file"], "r+b") as shard:
        shard.seek(first["offset"] + 12)
        shard.write(bytes(first["length"]))
    with pytest.raises(Exception, match="(?i)corrupt|crc|checksum"):
        list(record_dataset(damaged, "train"))  # a reader that walks the shard does trip over it

    assert written_path(run_tool("--dataset-dir", damaged, "--sample", 1)).is_file()
    assert_clean_error(
        run_tool("--dataset-dir", damaged, "--sample", 0), "record 0", first["case_id"], "could not be decoded"
    )


@pytest.mark.parametrize(
    "problem", ["no index.json", "unknown split", "sample out of range", "missing image", "missing label"]
)
def test_clear_errors(converted, tmp_path, problem):
    if problem == "no index.json":
        assert_clean_error(run_tool("--dataset-dir", tmp_path, "--sample", 0), "index.json", str(tmp_path))
    elif problem == "unknown split":
        assert_clean_error(
            run_tool("--dataset-dir", converted, "--sample", 0, "--split", "val"), "'val'", "available splits: train"
        )
    elif problem == "sample out of range":
        assert_clean_error(run_tool("--dataset-dir", converted, "--sample", 3), "sample 3", "has 3 records")
    elif problem == "missing image":
        assert_clean_error(run_tool("--image", tmp_path / "nope.nii.gz"), "--image", "nope.nii.gz", "not found")
    else:
        write_nifti(tmp_path / "scan.nii.gz", np.ones((4, 4, 4), np.float32), lps_affine())
        assert_clean_error(
            run_tool("--image", tmp_path / "scan.nii.gz", "--label", tmp_path / "seg.nii.gz"),
            "--label",
            "seg.nii.gz",
            "not found",
        )


def test_help_explains_every_flag():
    result = run_tool("--help")
    assert result.returncode == 0
    for flag in (
        "--dataset-dir",
        "--sample",
        "--split",
        "--no-screen",
        "--output",
        "--image",
        "--label",
        "--prediction",
        "--class-names",
    ):
        assert flag in result.stdout


# --- the figure itself ---------------------------------------------------------------------------------


def synthetic_case(shape=(24, 20, 16), spacing=(1.0, 1.0, 1.0)):
    """Two channels that ramp along z (each axial slice is one grey) and classes 1 and 3 present, 2 declared
    but absent."""
    ramp = np.broadcast_to(10.0 + np.arange(shape[2]), shape)
    image = np.stack([ramp, 2 * ramp], axis=-1)
    label = np.zeros(shape, np.uint8)
    label[4:14, 4:14, :] = 1
    label[16:20, 12:16, :] = 3
    return image, label


def pixel_of(fig, ax, point_mm, rgb) -> np.ndarray:
    """The rendered colour at data coordinates (mm) of `ax`."""
    x, y = ax.transData.transform(point_mm)
    return rgb[rgb.shape[0] - 1 - int(round(y)), int(round(x))].astype(int)


def test_figure_axes_legend_and_overlay_colour():
    image, label = synthetic_case()
    fig = plot_orthogonal_planes(image, label, class_names=CLASS_NAMES, channel_names=["T1", "T2"], title="case_7")
    assert len(fig.axes) == 2 * 3
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["organ", "tumour"]
    assert "case_7" in fig._suptitle.get_text()
    assert [ax.get_ylabel() for ax in fig.axes[::3]] == ["T1", "T2"]

    with_label = render_rgb(fig)
    plain_fig = plot_orthogonal_planes(image, class_names=CLASS_NAMES)
    plain = render_rgb(plain_fig)
    assert not plain_fig.legends  # no label, no legend
    axial = fig.axes[2]
    assert [p.name for p in PLANES] == ["sagittal", "coronal", "axial"]
    labelled, unlabelled = (8.5, 8.5), (2.5, 17.5)  # mm in the axial panel: class 1, background
    grey = pixel_of(plain_fig, plain_fig.axes[2], labelled, plain)
    assert grey[0] == grey[1] == grey[2]  # the image alone is grey
    overlaid = pixel_of(fig, axial, labelled, with_label)
    expected = 0.6 * grey + 0.4 * 255 * np.array(class_color(1))
    np.testing.assert_allclose(overlaid, expected, atol=3)
    assert np.ptp(overlaid) > 40  # visibly coloured
    np.testing.assert_array_equal(pixel_of(fig, axial, unlabelled, with_label), grey)  # background transparent


def test_panels_have_physical_aspect_and_orientation_letters():
    image, label = synthetic_case(shape=(20, 20, 10))
    fig = plot_orthogonal_planes(image, label, spacing=(1.0, 1.0, 3.0))
    render_rgb(fig)
    sagittal, coronal, axial = fig.axes[:3]
    for ax, (width_mm, height_mm) in ((sagittal, (20, 30)), (coronal, (20, 30)), (axial, (20, 20))):
        box = ax.get_window_extent()
        assert box.height / box.width == pytest.approx(height_mm / width_mm, rel=0.03)
    assert [t.get_text() for t in sagittal.texts] == ["P", "A", "I", "S"]  # left, right, bottom, top
    assert [t.get_text() for t in coronal.texts] == ["L", "R", "I", "S"]
    assert [t.get_text() for t in axial.texts] == ["L", "R", "P", "A"]


def test_patient_right_and_anterior_are_drawn_where_the_letters_say():
    image = np.full((20, 20, 10, 1), 0.5, np.float32)
    image[15:19, 15:19, :] = 1.0  # a bright column at the right (high x), anterior (high y) corner
    fig = plot_orthogonal_planes(image)
    rgb = render_rgb(fig)
    axial = fig.axes[2]
    right_anterior = pixel_of(fig, axial, (17.0, 17.0), rgb)
    left_posterior = pixel_of(fig, axial, (3.0, 3.0), rgb)
    assert right_anterior.min() > 200 and left_posterior.max() < 30
    box = axial.get_window_extent()
    x, y = axial.transData.transform((17.0, 17.0))
    assert x > (box.x0 + box.x1) / 2 and y > (box.y0 + box.y1) / 2  # screen right, screen top


def test_prediction_is_drawn_as_outlines():
    image, label = synthetic_case()
    prediction = np.zeros_like(label)
    prediction[4:14, 4:14, :] = 1
    fig = plot_orthogonal_planes(image, label, class_names=CLASS_NAMES, prediction=prediction)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["organ", "tumour", "prediction: outlines"]
    rgb = render_rgb(fig)
    axial = fig.axes[2]
    edge, inside = (4.5, 8.5), (8.5, 8.5)
    np.testing.assert_allclose(pixel_of(fig, axial, edge, rgb), 255 * np.array(class_color(1)), atol=2)
    assert np.abs(pixel_of(fig, axial, inside, rgb) - 255 * np.array(class_color(1))).max() > 40  # fill only


# --- a prediction on its NIfTI image (--prediction) ----------------------------------------------------

TUMOUR = 2  # class value of "tumour" in PREDICTION_CLASSES
PREDICTION_CLASSES = "background,liver,tumour"


@pytest.fixture(scope="module")
def predicted_case(tmp_path_factory):
    """scan.nii.gz (LPS, 16x18x12, 1.5x1.5x2 mm), its ground truth and a prediction that differs from it: the
    prediction finds the liver but puts a false tumour where the ground truth has only background.

    Returns (folder, prediction in RAS voxel order)."""
    root = tmp_path_factory.mktemp("predicted")
    shape = (16, 18, 12)
    image = np.random.default_rng(2).normal(100, 10, shape).astype(np.float32)
    label = np.zeros(shape, np.uint8)
    label[2:9, 3:10, 3:9] = 1
    label[4:7, 5:8, 4:8] = TUMOUR
    prediction = label.copy()
    prediction[4:7, 5:8, 4:8] = 1  # the real tumour missed ...
    prediction[10:14, 12:16, 3:9] = TUMOUR  # ... and a false one found in the background
    write_nifti(root / "scan.nii.gz", image, lps_affine(), np.int16)
    write_nifti(root / "seg.nii.gz", label, lps_affine(), np.uint8)
    write_nifti(root / "pred.nii.gz", prediction, lps_affine(), np.uint8)
    write_nifti(root / "short.nii.gz", prediction[:, :, :10], lps_affine(), np.uint8)
    return root, prediction[::-1, ::-1, :]  # LPS on disk → x and y flipped in RAS


def run_main(capsys, *args):
    """`tfmis-visualize ARGS` in this process (its `main`): (exit status, stdout, stderr)."""
    status = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return status, out, err


def test_png_with_label_and_prediction(predicted_case, tmp_path, monkeypatch, capsys):
    root, _ = predicted_case
    monkeypatch.chdir(tmp_path)
    status, out, err = run_main(
        capsys,
        "--image",
        root / "scan.nii.gz",
        "--label",
        root / "seg.nii.gz",
        "--prediction",
        root / "pred.nii.gz",
        "--class-names",
        PREDICTION_CLASSES,
    )
    assert status == 0, err
    assert Path(out.strip()) == Path("scan_prediction.png")  # the default name says a prediction is drawn
    with Image.open(tmp_path / "scan_prediction.png") as png:
        assert png.format == "PNG" and png.width >= 500


def test_prediction_outline_is_where_only_the_prediction_has_the_class(predicted_case, tmp_path, capsys):
    root, ras_prediction = predicted_case
    case = nifti_case(
        root / "scan.nii.gz",
        root / "seg.nii.gz",
        class_names=PREDICTION_CLASSES.split(","),
        prediction_path=root / "pred.nii.gz",
    )
    np.testing.assert_array_equal(case.prediction, ras_prediction)  # reoriented like the image and the label
    assert "label (fill) vs prediction (outline)" in case.title
    fig = orthogonal_figure(case)
    assert "label (fill) vs prediction (outline)" in fig._suptitle.get_text()
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["liver", "tumour", "prediction: outlines"]
    rgb = render_rgb(fig)

    # the false tumour's edge in the axial mid-plane, a voxel where the ground truth is background
    z = case.image.shape[2] // 2
    xs, ys = np.nonzero(ras_prediction[:, :, z] == TUMOUR)
    x, y = xs.min(), int(np.median(ys))
    assert case.label[x, y, z] == 0
    point_mm = ((x + 0.5) * case.spacing[0], (y + 0.5) * case.spacing[1])
    tumour_rgb = 255 * np.array(class_color(TUMOUR))
    np.testing.assert_allclose(pixel_of(fig, fig.axes[2], point_mm, rgb), tumour_rgb, atol=2)
    without = nifti_case(root / "scan.nii.gz", root / "seg.nii.gz")
    plain_fig = orthogonal_figure(without)
    grey = pixel_of(plain_fig, plain_fig.axes[2], point_mm, render_rgb(plain_fig))
    assert grey[0] == grey[1] == grey[2]  # the ground truth alone leaves it uncoloured

    # and the PNG the command writes is this very figure
    status, _, err = run_main(
        capsys,
        "--image",
        root / "scan.nii.gz",
        "--label",
        root / "seg.nii.gz",
        "--prediction",
        root / "pred.nii.gz",
        "--class-names",
        PREDICTION_CLASSES,
        "--output",
        tmp_path / "out.png",
    )
    assert status == 0, err
    with Image.open(tmp_path / "out.png") as png:
        written = np.asarray(png.convert("RGB"))
    assert written.shape == rgb.shape
    np.testing.assert_allclose(pixel_of(fig, fig.axes[2], point_mm, written), tumour_rgb, atol=2)


def test_prediction_alone_as_gif(predicted_case, tmp_path, monkeypatch, capsys):
    root, ras_prediction = predicted_case
    monkeypatch.chdir(tmp_path)
    status, out, err = run_main(
        capsys, "--image", root / "scan.nii.gz", "--prediction", root / "pred.nii.gz", "--no-screen"
    )
    assert status == 0, err
    assert Path(out.strip()) == Path("scan_prediction.gif")
    case = nifti_case(root / "scan.nii.gz", prediction_path=root / "pred.nii.gz")
    assert case.label is None and "prediction (outline)" in case.title and "label" not in case.title
    tumour_rgb = 255 * np.array(class_color(TUMOUR))

    def tumour_coloured_pixels(gif, index) -> int:
        gif.seek(index)
        frame = np.asarray(gif.convert("RGB")).astype(int)
        return int((np.abs(frame - tumour_rgb).max(axis=-1) <= 12).sum())

    with Image.open(tmp_path / "scan_prediction.gif") as gif:
        assert gif.format == "GIF" and gif.is_animated and gif.n_frames == ras_prediction.shape[2]
        assert not (ras_prediction[:, :, 0] == TUMOUR).any()
        # slice 0 has no tumour (only the legend's patch has its colour); the middle slice cuts the false one,
        # whose outline adds pixels of that colour
        assert tumour_coloured_pixels(gif, ras_prediction.shape[2] // 2) >= tumour_coloured_pixels(gif, 0) + 10


def test_prediction_on_another_grid_is_a_clear_error(predicted_case, tmp_path, capsys):
    root, _ = predicted_case
    status, _, err = run_main(
        capsys,
        "--image",
        root / "scan.nii.gz",
        "--label",
        root / "seg.nii.gz",
        "--prediction",
        root / "short.nii.gz",
        "--output",
        tmp_path / "x.png",
    )
    assert status == 1 and "Traceback" not in err
    message = err.strip().splitlines()[-1]
    for fragment in ("error: --prediction", "short.nii.gz", "(16, 18, 10)", "(16, 18, 12)"):
        assert fragment in message, message
    assert not (tmp_path / "x.png").exists()


def test_prediction_does_not_go_with_a_converted_record(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--dataset-dir", str(tmp_path), "--sample", "0", "--prediction", str(tmp_path / "pred.nii.gz")])
    assert exit_.value.code == 2
    assert "--prediction goes with --image" in capsys.readouterr().err


def test_channel_file_of_an_nnunet_case_draws_the_case_as_its_msd_file_does(tmp_path, capsys):
    """`--image imagesTr/<case>_0000.nii.gz` of an nnU-Net v2 dataset: every channel of the case, its id and the
    dataset's channel and class names, as `--image` of the same case's 4D file in the MSD layout; the same for
    an .mha label and image (tfmis[formats])."""
    from nnunet_layout import msd_to_nnunet

    msd = make_msd_dataset(tmp_path / "Task99_Test", num_cases=1)
    nnunet = msd_to_nnunet(msd, tmp_path / "Dataset099_Test")
    expected = nifti_case(msd / "imagesTr" / "case_000.nii.gz", msd / "labelsTr" / "case_000.nii.gz")
    case = nifti_case(nnunet / "imagesTr" / "case_000_0001.nii.gz", nnunet / "labelsTr" / "case_000.nii.gz")
    assert case.name == "case_000" and case.channel_names == ["MR0", "MR1"] == expected.channel_names
    assert case.class_names == ["background", "organ", "core"] == expected.class_names
    np.testing.assert_array_equal(case.image, expected.image)
    np.testing.assert_array_equal(case.label, expected.label)
    assert case.spacing == expected.spacing
    status, out, err = run_main(
        capsys, "--image", nnunet / "imagesTr" / "case_000_0000.nii.gz", "--output", tmp_path / "c.png"
    )
    assert status == 0 and (tmp_path / "c.png").is_file(), err
    pytest.importorskip("SimpleITK")
    mha = msd_to_nnunet(msd, tmp_path / "Dataset098_Mha", ".mha")
    case = nifti_case(mha / "imagesTr" / "case_000_0000.mha", mha / "labelsTr" / "case_000.mha")
    np.testing.assert_array_equal(case.image, expected.image)
    np.testing.assert_array_equal(case.label, expected.label)
    shutil.copyfile(mha / "imagesTr" / "case_000_0001.mha", tmp_path / "single.mha")  # one .mha file, no dataset
    single = nifti_case(tmp_path / "single.mha", mha / "labelsTr" / "case_000.mha")
    assert single.name == "single" and single.spacing == expected.spacing
    np.testing.assert_array_equal(np.reshape(single.image, expected.image.shape[:3]), expected.image[..., 1])
