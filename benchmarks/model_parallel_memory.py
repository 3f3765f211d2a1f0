#!/usr/bin/env python3
"""Memory per device of a U-Net's training step run over 1, 2 or 4 devices by space or by layers
(`tfmis.networks.parallel.ModelParallel`), counted from the traced graphs, and what it implies for 80 GB GPUs.

TensorFlow has no per-device memory figure for CPU devices: `tf.config.experimental.get_memory_info("CPU:k")`
answers on TensorFlow 2.21, but with the one process-wide CPU allocator's numbers, the same for every logical
device. So this script makes 4 logical CPU devices, TRACES one training step (forward, loss, gradient; never
runs it) for each net, cube patch, mode and device count, and counts each device's tensors with
`tfmis.profiling.graph_memory.placed_memory`: the peak of live tensor bytes per device in the graph's op order,
and the bytes crossing devices. Two placements of the backward pass are counted:

- `tape`: `tf.GradientTape().gradient`, as a plain Keras step takes it. Its backward ops get no device, so TensorFlow
  runs them all on the default device (/CPU:0, a GPU's /GPU:0): the saved activations of every other device are
  sent there.
- `colocated`: `tf.gradients`, which in TensorFlow 2 colocates each backward op with its forward op (the same
  gradient values): each slab's or stage's backward pass on its own device. The trainer takes model-parallel
  gradients this way (`ModelParallel.gradients`).

Nets: the demo U-Net (`demo`: 2 channels, 4 classes, filters 8-64, strides (2, 2, 2, 1), transposed-convolution
output with the image, deep supervision 2, 2 residual units, instance norm) and `large`, a net of roughly the
shape of nnU-Net's ResEnc-L (6 stages of 32-320 filters, strides (1, 2, 2, 2, 2, 2), 3 residual units, deep
supervision 3, instance norm). ResEnc-L has ~102M parameters (1-6 residual blocks of 2 convolutions per encoder
stage); this one has fewer (printed) and only approximates its activations. Batch 2, cube patches; spatial mode
cuts axis 0 into slabs that are multiples of the strides' product (8 and 32), so a side that is not a multiple of
that times N gives unequal slabs (the largest sets the peak; the table shows the rows). Pipeline mode uses 2
micro-batches.

From the counts: linear fits of the largest per-device peak against voxels (for spatial, the voxels the largest
slab would give N equal slabs: N x its rows x side², equal to side³ for equal slabs), the largest patch within a
fixed per-device budget (the one-device peak at 128³), and a paper model for 80 GB GPUs (A100 80GB: 80 GiB, 1 GiB
reserved; weights and Adam's two slots counted apart, the gradients are in the counted peak) with the halo's
time on NVLink (300 GB/s per direction) and PCIe 4.0 x16 (25 GB/s).

Per device it also reads the variables each device holds (weights + Adam's two slots, from where each variable
is: a pipeline's stages own theirs, spatial mode keeps them on the first device) and prints them beside the
counted peaks ("Per device" table; the figures: docs/model-parallel.md, "Variables and peak per device").

Writes the plot to docs/img/model_parallel_memory.png and every number (per device, per config, the fits and the
paper model) to docs/benchmarks/model_parallel_memory.json.

Example:
    python benchmarks/model_parallel_memory.py                         # everything (~9 min on 2 busy cores)
    python benchmarks/model_parallel_memory.py --nets demo --patches 64,96
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEVICES = 4  # logical CPU devices
GIB, MIB = 2**30, 2**20
GPU_BYTES = 80 * GIB  # A100 80GB: 81920 MiB
RESERVED = GIB
LINKS = {"NVLink (A100, 300 GB/s)": 300e9, "PCIe 4.0 x16 (25 GB/s)": 25e9}
GRADIENTS = ("tape", "colocated")

NETS = {
    "demo": None,  # configs/demo.yaml's network (net_arch)
    "large": dict(
        in_channels=1,
        num_classes=4,
        filters=(32, 64, 128, 256, 320, 320),
        strides=(1, 2, 2, 2, 2, 2),
        deep_supervision=3,
        num_res_units=3,
        norm="instance",
    ),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nets", default="demo,large", help=f"some of {','.join(NETS)}")
    p.add_argument("--patches", default="64,96,128,160,192", help="cube sides")
    p.add_argument("--devices", default="2,4", help="devices per model (besides one)")
    p.add_argument("--modes", default="spatial,pipeline")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2, help="pipeline mode")
    p.add_argument("--budget-patch", type=int, default=128, help="the fixed budget: the one-device peak at this side")
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "img" / "model_parallel_memory.png")
    p.add_argument("--json", type=Path, default=REPO / "docs" / "benchmarks" / "model_parallel_memory.json")
    return p.parse_args()


def net_arch(net: str) -> dict:
    """A net's UNetConfig arguments; the demo's come from configs/demo.yaml, the one place they are written."""
    if NETS[net] is not None:
        return NETS[net]
    import dataclasses

    from tfmis.config import load_config

    model = load_config(REPO / "configs" / "demo.yaml").model
    return dict(in_channels=2, num_classes=4, **dataclasses.asdict(model))


def mib(x) -> str:
    return f"{x / MIB:,.1f}"


def markdown(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def lstsq_line(xs, ys):
    """(a, b) of y = a + b x by least squares, and the largest |residual| / y."""
    n = len(xs)
    if n == 1:
        return 0.0, ys[0] / xs[0], 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    worst = max(abs(a + b * x - y) / y for x, y in zip(xs, ys))
    return a, b, worst


def effective_voxels(side: int, mode: str, n: int, unit: int) -> tuple[int, str]:
    """Voxels as N equal slabs of the largest slab would have (side³ for equal slabs), and the slab rows."""
    if mode != "spatial" or n == 1:
        return side**3, ""
    units = side // unit
    rows = [(units // n + (i < units % n)) * unit for i in range(n)]
    return n * max(rows) * side * side, "/".join(str(r) for r in rows)


def variable_bytes(model, slots: int = 2) -> dict:
    """Per device ("/CPU:1"): the bytes of the model's variables, read from where each one is (its `tf.Variable`'s
    device), each trainable one with Adam's `slots` float32 slots (Keras' TensorFlow optimizer makes them
    colocated with their variable: tests/test_model_parallel_placement.py)."""
    import tensorflow as tf

    trainable = {id(v) for v in model.trainable_variables}
    out = {}
    for v in model.variables:
        spec = tf.DeviceSpec.from_string(v.value.device)
        device = f"/{spec.device_type}:{spec.device_index}"
        size = math.prod(int(d) for d in v.shape) * v.value.dtype.size
        out[device] = out.get(device, 0) + size * (1 + (slots if id(v) in trainable else 0))
    return out


def variables_home(model) -> None:
    """Puts the model's variables back on /CPU:0 after a pipeline case moved them to its stages' devices (a no-op
    for a tfmis whose pipeline does not move them), so that every case starts from the same placement."""
    try:
        from tfmis.networks.pipeline_stages import place_stage_variables
    except ImportError:
        return
    place_stage_variables(model, {layer.name: 0 for layer in model.layers}, ["/CPU:0"])


def trace_all(args, nets, patches, devices, modes):
    import keras

    from tfmis.losses import DeepSupervisionLoss, build_loss
    from tfmis.networks.parallel import ModelParallel
    from tfmis.networks.unet import UNetConfig
    from tfmis.profiling.graph_memory import parameter_bytes, placed_memory, spatial_halo, step_graph, summary

    rows, skipped, info = [], [], {}
    for net in nets:
        config = UNetConfig(**net_arch(net))
        _, training_model = config.build_for_training()
        loss_fn = DeepSupervisionLoss(build_loss("dice_ce"), [f for _, f in config.deep_supervision_levels])
        variables = training_model.trainable_variables
        unit = config.patch_divisor[0]
        info[net] = {
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in net_arch(net).items()},
            "parameters": sum(math.prod(v.shape) for v in variables),
            "parameter_bytes": parameter_bytes(variables),  # weights + gradients + Adam's 2 slots
            "weights_and_slots_bytes": parameter_bytes(variables, gradients=False),
            "unit": unit,
        }
        print(
            f"{net}: {info[net]['parameters']:,} parameters; weights + gradients + Adam slots "
            f"{mib(info[net]['parameter_bytes'])} MiB; slabs aligned to {unit}",
            flush=True,
        )
        for side in patches:
            patch = (side, side, side)
            cases = [("1 device", 1)] + [(mode, n) for mode in modes for n in devices]
            for mode, n in cases:
                if mode == "spatial" and side // unit < n:
                    skipped.append(f"{net} {side}³ spatial N={n}: {side} rows make {side // unit} slabs of {unit}")
                    continue
                if mode == "pipeline" and args.batch % args.micro_batches:
                    skipped.append(f"{net} pipeline: batch {args.batch} is not split into {args.micro_batches}")
                    continue
                names = [[f"/CPU:{i}" for i in range(n)]]
                start = time.perf_counter()
                parallel = None
                if n > 1:
                    parallel = ModelParallel(
                        training_model,
                        mode,
                        names,
                        config.strides,
                        micro_batches=args.micro_batches,
                        patch_size=patch,
                        in_channels=config.in_channels,
                    )
                voxels, slabs = effective_voxels(side, mode, n, unit)
                row = {"net": net, "side": side, "mode": mode, "n": n, "slabs": slabs, "effective_voxels": voxels}
                row["variable_bytes"] = variable_bytes(training_model)  # where the model's variables are now
                for gradients in GRADIENTS:
                    graph = step_graph(
                        training_model, loss_fn, args.batch, patch, config.in_channels, parallel, gradients=gradients
                    )
                    memory = placed_memory(graph, top=12)
                    ops = len(graph.get_operations())
                    halo = spatial_halo(graph, memory) if mode == "spatial" else None
                    peak_entry = max(memory.values(), key=lambda m: m.peak_bytes)
                    row[gradients] = {
                        **summary(memory),
                        "ops": ops,
                        "peaks": {d: m.peak_bytes for d, m in sorted(memory.items())},
                        "transfer_in": {d: m.transfer_in_bytes for d, m in sorted(memory.items())},
                        "transfer_out": {d: m.transfer_out_bytes for d, m in sorted(memory.items())},
                        "peak_breakdown": peak_entry.peak_breakdown,
                        "peak_op": peak_entry.peak_op,
                        "peak_tensors": peak_entry.peak_tensors,
                        "unknown_shape_tensors": sum(m.unknown_shape_tensors for m in memory.values()),
                        "halo": halo,
                    }
                    del graph, memory
                    gc.collect()
                row["seconds"] = time.perf_counter() - start
                rows.append(row)
                tape, colocated = row["tape"], row["colocated"]
                print(
                    f"  {net} {side}³ {mode:8s} N={n} {slabs:12s} peak/device tape {mib(tape['peak_bytes']):>10} MiB "
                    f"({tape['peak_device']}), colocated {mib(colocated['peak_bytes']):>10} MiB; "
                    f"{tape['ops']} ops; traced x2 in {row['seconds']:.1f} s",
                    flush=True,
                )
                del parallel
                variables_home(training_model)
        del training_model, variables
        gc.collect()
        keras.backend.clear_session()
    return rows, skipped, info


def fits(rows):
    """(net, mode, n, gradients) -> {a, b, worst, points}: largest per-device peak = a + b * effective voxels; the
    busiest device's transfers = link_a + link_b * side³; halo bytes per side² (spatial)."""
    out = {}
    keys = sorted({(r["net"], r["mode"], r["n"]) for r in rows})
    for net, mode, n in keys:
        points = [r for r in rows if (r["net"], r["mode"], r["n"]) == (net, mode, n)]
        for gradients in GRADIENTS:
            xs = [r["effective_voxels"] for r in points]
            ys = [r[gradients]["peak_bytes"] for r in points]
            link = [r[gradients]["busiest_link_bytes"] for r in points]
            a, b, worst = lstsq_line(xs, ys)
            # transfers against side³: with tape.gradient device 0 receives every other slab's saved activations
            cubes = [r["side"] ** 3 for r in points]
            la, lb, _ = lstsq_line(cubes, link) if any(link) else (0.0, 0.0, 0.0)
            entry = {"a": a, "b": b, "worst": worst, "points": len(points), "link_a": la, "link_b": lb}
            if mode == "spatial":  # halo ∝ side² (one face per boundary, every level)
                for kind in ("forward", "backward", "busiest_device"):
                    num = sum(r[gradients]["halo"][kind] * r["side"] ** 2 for r in points)
                    den = sum(r["side"] ** 4 for r in points)
                    entry[f"halo_{kind}"] = num / den
            out[net, mode, n, gradients] = entry
    return out


