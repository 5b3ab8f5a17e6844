"""sdkiln's quantization schemes against torchao and optimum-quanto on one model, in one run.

Every method starts from the same float pipeline and generates the same prompts with the same
seeds (``sample_plan``: sample i uses eval prompt i mod 10 and seed ``--seed`` + i); the float
images are generated once and every method is scored against them. Per method:

* ``transformer_bytes``: the bytes of the transformer's state-dict tensors. A tensor subclass
  (torchao's ``Int8Tensor``, quanto's ``WeightQBytesTensor``) is counted by the plain tensors it
  holds (``__tensor_flatten__``: int8 data, scales, zero points), recursively -- its real storage,
  not the nominal float size its wrapper reports.
* ``psnr`` / ``ssim``: the images against the float model's (mean over samples, PSNR capped at
  100 dB as in ``sdkiln.optimizer.evaluate``); ``class_accuracy`` / ``fd_fmnist``: the model
  family's own metrics (``spec.metrics``), also for the float model.
* per-layer SQNR: the float model's quantizable Linear inputs are captured during a short
  generation (``--sqnr-samples`` samples, every ``--sqnr-stride``-th denoising step and the last);
  each method's quantized module runs on the same inputs at the same steps, and SQNR =
  10 log10(sum |y_float|^2 / sum |y_float - y_quant|^2) per layer; ``sqnr_min_db`` and
  ``sqnr_median_db`` over the method's quantized layers. A layer whose SmoothQuant factor s was
  folded into its modulation gets the input x / s, which is what it reads inside the model.
* ``seconds_per_batch``: wall time of ``generate`` per batch of ``--batch-size`` samples on this
  CPU with the stated thread count; informational only.

Peers quantize exactly the layers sdkiln's steps take (``select_layers``: the block Linears minus
the family's float list), through torchao's ``filter_fn`` and quanto's ``include``; the set is
checked after quantization. A peer that is not installed or fails is recorded with its error.

    python bench/quant.py                       # the embedded model, every method
    python bench/quant.py --markdown bench/results/quant_fmnist.json   # the docs table
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (bench/harness.py: machine description, timed generation, scoring)

import sdkiln
from sdkiln import metrics
from sdkiln.calibrate.observers import observing
from sdkiln.configs import Deployment, RecipeConfig, SmoothQuantConfig
from sdkiln.errors import RecipeError
from sdkiln.model_zoo import get_spec
from sdkiln.model_zoo.fingerprint import weights_hash
from sdkiln.optimizer.evaluate import generate, sample_plan
from sdkiln.optimizer.layers import select_layers
from sdkiln.optimizer.quant.calibration import STATS_FILE
from sdkiln.optimizer.recipes import resolve_recipe
from sdkiln.optimizer.registry import TransformContext

SQNR_CAP_DB = 100.0
"""A layer whose quantized output equals the float one has infinite SQNR; the JSON caps it here."""


def transformer_bytes(model: nn.Module) -> int:
    """Bytes of the state dict's tensors, a tensor subclass counted by the plain tensors it holds."""

    def nbytes(t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        if is_traceable_wrapper_subclass(t):
            inner, _ = t.__tensor_flatten__()
            return sum(nbytes(getattr(t, name)) for name in inner)
        return t.numel() * t.element_size()

    return sum(nbytes(t) for t in model.state_dict().values())


def _torchao(config_name: str):
    def quantize(transformer: nn.Module, names: set[str]) -> str:
        from torchao import quantization

        config = getattr(quantization, config_name)()
        quantization.quantize_(transformer, config, filter_fn=lambda m, fqn: fqn in names)
        return f"torchao.quantization.quantize_(model, {config_name}(), filter_fn=<sdkiln's layer set>)"

    return quantize


def _quanto_qint8(transformer: nn.Module, names: set[str]) -> str:
    from optimum.quanto import freeze, qint8, quantize

    quantize(transformer, weights=qint8, include=sorted(names))
    freeze(transformer)
    return "optimum.quanto.quantize(model, weights=qint8, include=<sdkiln's layer set>); freeze(model)"


PEERS = {
    "torchao-int8-dynamic": _torchao("Int8DynamicActivationInt8WeightConfig"),
    "torchao-int8-weight-only": _torchao("Int8WeightOnlyConfig"),
    "quanto-qint8-weight-only": _quanto_qint8,
}
PEER_PACKAGES = {
    "torchao-int8-dynamic": "torchao",
    "torchao-int8-weight-only": "torchao",
    "quanto-qint8-weight-only": "optimum-quanto",
}

OURS = (
    "w8a8-dynamic",
    "w8a8-dynamic+smoothquant",
    "w8a8-dynamic-gptq",
    "w8a8-static",
    "w8a8-static+smoothquant",
    "w8a8-timestep",
    "fp8-dynamic",
    "w8a16",
    "w8a16-gptq",
    "w4a16",
    "w4a16-gptq",
    "quant-auto",
)
METHODS = (*OURS, *PEERS)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "quant_fmnist.json"
PACKAGES = ("torch", "diffusers", "transformers", "torchao", "optimum-quanto", "sdkiln")


@dataclasses.dataclass
class LayerInputs:
    """Inputs of the float model's quantizable Linears, captured at ``steps`` of a short generation."""

    steps: list[int]
    num_steps: int
    inputs: dict[str, list[tuple[int, torch.Tensor]]]


def capture_layer_inputs(base, spec, names, call, prompts, seeds, stride: int) -> LayerInputs:
    num_steps = call["num_inference_steps"]
    keep = sorted(set(range(0, num_steps, stride)) | {num_steps - 1})
    inputs: dict[str, list[tuple[int, torch.Tensor]]] = {n: [] for n in names}

    def recorder(name: str):
        def record(x: torch.Tensor, step: int, _num_steps: int) -> None:
            if step in keep:
                inputs[name].append((step, x.detach().clone()))

        return record

    with observing(base, spec.transformer_attr, {n: recorder(n) for n in names}):
        generate(base, call, prompts, seeds, batch_size=len(prompts), desc="capture")
    return LayerInputs(keep, num_steps, inputs)


def _run_ours(module: nn.Module, inverse_scale: torch.Tensor | None, num_steps: int, x, step: int):
    """One of our quantized modules on a float input at denoising ``step``."""
    if inverse_scale is not None:
        x = (x.float() * inverse_scale).to(x.dtype)
    stepped = [m for m in module.modules() if getattr(m, "needs_step", False)]
    for m in stepped:
        m.set_step(step, num_steps)  # what DenoisingStepTracker does before a call
    try:
        return module(x)
    finally:
        for m in stepped:
            m.set_step(None, None)


def our_layers(result, spec, num_steps: int) -> dict[str, Callable[[torch.Tensor, int], torch.Tensor]]:
    """``layer -> f(x, step)`` for every layer the manifest swaps. A layer whose SmoothQuant factor
    was folded into its modulation reads x / s inside the model, so it gets x / s here too."""
    transformer = getattr(result.pipeline, spec.transformer_attr)
    folded = {
        name
        for step in result.manifest["recipe"]["steps"]
        if step["config"]["kind"] == SmoothQuantConfig.kind
        for name in step["result"]["folded"]
    }
    stats = result.files.get(STATS_FILE, {})
    layers = {}
    for name in result.manifest["modules"]:
        inverse = 1.0 / stats[f"{SmoothQuantConfig.kind}/{name}.smooth_scale"] if name in folded else None
        layers[name] = functools.partial(_run_ours, transformer.get_submodule(name), inverse, num_steps)
    return layers


def peer_layers(
    transformer: nn.Module, names: list[str]
) -> dict[str, Callable[[torch.Tensor, int], torch.Tensor]]:
    """``layer -> f(x, step)`` for a peer's layers, after checking it quantized exactly ``names``."""
    quantized = {
        n for n, m in transformer.named_modules() if is_traceable_wrapper_subclass(getattr(m, "weight", None))
    }
    if quantized != set(names):
        extra, missing = sorted(quantized - set(names)), sorted(set(names) - quantized)
        raise RuntimeError(
            f"the peer quantized other layers than sdkiln's set: extra {extra}, missing {missing}"
        )
    return {n: functools.partial(_run_peer, transformer.get_submodule(n)) for n in names}


def _run_peer(module: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
    return module(x)


@torch.inference_mode()
def layer_sqnr(
    float_model: nn.Module, layers: dict[str, Callable], captured: LayerInputs
) -> dict[str, float]:
    """SQNR in dB per layer: float output energy over error energy, summed over the captured inputs."""
    out = {}
    for name, run_layer in layers.items():
        reference, energy, error = float_model.get_submodule(name), 0.0, 0.0
        for step, x in captured.inputs[name]:
            y = reference(x).double()
            energy += float(y.pow(2).sum())
            error += float((y - run_layer(x, step).double()).pow(2).sum())
        out[name] = min(SQNR_CAP_DB, metrics.ratio_db(energy, error))
    return out


def _sqnr_summary(per_layer: dict[str, float]) -> dict[str, Any]:
    worst = min(per_layer, key=per_layer.get)
    return {
        "sqnr_min_db": per_layer[worst],
        "sqnr_median_db": float(np.median(list(per_layer.values()))),
        "sqnr_worst_layer": worst,
        "sqnr_per_layer_db": {k: round(v, 3) for k, v in per_layer.items()},
    }


def _recipe(name: str, steps: int) -> RecipeConfig:
    """The named recipe, deployed at the benchmark's step count."""
    recipe = resolve_recipe(name)
    return dataclasses.replace(recipe, deployment=Deployment(num_inference_steps=steps))


def _missing_recipe(method: str) -> str | None:
    """Why one of our recipes does not exist in this sdkiln (``quant-auto`` may come later), or None."""
    if method not in OURS:
        return None
    try:
        resolve_recipe(method)
    except RecipeError as exc:
        return str(exc)
    return None


def prepare(method: str, base, spec, names: list[str], steps: int):
    """(quantized pipeline, its layers for SQNR, what was applied)."""
    if method in OURS:
        recipe = _recipe(method, steps)
        result = sdkiln.optimize(base, recipe, out_dir=None, eval_samples=0)
        applied = {
            "recipe": recipe.to_dict(),
            "schemes": sorted({m["scheme"] for m in result.manifest["modules"].values()}),
        }
        for step in result.manifest["recipe"]["steps"]:
            if step["config"]["kind"] == SmoothQuantConfig.kind:
                applied["smoothquant"] = {k: step["result"][k] for k in ("folded", "mul_scale", "unsmoothed")}
            if "dynamic_steps" in step["result"]:
                applied["dynamic_steps"] = step["result"]["dynamic_steps"]
        return result.pipeline, our_layers(result, spec, steps), applied
    attr = spec.transformer_attr
    pipe = type(base)(**{**base.components, attr: copy.deepcopy(getattr(base, attr))})
    applied = PEERS[method](getattr(pipe, attr), set(names))
    return pipe, peer_layers(getattr(pipe, attr), names), {"call": applied}


def run(
    model: str = "fmnist-flux",
    methods: tuple[str, ...] = METHODS,
    num_samples: int = 100,
    steps: int | None = None,
    seed: int = 1000,
    batch_size: int = 16,
    sqnr_samples: int = 2,
    sqnr_stride: int = 4,
) -> dict[str, Any]:
    """Measure ``methods`` on ``model``; returns the report that ``main`` writes as JSON."""
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    started, load_at_start = time.perf_counter(), os.getloadavg()
    spec = get_spec(model)
    base = spec.build()
    call = spec.call_kwargs(num_inference_steps=steps)
    steps = call["num_inference_steps"]
    prompts, seeds = sample_plan(spec, num_samples, seed)
    float_model = getattr(base, spec.transformer_attr)
    targets, kept = select_layers(TransformContext(base, spec, None))
    names = [t.layer for t in targets]

    base_images, timing = harness.timed_generate(base, call, prompts, seeds, batch_size, "float")
    reference = {"method": "float", "transformer_bytes": transformer_bytes(float_model)}
    reference |= harness.scores(base_images, None, spec, prompts) | timing
    print(f"float: {_line(reference)}", file=sys.stderr)
    captured = capture_layer_inputs(
        base, spec, names, call, prompts[:sqnr_samples], seeds[:sqnr_samples], sqnr_stride
    )

    rows = []
    for method in methods:
        row: dict[str, Any] = {"method": method, "by": "sdkiln" if method in OURS else "peer"}
        missing = _missing_recipe(method)
        if missing:
            rows.append(row | {"status": "not available", "error": missing})
            print(f"{method}: not available ({missing})", file=sys.stderr)
            continue
        start = time.perf_counter()
        try:
            pipe, layers, row["applied"] = prepare(method, base, spec, names, steps)
            row |= {"prepare_seconds": time.perf_counter() - start, "quantized_layers": len(layers)}
            row["transformer_bytes"] = transformer_bytes(getattr(pipe, spec.transformer_attr))
            images, timing = harness.timed_generate(pipe, call, prompts, seeds, batch_size, method)
            row |= harness.scores(images, base_images, spec, prompts) | timing
            row |= _sqnr_summary(layer_sqnr(float_model, layers, captured)) | {"status": "ok"}
        except ImportError as exc:
            if method in OURS:
                raise
            row |= {"status": "not installed", "error": f"{exc} (pip install {PEER_PACKAGES[method]})"}
        except Exception as exc:  # a peer's failure is a result to record; ours is a bug to raise
            if method in OURS:
                raise
            row |= {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        rows.append(row)
        print(f"{method}: {_line(row) if row['status'] == 'ok' else row['error']}", file=sys.stderr)

    return {
        "benchmark": "quantization schemes vs peers (bench/quant.py)",
        "model": spec.name,
        "model_weights_sha256": weights_hash(float_model),
        "settings": {
            "num_samples": num_samples,
            "steps": steps,
            "guidance": call.get(spec.guidance_arg),
            "seeds": f"{seeds[0]}..{seeds[-1]}",
            "batch_size": batch_size,
            "prompts": sorted(set(prompts)),
            "layers": {"quantized": names, "float": kept},
            "sqnr": {"samples": sqnr_samples, "steps": captured.steps},
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch_threads": torch.get_num_threads(),
            "load_average_1_5_15min": {"start": load_at_start, "end": os.getloadavg()},
        },
        "machine": harness.machine(PACKAGES),
        "float": reference,
        "methods": rows,
        "acceptance": acceptance(reference, rows),
        "total_seconds": time.perf_counter() - started,
    }


def _line(row: dict[str, Any]) -> str:
    keys = (
        "transformer_bytes",
        "psnr",
        "ssim",
        "class_accuracy",
        "fd_fmnist",
        "sqnr_min_db",
        "sqnr_median_db",
    )
    return ", ".join(f"{k}={row[k]:.4g}" for k in keys if row.get(k) is not None)


def acceptance(reference: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's acceptance lines, computed from the measured rows; a line whose inputs were not
    measured says so instead of passing."""
    by = {r["method"]: r for r in rows if r.get("status") == "ok"}
    acc0 = reference.get("class_accuracy")

    def accuracy_drop(method: str, points: float) -> dict[str, Any]:
        line = f"{method} keeps class accuracy within {points:g} points of float"
        if acc0 is None or method not in by:
            return {"line": line, "result": "not measured"}
        drop = 100 * (acc0 - by[method]["class_accuracy"])
        return {"line": line, "value": f"drop {drop:.1f} points", "result": _verdict(drop <= points + 1e-9)}

    def psnr_margin(ours: str, theirs: str, margin: float) -> dict[str, Any]:
        line = f"{ours} PSNR >= {theirs} PSNR" + (f" + {margin:g} dB" if margin else "")
        if ours not in by or theirs not in by:
            return {"line": line, "result": "not measured"}
        diff = by[ours]["psnr"] - by[theirs]["psnr"]
        out = {"line": line, "value": f"{diff:+.2f} dB", "result": _verdict(diff >= margin)}
        paired = np.subtract(by[ours]["psnr_per_sample"], by[theirs]["psnr_per_sample"])
        if paired.size > 1:
            half = 1.96 * paired.std(ddof=1) / math.sqrt(paired.size)
            out["paired_ci95_db"] = [round(diff - half, 3), round(diff + half, 3)]
        return out

    return [
        accuracy_drop("w8a8-dynamic", 2),
        accuracy_drop("w8a8-dynamic+smoothquant", 2),
        accuracy_drop("w8a8-dynamic-gptq", 2),
        accuracy_drop("w8a8-timestep", 2),
        psnr_margin("w8a8-dynamic", "torchao-int8-dynamic", 0.0),
        psnr_margin("w8a8-dynamic+smoothquant", "torchao-int8-dynamic", 0.0),
        psnr_margin("w8a8-dynamic-gptq", "torchao-int8-dynamic", 0.0),
        psnr_margin("w8a8-timestep", "w8a8-static", 1.0),
        accuracy_drop("w4a16", 5),
    ]


def _verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def markdown(report: dict[str, Any]) -> str:
    """The docs table and acceptance lines of a report."""
    cols = [
        ("method", "{}"),
        ("transformer_bytes", "{:,}"),
        ("psnr", "{:.2f}"),
        ("ssim", "{:.4f}"),
        ("class_accuracy", "{:.3f}"),
        ("fd_fmnist", "{:.2f}"),
        ("sqnr_min_db", "{:.1f}"),
        ("sqnr_median_db", "{:.1f}"),
        ("seconds_per_batch", "{:.2f}"),
    ]
    head = ["method", "transformer bytes", "PSNR dB", "SSIM", "class acc", "FD-FMNIST"]
    head += ["SQNR min dB", "SQNR median dB", "s / batch"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in [report["float"], *report["methods"]]:
        if row.get("status", "ok") != "ok":
            out.append(f"| {row['method']} | {row['status']} (see the JSON) |" + " |" * (len(head) - 2))
            continue
        cells = [fmt.format(row[k]) if row.get(k) is not None else "-" for k, fmt in cols]
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for a in report["acceptance"]:
        detail = [a["value"]] if "value" in a else []
        if "paired_ci95_db" in a:
            detail.append("paired 95% CI [{:+.2f}, {:+.2f}] dB".format(*a["paired_ci95_db"]))
        out.append(f"- {a['line']}: **{a['result']}**" + (f" ({'; '.join(detail)})" if detail else ""))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="fmnist-flux")
    parser.add_argument("--num-samples", type=int, default=100)
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated, from: {', '.join(METHODS)}"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--sqnr-samples", type=int, default=2)
    parser.add_argument("--sqnr-stride", type=int, default=4)
    parser.add_argument("--markdown", type=Path, help="print the table of an existing report and exit")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    report = run(
        args.model,
        methods,
        args.num_samples,
        args.steps,
        args.seed,
        args.batch_size,
        args.sqnr_samples,
        args.sqnr_stride,
    )
    report["command"] = " ".join(["python", "bench/quant.py", *(argv if argv is not None else sys.argv[1:])])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
