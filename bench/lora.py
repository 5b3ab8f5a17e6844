"""A trained LoRA on the embedded model: runtime branch and offline fusion against diffusers' own LoRA.

The LoRA is ``tests/fixtures/fmnist_frame_lora.safetensors`` (``tools/fmnist/train_lora.py``: a frame
around every garment as bright as the strength; its effect is the frame score, the mean border
brightness). For each strength (0.5, 1.0), on the same prompts and seeds:

* ``float + LoRA (diffusers)``: the float pipeline, the LoRA loaded by diffusers and peft
  (``transformer.load_lora_adapter``): the reference;
* ``package + runtime LoRA``: the default-recipe package (quantized, cached), ``pipe.load_lora_weights``,
  with the runtime's default cache policy (``headroom``: a safer schedule of the package's search front
  while the LoRA is on; ``runtime.cache.headroom``), and again with the schedule kept as searched
  (``cache kept``); each row has the block evaluations it took over an uncached run's;
* ``package --lora``: a default-recipe package optimized with the LoRA fused (``optimize --lora``).

Reported: PSNR against the reference (and the package's own PSNR against the float model without a
LoRA, the bar: at most 1 dB lower), the frame score and its change over the model without the LoRA
(the LoRA's effect: within 10% of the float model's), class accuracy.

    OMP_NUM_THREADS=2 python bench/lora.py                   # about 15 minutes on 2 cores
    OMP_NUM_THREADS=2 python bench/lora.py --ablate-cache    # then: without the cache schedule, 2 minutes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tools" / "fmnist"))
import harness  # noqa: E402
from train_lora import DEFAULT_OUT, frame_score  # noqa: E402

import sdkiln  # noqa: E402
from sdkiln.configs import LoraFile  # noqa: E402
from sdkiln.model_zoo import get_spec  # noqa: E402
from sdkiln.optimizer.evaluate import generate, sample_plan  # noqa: E402
from sdkiln.runtime.cache import cache_runner  # noqa: E402

STRENGTHS = (0.5, 1.0)
PSNR_SLACK_DB = 1.0
EFFECT_TOL = 0.10


def _images(pipe, call, prompts, seeds) -> np.ndarray:
    images, _ = generate(pipe, call, prompts, seeds, batch_size=10, desc="generate")
    return images


def _counted(pipe, call, prompts, seeds) -> tuple[np.ndarray, float]:
    """The images and the block evaluations they took over an uncached run's (1.0 without a cache)."""
    runner = cache_runner(pipe.transformer)
    if runner is None:
        return _images(pipe, call, prompts, seeds), 1.0
    runner.reset_counters()
    images = _images(pipe, call, prompts, seeds)
    return images, runner.block_evaluations / (runner.transformer_calls * runner.num_blocks)


def _row(name: str, images, ratio: float | None, reference, base_score: float, spec, prompts) -> dict:
    out = harness.scores(images, reference, spec, prompts)
    out.pop("psnr_per_sample", None)
    score = frame_score(images)
    extra = {} if ratio is None else {"block_evaluations_ratio": round(ratio, 4)}
    return {"variant": name, **out, "frame_score": score, "effect": score - base_score, **extra}