def extrapolated(fit, net, gradients, n):
    """The spatial fit at n devices: measured, one device, or for n > 4 extrapolated as w + s/N from N = 2 and 4
    (slope, intercept and busiest-link bytes; the halo per boundary of N = 4, whose inner slabs have two
    neighbours as at any N > 4)."""
    if n == 1:
        return fit[net, "1 device", 1, gradients]
    if (net, "spatial", n, gradients) in fit:
        return fit[net, "spatial", n, gradients]
    two, four = fit[net, "spatial", 2, gradients], fit[net, "spatial", 4, gradients]
    entry = {}
    for key in ("a", "b", "link_a", "link_b"):
        w = 2 * four[key] - two[key]  # y(N) = w + s / N through N = 2 and 4
        s = 4 * (two[key] - four[key])
        entry[key] = w + s / n
    for kind in ("forward", "backward"):
        entry[f"halo_{kind}"] = four[f"halo_{kind}"] * (n - 1) / 3
    entry["halo_busiest_device"] = four["halo_busiest_device"]
    entry["extrapolated"] = True
    return entry


def largest_side(entry, budget, n, unit, step=32, limit=2048):
    """The largest cube side (a multiple of `step`) whose predicted peak fits `budget`, with its slab rows."""
    best = None
    for side in range(step, limit + 1, step):
        if n > 1 and (side % unit or side // unit < n):
            continue
        voxels, slabs = effective_voxels(side, "spatial", n, unit)
        if entry["a"] + entry["b"] * voxels <= budget:
            best = (side, voxels, slabs)
    return best


def report(args, rows, skipped, info, elapsed):
    from tfmis.hardware import cpu_name

    fit = fits(rows)
    lines = []
    lines.append(f"CPU: {cpu_name()}; {DEVICES} logical CPU devices; traced only, never run; batch {args.batch}")
    lines.append(
        "Counted by tfmis.profiling.graph_memory.placed_memory: per device, the peak of live tensor bytes in the "
        "graph's op order (weights and Adam slots not included: see the parameter columns)."
    )
    for net, meta in info.items():
        extra = ""
        if net == "large":
            extra = (
                " (nnU-Net's ResEnc-L: ~102M parameters, 6 stages of 1-6 residual blocks; this net approximates it "
                "only roughly: same stages, filters and strides, fewer convolutions per stage)"
            )
        lines.append(
            f"{net}: {meta['parameters']:,} parameters, weights + gradients + Adam slots "
            f"{mib(meta['parameter_bytes'])} MiB{extra}"
        )
    lines.append("")
    header = [
        "net",
        "patch",
        "mode",
        "N",
        "slab rows",
        "peak/device tape MiB (device)",
        "peak/device colocated MiB (device)",
        "transfers/step tape MiB",
        "transfers/step colocated MiB",
        "halo/step fwd+bwd MiB (colocated)",
        "params+grads+Adam MiB",
    ]
    table = []
    for r in rows:
        tape, col = r["tape"], r["colocated"]
        halo = col["halo"]
        table.append(
            [
                r["net"],
                f"{r['side']}³",
                r["mode"],
                r["n"],
                r["slabs"] or "-",
                f"{mib(tape['peak_bytes'])} ({tape['peak_device'][1:]})",
                f"{mib(col['peak_bytes'])} ({col['peak_device'][1:]})",
                mib(tape["transfer_bytes"]),
                mib(col["transfer_bytes"]),
                "-" if halo is None else f"{mib(halo['forward'])}+{mib(halo['backward'])}",
                mib(info[r["net"]]["parameter_bytes"]),
            ]
        )
    lines.append(markdown(header, table))
    if skipped:
        lines.append("")
        lines.append("Skipped: " + "; ".join(skipped))

    lines.append("")
    lines.append(placement_table(rows))

    # where each device's bytes go: the rows the explanation needs
    lines.append("")
    lines.append("Peak per device (MiB) and what is live at the largest peak (forward / backward / received copies):")
    for r in rows:
        if r["n"] == 1 or r["side"] != args.budget_patch:
            continue
        for gradients in GRADIENTS:
            g = r[gradients]
            peaks = ", ".join(f"{d[1:]} {mib(v)}" for d, v in g["peaks"].items())
            bd = g["peak_breakdown"]
            links = ", ".join(mib(g["transfer_in"][d]) + "/" + mib(g["transfer_out"][d]) for d in g["peaks"])
            lines.append(
                f"  {r['net']} {r['side']}³ {r['mode']} N={r['n']} {gradients}: {peaks}; at {g['peak_op']}: "
                f"forward {mib(bd['forward'])}, backward {mib(bd['backward'])}, copies {mib(bd['copies'])}; "
                f"in/out per device {links}"
            )

    lines.append("")
    lines.append("Fits: largest per-device peak = a + b x voxels (spatial: N x largest slab rows x side²):")
    table = []
    for (net, mode, n, gradients), e in sorted(fit.items()):
        table.append([net, mode, n, gradients, mib(e["a"]), f"{e['b']:.1f}", e["points"], f"{100 * e['worst']:.1f}%"])
    lines.append(markdown(["net", "mode", "N", "gradients", "a MiB", "b bytes/voxel", "points", "worst"], table))

    # the fixed per-device budget: the one-device peak at budget_patch
    lines.append("")
    lines.append(
        f"Fixed per-device budget = the one-device peak at {args.budget_patch}³ (tape); largest patch within it, "
        "from the fits (equal slabs):"
    )
    table = []
    for net in info:
        base = next((r for r in rows if r["net"] == net and r["n"] == 1 and r["side"] == args.budget_patch), None)
        if base is None:
            continue
        budget = base["tape"]["peak_bytes"]
        for (fnet, mode, n, gradients), e in sorted(fit.items()):
            if fnet != net:
                continue
            one = fit[net, "1 device", 1, gradients]
            v = (budget - e["a"]) / e["b"]
            v1 = (budget - one["a"]) / one["b"]
            table.append(
                [net, mib(budget), mode, n, gradients, f"{v / 1e6:.2f}M", f"{v ** (1 / 3):.0f}³", f"{v / v1:.2f}"]
            )
    lines.append(
        markdown(["net", "budget MiB", "mode", "N", "gradients", "voxels", "cube", "voxels / one device's"], table)
    )

    # the paper model: 80 GB GPUs
    lines.append("")
    lines.append(
        f"Paper model, spatial mode, batch {args.batch}: the largest cube side (multiple of 32) whose predicted "
        "peak fits an 80 GB GPU (80 GiB - 1 GiB reserved - weights and Adam's 2 slots; the gradients are in the "
        "peak); N = 8 extrapolated from N = 2 and 4 as w + s/N (slope, intercept, transfers) and N = 4's halo per "
        "boundary; transfer times for the busiest device's bytes in one direction:"
    )
    table = []
    paper = []
    for net, meta in info.items():
        unit = meta["unit"]
        budget = GPU_BYTES - RESERVED - meta["weights_and_slots_bytes"]
        for gradients in GRADIENTS:
            if (net, "1 device", 1, gradients) not in fit:
                continue
            for n in (1, 2, 4, 8):
                if n > 1 and not ((net, "spatial", 2, gradients) in fit and (net, "spatial", 4, gradients) in fit):
                    continue
                e = extrapolated(fit, net, gradients, n)
                found = largest_side(e, budget, n, unit)
                if found is None:
                    table.append([net, gradients, n, "none fits", "", "", "", "", "", ""])
                    continue
                side, voxels, slabs = found
                peak = e["a"] + e["b"] * voxels
                halo_fwd = e.get("halo_forward", 0.0) * side**2
                halo_bwd = e.get("halo_backward", 0.0) * side**2
                halo_busy = e.get("halo_busiest_device", 0.0) * side**2
                link = e["link_a"] + e["link_b"] * side**3 if n > 1 else 0.0
                times = [f"{1e3 * halo_busy / bw:.1f} / {1e3 * link / bw:.0f}" for bw in LINKS.values()]
                table.append(
                    [
                        net,
                        gradients,
                        f"{n}{' (extrapolated)' if e.get('extrapolated') else ''}",
                        f"{side}³",
                        slabs or "-",
                        f"{peak / GIB:.1f}",
                        f"{(halo_fwd + halo_bwd) / MIB:,.0f}",
                        f"{halo_busy / MIB:,.0f} / {link / MIB:,.0f}",
                        *times,
                    ]
                )
                paper.append(
                    {
                        "net": net,
                        "gradients": gradients,
                        "n": n,
                        "side": side,
                        "slabs": slabs,
                        "peak_bytes": peak,
                        "budget_bytes": budget,
                        "halo_bytes": halo_fwd + halo_bwd,
                        "halo_busiest_device_bytes": halo_busy,
                        "busiest_link_bytes": link,
                        "extrapolated": bool(e.get("extrapolated")),
                    }
                )
    lines.append(
        markdown(
            [
                "net",
                "gradients",
                "N",
                "largest cube",
                "slab rows",
                "peak GiB",
                "halo/step MiB",
                "busiest device: halo / all transfers MiB",
                *[f"ms on {name}: halo / all" for name in LINKS],
            ],
            table,
        )
    )
    lines.append("")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    lines.append(f"Elapsed: {elapsed:.0f} s tracing and counting; peak RSS {rss:.2f} GiB")
    return "\n".join(lines), fit, paper


def placement_table(rows) -> str:
    """Per device: the variables it holds (weights + Adam's slots, read from the variables' devices) and its
    counted peak of tensors (the trainer's colocated backward pass), MiB, and the largest sum over the devices."""
    lines = [
        "Per device, MiB: variables held (weights + Adam's 2 slots, read from where the variables are) / counted peak "
        "of the step's tensors (colocated backward; gradients included), and the largest sum of the two:"
    ]
    header = ["net", "patch", "mode", "N", *[f"CPU:{d} vars / peak" for d in range(DEVICES)], "largest vars + peak"]
    table = []
    for r in rows:
        held, peaks = r["variable_bytes"], r["colocated"]["peaks"]
        devices = [f"/CPU:{d}" for d in range(r["n"])]
        cells = [f"{mib(held.get(d, 0))} / {mib(peaks.get(d, 0))}" for d in devices]
        cells += ["-"] * (DEVICES - len(cells))
        largest = max(held.get(d, 0) + peaks.get(d, 0) for d in devices)
        table.append([r["net"], f"{r['side']}³", r["mode"], r["n"], *cells, mib(largest)])
    return "\n".join(lines + [markdown(header, table)])


def plot(rows, nets, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(nets), figsize=(6.5 * len(nets), 4.8), squeeze=False)
    colors = {("1 device", 1): "black", ("spatial", 2): "tab:blue", ("spatial", 4): "tab:cyan"}
    colors.update({("pipeline", 2): "tab:red", ("pipeline", 4): "tab:orange"})
    for ax, net in zip(axes[0], nets):
        points = [r for r in rows if r["net"] == net]
        for mode, n in sorted({(r["mode"], r["n"]) for r in points}, key=lambda k: (k[1], k[0])):
            series = sorted((r for r in points if (r["mode"], r["n"]) == (mode, n)), key=lambda r: r["side"])
            xs = [r["side"] ** 3 / 1e6 for r in series]
            for gradients, style in (("tape", "-"), ("colocated", "--")):
                if n == 1 and gradients == "colocated":
                    continue
                label = "1 device" if n == 1 else f"{mode} N={n} ({gradients})"
                ys = [r[gradients]["peak_bytes"] / GIB for r in series]
                ax.plot(xs, ys, style, marker="o", ms=3, color=colors.get((mode, n), "gray"), label=label)
        ax.set_title(f"{net}: largest per-device peak, one training step (batch 2)")
        ax.set_xlabel("patch voxels (millions; cubes 64³-192³)")
        ax.set_ylabel("GiB (counted from the traced graph)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.text(
        0.01,
        0.005,
        "solid: tape.gradient (backward on device 0), dashed: tf.gradients (backward colocated: the trainer's). "
        "Spatial kinks: unequal slabs (aligned to the strides' product) where the side is not a multiple of it x N.",
        fontsize=7,
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main():
    args = parse_args()
    start = time.perf_counter()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * DEVICES)

    nets = [n for n in args.nets.split(",") if n]
    patches = [int(p) for p in args.patches.split(",")]
    devices = [int(d) for d in args.devices.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(nets) - set(NETS)
    if unknown or max(devices) > DEVICES:
        sys.exit(f"unknown nets {sorted(unknown)} or more than {DEVICES} devices")
    with tf.device("/CPU:1"):  # why the memory is counted: TensorFlow's figure is one for all CPU devices
        kept = tf.zeros([1 << 20]) + 1.0
    try:
        seen = [tf.config.experimental.get_memory_info(d)["current"] for d in ("CPU:0", "CPU:1")]
        print(f"get_memory_info current after 4 MiB on /CPU:1: CPU:0 {seen[0]:,} B, CPU:1 {seen[1]:,} B")
    except ValueError as e:
        print(f"get_memory_info on CPU: {e}")
    del kept
    rows, skipped, info = trace_all(args, nets, patches, devices, modes)
    elapsed = time.perf_counter() - start
    text, fit, paper = report(args, rows, skipped, info, elapsed)
    print()
    print(text)
    plot(rows, nets, args.plot)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "tensorflow": tf.__version__,
        "nets": info,
        "rows": rows,
        "skipped": skipped,
        "fits": [{"net": k[0], "mode": k[1], "n": k[2], "gradients": k[3], **v} for k, v in fit.items()],
        "paper_model": paper,
        "elapsed_seconds": elapsed,
    }
    args.json.write_text(json.dumps(payload, indent=1))
    shown = [p.relative_to(REPO) if p.is_relative_to(REPO) else p for p in (args.plot, args.json)]
    print(f"\nwrote {shown[0]} and {shown[1]}")


if __name__ == "__main__":
    main()
