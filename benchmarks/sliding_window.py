#!/usr/bin/env python3
"""Seconds per volume and windows/s of tfmis's sliding-window inference on a fixed cheap predictor.

The predictor is one cheap elementwise function (`x**2 - x/2` and/or `tanh(x)`), so what is timed is
mostly everything around the network: cutting windows, batching, blending, dividing, padding. The
predictor alone on the same window batches is timed too ("net s"). Each case is a random volume
(fixed seed) of a given size, window (roi), sliding-window batch, overlap, blending mode and
predictor; every case runs once to warm up, then `--repeats` timed runs, and the table shows the
median (fast cases get more runs, see --min-seconds).

With `--monai PYTHON` the same cases also run through `monai.inferers.sliding_window_inference` in
that interpreter (benchmarks/monai_sliding_window.py, a worker that imports only torch and MONAI),
on the same input arrays (saved to .npy): the two arms alternate run by run in this one invocation,
the outputs are compared (max abs difference) and the table gets the MONAI/tfmis time ratio (> 1:
tfmis is faster), in total and around the network (total minus "net s": torch's tanh on a CPU is
several times slower than TensorFlow's, which the total alone would credit to tfmis).
TensorFlow's intra-op threads and torch's threads are both set to `--threads` (default: the cores
this process may use), and the worker runs with OMP_WAIT_POLICY=PASSIVE
unless told otherwise (busy-waiting OpenMP threads slow torch down many times over on a machine
with other work). With `--baseline FILE` an earlier version of
tfmis/inference/sliding_window.py (e.g. `git show <commit>:tfmis/inference/sliding_window.py`)
runs as a third arm, for before/after numbers (it still blends with this tree's blending modules;
for an older tree's whole window machinery run this script with PYTHONPATH on that tree).

tfmis runs twice per case: with the TensorFlow predictor on tf.Tensor windows ("tfmis"), and with
the numpy twin of the predictor on numpy windows (`windows_as="numpy"`, "np": how a numpy-in,
numpy-out engine such as ONNX Runtime or OpenVINO is driven). After the timed runs, `--breakdown N`
runs (default 20) per case time the phases of the host blend for both: setup (geometry, Σ(weight),
kept from the previous call of the same geometry), window cutting, the predictor, weighting and
adding the predictions, allocating the sum buffer, the division (and crop), and the rest.

Example:
    python benchmarks/sliding_window.py
    python benchmarks/sliding_window.py --monai .venv-monai/bin/python --repeats 9 --json /tmp/sw.json
    python benchmarks/sliding_window.py --case 99x117x95:64:4:0.5 --modes gaussian --predictors poly
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().with_name("monai_sliding_window.py")

PREDICTORS = {"poly": "x**2 - x/2", "tanh": "tanh(x)"}  # the same elementwise op in both frameworks
# SHAPE:ROI:SW_BATCH:OVERLAP[:BATCH] — the volume first; a small one with little overlap; two
# volumes in one call; a large one with a large window; one smaller than the window (padded).
DEFAULT_CASES = (
    "99x117x95:64:4:0.5",
    "48x40x36:32:4:0.25",
    "72x64x56:48:3:0.5:2",
    "160x160x128:96:2:0.5",
    "50x60x40:64:4:0.5",
)


def parse_case(text: str) -> dict:
    """'99x117x95:64:4:0.5[:2]' -> shape, roi, sw batch, overlap, batch of volumes."""
    parts = text.split(":")
    if len(parts) not in (4, 5):
        raise argparse.ArgumentTypeError(
            f"--case must be SHAPE:ROI:SW_BATCH:OVERLAP[:BATCH], e.g. 99x117x95:64:4:0.5, got {text!r}"
        )
    try:
        shape = tuple(int(s) for s in parts[0].split("x"))
        roi = tuple(int(s) for s in parts[1].split("x"))
        case = {
            "shape": shape,
            "roi": roi * 3 if len(roi) == 1 else roi,
            "sw_batch_size": int(parts[2]),
            "overlap": float(parts[3]),
            "batch": int(parts[4]) if len(parts) == 5 else 1,
        }
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--case {text!r}: {e}") from None
    if len(shape) != 3 or len(case["roi"]) != 3:
        raise argparse.ArgumentTypeError(f"--case {text!r}: SHAPE and ROI need 3 sizes (or ROI one)")
    return case


def case_name(case: dict) -> str:
    batch = f" x{case['batch']}" if case["batch"] > 1 else ""
    roi = case["roi"][0] if len(set(case["roi"])) == 1 else "x".join(map(str, case["roi"]))
    return (
        f"{'x'.join(map(str, case['shape']))}{batch} roi {roi} sw {case['sw_batch_size']} "
        f"ov {case['overlap']:g} {case['mode'][:5]} {case['predictor']}"
    )


class MonaiWorker:
    """benchmarks/monai_sliding_window.py in `python`, one JSON request and answer per line."""

    def __init__(self, python: str, threads: int, omp_wait_policy: str | None):
        environment = dict(os.environ)
        if omp_wait_policy:
            environment["OMP_WAIT_POLICY"] = omp_wait_policy
        self.process = subprocess.Popen(
            [python, str(WORKER), "--threads", str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=environment,
        )
        self.info = self._answer()

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(
                f"the MONAI worker ({WORKER.name}) stopped; run it by hand to see why: "
                f"{self.process.args[0]} {WORKER} --threads 1"
            )
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"MONAI worker: {answer['error']}")
        return answer

    def request(self, **payload) -> dict:
        self.process.stdin.write(json.dumps(payload) + "\n")
        return self._answer()

    def load(self, name: str, case: dict, volume, sizes: list[int], folder: Path, index: int):
        """Hands the worker one case (the volume through a .npy file), warms it up, and returns its output."""
        import numpy as np

        source, target = folder / f"in{index}.npy", folder / f"out{index}.npy"
        np.save(source, volume)
        self.request(cmd="load", case=name, input=str(source), roi_size=list(case["roi"]),
                     sw_batch_size=case["sw_batch_size"], overlap=case["overlap"], mode=case["mode"],
                     predictor=case["predictor"], batches=sizes)  # fmt: skip
        self.request(cmd="save", case=name, output=str(target))
        self.request(cmd="time_predictor", case=name)
        return np.load(target)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.process.stdin.close()
            self.process.wait(timeout=30)


def load_baseline(path: str):
    """The `sliding_window_inference` of another copy of tfmis/inference/sliding_window.py."""
    spec = importlib.util.spec_from_file_location("baseline_sliding_window", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.sliding_window_inference


def cpu_model() -> str:
    """`lscpu`'s model name (or /proc/cpuinfo's, or the platform's processor)."""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


