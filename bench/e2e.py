"""One transformer forward of FLUX.1-dev and Wan2.1-14B size: float, torch.compile, torchao and
sdkiln's quantized modules, every figure from one run.

Models: diffusers' ``FluxTransformer2DModel`` with FLUX.1-dev's config (19 double and 38 single
blocks, 24 heads of 128) at 1024x1024 (4096 image + 512 text tokens), and
``WanTransformer3DModel`` with Wan2.1-T2V-14B's config (40 blocks, 40 heads of 128, FFN 13824) at
480x832, 81 frames (21 x 30 x 52 = 32760 video tokens + 512 text tokens). Weights are random
(``torch.manual_seed``), built directly on the device in the run's dtype, so a 12B model never
passes through CPU memory. On CPU the same classes run at a small config in float32 ("small
shapes"). Every row rebuilds its model from the same seed (the JSON's ``weights_checksum`` shows the
weights match) and frees it before the next; the inputs are the same fixed-seed tensors for all.

Rows (``--rows`` takes their ids):

* ``eager``: the float model (bf16 on a GPU, fp32 on CPU); every row's output is compared with
  it, so it always runs.
* ``compile``: regional ``torch.compile`` (diffusers' ``compile_repeated_blocks``: each repeated
  block compiled once, as the FLUX.1-dev cold compile of the whole model takes minutes).
* ``torchao-int8`` / ``torchao-fp8``: torchao's ``Int8DynamicActivationInt8WeightConfig`` /
  ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` on the block Linears sdkiln
  quantizes (``select_layers``: the block Linears minus the family's float list, so every one has
  M = tokens; torchao's ``_int_mm`` refuses the M = 1 modulation Linears), then regional compile.
* ``ours-w8a8`` / ``ours-fp8``: the same Linears swapped in memory for ``W8A8DynamicLinear`` /
  ``FP8DynamicLinear`` (``from_linear``: the modules a loaded package runs), compiled with
  ``sdkiln.runtime.compile.compile_transformer(..., CompileConfig(backend="sdkiln", regional=True,
  cuda_graphs=<on CUDA>))``.
* ``ours-w8a8-eager`` / ``ours-fp8-eager``: the swapped model uncompiled, with the device's kernels
  (on a GPU only: on CPU it is the reference row).
* ``ours-w8a8-ref`` / ``ours-fp8-ref``: the swapped model uncompiled on the reference ops. They run
  before ``load_device_kernels`` is called (for every model first, then the rest), so they are the
  references on any device.

Every row of ours records ``kernels``: per op, how many swapped layers the dispatcher sends to
which kernel (``sdkiln.kernels.implementation`` with each layer's real input shape, captured in
the eager row); a compiled row may fuse further (the sdkiln backend's patterns).

Per row: ``ms``, the median forward (CUDA events on a GPU, ``time.perf_counter`` on CPU, after
warm-up); ``first_call_s``, the first forward's seconds, which for a compiled row is its cold
compile (a fresh Inductor and Triton cache directory per run unless ``--warm-cache``; Inductor's
one-time start in the process is paid before the first row, ``compiler_start_s``);
``vs_float_compile`` and ``vs_float_eager`` (above 1: faster); ``rel_error``,
||y - y_eager|| / ||y_eager|| over the whole output, and ``sqnr_db``; ``peak_memory_bytes``, the
GPU allocator's peak from build to the last forward (on CPU: the process's resident peak so far,
which only grows). A row that fails or whose package is missing records why; the run goes on.

    python bench/e2e.py --model flux              # on a GPU: FLUX.1-dev size
    python bench/e2e.py --model both --quick --rows eager,compile,ours-w8a8
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

sys.path.insert(0, str(Path(__file__).resolve().parent))
import timing  # noqa: E402  (bench/timing.py: device description, timing, the report)
from e2e_models import MODELS, SEED, Model, build, make_inputs, tokens, weights_checksum  # noqa: E402
from kernel_cases import quantized_like  # noqa: E402

from sdkiln import kernels  # noqa: E402
from sdkiln.model_zoo import get_spec  # noqa: E402
from sdkiln.optimizer.layers import select_layers  # noqa: E402
from sdkiln.optimizer.registry import TransformContext  # noqa: E402
from sdkiln.runtime.quant.fp8_dynamic import FP8DynamicLinear  # noqa: E402
from sdkiln.runtime.quant.w8a8_dynamic import W8A8DynamicLinear  # noqa: E402


def quantized_names(transformer: nn.Module, model: Model) -> tuple[list[str], list[str]]:
    """(the Linears sdkiln's quantization steps take, the in-block Linears kept in float)."""
    ctx = TransformContext(SimpleNamespace(transformer=transformer), get_spec(model.spec), None)
    targets, kept = select_layers(ctx)
    return [t.layer for t in targets], kept


def swap(transformer: nn.Module, names: list[str], module_class) -> None:
    for name in names:
        parent, _, leaf = name.rpartition(".")
        setattr(
            transformer.get_submodule(parent), leaf, module_class.from_linear(transformer.get_submodule(name))
        )


def compile_regional(transformer: nn.Module) -> str:
    """Compile each repeated block (diffusers' ``compile_repeated_blocks``), else every block of
    the spec's block lists; returns how."""
    if getattr(transformer, "_repeated_blocks", None):
        transformer.compile_repeated_blocks()
        return f"diffusers compile_repeated_blocks ({', '.join(transformer._repeated_blocks)})"
    raise RuntimeError(f"{type(transformer).__name__} declares no _repeated_blocks to compile regionally")


def torchao_quantize(transformer: nn.Module, names: list[str], kind: str) -> str:
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8DynamicActivationInt8WeightConfig,
        PerRow,
        quantize_,
    )

    if kind == "int8":
        config, text = Int8DynamicActivationInt8WeightConfig(), "Int8DynamicActivationInt8WeightConfig()"
    else:
        config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
        text = "Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())"
    wanted = set(names)
    quantize_(transformer, config, filter_fn=lambda m, fqn: fqn in wanted)
    quantized = {
        n for n, m in transformer.named_modules() if is_traceable_wrapper_subclass(getattr(m, "weight", None))
    }
    if quantized != wanted:
        raise RuntimeError(
            f"torchao quantized other layers than sdkiln's set: extra {sorted(quantized - wanted)[:5]}, "
            f"missing {sorted(wanted - quantized)[:5]}"
        )
    return f"torchao.quantization.quantize_(transformer, {text}, filter_fn=<sdkiln's layer set>)"


