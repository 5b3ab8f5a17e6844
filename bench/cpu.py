"""The CPU as a device: each quantized layer of the embedded model against its fp32 Linear, per
int8 kernel; one transformer forward in fp32, bf16 and fp16, native and widened to fp32 per module;
per-op time of a generation, float package vs default package; and `sdkiln run`'s wall time for
both packages side by side in one process.

    python bench/cpu.py [--package build/demo/package] [--float-package build/bench_cpu/float]

The default package is `make demo`'s; the float package (recipe ``none``) is made when missing.
Results go to ``bench/results/cpu_<cpu>.json``, named by the CPU's model and whether it has an int8
dot-product instruction set; the JSON names the CPU, its ISA, the thread count and the profile's
measured products. Timings are medians of alternating rounds (each package goes first in half), so
a load on the other core skews both alike.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from timing import RESULTS, device_info  # noqa: E402

from sdkiln import kernels  # noqa: E402
from sdkiln.kernels import cpu_profile as cp  # noqa: E402
from sdkiln.kernels.cpu import native  # noqa: E402
from sdkiln.kernels.cpu_profile import median_ms  # noqa: E402
from sdkiln.runtime import load  # noqa: E402
from sdkiln.runtime.quant import QuantLinear  # noqa: E402

PROMPTS = ["a photo of a sneaker", "a pair of trousers", "a picture of an ankle boot"]


def paired_ms(fns: dict, rounds: int, budget_s: float = 0.01) -> dict[str, float]:
    """Median milliseconds per call of each function, timed in alternating rounds (the order turns
    each round) of enough calls to last about ``budget_s``: at 15 us a call a lone timing is mostly
    noise, and a load on the other core skews every function of a round alike."""
    names = list(fns)
    for fn in fns.values():
        fn()
    start = time.perf_counter()
    fns[names[0]]()
    calls = max(1, int(budget_s / max(time.perf_counter() - start, 1e-7)))
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = fns[name]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    return {n: statistics.median(t) for n, t in times.items()}


def layer_inputs(pipe, attr: str) -> dict[str, torch.Tensor]:
    """One denoising step's input to every quantized layer (the first call of each)."""
    seen: dict[str, torch.Tensor] = {}

    def record(mod, args, name) -> None:
        seen.setdefault(name, args[0].detach().clone())

    handles = [
        m.register_forward_pre_hook(lambda mod, args, name=name: record(mod, args, name))
        for name, m in getattr(pipe, attr).named_modules()
        if isinstance(m, QuantLinear)
    ]
    pipe(
        prompt=PROMPTS[0], num_inference_steps=1, output_type="np", generator=torch.Generator().manual_seed(0)
    )
    for h in handles:
        h.remove()
    return seen


def forced(product: str, fn):
    """``fn`` run with this machine's profile changed to choose ``product`` for every int8 call."""
    profile = cp.cpu_profile().choosing(product)

    def run():
        real = cp.cpu_profile
        cp.cpu_profile = lambda: profile
        try:
            return fn()
        finally:
            cp.cpu_profile = real

    return run


def bench_layers(pipe, float_pipe, attr: str, rounds: int) -> list[dict]:
    """Each quantized layer (the module call, as the package runs it) against its fp32 Linear: with
    the kernel this machine's profile chooses for its shape, and with each int8 product forced."""
    quant_mods = dict(getattr(pipe, attr).named_modules())
    float_mods = dict(getattr(float_pipe, attr).named_modules())
    products = [p for p in cp.INT8_PRODUCTS if p != "native" or native.available()]
    rows = []
    with torch.no_grad():
        for name, x in layer_inputs(pipe, attr).items():
            q, f = quant_mods[name], float_mods[name]
            assert isinstance(f, nn.Linear), name
            m, k, n = x.numel() // x.shape[-1], f.in_features, f.out_features
            fns = {"fp32_linear": lambda f=f, x=x: f(x), "chosen": lambda q=q, x=x: q(x)}
            fns |= {p: forced(p, lambda q=q, x=x: q(x)) for p in products}
            kernels.reset_kernel_counts()
            q(x)
            ran = ", ".join(f"{op}:{kernel}" for op, _, kernel in sorted(kernels.kernel_counts()))
            times = paired_ms(fns, rounds)
            rows.append(
                {
                    "layer": name,
                    "scheme": q.scheme,
                    "shape_MxKxN": [m, k, n],
                    "kernel": ran,
                    "fp32_linear_ms": times["fp32_linear"],
                    "chosen_ms": times["chosen"],
                    **{f"{p}_ms": times[p] for p in products},
                    "chosen_vs_fp32": times["chosen"] / times["fp32_linear"],
                }
            )
    return rows


def bench_widening(float_pipe, attr: str, reps: int) -> dict:
    """One transformer forward at the model's real inputs: fp32, the same weights in bf16 and fp16
    as torch runs them, and widened to fp32 per module (``runtime.cpu_dtype``), which ``load`` applies
    where the profile says the 16-bit dtype is slow."""
    import copy

    from sdkiln.runtime.cpu_dtype import widen_to_float32

    transformer = getattr(float_pipe, attr)
    seen = {}

    def record(mod, args, kwargs) -> None:
        seen.setdefault("kwargs", kwargs)

    hook = transformer.register_forward_pre_hook(record, with_kwargs=True)
    float_pipe(
        prompt=PROMPTS[0], num_inference_steps=1, output_type="np", generator=torch.Generator().manual_seed(0)
    )
    hook.remove()
    kwargs = seen["kwargs"]
    out = {"fp32_ms": median_ms(lambda: transformer(**kwargs), reps)}
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        narrow = copy.deepcopy(transformer).to(dtype)
        narrow_kwargs = {
            k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kwargs.items()
        }
        out[f"{name}_ms"] = median_ms(lambda narrow=narrow, kw=narrow_kwargs: narrow(**kw), reps)
        widen_to_float32(narrow)
        out[f"{name}_widened_ms"] = median_ms(lambda narrow=narrow, kw=narrow_kwargs: narrow(**kw), reps)
        out[f"{name}_chosen"] = "native" if cp.cpu_profile().fast_dtype(dtype) else "widened"
        del narrow
    return out