def cache_ablation(lora: Path, work: Path, out: Path, samples: int = 20) -> dict:
    """Strength 1.0 with the default package's cache schedule detached (``detach_cache``): how much of
    the PSNR the quantized layers with the branch keep, against the float model with the LoRA."""
    from sdkiln import metrics
    from sdkiln.runtime.cache import detach_cache

    spec = get_spec("fmnist-flux")
    base, call = spec.build(), spec.call_kwargs()
    prompts, seeds = sample_plan(spec, samples, seed=0)
    float_plain = _images(base, call, prompts, seeds)
    base.transformer.load_lora_adapter(str(lora), adapter_name="frame", prefix="transformer")
    float_lora = _images(base, call, prompts, seeds)
    pkg = sdkiln.load(work / "default", device="cpu")
    detach_cache(pkg.transformer)
    pkg_plain = _images(pkg, call, prompts, seeds)
    pkg.load_lora_weights(lora)
    pkg_lora = _images(pkg, call, prompts, seeds)

    def psnr(a, b) -> float:
        return float(np.minimum(metrics.psnr(a, b), 100.0).mean())

    result = {
        "bench": "lora_cache_ablation",
        "machine": harness.machine(("torch", "diffusers", "peft")),
        "samples": samples,
        "no_lora": {"psnr": psnr(float_plain, pkg_plain), "frame_score": frame_score(pkg_plain)},
        "lora_1.0": {
            "psnr": psnr(float_lora, pkg_lora),
            "frame_score": frame_score(pkg_lora),
            "float_frame_score": frame_score(float_lora),
        },
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("no_lora", "lora_1.0")}, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lora", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "bench-lora")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lora_fmnist.json")
    parser.add_argument(
        "--ablate-cache",
        action="store_true",
        help="only the cache ablation (strength 1.0, the cache schedule detached; needs the packages of a "
        "previous run under --work): bench/results/lora_fmnist_nocache.json",
    )
    args = parser.parse_args(argv)
    if args.ablate_cache:
        cache_ablation(args.lora, args.work, args.out.with_name("lora_fmnist_nocache.json"))
        return 0
    start = time.time()
    spec = get_spec("fmnist-flux")
    base = spec.build()
    call = spec.call_kwargs()
    prompts, seeds = sample_plan(spec, args.samples, seed=0)
    packages = {
        "default": sdkiln.optimize(None, "default", args.work / "default", force=True, eval_samples=0).package
    }
    for s in STRENGTHS:
        packages[f"fused@{s}"] = sdkiln.optimize(
            None,
            "default",
            args.work / f"fused-{s}",
            force=True,
            eval_samples=0,
            lora=[LoraFile(str(args.lora), s)],
        ).package

    float_plain = _images(base, call, prompts, seeds)
    base_score = frame_score(float_plain)
    pkg = sdkiln.load(packages["default"], device="cpu")
    pkg_plain, pkg_ratio = _counted(pkg, call, prompts, seeds)
    rows = [
        _row("float", float_plain, None, None, base_score, spec, prompts),
        _row("package (no LoRA)", pkg_plain, pkg_ratio, float_plain, frame_score(pkg_plain), spec, prompts),
    ]
    no_lora_psnr = rows[1]["psnr"]
    pkg.load_lora_weights(args.lora, adapter_name="frame")
    base.transformer.load_lora_adapter(str(args.lora), adapter_name="frame", prefix="transformer")
    checks = {}
    for s in STRENGTHS:
        base.transformer.set_adapters(["frame"], [s])
        reference = _images(base, call, prompts, seeds)
        ref_row = _row(f"float + LoRA (diffusers) @{s}", reference, None, None, base_score, spec, prompts)
        pkg.set_adapters("frame", s)
        branch = _row(
            f"package + runtime LoRA @{s}",
            *_counted(pkg, call, prompts, seeds),
            reference,
            base_score,
            spec,
            prompts,
        )
        pkg.sdkiln_lora.set_cache_policy("keep")
        kept = _row(
            f"package + runtime LoRA @{s}, cache kept",
            *_counted(pkg, call, prompts, seeds),
            reference,
            base_score,
            spec,
            prompts,
        )
        pkg.sdkiln_lora.set_cache_policy("headroom")
        fused_pipe = sdkiln.load(packages[f"fused@{s}"], device="cpu")
        fused = _row(
            f"package --lora @{s}",
            *_counted(fused_pipe, call, prompts, seeds),
            reference,
            base_score,
            spec,
            prompts,
        )
        rows += [ref_row, branch, kept, fused]
        for row in (branch, kept, fused):
            checks[row["variant"]] = {
                "psnr_within_1db": row["psnr"] >= no_lora_psnr - PSNR_SLACK_DB,
                "effect_within_10pct": abs(row["effect"] - ref_row["effect"])
                <= EFFECT_TOL * abs(ref_row["effect"]),
            }
    result = {
        "bench": "lora",
        "machine": harness.machine(("torch", "diffusers", "peft")),
        "lora": str(args.lora.relative_to(ROOT)) if args.lora.is_relative_to(ROOT) else str(args.lora),
        "samples": args.samples,
        "call": {k: v for k, v in call.items() if isinstance(v, int | float | str)},
        "rows": rows,
        "checks": checks,
        "minutes": round((time.time() - start) / 60, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'variant':<36} {'PSNR':>7} {'frame':>7} {'effect':>7} {'acc':>6}")
    for row in rows:
        psnr = f"{row['psnr']:.2f}" if "psnr" in row else "-"
        acc = row.get("class_accuracy", float("nan"))
        print(f"{row['variant']:<36} {psnr:>7} {row['frame_score']:7.3f} {row['effect']:7.3f} {acc:6.2f}")
    print(json.dumps(checks, indent=2))
    print(f"wrote {args.out} ({result['minutes']} min)")
    return 0 if all(all(c.values()) for c in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