def _missing(row: Row, device: torch.device) -> str | None:
    """Why a row cannot run here (a package or the compile contract is missing), before building."""
    if row.quantize and row.quantize.startswith("torchao") and importlib.util.find_spec("torchao") is None:
        return "torchao is not importable (pip install torchao)"
    if row.compile == "sdkiln":
        try:
            from sdkiln.configs.runtime import CompileConfig
            from sdkiln.runtime.compile import compile_transformer  # noqa: F401

            CompileConfig(backend="sdkiln", regional=True, cuda_graphs=device.type == "cuda")
        except Exception as exc:
            return f"sdkiln's compile contract is not available: {timing.error_text(exc)}"
    return None


def compile_ours(transformer: nn.Module, device: torch.device) -> tuple[nn.Module, str]:
    from sdkiln.configs.runtime import CompileConfig
    from sdkiln.runtime.compile import compile_transformer

    config = CompileConfig(backend="sdkiln", regional=True, cuda_graphs=device.type == "cuda")
    return compile_transformer(transformer, config), repr(config)


def kernels_that_run(transformer: nn.Module, input_shapes: dict[str, torch.Size], device, dtype) -> dict:
    """For each op our swapped modules call: kernel name -> how many layers run it, asked of
    ``sdkiln.kernels.implementation`` with each layer's real input shape."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for name, module in transformer.named_modules():
        if name not in input_shapes or not isinstance(module, W8A8DynamicLinear | FP8DynamicLinear):
            continue
        x = torch.empty(input_shapes[name], device=device, dtype=dtype)
        fp8 = isinstance(module, FP8DynamicLinear)
        quantize, linear = (
            ("fp8_quantize_per_token", "fp8_linear") if fp8 else ("quantize_per_token_int8", "w8a8_linear")
        )
        q, s = quantized_like(x, torch.float8_e4m3fn if fp8 else torch.int8)
        counts[quantize][kernels.implementation(quantize, device.type, x)] += 1
        args = (q, s, module.weight, module.weight_scale, module.bias, dtype)
        counts[linear][kernels.implementation(linear, device.type, *args)] += 1
        del x, q, s
    return {op: dict(c) for op, c in counts.items()}


@dataclass(frozen=True)
class Row:
    id: str
    title: str
    quantize: str | None = None
    """None, "torchao-int8", "torchao-fp8", or one of our schemes ("W8A8_DYNAMIC", "FP8_DYNAMIC")"""
    compile: str | None = None
    """None, "inductor" (regional torch.compile) or "sdkiln" (our backend)"""
    device_kernels: bool = True
    """False: must run before the device's kernels are loaded (the reference ops)"""
    gpu_only: str = ""
    """why the row is skipped on CPU, if it is"""