def op_table(pipe, steps: int, top: int) -> list[dict]:
    """Self CPU time per aten/sdkiln op over one prompt, per denoising step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pipe(
            prompt=PROMPTS[0],
            num_inference_steps=steps,
            output_type="np",
            generator=torch.Generator().manual_seed(0),
        )
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    return [
        {
            "op": e.key,
            "ms_per_step": e.self_cpu_time_total / 1e3 / steps,
            "calls_per_step": e.count / steps,
            "share": e.self_cpu_time_total / total,
        }
        for e in events[:top]
    ]


def end_to_end(pipes: dict, steps: int, rounds: int) -> dict:
    times: dict[str, list[float]] = {name: [] for name in pipes}
    order = list(pipes)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            for i, prompt in enumerate(PROMPTS):
                pipes[name](
                    prompt=prompt,
                    num_inference_steps=steps,
                    output_type="np",
                    generator=torch.Generator().manual_seed(i),
                )
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "steps": steps,
        "prompts": len(PROMPTS),
        "rounds": rounds,
        "seconds": times,
        "median_seconds": med,
        "float_over_package": med["float"] / med["package"],
    }


def result_name(profile: cp.CpuProfile) -> str:
    cpu = re.sub(r"[^a-z0-9]+", "-", profile.info.name.lower()).strip("-")
    dot = "vnni" if profile.info.features & cp.INT8_FAST_ISA else "no-vnni"
    return f"cpu_{cpu}_{dot}.json"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", default=str(ROOT / "build/demo/package"))
    parser.add_argument("--float-package", default=str(ROOT / "build/bench_cpu/float"))
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layer-rounds", type=int, default=7)
    parser.add_argument("--layer-reps", type=int, default=30, help="timings of each transformer forward")
    parser.add_argument("--out", default=None, help="JSON path (default: bench/results/cpu_<cpu>.json)")
    args = parser.parse_args(argv)
    if not Path(args.package).is_dir():
        parser.error(f"--package {args.package}: not found; run `make demo` first or pass a package")
    if not Path(args.float_package).is_dir():
        from sdkiln.optimizer import optimize

        print(f"making the float package at {args.float_package}")
        optimize(None, "none", args.float_package, eval_samples=0, force=True)
    profile = cp.cpu_profile()
    print(
        f"cpu: {profile.info.describe()}, {profile.threads} thread(s); int8 product: {profile.int8_product}, "
        f"{'x'.join(map(str, cp.SMALL_SHAPE))}-size: {profile.int8_product_small}, fused "
        f"{profile.fused_product_small}; native kernels: {native.status().detail}"
    )
    pipes = {"float": load(args.float_package, "cpu"), "package": load(args.package, "cpu")}
    for p in pipes.values():
        p.set_progress_bar_config(disable=True)
    attr = pipes["package"].sdkiln_manifest["model"]["transformer_attr"]
    layers = bench_layers(pipes["package"], pipes["float"], attr, args.layer_rounds)
    for row in layers:
        forced_ms = "  ".join(f"{p} {row[f'{p}_ms']:.3f}" for p in cp.INT8_PRODUCTS if f"{p}_ms" in row)
        print(
            f"  {row['layer']:<42} {row['scheme']:<13} {'x'.join(map(str, row['shape_MxKxN'])):>13}  fp32 "
            f"{row['fp32_linear_ms']:.3f} ms  ran {row['kernel']} {row['chosen_ms']:.3f} ms "
            f"({row['chosen_vs_fp32']:.2f}x)  forced: {forced_ms}"
        )
    with torch.no_grad():
        widening = bench_widening(pipes["float"], attr, args.layer_reps)
    print(
        "transformer forward: "
        + ", ".join(f"{k.removesuffix('_ms')} {v:.2f} ms" for k, v in widening.items() if k.endswith("_ms"))
        + f" (bf16 runs {widening['bfloat16_chosen']}, fp16 {widening['float16_chosen']})"
    )
    ops = {name: op_table(p, args.steps, 15) for name, p in pipes.items()}
    e2e = end_to_end(pipes, args.steps, args.rounds)
    print(
        f"sdkiln run, {len(PROMPTS)} prompts x {args.steps} steps: float {e2e['median_seconds']['float']:.2f} s, "
        f"package {e2e['median_seconds']['package']:.2f} s ({e2e['float_over_package']:.2f}x faster)"
    )
    result = {
        "device": device_info(torch.device("cpu")),
        "cpu_profile": profile.to_dict(),
        "native": native.status().detail,
        "packages": {"float": args.float_package, "package": args.package},
        "layers": layers,
        "worst_chosen_vs_fp32": max((r["chosen_vs_fp32"] for r in layers), default=None),
        "transformer_16bit": widening,
        "ops_per_step": ops,
        "end_to_end": e2e,
    }
    out = Path(args.out) if args.out else RESULTS / result_name(profile)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    kernels.load_device_kernels("cpu")
    main()
