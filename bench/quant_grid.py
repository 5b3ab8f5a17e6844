"""A/B of the symmetric int8 grids, narrow against full (torchao's), on the embedded model.

bench/quant.py found torchao a little ahead of our W8A8_DYNAMIC and W8A16 end to end while the
per-layer SQNR was the same or ours was better. The one difference in the weights is the grid:

* ``narrow`` (sdkiln until session 3): ``scale = absmax / 127``, values in [-127, 127];
* ``full`` (torchao's ``MappingType.SYMMETRIC``, sdkiln's since): ``scale = absmax / 127.5``,
  values in [-128, 127].

Since sdkiln adopted the full grid, ``narrow`` is the variant patched in here (both are patched
explicitly, so the script measures the same thing before and after the switch).

The same two grids exist for the per-token activations of W8A8_DYNAMIC: sdkiln's
``quantize_per_token_int8`` uses ``narrow`` (as Ascend's ``npu_dynamic_quant``: absmax / 127);
torchao 0.18's ``Int8Tensor`` uses ``full`` for activations too. ``--activations`` adds the variant
with both grids full (``dynamic/full+act-full``), which computes what torchao computes.

This script runs the grids inside our own modules (everything else unchanged) beside torchao's two
configs, on several seed sets, and prints each pair's paired 95 % CI of the PSNR difference (against
the float model's images), so the question "does the grid matter end to end?" is answered by data.

    OMP_NUM_THREADS=2 python bench/quant_grid.py --seeds 2000 5000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (bench/harness.py)
import quant  # noqa: E402  (bench/quant.py: the same preparation)

from sdkiln.model_zoo import get_spec  # noqa: E402
from sdkiln.optimizer.evaluate import sample_plan  # noqa: E402
from sdkiln.optimizer.layers import select_layers  # noqa: E402
from sdkiln.optimizer.registry import TransformContext  # noqa: E402
from sdkiln.runtime.quant import w8a8_dynamic, weight_only  # noqa: E402

DEFAULT_OUT = Path(__file__).parent / "results" / "quant_grid_fmnist.json"


def full_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's symmetric grid per output channel: (int8 values in [-128, 127], fp32 scale [N, 1])."""
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127.5
    return torch.round(w / scale).clamp_(-128, 127).to(torch.int8), scale