OURS = {"W8A8_DYNAMIC": W8A8DynamicLinear, "FP8_DYNAMIC": FP8DynamicLinear}
ROWS = (
    Row("eager", "float eager", device_kernels=False),
    Row(
        "ours-w8a8-ref",
        "sdkiln W8A8_DYNAMIC, reference ops, no compile",
        "W8A8_DYNAMIC",
        device_kernels=False,
    ),
    Row("ours-fp8-ref", "sdkiln FP8_DYNAMIC, reference ops, no compile", "FP8_DYNAMIC", device_kernels=False),
    Row("compile", "float torch.compile (regional)", compile="inductor"),
    Row("torchao-int8", "torchao int8-dynamic + torch.compile (regional)", "torchao-int8", "inductor"),
    Row("torchao-fp8", "torchao fp8 row-wise + torch.compile (regional)", "torchao-fp8", "inductor"),
    Row(
        "ours-w8a8-eager",
        "sdkiln W8A8_DYNAMIC, device kernels, no compile",
        "W8A8_DYNAMIC",
        gpu_only="on CPU the device kernels are the reference ops: see ours-w8a8-ref",
    ),
    Row(
        "ours-fp8-eager",
        "sdkiln FP8_DYNAMIC, device kernels, no compile",
        "FP8_DYNAMIC",
        gpu_only="on CPU the device kernels are the reference ops: see ours-fp8-ref",
    ),
    Row("ours-w8a8", "sdkiln W8A8_DYNAMIC + compile (sdkiln backend)", "W8A8_DYNAMIC", "sdkiln"),
    Row("ours-fp8", "sdkiln FP8_DYNAMIC + compile (sdkiln backend)", "FP8_DYNAMIC", "sdkiln"),
)
ROW_IDS = tuple(r.id for r in ROWS)


