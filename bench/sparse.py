"""Block-sparse attention: CPU attention time and error at long sequences, and end-to-end quality of
calibrated, uniform and cumulative-mass plans on the embedded model, in one run.

Part 1 (``attention``): q, k, v of Wan-tiny's attention shape (2 heads of 32) at 4096-16384 video
tokens (frames x 32 x 16 after the patch), random: the tiling, the block selection and
``sdkiln::block_sparse_attention`` (the CPU gather + flash kernel) against the dense reference op
and torch's SDPA at the same shapes, at sparsity 0.5 / 0.7 / 0.8 / 0.9 with 64-token blocks. Times
are the median of ``--repeats`` after a warm-up; "sparse op" is the kernel alone, "sparse call"
adds the permutation and the selection, as the backend runs them. Random q and k attend nearly
uniformly, so their attention error is an upper bound, not a model's.

Part 2 (``embedded``): the embedded model at its deployment (28 steps, CFG 4): PSNR of the final
images against dense attention on held-out prompts for uniform top-k plans (0.7 also with its block
selection reused over 2 and 4 denoising steps), cumulative-mass plans
and calibrated plans (budgets 0.05, 0.2 and 0.35), all with 2 dense steps, with the computed
fraction of block pairs each plan realized, and paired Student-t intervals of calibrated minus
uniform PSNR against the uniform plan of the nearest computed fraction of block pairs (dense layers
and steps counted whole), and the 2:4 weight-sparsity step's PSNR. JSON to
bench/results/sparse_cpu.json.

Part 3 (``allocation``, not in the default run; its own JSON, bench/results/sparse_allocation_cpu.json):
does a per-layer allocation beat uniform top-k at *exactly* the same cost? One error probe (the
calibration's ``ErrorProbe``, on ``--calib-samples`` calibration samples) measures every
self-attention layer's relative L1 attention error at every keep level of the sequence (1 to n-1 of
its n key blocks); for each target sparsity the smallest error budget whose per-layer plan keeps, in
all, no more blocks than uniform top-k at that target gives the minimax plan (each layer as sparse as
the shared budget allows). Both run on ``--samples`` held-out samples with 2 dense steps; the counters'
computed fractions are asserted equal, and the paired Student-t interval of minimax minus uniform
PSNR against dense attention is reported.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import machine  # noqa: E402

from sdkiln import kernels  # noqa: E402
from sdkiln.configs import Deployment, RecipeConfig, Sparse24Config, SparseAttentionConfig  # noqa: E402
from sdkiln.kernels.ops.attention import attention_reference  # noqa: E402
from sdkiln.metrics import paired_interval, psnr  # noqa: E402
from sdkiln.model_zoo import get_spec
from sdkiln.optimizer.evaluate import generate  # noqa: E402
from sdkiln.optimizer.optimize import optimize  # noqa: E402
from sdkiln.runtime.sparse import sparse_attention_of  # noqa: E402
from sdkiln.runtime.sparse.selection import kept_fraction, select_blocks  # noqa: E402
from sdkiln.runtime.sparse.tiling import default_tile, tile_order  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    )


def _sparse_call(q, k, v, tiling, values, dense_blocks, block):
    """What the backend does per call: tile, select, attend over the kept blocks, untile."""
    qp, kp, vp = q[:, tiling.order], k[:, tiling.order], v[:, tiling.order]
    kept = select_blocks(qp, kp, values, block, "topk", dense_blocks, dense_blocks)
    return kernels.block_sparse_attention(qp, kp, vp, kept, block)[0][:, tiling.inverse], kept


def attention_part(tokens: list[int], sparsities: list[float], repeats: int, block: int) -> list[dict]:
    rows = []
    heads, dim, rows_, cols = 2, 32, 32, 16
    for n in tokens:
        frames = n // (rows_ * cols)
        f, r, c = torch.meshgrid(torch.arange(frames), torch.arange(rows_), torch.arange(cols), indexing="ij")
        tiling = tile_order(torch.stack([f, r, c], -1).reshape(-1, 3), default_tile(block, frames), True)
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, n, heads, dim, generator=gen) for _ in range(3))
        nb = math.ceil(n / block)
        dense_blocks = torch.zeros(nb, dtype=torch.bool)
        dense_blocks[: math.ceil(tiling.first_frame / block)] = True
        sdpa = median_time(functools.partial(_sdpa, q, k, v), repeats)
        reference_s = median_time(
            functools.partial(attention_reference, q, k, v, None, None), max(1, repeats // 2)
        )
        dense_out, _ = attention_reference(q, k, v, None, None)
        for s in sparsities:
            call = functools.partial(
                _sparse_call, q, k, v, tiling, torch.full((heads,), s), dense_blocks, block
            )
            out, kept = call()
            qp, kp, vp = q[:, tiling.order], k[:, tiling.order], v[:, tiling.order]
            op = median_time(
                functools.partial(kernels.block_sparse_attention, qp, kp, vp, kept, block), repeats
            )
            full = median_time(call, repeats)
            rows.append({
                "tokens": n, "frames": frames, "sparsity": s, "block_size": block,
                "kept_block_pairs": round(kept_fraction(kept, nb), 4),
                "kernel": kernels.implementation("block_sparse_attention", "cpu", qp, kp, vp, kept, block, None),
                "dense_reference_ms": round(reference_s * 1e3, 1), "sdpa_ms": round(sdpa * 1e3, 1),
                "sparse_op_ms": round(op * 1e3, 1), "sparse_call_ms": round(full * 1e3, 1),
                "op_speedup_vs_reference": round(reference_s / op, 2), "call_speedup_vs_reference": round(reference_s / full, 2),
                "call_speedup_vs_sdpa": round(sdpa / full, 2),
                "attention_rel_l1": round(float((out - dense_out).abs().sum() / dense_out.abs().sum()), 4),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def embedded_part(samples: int) -> dict:
    dep = Deployment(num_inference_steps=28)
    plans = {f"uniform {s}": SparseAttentionConfig(sparsity=s, dense_steps=2) for s in (0.5, 0.7, 0.8, 0.9)}
    plans |= {
        f"uniform 0.7 reuse {r}": SparseAttentionConfig(sparsity=0.7, dense_steps=2, mask_reuse=r)
        for r in (2, 4)
    }
    plans |= {f"mass {m}": SparseAttentionConfig(mass=m, dense_steps=2) for m in (0.95, 0.9, 0.8)}
    plans |= {
        f"calibrated budget {b}": SparseAttentionConfig(budget=b, dense_steps=2) for b in (0.05, 0.2, 0.35)
    }
    results, images, base = {}, {}, None
    for name, config in plans.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a fixed dense-step count: the floor is not the point here
            made = optimize(get_spec(None).build(), RecipeConfig(name, [config], dep), None, eval_samples=0)
        spec = made.spec
        call = spec.call_kwargs(num_inference_steps=28)
        prompts = [spec.eval_prompts[i % len(spec.eval_prompts)] for i in range(samples)]
        seeds = [1000 + i for i in range(samples)]
        if base is None:
            start = time.perf_counter()
            base, _ = generate(made.base, call, prompts, seeds, samples, "dense")
            dense_s = time.perf_counter() - start
        start = time.perf_counter()
        images[name], _ = generate(made.pipeline, call, prompts, seeds, samples, name)
        seconds = time.perf_counter() - start
        record = made.manifest["recipe"]["steps"][0]["result"]
        per_sample = psnr(base, images[name])
        results[name] = {
            "planned_mean_sparsity": record["mean_sparsity"],
            "computed_block_pairs": round(
                sparse_attention_of(made.pipeline.transformer).computed_fraction(), 4
            ),
            "psnr_mean": round(float(per_sample.mean()), 3),
            "psnr_p5": round(float(np.percentile(per_sample, 5)), 3),
            "seconds": round(seconds, 2),
            "dense_seconds": round(dense_s, 2),
            "plan": made.files["attention/sparse_attention.json"]["layers"],
        }
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "plan"}), flush=True)
    comparisons = {}
    uniform = [n for n in results if n.startswith("uniform") and "reuse" not in n]
    for cal in (n for n in results if n.startswith("calibrated")):
        # the uniform plan whose computed fraction of block pairs is closest: the same attention cost
        peer = min(
            uniform,
            key=lambda n: abs(results[n]["computed_block_pairs"] - results[cal]["computed_block_pairs"]),
        )
        m, lo, hi = paired_interval(psnr(base, images[cal]) - psnr(base, images[peer]))
        comparisons[f"{cal} - {peer}"] = {
            "mean_db": round(m, 3), "ci95_db": [round(lo, 3), round(hi, 3)],
            "computed_block_pairs": [results[cal]["computed_block_pairs"], results[peer]["computed_block_pairs"]],
        }  # fmt: skip
        print(f"{cal} - {peer}", json.dumps(comparisons[f"{cal} - {peer}"]), flush=True)
    pruned = optimize(None, RecipeConfig("sparse-2-4", [Sparse24Config()], dep), None, eval_samples=0)
    pruned_images, _ = generate(pruned.pipeline, call, prompts, seeds, samples, "2:4 weights")
    per_sample = psnr(base, pruned_images)
    weights = {
        "mean_weight_rel_l2": pruned.manifest["recipe"]["steps"][0]["result"]["mean_weight_rel_l2"],
        "psnr_mean": round(float(per_sample.mean()), 3),
        "psnr_p5": round(float(np.percentile(per_sample, 5)), 3),
    }
    print("2:4 weights", json.dumps(weights), flush=True)
    return {
        "samples": samples, "steps": 28, "plans": results, "calibrated_minus_uniform": comparisons,
        "weights_2_4": weights,
    }  # fmt: skip


def allocation_part(targets: list[float], calib_samples: int, samples: int) -> dict:
    from sdkiln.calibrate.loop import resolve_loop
    from sdkiln.model_zoo import get_spec
    from sdkiln.model_zoo.fingerprint import config_hash
    from sdkiln.runtime.sparse import SparseAttentionPlan, attach_sparse_attention, detach_sparse_attention
    from sdkiln.runtime.sparse.attention import SparseAttention
    from sdkiln.sparsify.attention import ErrorProbe

    spec = get_spec(None)
    pipe = spec.build()
    pipe.set_progress_bar_config(disable=True)
    call = spec.call_kwargs(num_inference_steps=28)
    names = [
        x for x, _ in pipe.transformer.named_modules()
        if (site := spec.attention_site(x)) is not None and site.attends_own_tokens
    ]  # fmt: skip
    bs = spec.sparse_block_size
    common = dict(block_size=bs, tile=default_tile(bs, 1), first_frame_dense=True, mask_reuse=1,
                  config_hash=config_hash(pipe.transformer.config))  # fmt: skip
    prompts = [spec.eval_prompts[i % len(spec.eval_prompts)] for i in range(samples)]
    seeds = [1000 + i for i in range(samples)]

    def plan(values, dense_steps=2):
        layers = dict(zip(names, ([v] for v in values), strict=True))
        return SparseAttentionPlan(layers=layers, selection="topk", dense_steps=dense_steps, **common)

    blocks = set()

    class Recorder(SparseAttention):  # the number of key blocks n of the deployment's sequence
        def layout(self, c):
            lay = super().layout(c)
            blocks.add(lay.blocks)
            return lay

    attach_sparse_attention(pipe, spec, plan([0.5] * len(names), 0), Recorder)
    try:
        generate(pipe, spec.call_kwargs(num_inference_steps=1), prompts[:1], seeds[:1], 1, "blocks")
    finally:
        detach_sparse_attention(pipe.transformer)
    (n,) = blocks
    grid = [1 - k / n for k in range(n - 1, 0, -1)]  # every keep level, sparsity ascending
    started = time.perf_counter()
    probe = attach_sparse_attention(
        pipe, spec, plan([0.0] * len(names), 0), functools.partial(ErrorProbe, sparsities=grid, groups=1)
    )
    loop, _ = resolve_loop(spec, None, calib_samples, call)
    try:
        loop(pipe)
    finally:
        detach_sparse_attention(pipe.transformer)
    probe_s = time.perf_counter() - started
    dense, _ = generate(pipe, call, prompts, seeds, samples, "dense")

    def run(values):
        sparse = attach_sparse_attention(pipe, spec, plan(values))
        try:
            images, _ = generate(pipe, call, prompts, seeds, samples, "sparse")
            return psnr(dense, images), sparse.computed_fraction()
        finally:
            detach_sparse_attention(pipe.transformer)

    def kept_blocks(budget):
        layers, _ = probe.choose(budget, 2)
        values = [layers.get(x, [0.0])[0] for x in names]
        return sum(math.ceil((1 - v) * n - 1e-6) for v in values), values

    rows = []
    for target in targets:
        allowed = math.ceil((1 - target) * n - 1e-6) * len(names)  # uniform top-k's key blocks, all layers
        low, high = 0.0, 1.0  # the smallest budget whose plan keeps no more blocks than uniform
        for _ in range(40):
            mid = (low + high) / 2
            low, high = (low, mid) if kept_blocks(mid)[0] <= allowed else (mid, high)
        total, values = kept_blocks(high)
        uniform, uniform_fraction = run([target] * len(names))
        minimax, minimax_fraction = run(values)
        m, lo, hi = paired_interval(minimax - uniform)
        rows.append({
            "target": target, "key_blocks": n, "budget": round(high, 5),
            "plan": dict(zip(names, (round(v, 4) for v in values), strict=True)),
            "kept_blocks": [total, allowed], "computed_block_pairs": [round(minimax_fraction, 6), round(uniform_fraction, 6)],
            "psnr_mean": [round(float(minimax.mean()), 3), round(float(uniform.mean()), 3)],
            "minimax_minus_uniform_db": round(m, 3), "ci95_db": [round(lo, 3), round(hi, 3)],
        })  # fmt: skip
        print("allocation", json.dumps(rows[-1]), flush=True)
    return {"samples": samples, "calib_samples": calib_samples, "steps": 28, "probe_seconds": round(probe_s, 1),
            "rows": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.5, 0.7, 0.8, 0.9])
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["attention", "embedded"],
        choices=["attention", "embedded", "allocation"],
    )
    parser.add_argument("--targets", type=float, nargs="+", default=[0.7, 0.8], help="allocation part")
    parser.add_argument("--calib-samples", type=int, default=8, help="allocation part")
    parser.add_argument("--allocation-samples", type=int, default=40, help="allocation part")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default: bench/results/sparse_cpu.json, or "
        "sparse_allocation_cpu.json for the allocation part alone",
    )
    args = parser.parse_args(argv)
    kernels.load_device_kernels("cpu")
    result = {"machine": machine(("torch", "diffusers")), "threads": torch.get_num_threads()}
    if "attention" in args.parts:
        result["attention"] = attention_part(args.tokens, args.sparsities, args.repeats, args.block_size)
    if "embedded" in args.parts:
        result["embedded"] = embedded_part(args.samples)
    if "allocation" in args.parts:
        result["allocation"] = allocation_part(args.targets, args.calib_samples, args.allocation_samples)
    if args.out is None:
        alone = args.parts == ["allocation"]
        args.out = RESULTS / ("sparse_allocation_cpu.json" if alone else "sparse_cpu.json")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    main()