def narrow_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid sdkiln used before: (int8 values in [-127, 127], fp32 scale absmax / 127 [N, 1])."""
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    return torch.round(w / scale).clamp_(-127, 127).to(torch.int8), scale


GRIDS = {"narrow": narrow_grid, "full": full_grid}


def full_grid_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The full grid per token (last dim): (int8 values in [-128, 127], fp32 scale [..., 1])."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.5
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(xf / scale).clamp_(-128, 127).to(torch.int8), scale


def full_activation_grid(transformer: torch.nn.Module) -> int:
    """Make every W8A8_DYNAMIC layer of ``transformer`` quantize its input on the full grid; returns
    how many it changed."""
    from sdkiln import kernels

    layers = [m for m in transformer.modules() if isinstance(m, w8a8_dynamic.W8A8DynamicLinear)]
    for layer in layers:

        def forward(x, layer=layer):
            x_q, x_scale = full_grid_per_token(x)
            return kernels.w8a8_linear(x_q, x_scale, layer.weight, layer.weight_scale, layer.bias, x.dtype)

        layer.forward = forward
    return len(layers)


@contextlib.contextmanager
def grid(name: str):
    """Within the block, our W8A8_DYNAMIC and W8A16 modules quantize weights on grid ``name``."""
    to_grid = GRIDS[name]
    originals = (w8a8_dynamic.W8A8DynamicLinear.from_linear, weight_only.W8A16Linear.from_linear)

    def regridded(from_linear):
        def build(linear, ranges=None):
            mod = from_linear(linear)
            values, scale = to_grid(linear.weight.detach().float())
            mod.weight.copy_(values)
            mod.weight_scale.copy_(scale)
            return mod

        return staticmethod(build)

    w8a8_dynamic.W8A8DynamicLinear.from_linear = regridded(originals[0])
    weight_only.W8A16Linear.from_linear = regridded(originals[1])
    try:
        yield
    finally:
        w8a8_dynamic.W8A8DynamicLinear.from_linear = classmethod(originals[0].__func__)
        weight_only.W8A16Linear.from_linear = classmethod(originals[1].__func__)


VARIANTS = {
    "dynamic/narrow": ("w8a8-dynamic", "narrow"),
    "dynamic/full": ("w8a8-dynamic", "full"),
    "dynamic/torchao": ("torchao-int8-dynamic", None),
    "weight-only/narrow": ("w8a16", "narrow"),
    "weight-only/full": ("w8a16", "full"),
    "weight-only/torchao": ("torchao-int8-weight-only", None),
}
ACTIVATION_VARIANTS = {"dynamic/full+act-full": ("w8a8-dynamic", "full")}
ACTIVATION_PAIRS = (
    ("dynamic/full+act-full", "dynamic/full"),
    ("dynamic/full+act-full", "dynamic/torchao"),
)
PAIRS = (
    ("dynamic/full", "dynamic/narrow"),
    ("dynamic/narrow", "dynamic/torchao"),
    ("dynamic/full", "dynamic/torchao"),
    ("weight-only/full", "weight-only/narrow"),
    ("weight-only/narrow", "weight-only/torchao"),
    ("weight-only/full", "weight-only/torchao"),
)


def paired(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    d = a - b
    half = 1.96 * d.std(ddof=1) / math.sqrt(d.size)
    return {
        "mean_db": float(d.mean()),
        "ci95_db": [float(d.mean() - half), float(d.mean() + half)],
        "wins": int((d > 0).sum()),
        "n": int(d.size),
    }


def run(
    seed_sets: list[int], num_samples: int, batch_size: int, activations: bool = False, prefix: str = ""
) -> dict[str, Any]:
    spec = get_spec("fmnist-flux")
    base = spec.build()
    call = spec.call_kwargs()
    names = [t.layer for t in select_layers(TransformContext(base, spec, None))[0]]
    variants = VARIANTS | (ACTIVATION_VARIANTS if activations else {})
    variants = {v: m for v, m in variants.items() if v.startswith(prefix)}
    pipes = {}
    for variant, (method, grid_name) in variants.items():
        with grid(grid_name) if grid_name else contextlib.nullcontext():
            pipes[variant] = quant.prepare(method, base, spec, names, call["num_inference_steps"])[0]
        if variant in ACTIVATION_VARIANTS:
            assert full_activation_grid(getattr(pipes[variant], spec.transformer_attr)) > 0
    psnr: dict[str, list[float]] = {v: [] for v in variants}
    sets = []
    for seed in seed_sets:
        prompts, seeds = sample_plan(spec, num_samples, seed)
        ref, _ = harness.timed_generate(base, call, prompts, seeds, batch_size, f"float {seed}")
        row = {"seeds": f"{seeds[0]}..{seeds[-1]}", "psnr": {}}
        for variant, pipe in pipes.items():
            images, _ = harness.timed_generate(pipe, call, prompts, seeds, batch_size, f"{variant} {seed}")
            scores = harness.scores(images, ref, spec, prompts)
            psnr[variant] += scores["psnr_per_sample"]
            row["psnr"][variant] = scores["psnr"]
            print(f"seeds {seed}: {variant:22s} PSNR {scores['psnr']:.2f}", file=sys.stderr)
        sets.append(row)
    arrays = {v: np.array(p) for v, p in psnr.items()}
    return {
        "benchmark": "int8 weight grid A/B (bench/quant_grid.py)",
        "model": spec.name,
        "settings": {
            "num_samples_per_set": num_samples,
            "seed_sets": seed_sets,
            "variants": list(variants),
            "steps": call["num_inference_steps"],
            "torch_threads": torch.get_num_threads(),
        },
        "machine": harness.machine(quant.PACKAGES),
        "per_seed_set": sets,
        "mean_psnr": {v: float(a.mean()) for v, a in arrays.items()},
        "pairs": {
            f"{a} - {b}": paired(arrays[a], arrays[b])
            for a, b in PAIRS + (ACTIVATION_PAIRS if activations else ())
            if a in arrays and b in arrays
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[2000, 5000])
    parser.add_argument("--num-samples", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--activations", action="store_true", help="add the full activation grid variant")
    parser.add_argument(
        "--only", default="", help="run the variants whose name starts with this (dynamic/...)"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    report = run(args.seeds, args.num_samples, args.batch_size, args.activations, args.only)
    report["total_seconds"] = time.perf_counter() - start
    report["command"] = " ".join(
        ["python", "bench/quant_grid.py", *(argv if argv is not None else sys.argv[1:])]
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for name, p in report["pairs"].items():
        print(
            f"{name:42s} {p['mean_db']:+.2f} dB  CI [{p['ci95_db'][0]:+.2f}, {p['ci95_db'][1]:+.2f}]"
            f"  wins {p['wins']}/{p['n']}"
        )
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