def _free(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()
    timing.release(device)


def run_row(
    row: Row, model: Model, device, dtype, clock: timing.Clock, state: dict[str, Any]
) -> dict[str, Any]:
    """Build, transform, compile, time and compare one row; ``state`` carries the eager output, the
    layer input shapes and the checksum of the first build."""
    record: dict[str, Any] = {"id": row.id, "title": row.title}
    if row.gpu_only and device.type == "cpu":
        return record | {"status": "skipped", "reason": row.gpu_only}
    if row.id != "eager" and "reference_output" not in state:
        return record | {"status": "skipped", "reason": "the eager row did not produce a reference output"}
    missing = _missing(row, device)
    if missing:
        return record | {"status": "not available", "error": missing}
    timing.reset_peak_memory(device)
    transformer = None
    try:
        started = time.perf_counter()
        transformer = build(model, device, dtype)
        record["weights_checksum"] = weights_checksum(transformer)
        names, kept = quantized_names(transformer, model)
        hooks = []
        if row.id == "eager":
            shapes = state["input_shapes"] = {}
            for name in names:
                hook = lambda mod, args, name=name: shapes.__setitem__(name, tuple(args[0].shape))  # noqa: E731
                hooks.append(transformer.get_submodule(name).register_forward_pre_hook(hook))
        if row.quantize in OURS:
            swap(transformer, names, OURS[row.quantize])
            record["kernels"] = kernels_that_run(transformer, state["input_shapes"], device, dtype)
        elif row.quantize:
            record["applied"] = torchao_quantize(transformer, names, row.quantize.removeprefix("torchao-"))
        if row.quantize:
            record |= {"quantized_layers": len(names), "float_layers_in_blocks": len(kept)}
        if row.compile == "inductor":
            record["compiled"] = compile_regional(transformer)
        elif row.compile == "sdkiln":
            transformer, record["compiled"] = compile_ours(transformer, device)
        timing.sync(device)
        record["prepare_s"] = time.perf_counter() - started
        with torch.no_grad():
            forward = lambda module, inputs: module(**inputs)[0]  # noqa: E731
            timed, out = clock.measure(forward, [(transformer, make_inputs(model, device, dtype))])
        for hook in hooks:
            hook.remove()
        record |= timed | timing.peak_memory(device)
        out = out.detach().double().cpu()
        record["finite"] = bool(torch.isfinite(out).all())
        if row.id == "eager":
            state["reference_output"] = out
            state["checksum"] = record["weights_checksum"]
        ref = state["reference_output"]
        record["rel_error"] = float((out - ref).norm() / ref.norm())
        record["sqnr_db"] = timing.capped_sqnr(ref, out)
        if record["weights_checksum"] != state["checksum"]:
            record["warning"] = "weights differ from the eager row's build: the errors compare other models"
        record["status"] = "ok"
    except ImportError as exc:
        record |= {"status": "not installed", "error": timing.error_text(exc)}
    except Exception as exc:
        record |= {"status": "failed", "error": timing.error_text(exc)}
    del transformer
    _free(device)
    return record


def _ratios(rows: list[dict[str, Any]]) -> None:
    by_id = {r["id"]: r for r in rows if r.get("status") == "ok"}
    for r in rows:
        if "ms" not in r:
            continue
        for base in ("compile", "eager"):
            if base in by_id:
                r[f"vs_float_{base}"] = by_id[base]["ms"] / r["ms"]


@contextlib.contextmanager
def fresh_compile_caches(enabled: bool):
    """Inductor's and Triton's caches in a new directory, so the first compiled call is cold."""
    if not enabled:
        yield None
        return
    root = tempfile.mkdtemp(prefix="sdkiln-e2e-cache-")
    saved = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{root}/inductor"
    os.environ["TRITON_CACHE_DIR"] = f"{root}/triton"
    try:
        yield root
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(root, ignore_errors=True)


def run(
    models: tuple[str, ...] = ("flux", "wan"),
    device: str = "auto",
    quick: bool = False,
    rows: tuple[str, ...] = ROW_IDS,
    warm_cache: bool = False,
    repeats: int | None = None,
) -> dict[str, Any]:
    """Measure ``rows`` on ``models``; returns the report ``main`` writes as JSON."""
    unknown = sorted(set(rows) - set(ROW_IDS)) + sorted(set(models) - set(MODELS))
    if unknown:
        raise ValueError(
            f"unknown rows or models {unknown}; rows: {', '.join(ROW_IDS)}; models: {', '.join(MODELS)}"
        )
    started, load_at_start = time.perf_counter(), os.getloadavg()
    dev = kernels.resolve_device(device)
    small = dev.type == "cpu"
    dtype = torch.float32 if small else torch.bfloat16
    if small:
        settings = timing.Settings(1, 2, 5.0) if quick else timing.Settings(1, 5, 10.0)
    else:
        settings = timing.Settings(1, 3, 20.0) if quick else timing.Settings(2, 10, 60.0)
    settings.min_repeats, settings.slow_first_is_estimate = 1, True
    if repeats is not None:
        settings.repeats = repeats
    clock = timing.Clock(dev, settings)
    note = "CPU run: small configs of the same classes, float32; not GPU figures" if small else None
    info = timing.announce(dev, dtype, note)

    chosen = [r for r in ROWS if r.id in rows or r.id == "eager"]  # eager: every error is against it
    built = {name: MODELS[name](small) for name in models}
    states: dict[str, dict[str, Any]] = {name: {} for name in models}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in models}
    loaded, compiler_start_s = None, None
    with fresh_compile_caches(not warm_cache and any(r.compile for r in chosen)) as cache_dir:
        if any(r.compile for r in chosen):
            compiler_start_s = timing.start_compiler(dev)
        for phase in (False, True):
            for name, model in built.items():
                for row in (r for r in chosen if r.device_kernels == phase):
                    if phase and loaded is None:
                        loaded = timing.load_kernels(dev)
                        print(f"device kernels: {loaded}", file=sys.stderr)
                    record = run_row(row, model, dev, dtype, clock, states[name])
                    results[name].append(record)
                    print(f"{name} {_line(record)}", file=sys.stderr)

    report_models = []
    for name, model in built.items():
        order = {r.id: i for i, r in enumerate(ROWS)}
        rows_out = sorted(results[name], key=lambda r: order[r["id"]])
        _ratios(rows_out)
        report_models.append(
            {
                "model": name,
                "diffusers_class": model.diffusers_class,
                "config": model.config,
                "config_is": "small (CPU)"
                if small
                else ("FLUX.1-dev" if name == "flux" else "Wan2.1-T2V-14B"),
                "inputs": model.inputs,
                "tokens": tokens(model),
                "layer_input_shapes": {k: list(v) for k, v in states[name].get("input_shapes", {}).items()},
                "rows": rows_out,
            }
        )
    return {
        "benchmark": "one transformer forward: float, torch.compile, torchao, sdkiln (bench/e2e.py)",
        "small_shapes": small,
        "note": "CPU run: small configs, float32; checks the bench, not GPU figures" if small else None,
        "device": info,
        "device_kernels": loaded,
        "settings": {
            "dtype": str(dtype).removeprefix("torch."),
            "quick": quick,
            "seed": SEED,
            "timing": clock.describe(),
            "compile_cache": "fresh per run" if cache_dir else "the user's (warm)",
            "compiler_start_s": compiler_start_s,
            "load_average_1_5_15min": {"start": load_at_start, "end": os.getloadavg()},
        },
        "models": report_models,
        "total_seconds": time.perf_counter() - started,
    }