PHASES = ("setup", "windows", "predictor", "add", "allocate", "result", "other")


def phase_breakdown(run, repeats: int) -> dict:
    """Median milliseconds per phase of `run()` over `repeats` runs: the host blend's methods (`HostBlend`) and
    the predictor calls (`run_predictor`) timed around each call; "other" is the rest of the run."""
    from tfmis.inference import blending
    from tfmis.inference.host_blend import HostBlend

    spent = collections.defaultdict(float)
    methods = {"__init__": "setup", "windows": "windows", "allocate": "allocate", "add": "add", "result": "result"}
    originals = {name: getattr(HostBlend, name) for name in methods}
    original_predictor = blending.run_predictor

    def timed(phase, function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - start

        return wrapper

    for name, phase in methods.items():
        setattr(HostBlend, name, timed(phase, originals[name]))
    blending.run_predictor = timed("predictor", original_predictor)
    per_phase = collections.defaultdict(list)
    try:
        for _ in range(repeats):
            spent.clear()
            start = time.perf_counter()
            run()
            total = time.perf_counter() - start
            for phase in PHASES[:-1]:
                per_phase[phase].append(spent[phase])
            per_phase["other"].append(total - sum(spent.values()))
            per_phase["total"].append(total)
    finally:
        for name, function in originals.items():
            setattr(HostBlend, name, function)
        blending.run_predictor = original_predictor
    return {phase: 1e3 * statistics.median(times) for phase, times in per_phase.items()}


def window_batches(windows: int, sw_batch_size: int) -> list[int]:
    """Windows per predictor call: full batches, then the rest."""
    return [min(sw_batch_size, windows - first) for first in range(0, windows, sw_batch_size)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--case",
        action="append",
        type=parse_case,
        metavar="SHAPE:ROI:SW_BATCH:OVERLAP[:BATCH]",
        help=f"a case (repeatable); default: {', '.join(DEFAULT_CASES)}",
    )
    p.add_argument("--modes", default="gaussian,constant", help="blending modes, comma-separated")
    p.add_argument(
        "--predictors",
        default="poly,tanh",
        help="comma-separated: poly (x**2 - x/2), tanh (tanh(x)); each case runs with each",
    )
    p.add_argument("--channels", type=int, default=1, help="image channels C (the prediction has C too)")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per case and arm at least (median reported)")
    p.add_argument(
        "--min-seconds", type=float, default=1.0, help="more runs (up to 200) until tfmis has run this long on the case"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="TensorFlow intra-op threads and torch threads (default: the usable cores)",
    )
    p.add_argument("--monai", metavar="PYTHON", help="an interpreter with torch and MONAI, e.g. .venv-monai/bin/python")
    p.add_argument(
        "--omp-wait-policy",
        default="PASSIVE",
        choices=("PASSIVE", "ACTIVE", ""),
        help="OMP_WAIT_POLICY of the MONAI worker ('' = torch's default). PASSIVE by default: on a "
        "busy machine torch's spinning OpenMP threads make MONAI many times slower",
    )
    p.add_argument("--baseline", metavar="FILE", help="another sliding_window.py to time as a third arm")
    p.add_argument(
        "--breakdown",
        type=int,
        default=20,
        metavar="N",
        help="runs per case and tfmis arm whose phases are timed after the timed runs (0: none)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    predictor_names = [m.strip() for m in args.predictors.split(",") if m.strip()]
    if not set(predictor_names) <= set(PREDICTORS):
        p.error(f"--predictors: choose from {', '.join(PREDICTORS)}, got {args.predictors!r}")
    cases = [
        {**case, "mode": mode, "predictor": name}
        for name in predictor_names
        for case in (args.case or [parse_case(c) for c in DEFAULT_CASES])
        for mode in modes
    ]

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    from tfmis.inference import number_of_windows, sliding_window_inference
    from tfmis.inference.blending import aggregates_on_host
    from tfmis.utils.io import atomic_write_json

    predictors = {"tanh": tf.tanh, "poly": lambda x: x * x - x / 2}
    numpy_predictors = {"tanh": np.tanh, "poly": lambda x: x * x - x / 2}  # numpy in, numpy out: an engine
    baseline = load_baseline(args.baseline) if args.baseline else None
    worker = MonaiWorker(args.monai, args.threads, args.omp_wait_policy) if args.monai else None
    print_header(args, worker, tf.__version__, aggregates_on_host(None))

    def run_tfmis(function, volume, case):
        out = function(volume, case["roi"], case["sw_batch_size"], predictors[case["predictor"]],
                       overlap=case["overlap"], mode=case["mode"])  # fmt: skip
        return np.asarray(out)  # the result, in host memory (no copy when it is there already)

    def run_numpy(volume, case):
        return sliding_window_inference(volume, case["roi"], case["sw_batch_size"], numpy_predictors[case["predictor"]],
                                        overlap=case["overlap"], mode=case["mode"], output="numpy",
                                        windows_as="numpy")  # fmt: skip

    def run_predictor_alone(batches, case, functions=predictors):
        for batch in batches:
            out = functions[case["predictor"]](batch)
        return np.asarray(out)

    rows = []
    rng = np.random.default_rng(0)
    try:
        with tempfile.TemporaryDirectory(prefix="sw_bench_") as folder:
            for index, case in enumerate(cases):
                name = case_name(case)
                volume = rng.normal(size=(case["batch"], *case["shape"], args.channels)).astype(np.float32)
                windows = case["batch"] * number_of_windows(case["shape"], case["roi"], case["overlap"])
                sizes = window_batches(windows, case["sw_batch_size"])
                batches = [
                    tf.constant(rng.normal(size=(n, *case["roi"], args.channels)).astype(np.float32)) for n in sizes
                ]
                numpy_batches = [batch.numpy() for batch in batches]
                arms = {
                    "tfmis": lambda v=volume, c=case: run_tfmis(sliding_window_inference, v, c),
                    "tfmis_net": lambda b=batches, c=case: run_predictor_alone(b, c),
                    "np": lambda v=volume, c=case: run_numpy(v, c),
                    "np_net": lambda b=numpy_batches, c=case: run_predictor_alone(b, c, numpy_predictors),
                }
                if baseline is not None:
                    arms["baseline"] = lambda v=volume, c=case: run_tfmis(baseline, v, c)
                outputs = {arm: run() for arm, run in arms.items()}  # warm-up, and the outputs compared
                if worker is not None:
                    outputs["monai"] = worker.load(name, case, volume, sizes, Path(folder), index)
                    arms["monai"] = lambda n=name: worker.request(cmd="time", case=n)
                    arms["monai_net"] = lambda n=name: worker.request(cmd="time_predictor", case=n)
                times, cpu_times, runs = time_arms(arms, args.repeats, args.min_seconds)
                row = {
                    "case": name,
                    **case,
                    "windows": windows,
                    "runs": runs,
                    **{f"{arm}_s": statistics.median(t) for arm, t in times.items()},
                    **{f"{arm}_cpu_s": statistics.median(t) for arm, t in cpu_times.items()},
                    **{f"{arm}_runs_s": t for arm, t in times.items()},
                }
                add_comparisons(row, outputs)
                if args.breakdown and aggregates_on_host(None):
                    row["breakdown_ms"] = {arm: phase_breakdown(arms[arm], args.breakdown) for arm in ("tfmis", "np")}
                rows.append(row)
                print_row(row, header=index == 0, monai=worker is not None, baseline=baseline is not None)
    finally:
        if worker is not None:
            worker.close()
    if any("breakdown_ms" in r for r in rows):
        print_breakdown(rows)
    if worker is not None:
        print_monai_summary(rows)
    if args.json:
        atomic_write_json(
            args.json,
            {
                "threads": args.threads,
                "channels": args.channels,
                "repeats": args.repeats,
                "monai": worker.info if worker else None,
                "omp_wait_policy": args.omp_wait_policy if worker else None,
                "tensorflow": tf.__version__,
                "cpu": cpu_model(),
                "rows": rows,
            },
        )
    return 0


def print_header(args, worker, tensorflow_version: str, on_host: bool) -> None:
    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs, {args.threads} usable; load average {os.getloadavg()}")
    print(
        f"TensorFlow {tensorflow_version}: {args.threads} intra-op threads, blending in "
        f"{'host memory (numpy)' if on_host else 'accelerator memory'}"
        + (
            f"; MONAI {worker.info['monai']}, torch {worker.info['torch']}: {worker.info['threads']} threads, "
            f"OMP_WAIT_POLICY={args.omp_wait_policy or 'default'}"
            if worker
            else ""
        )
        + f"; {args.channels} channel(s); median of {args.repeats} runs after 1 warm-up.\n"
        "net s: the predictor alone on the same window batches (what the network would cost); np s: tfmis "
        "with numpy windows and the numpy twin of the predictor (an engine's path); around: MONAI/tfmis of "
        "(total - net), the time spent around the network; cpu: MONAI/tfmis of the process CPU time (all "
        "threads) per volume; max|Δ|: the largest difference of MONAI's and np's output from tfmis's",
        flush=True,
    )


def time_arms(arms: dict, repeats: int, min_seconds: float) -> tuple[dict, dict, int]:
    """Seconds and CPU seconds per run of each arm, and the number of runs. The arms alternate, so a busy moment
    hits all of them; fast cases run until tfmis has had `min_seconds` (at most 200 runs), so that their medians
    settle too. A MONAI arm times itself in its worker and answers {"seconds", "cpu_seconds"}."""
    times = {arm: [] for arm in arms}
    cpu_times = {arm: [] for arm in arms}
    runs = 0
    while runs < repeats or (sum(times["tfmis"]) < min_seconds and runs < 200):
        runs += 1
        for arm, run in arms.items():
            if arm.startswith("monai"):
                answer = run()
                times[arm].append(answer["seconds"])
                cpu_times[arm].append(answer["cpu_seconds"])
            else:
                start, cpu = time.perf_counter(), time.process_time()
                run()
                times[arm].append(time.perf_counter() - start)
                cpu_times[arm].append(time.process_time() - cpu)
    return times, cpu_times, runs


def add_comparisons(row: dict, outputs: dict) -> None:
    """The largest output difference from tfmis and the time ratios of the other arms, into `row`."""
    import numpy as np

    for arm in ("monai", "baseline", "np"):
        if arm in outputs:
            row[f"{arm}_max_abs_diff"] = float(np.abs(outputs[arm] - outputs["tfmis"]).max())
            row[f"{arm}_over_tfmis"] = row[f"{arm}_s"] / row["tfmis_s"]
    if "monai" in outputs:
        row["monai_cpu_over_tfmis"] = row["monai_cpu_s"] / row["tfmis_cpu_s"]
        monai_around = row["monai_s"] - row["monai_net_s"]
        for arm, key in (("tfmis", "monai_around_over_tfmis"), ("np", "monai_around_over_np")):
            around = row[f"{arm}_s"] - row[f"{arm}_net_s"]
            row[key] = monai_around / around if around > 0 else float("inf")
        row["monai_over_np"] = row["monai_s"] / row["np_s"]


def print_monai_summary(rows: list[dict]) -> None:
    ratios = [r["monai_over_tfmis"] for r in rows]
    around = [r["monai_around_over_tfmis"] for r in rows]
    cpu = [r["monai_cpu_over_tfmis"] for r in rows]
    print(
        f"MONAI/tfmis: min {min(ratios):.2f}, median {statistics.median(ratios):.2f}; around the network: "
        f"min {min(around):.2f}, median {statistics.median(around):.2f}; CPU time: min {min(cpu):.2f}, "
        f"median {statistics.median(cpu):.2f}; max |tfmis - MONAI| "
        f"{max(r['monai_max_abs_diff'] for r in rows):.2g}"
    )
    np_ratios = [r["monai_over_np"] for r in rows]
    np_around = [r["monai_around_over_np"] for r in rows]
    print(
        f"MONAI/tfmis with numpy windows and a numpy predictor (np): min {min(np_ratios):.2f}, median "
        f"{statistics.median(np_ratios):.2f}; around the network: min {min(np_around):.2f}, median "
        f"{statistics.median(np_around):.2f}"
    )


def print_breakdown(rows: list[dict]) -> None:
    """Per case and tfmis arm, the median milliseconds of each phase (`phase_breakdown`)."""
    print(
        "\nWhere tfmis's time goes (median ms of the instrumented runs; tfmis: TensorFlow predictor on tensors, "
        "np: numpy predictor on numpy windows)"
    )
    columns = [("case", 49), ("arm", 5), *((phase, 9) for phase in (*PHASES, "total"))]
    print("  ".join(f"{t:<{w}}" if i < 2 else f"{t:>{w}}" for i, (t, w) in enumerate(columns)))
    for row in rows:
        for arm, phases in row.get("breakdown_ms", {}).items():
            cells = [row["case"], arm, *(f"{phases[p]:.2f}" for p in (*PHASES, "total"))]
            print("  ".join(f"{c:<{w}}" if i < 2 else f"{c:>{w}}" for i, (c, (_, w)) in enumerate(zip(cells, columns))))


def print_row(row: dict, header: bool, monai: bool, baseline: bool) -> None:
    columns = [("case", 49), ("windows", 7), ("tfmis s", 8), ("win/s", 6), ("net s", 7), ("np s", 7), ("net s", 7)]
    cells = [
        row["case"],
        f"{row['windows']}",
        f"{row['tfmis_s']:.4f}",
        f"{row['windows'] / row['tfmis_s']:.0f}",
        f"{row['tfmis_net_s']:.4f}",
        f"{row['np_s']:.4f}",
        f"{row['np_net_s']:.4f}",
    ]
    if monai:
        columns += [
            ("MONAI s", 8),
            ("win/s", 6),
            ("net s", 7),
            ("MONAI/tfmis", 11),
            ("around", 6),
            ("cpu", 5),
            ("MONAI/np", 8),
            ("around", 6),
            ("max|Δ|", 7),
        ]
        cells += [
            f"{row['monai_s']:.4f}",
            f"{row['windows'] / row['monai_s']:.0f}",
            f"{row['monai_net_s']:.4f}",
            f"{row['monai_over_tfmis']:.2f}",
            f"{row['monai_around_over_tfmis']:.2f}",
            f"{row['monai_cpu_over_tfmis']:.2f}",
            f"{row['monai_over_np']:.2f}",
            f"{row['monai_around_over_np']:.2f}",
            f"{max(row['monai_max_abs_diff'], row['np_max_abs_diff']):.0e}",
        ]
    if baseline:
        columns += [("baseline s", 10), ("speed-up", 8), ("max|Δ|", 7)]
        cells += [
            f"{row['baseline_s']:.4f}",
            f"{row['baseline_over_tfmis']:.2f}",
            f"{row['baseline_max_abs_diff']:.0e}",
        ]
    if header:
        print(
            "  ".join(
                f"{title:<{width}}" if i == 0 else f"{title:>{width}}" for i, (title, width) in enumerate(columns)
            )
        )
    print(
        "  ".join(
            f"{cell:<{width}}" if i == 0 else f"{cell:>{width}}"
            for i, (cell, (_, width)) in enumerate(zip(cells, columns))
        ),
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
