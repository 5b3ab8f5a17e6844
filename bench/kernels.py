"""sdkiln's ops against torch eager and torch.compile, per op and shape, in one run.

Every case (one op at one shape) runs these on the same inputs:

* ``ours``: ``torch.ops.sdkiln.<op>`` after ``sdkiln.kernels.load_device_kernels(device)``. The row
  records which kernel ran (``sdkiln.kernels.implementation`` with the case's arguments):
  "reference" on CPU; on CUDA the Triton kernels' "triton", and "scaled_mm" for ``fp8_linear``.
* ``eager``: the plain torch formula in the input dtype: bfloat16 on a GPU, float32 on CPU (where
  a bf16 matmul is about 2x slower than fp32, so fp32 is the honest float baseline). Quantized
  linears run *with* their activation quantization (quantize + linear) against the float
  ``F.linear``; block-sparse and quantized attention (INT8 QKᵀ with FP8 PV, and all-FP8, rotated,
  its quantization of Q/K/V included) against dense ``F.scaled_dot_product_attention`` (flash on a GPU).
* ``compile``: ``torch.compile`` of that formula, cold (``torch._dynamo.reset()`` first); its first
  call's seconds are recorded.
* peers, where one exists: the quantized formula as Inductor compiles it (``torch._int_mm``,
  ``torch._scaled_mm``, dequantize-then-matmul for weight-only), our dense ``attention`` and, on CUDA,
  FlexAttention with the same block mask.

Method. GPU: CUDA events around each call after a warm-up, the median of the timed calls. CPU:
``time.perf_counter`` around each call, the same median. Inputs rotate through several sets, each
with its own weights, together at least ``ROTATE_BYTES`` (five times an H100's 50 MB L2), so a
small shape is not flattered by a warm cache. A call's time includes its Python dispatch, as a
model run without CUDA graphs pays it. The number of calls adapts to a time budget per
implementation (a reference op on CUDA can take seconds); the row records how many ran.

Rates: TFLOP/s for GEMMs and attention (2 flops a multiply-add; block-sparse attention counts its
kept blocks only), GB/s for the rest (the bytes ours reads and writes, each once: the least traffic
an implementation of the op can have; the same figure rates every implementation of a case).
``fraction_of_peak`` divides by a peak measured in the same run: a bf16 (CPU: fp32) ``torch.mm`` at
the largest GEMM shape of the shape set, and a device-to-device copy. ``sqnr_db`` compares each
implementation's output with eager's (quantized values dequantized with their scales), capped at
``SQNR_CAP_DB``. An implementation that fails records its error; the run goes on.

    python bench/kernels.py                          # every op: GPU shapes on a GPU, small on CPU
    python bench/kernels.py --quick --ops rms_norm,w8a8_linear --out /tmp/k.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import timing  # noqa: E402  (bench/timing.py: device description, timing, peaks, the report)
from kernel_cases import CPU_SHAPES, EPS, GPU_SHAPES, INT4_GROUP, OPS, Case, build_cases  # noqa: E402

from sdkiln import kernels  # noqa: E402


def _outputs(out) -> list[Tensor]:
    return list(out) if isinstance(out, tuple | list) else [out]


def comparable(out) -> Tensor:
    """An output as fp32 values: quantized (values, scales) dequantized, (out, lse) its out."""
    if isinstance(out, tuple | list):
        values, second = out[0], out[1]
        if values.dtype in (torch.int8, torch.float8_e4m3fn):
            return values.float() * second
        return values.float()
    return out.float()


def _free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free


def run_case(
    case: Case, clock: timing.Clock, device, do_compile: bool, peaks: dict[str, float]
) -> dict[str, Any]:
    row: dict[str, Any] = {"op": case.op, **case.shape, "bound": case.bound}
    try:
        sets = timing.rotating_sets(case.make)
        row["kernel"] = case.kernels(sets[0])
    except Exception as exc:
        timing.release(device)
        return row | {"error": f"inputs: {timing.error_text(exc)}"}
    row["input_sets"] = len(sets)
    read_bytes = timing.nbytes(case.reads(sets[0]) if case.reads else sets[0])

    impls: dict[str, tuple[Callable, bool]] = {"eager": (case.eager, False), "ours": (case.ours, False)}
    impls["compile"] = (case.eager, True)
    impls |= {name: (fn, name in case.compiled_peers) for name, fn in case.peers.items()}
    reference = None
    results: dict[str, dict[str, Any]] = {}
    for name, (fn, compiled) in impls.items():
        if compiled and not do_compile:
            results[name] = {"skipped": "--no-compile"}
            continue
        free = _free_bytes(device)
        if free is not None and name in case.reference_guard:
            need, runs = case.reference_guard[name]
            if runs(sets[0]) == "reference" and need > 0.8 * free:
                results[name] = {
                    "skipped": f"the reference op would need about {need / 2**30:.1f} GiB "
                    f"(free: {free / 2**30:.1f} GiB)"
                }
                continue
        try:
            if compiled:
                torch._dynamo.reset()
                fn = torch.compile(fn, dynamic=False)
            result = clock.measure(fn, sets)[0]
            out = fn(*sets[0])
            if name in ("eager", "ours"):  # ours' output sizes rate the case; eager's when ours fails
                row["write_bytes"] = timing.nbytes(_outputs(out))
            values = comparable(out)
            del out
            if name == "eager":
                reference = values
            elif reference is not None and case.compare:
                result["sqnr_db"] = timing.capped_sqnr(reference, values)
            del values
        except Exception as exc:
            result = {"error": timing.error_text(exc)}
            timing.release(device)
        results[name] = result
    del reference, sets
    timing.release(device)

    moved = read_bytes + row.get("write_bytes", 0)
    row["read_bytes"] = read_bytes
    row["flops"] = case.flops or None
    ours_ms = results.get("ours", {}).get("ms")
    for result in results.values():
        if "ms" not in result:
            continue
        seconds = result["ms"] / 1e3
        result["gb_per_s"] = moved / seconds / 1e9
        if case.flops:
            result["tflop_per_s"] = case.flops / seconds / 1e12
        rate, peak = (
            (result.get("tflop_per_s"), peaks.get("matmul_tflop_per_s"))
            if case.bound == "compute"
            else (result["gb_per_s"], peaks.get("copy_gb_per_s"))
        )
        if rate is not None and peak:
            result["fraction_of_peak"] = rate / peak
        if ours_ms and result is not results.get("ours"):
            result["over_ours"] = result["ms"] / ours_ms
    row["results"] = results
    return row


def run(
    device: str = "auto",
    quick: bool = False,
    ops: tuple[str, ...] = OPS,
    do_compile: bool = True,
    repeats: int | None = None,
) -> dict[str, Any]:
    """Measure ``ops`` on ``device``; returns the report ``main`` writes as JSON."""
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise ValueError(f"unknown ops {unknown}; known: {', '.join(OPS)}")
    started, load_at_start = time.perf_counter(), os.getloadavg()
    dev = kernels.resolve_device(device)
    gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    shapes = GPU_SHAPES if gpu else CPU_SHAPES
    shapes = (shapes[0], shapes[-1]) if quick and gpu else shapes[:1] if quick else shapes
    if gpu:
        settings = timing.Settings(3, 10, 0.3) if quick else timing.Settings(10, 50, 0.5)
    else:
        settings = timing.Settings(1, 3, 0.2, min_repeats=2) if quick else timing.Settings(2, 10, 1.0)
    if repeats is not None:
        settings.repeats = repeats
    torch.manual_seed(0)
    loaded = timing.load_kernels(dev)
    clock = timing.Clock(dev, settings)
    note = None if gpu else "CPU run: small shapes, float32 baseline; the figures say nothing about a GPU"
    info = timing.announce(dev, dtype, note)

    largest = max(shapes, key=lambda s: s.tokens * s.hidden * s.ffn)
    gemm = (largest.tokens, largest.hidden, largest.ffn)
    peaks, rates = timing.device_peaks(clock, gemm, dtype, 2**30 if gpu else 64 * 2**20)

    compiler_start_s = timing.start_compiler(dev) if do_compile else None
    rows = []
    for case in build_cases(shapes, dev, dtype, quick, ops):
        row = run_case(case, clock, dev, do_compile, rates)
        rows.append(row)
        print(_line(row), file=sys.stderr)

    return {
        "benchmark": "sdkiln ops vs torch eager and torch.compile (bench/kernels.py)",
        "small_shapes": not gpu,
        "note": None if gpu else "CPU run at small shapes: checks the bench end to end; not GPU figures",
        "device": info,
        "device_kernels": loaded,
        "settings": {
            "dtype": str(dtype).removeprefix("torch."),
            "quick": quick,
            "compile": do_compile,
            "compiler_start_s": compiler_start_s,
            "shapes": [asdict(s) for s in shapes],
            "timing": clock.describe(),
            "rotate_bytes": timing.ROTATE_BYTES,
            "max_input_sets": timing.MAX_SETS,
            "eps": EPS,
            "int4_group_size": INT4_GROUP,
            "load_average_1_5_15min": {"start": load_at_start, "end": os.getloadavg()},
        },
        "peaks": peaks,
        "rows": rows,
        "total_seconds": time.perf_counter() - started,
    }


DESCRIBE = ("x", "qdtype", "weight", "M", "K", "N", "S", "H", "D", "sparsity")


def _describe(row: dict[str, Any]) -> str:
    """The few shape fields that tell a case from its neighbours, e.g. ``x=1x256x256 qdtype=int8``."""
    fields = []
    for key in DESCRIBE:
        if key in row:
            value = row[key]
            fields.append(f"{key}={'x'.join(map(str, value)) if isinstance(value, list) else value}")
    return " ".join(fields)


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['op']} {row.get('shape')}: ERROR {row['error']}"
    parts = []
    for name, r in row["results"].items():
        parts.append(
            f"{name} {r['ms']:.4g} ms"
            if "ms" in r
            else f"{name} {'ERROR ' + r['error'] if 'error' in r else r['skipped']}"
        )
    return (
        f"{row['op']} {row['shape']} {_describe(row)} [{','.join(sorted(set(row['kernel'].values())))}]: "
        + "; ".join(parts)
    )


def table(report: dict[str, Any]) -> str:
    """The rows as a text table: times, eager/ours and compile/ours (above 1: ours is faster), ours'
    rate and its fraction of the measured peak, ours' SQNR against eager; peers on their own lines."""
    head = [
        "op",
        "shape",
        "kernel",
        "ours ms",
        "eager ms",
        "compile ms",
        "eager/ours",
        "compile/ours",
        "ours rate",
        "% peak",
        "SQNR dB",
    ]
    lines = [head]
    for row in report["rows"]:
        if "error" in row:
            lines.append([row["op"], row.get("shape", ""), "ERROR", row["error"][:60]] + [""] * 7)
            continue
        res = row["results"]
        ours, eager, comp = res.get("ours", {}), res.get("eager", {}), res.get("compile", {})

        def ms(r):
            return f"{r['ms']:.4g}" if "ms" in r else ("err" if "error" in r else "skip")

        def ratio(r):
            return f"{r['over_ours']:.2f}" if "over_ours" in r else "-"

        rate = "-"
        if "ms" in ours:
            rate = (
                f"{ours['tflop_per_s']:.3g} TFLOP/s"
                if row["bound"] == "compute"
                else f"{ours['gb_per_s']:.3g} GB/s"
            )
        frac = f"{100 * ours['fraction_of_peak']:.0f}" if "fraction_of_peak" in ours else "-"
        sq = f"{ours['sqnr_db']:.1f}" if "sqnr_db" in ours else "-"
        kernel = ",".join(sorted(set(row["kernel"].values())))
        lines.append(
            [
                row["op"],
                f"{row['shape']} {_describe(row)}",
                kernel,
                ms(ours),
                ms(eager),
                ms(comp),
                ratio(eager),
                ratio(comp),
                rate,
                frac,
                sq,
            ]
        )
        for name, r in res.items():
            if name not in ("ours", "eager", "compile"):
                lines.append(f"{'':30}  peer {name}: {ms(r)} ms, peer/ours {ratio(r)}")
    out = timing.align(lines)
    peaks = report["peaks"]
    out.append(
        f"peaks: matmul {peaks['matmul'].get('tflop_per_s', float('nan')):.2f} TFLOP/s "
        f"({peaks['matmul'].get('dtype', '')} {peaks['matmul'].get('M')}x{peaks['matmul'].get('K')}x{peaks['matmul'].get('N')}), "
        f"copy {peaks['copy'].get('gb_per_s', float('nan')):.1f} GB/s"
    )
    if report["small_shapes"]:
        out.append(
            "CPU run at small shapes (float32 baseline): these figures check the bench, not GPU speed."
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (the accelerator, else CPU), cpu or cuda")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and calls")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from: {', '.join(OPS)}")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile columns")
    parser.add_argument("--repeats", type=int, help="most timed calls per implementation")
    timing.report_arguments(parser, "kernels")
    args = parser.parse_args(argv)
    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    return timing.run_or_show_table(
        args,
        argv,
        "kernels",
        lambda: run(args.device, args.quick, ops, not args.no_compile, args.repeats),
        table,
    )


if __name__ == "__main__":
    main()