def _line(r: dict[str, Any]) -> str:
    if r.get("status") != "ok":
        return f"{r['id']}: {r.get('status')} ({r.get('reason') or r.get('error')})"
    return (
        f"{r['id']}: {r['ms']:.4g} ms, first call {r['first_call_s']:.3g} s, rel error {r['rel_error']:.3g}, "
        f"peak {r['peak_memory_bytes'] / 2**30:.2f} GiB"
    )


def _fmt(row: dict[str, Any], key: str, spec: str) -> str:
    return format(row[key], spec) if key in row else "-"


def table(report: dict[str, Any]) -> str:
    head = [
        "model",
        "row",
        "ms",
        "first call s",
        "vs compile",
        "vs eager",
        "rel error",
        "SQNR dB",
        "peak GiB",
        "kernels / why not",
    ]
    lines = [head]
    for m in report["models"]:
        for r in m["rows"]:
            if r.get("status") != "ok":
                why = (r.get("reason") or r.get("error", "")).splitlines()[0][:160]
                lines.append([m["model"], r["id"], r.get("status", "")] + [""] * 6 + [why])
                continue
            used = sorted({k for counts in r.get("kernels", {}).values() for k in counts})
            lines.append(
                [
                    m["model"],
                    r["id"],
                    _fmt(r, "ms", ".4g"),
                    _fmt(r, "first_call_s", ".3g"),
                    _fmt(r, "vs_float_compile", ".2f"),
                    _fmt(r, "vs_float_eager", ".2f"),
                    _fmt(r, "rel_error", ".3g"),
                    _fmt(r, "sqnr_db", ".1f"),
                    f"{r['peak_memory_bytes'] / 2**30:.2f}",
                    ",".join(used) or "-",
                ]
            )
    out = timing.align(lines)
    if report["small_shapes"]:
        out.append("CPU run at small shapes (float32): these figures check the bench, not GPU speed.")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("flux", "wan", "both"), default="both")
    parser.add_argument("--device", default="auto", help="auto (the accelerator, else CPU), cpu or cuda")
    parser.add_argument("--quick", action="store_true", help="fewer timed forwards")
    parser.add_argument(
        "--rows", default=",".join(ROW_IDS), help=f"comma-separated, from: {', '.join(ROW_IDS)}"
    )
    parser.add_argument("--repeats", type=int, help="most timed forwards per row")
    parser.add_argument("--warm-cache", action="store_true", help="keep the user's Inductor/Triton caches")
    timing.report_arguments(parser, "e2e")
    args = parser.parse_args(argv)
    models = ("flux", "wan") if args.model == "both" else (args.model,)
    rows = tuple(r.strip() for r in args.rows.split(",") if r.strip())
    return timing.run_or_show_table(
        args,
        argv,
        "e2e",
        lambda: run(models, args.device, args.quick, rows, args.warm_cache, args.repeats),
        table,
    )


if __name__ == "__main__":
    main()
