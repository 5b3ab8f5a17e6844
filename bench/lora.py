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
* ``package --lora``: a default-recipe package optimized with the LoRA fused (``optimize --lora``);
* ``package --lora --match-quality``: the same, its cache search matching the package without a LoRA
  (``optimize --match-quality``: the floor at that package's held-out PSNR less 1 dB, its front given
  to the search).

Reported: PSNR against the reference (and the package's own PSNR against the float model without a
LoRA, the bar: at most 1 dB lower), the frame score and its change over the model without the LoRA
(the LoRA's effect: within 10% of the float model's), class accuracy.

    OMP_NUM_THREADS=2 python bench/lora.py                   # about 25 minutes on 2 cores
    OMP_NUM_THREADS=2 python bench/lora.py --ablate-cache    # then: without the cache schedule, 2 minutes
    OMP_NUM_THREADS=2 python bench/lora.py --ablate-match    # then: the matched floor without the front, 4 minutes
"""

from __future__ import annotations

import argparse
import dataclasses
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


def match_ablation(lora: Path, work: Path, out: Path, samples: int = 40) -> dict:
    """Strength 1.0, ``--lora`` with ``--match-quality``'s floor and held-out samples but without the
    front it gives the search (``candidates``): what the given front adds at the same floor. Needs the
    default package of a previous run under ``work``; compares with the run's matched row."""
    from sdkiln.configs import CacheAutoConfig
    from sdkiln.optimizer.match import QualityTarget
    from sdkiln.optimizer.recipes import resolve_recipe

    start = time.time()
    spec = get_spec("fmnist-flux")
    recipe = QualityTarget.read(work / "default").apply(resolve_recipe("default", spec))
    recipe = dataclasses.replace(
        recipe,
        name="default, matched floor, no front given",
        steps=[
            dataclasses.replace(s, candidates=()) if isinstance(s, CacheAutoConfig) else s
            for s in recipe.steps
        ],
    )
    package = sdkiln.optimize(
        None, recipe, work / "floor-only-1.0", force=True, eval_samples=0, lora=[LoraFile(str(lora), 1.0)]
    ).package
    base, call = spec.build(), spec.call_kwargs()
    prompts, seeds = sample_plan(spec, samples, seed=0)
    base_score = frame_score(_images(base, call, prompts, seeds))
    base.transformer.load_lora_adapter(str(lora), adapter_name="frame", prefix="transformer")
    reference = _images(base, call, prompts, seeds)
    row = _row(
        "package --lora, matched floor, no front given @1.0",
        *_counted(sdkiln.load(package, device="cpu"), call, prompts, seeds),
        reference,
        base_score,
        spec,
        prompts,
    )
    (cache_step,) = [s for s in recipe.steps if isinstance(s, CacheAutoConfig)]
    result = {
        "bench": "lora_match_ablation",
        "machine": harness.machine(("torch", "diffusers", "peft")),
        "samples": samples,
        "floor": {"psnr_mean_db": cache_step.psnr_floor_db, "psnr_p5_db": cache_step.psnr_p5_floor_db},
        "held_out_samples": cache_step.eval_samples,
        "row": row,
        "minutes": round((time.time() - start) / 60, 1),
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: row[k] for k in ("psnr", "block_evaluations_ratio")}, indent=2))
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
    parser.add_argument(
        "--ablate-match",
        action="store_true",
        help="only the --match-quality ablation (strength 1.0, the matched floor without the given front; "
        "needs the default package of a previous run under --work): bench/results/lora_fmnist_match_ablation.json",
    )
    args = parser.parse_args(argv)
    if args.ablate_match:
        match_ablation(args.lora, args.work, args.out.with_name("lora_fmnist_match_ablation.json"))
        return 0
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
        packages[f"matched@{s}"] = sdkiln.optimize(
            None,
            "default",
            args.work / f"matched-{s}",
            force=True,
            eval_samples=0,
            lora=[LoraFile(str(args.lora), s)],
            match_quality=packages["default"],
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
        matched = _row(
            f"package --lora --match-quality @{s}",
            *_counted(sdkiln.load(packages[f"matched@{s}"], device="cpu"), call, prompts, seeds),
            reference,
            base_score,
            spec,
            prompts,
        )
        rows += [ref_row, branch, kept, fused, matched]
        for row in (branch, kept, fused, matched):
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
    print(f"{'variant':<38} {'PSNR':>7} {'frame':>7} {'effect':>7} {'acc':>6} {'evals':>6}")
    for row in rows:
        psnr = f"{row['psnr']:.2f}" if "psnr" in row else "-"
        acc = row.get("class_accuracy", float("nan"))
        evals = f"{row['block_evaluations_ratio']:.3f}" if "block_evaluations_ratio" in row else "-"
        print(
            f"{row['variant']:<38} {psnr:>7} {row['frame_score']:7.3f} {row['effect']:7.3f} {acc:6.2f} {evals:>6}"
        )
    print(json.dumps(checks, indent=2))
    print(f"wrote {args.out} ({result['minutes']} min)")
    return 0 if all(all(c.values()) for c in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
