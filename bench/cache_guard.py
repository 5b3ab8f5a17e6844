"""What the cache guard costs on usual input and what it saves on unusual input (embedded model).

One ``cache_auto`` search with ``guard=True`` (default options otherwise) at 28 steps makes a
schedule and its thresholds. Then, on held-out samples, for each condition the uncached run, the
schedule without its guard and the schedule with it are generated and scored against the uncached
images:

* ``usual``: the eval prompts at the deployment guidance (what the thresholds were calibrated for:
  the guard should stay almost silent and cost almost nothing);
* ``guidance=G``: the same prompts at a guidance the schedule was not searched for;
* ``other prompts``: prompts outside the model's captions.

Reported per condition and variant: mean and 5th-percentile PSNR vs uncached, block evaluations
over the uncached run's (counted by the cache runner), and the guard's checks and forced steps.

    OMP_NUM_THREADS=2 python bench/cache_guard.py     # about 10 minutes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (bench/harness.py: the machine description)

import sdkiln  # noqa: E402
from sdkiln import metrics  # noqa: E402
from sdkiln.configs import CacheAutoConfig, Deployment, RecipeConfig  # noqa: E402
from sdkiln.model_zoo import get_spec  # noqa: E402
from sdkiln.optimizer.evaluate import PSNR_CAP_DB, generate, sample_plan  # noqa: E402
from sdkiln.runtime.cache import SCHEDULE_FILE, CacheSchedule, attach_cache, detach_cache  # noqa: E402

DEFAULT_OUT = Path(__file__).parent / "results" / "cache_guard_fmnist.json"
PACKAGES = ("torch", "diffusers", "sdkiln")
OTHER_PROMPTS = ["a photo of a cat", "a red car at night", "", "a bowl of soup", "a mountain lake"]


def _run(pipe, spec, schedule: CacheSchedule | None, call, prompts, seeds, batch: int, desc: str):
    if schedule is None:
        return generate(pipe, call, prompts, seeds, batch, desc)[0], None
    runner = attach_cache(pipe, schedule, spec.transformer_attr)
    try:
        images = generate(pipe, call, prompts, seeds, batch, desc)[0]
    finally:
        detach_cache(getattr(pipe, spec.transformer_attr))
    return images, runner


def run(
    num_samples: int,
    steps: int,
    seed: int,
    guidances: list[float],
    batch: int,
    model: str = "fmnist-flux",
    search: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The report; ``search`` overrides the cache_auto options (a smoke test's small search)."""
    spec = get_spec(model)
    base = spec.build()
    started = time.perf_counter()
    recipe = RecipeConfig(
        name="cache-auto+guard",
        steps=[CacheAutoConfig(guard=True, **(search or {}))],
        deployment=Deployment(num_inference_steps=steps),
    )
    result = sdkiln.optimize(base, recipe, out_dir=None, eval_samples=0)
    search_seconds = time.perf_counter() - started
    guarded = CacheSchedule.from_dict(result.files[SCHEDULE_FILE])
    plain = dataclasses.replace(guarded, guards={})
    pipe = result.pipeline
    detach_cache(getattr(pipe, spec.transformer_attr))  # the optimized pipeline comes with the schedule on

    prompts, seeds = sample_plan(spec, num_samples, seed)
    default_guidance = spec.call_kwargs()[spec.guidance_arg]
    conditions = [("usual", prompts, default_guidance)]
    conditions += [(f"guidance={g:g}", prompts, g) for g in guidances]
    other = [OTHER_PROMPTS[i % len(OTHER_PROMPTS)] for i in range(num_samples)]
    conditions.append(("other prompts", other, default_guidance))

    rows = []
    for name, cond_prompts, guidance in conditions:
        call = spec.call_kwargs(num_inference_steps=steps, guidance=guidance)
        reference, _ = _run(pipe, spec, None, call, cond_prompts, seeds, batch, f"{name}: uncached")
        for variant, schedule in (("schedule", plain), ("schedule+guard", guarded)):
            images, runner = _run(
                pipe, spec, schedule, call, cond_prompts, seeds, batch, f"{name}: {variant}"
            )
            psnr = np.minimum(metrics.psnr(reference, images), PSNR_CAP_DB)
            row = {
                "condition": name,
                "guidance": guidance,
                "variant": variant,
                "psnr": float(psnr.mean()),
                "psnr_p5": float(np.percentile(psnr, 5)),
                "block_evaluations_ratio": runner.block_evaluations
                / (runner.transformer_calls * runner.num_blocks),
                "guard_checks": runner.guard_checks,
                "guard_forced": runner.guard_forced,
            }
            rows.append(row)
            print(
                f"{name:16s} {variant:15s} PSNR {row['psnr']:6.2f} (p5 {row['psnr_p5']:6.2f})  blocks "
                f"{row['block_evaluations_ratio']:.3f}  forced {runner.guard_forced}/{runner.guard_checks}",
                file=sys.stderr,
            )
    return {
        "benchmark": "cache guard: usual vs unusual input (bench/cache_guard.py)",
        "model": spec.name,
        "settings": {
            "num_samples": num_samples,
            "steps": steps,
            "seeds": f"{seeds[0]}..{seeds[-1]}",
            "batch_size": batch,
            "recipe": recipe.to_dict(),
        },
        "machine": harness.machine(PACKAGES),
        "schedule": {
            "actions": result.files[SCHEDULE_FILE]["actions"],
            "guards": guarded.guards,
            "search_seconds": round(search_seconds, 1),
        },
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="fmnist-flux")
    parser.add_argument("--num-samples", type=int, default=40)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--seed", type=int, default=20_000)
    parser.add_argument("--guidance", type=float, nargs="+", default=[8.0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    report = run(args.num_samples, args.steps, args.seed, args.guidance, args.batch_size, args.model)
    report["total_seconds"] = time.perf_counter() - start
    report["command"] = " ".join(
        ["python", "bench/cache_guard.py", *(argv if argv is not None else sys.argv[1:])]
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
