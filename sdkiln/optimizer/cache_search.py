"""Search a static cache schedule against measured final-output error (the ``cache_auto`` step).

1. **Profile and reference.** The model as the recipe left it (quantized first, when the recipe
   does that) runs uncached on ``calib_samples`` calibration prompts as one batch, recording how
   every block's residual changes from step to step (``calibrate.cache_profile``, kept in the
   package with a heatmap) and the latents before every step (``calibrate.trajectories``).
2. **Segment errors.** A segment (s, L, a) is a full step s followed by L steps of action a. For
   each full step s and action a, one partial run starts from the reference latents before s, runs
   s full and then a for up to ``max_reuse`` steps, and records the latents after every step: the
   relative L2 error of the latents after step s+L against the reference is the segment's error for
   every L at once (a run's first L steps do not depend on what follows them).
3. **Dynamic programming.** Over the full steps, minimize block evaluations + lambda x (sum of the
   segment errors of the schedule), for lambda on a geometric grid: each lambda gives one schedule
   (the first ``min_full`` steps and the last step full, at most ``max_reuse`` non-full steps in a
   row). Summing segment errors is a model of the final error, so:
4. **Confirmation.** Every distinct schedule runs end to end on the calibration samples: its PSNR
   of the decoded images and relative L2 of the final latents against the uncached run (mean and
   5th/95th percentiles). These, with the block-evaluation ratio, form the Pareto front kept in the
   package. The chosen schedule is the cheapest whose mean PSNR reaches ``psnr_floor_db`` and whose
   5th-percentile PSNR reaches ``psnr_p5_floor_db`` (or, for the presets, the one at the preset's
   place on the front); it is then measured on held-out samples (``eval_samples`` of the family's
   eval prompts, other seeds) for the ``expected`` object.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from sdkiln.calibrate.cache_profile import HEATMAP_FILE, PROFILE_FILE, heatmap_png, profile
from sdkiln.calibrate.loop import PromptLoop
from sdkiln.calibrate.trajectories import Trajectories
from sdkiln.configs import CacheAutoConfig
from sdkiln.model_zoo.fingerprint import fingerprint
from sdkiln.optimizer import metrics
from sdkiln.optimizer.cache_layout import block_layout, run_sigmas
from sdkiln.optimizer.evaluate import PSNR_CAP_DB, generate
from sdkiln.optimizer.registry import StepContext, StepResult, register_transform
from sdkiln.runtime.cache import (
    BATCHED,
    FULL,
    SCHEDULE_FILE,
    Action,
    CacheSchedule,
    attach_cache,
    detach_cache,
)

EVAL_SEED = 10_000
"""Held-out samples use the eval prompts with seeds from here, disjoint from calibration seeds."""


@dataclass(frozen=True)
class Segment:
    start: int
    length: int
    action: Action


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    a, b = a.flatten(1).double(), b.flatten(1).double()
    return ((a - b).norm(dim=1) / b.norm(dim=1).clamp_min(1e-12)).numpy()


class Search:
    """The measurements and the schedules of one ``cache_auto`` step."""

    def __init__(self, ctx: StepContext, config: CacheAutoConfig, prompts: list[str], seeds: list[int]):
        self.ctx, self.config = ctx, config
        self.traj = Trajectories(ctx.pipeline, ctx.spec, prompts, seeds, config.steps)
        self.num_steps = self.traj.num_steps
        self.blocks = block_layout(ctx.spec, ctx.transformer)
        self.num_blocks = sum(b.count for b in self.blocks)
        self.actions = [Action.parse(a) for a in config.actions]
        self.sigmas: list[float] = []
        self.errors: dict[Segment, float] = {}

    def schedule(self, actions: list[Action]) -> CacheSchedule:
        return CacheSchedule(
            actions={BATCHED: actions},
            sigmas=self.sigmas,
            blocks=self.blocks,
            scheduler_class=type(self.ctx.pipeline.scheduler).__name__,
        )

    def measure_segments(self) -> None:
        reference = self.traj.reference()
        self.sigmas = run_sigmas(self.ctx.pipeline)
        t, k = self.num_steps, self.config.max_reuse
        starts = range(self.config.min_full - 1, t - 2)  # a segment's reuse ends before the last step
        jobs = [(s, a) for s in starts for a in self.actions]
        for s, action in tqdm(jobs, desc="cache segments", unit="run", leave=False):
            length = min(k, t - 2 - s)
            acts = [FULL] * t
            acts[s + 1 : s + 1 + length] = [action] * length
            attach_cache(self.ctx.pipeline, self.schedule(acts), self.ctx.spec.transformer_attr)
            try:
                after = self.traj.run(start=s, stop=s + length)
            finally:
                detach_cache(self.ctx.transformer)
            for n in range(1, length + 1):  # after[n]: the latents after step s + n
                self.errors[Segment(s, n, action)] = float(_rel_l2(after[n], reference[s + n + 1]).mean())

    def solve(self, lam: float) -> list[Action]:
        """The schedule minimizing block evaluations + lam * summed segment error."""
        t, n = self.num_steps, self.num_blocks
        best = [math.inf] * t  # best[i]: cost of steps i..t-1 given step i is full
        choice: list[Segment | None] = [None] * t
        best[t - 1] = n
        for i in range(t - 2, -1, -1):
            best[i], choice[i] = n + best[i + 1], None
            if i < self.config.min_full - 1:
                continue
            for seg, err in self.errors.items():
                if seg.start != i or i + seg.length + 1 > t - 1:
                    continue
                cost = n + seg.length * seg.action.block_evaluations(n) + lam * err + best[i + seg.length + 1]
                if cost < best[i]:
                    best[i], choice[i] = cost, seg
        actions, i = [FULL] * t, 0
        while i < t - 1:
            seg = choice[i]
            if seg is None:
                i += 1
                continue
            actions[i + 1 : i + 1 + seg.length] = [seg.action] * seg.length
            i += seg.length + 1
        return actions

    def confirm(
        self, actions: list[Action], prompts, seeds, reference_images, reference_latents
    ) -> dict[str, Any]:
        schedule = self.schedule(actions)
        call = self.ctx.spec.call_kwargs(steps=self.config.steps)
        runner = attach_cache(self.ctx.pipeline, schedule, self.ctx.spec.transformer_attr)
        try:
            images, latents = generate(self.ctx.pipeline, call, prompts, seeds, len(prompts), "confirm")
        finally:
            detach_cache(self.ctx.transformer)
        psnr = np.minimum(metrics.psnr(images, reference_images), PSNR_CAP_DB)
        rel = _rel_l2(latents, reference_latents)
        return {
            "actions": [str(a) for a in actions],
            "block_evaluations_ratio": schedule.block_evaluations_ratio(),
            "measured_block_evaluations": runner.block_evaluations,
            "psnr_mean": float(psnr.mean()),
            "psnr_p5": float(np.percentile(psnr, 5)),
            "rel_l2_mean": float(rel.mean()),
            "rel_l2_p95": float(np.percentile(rel, 95)),
            "ssim_mean": float(metrics.ssim(images, reference_images).mean()),
        }


def fixed_interval(num_steps: int, first: int, every: int, action: Action | None = None) -> list[Action]:
    """The FORA-style baseline: steps ``0 .. first-1`` full, then every ``every``-th step full, the
    last step full, the others ``action`` (default ``skip``)."""
    reuse = action or Action("skip")
    return [
        FULL if s < first or (s - first) % every == 0 or s == num_steps - 1 else reuse
        for s in range(num_steps)
    ]


def _pick(front: list[dict[str, Any]], config: CacheAutoConfig) -> dict[str, Any]:
    ok = [
        p for p in front if p["psnr_mean"] >= config.psnr_floor_db and p["psnr_p5"] >= config.psnr_p5_floor_db
    ]
    if not ok:
        return min(front, key=lambda p: -p["psnr_mean"])  # all-full is on the front and always passes
    return min(ok, key=lambda p: (p["block_evaluations_ratio"], -p["psnr_mean"]))


@register_transform(CacheAutoConfig)
def apply_cache_auto(ctx: StepContext, config: CacheAutoConfig) -> StepResult:
    started = time.perf_counter()
    calib = PromptLoop(ctx.spec, config.calib_samples, steps=config.steps)
    prompts, seeds = calib.plan()
    search = Search(ctx, config, prompts, seeds)
    prof = profile(search.traj, search.blocks)
    search.measure_segments()

    call = ctx.spec.call_kwargs(steps=config.steps)
    ref_images, ref_latents = generate(ctx.pipeline, call, prompts, seeds, len(prompts), "uncached")
    lambdas = [
        config.lambda_min * (config.lambda_max / config.lambda_min) ** (i / (config.lambdas - 1))
        for i in range(config.lambdas)
    ]
    seen, front = set(), []
    for lam in tqdm(lambdas, desc="cache schedules", leave=False):
        actions = search.solve(lam)
        key = tuple(str(a) for a in actions)
        if key in seen:
            continue
        seen.add(key)
        point = search.confirm(actions, prompts, seeds, ref_images, ref_latents)
        front.append(point | {"lambda": lam})
    full = [FULL] * search.num_steps
    if tuple(str(a) for a in full) not in seen:
        front.append(search.confirm(full, prompts, seeds, ref_images, ref_latents) | {"lambda": math.inf})
    front.sort(key=lambda p: p["block_evaluations_ratio"])
    chosen = _pick(front, config)

    eval_prompts = [ctx.spec.eval_prompts[i % len(ctx.spec.eval_prompts)] for i in range(config.eval_samples)]
    eval_seeds = [EVAL_SEED + i for i in range(config.eval_samples)]
    held_images, held_latents = generate(
        ctx.pipeline, call, eval_prompts, eval_seeds, len(eval_prompts), "held-out"
    )
    actions = [Action.parse(a) for a in chosen["actions"]]
    expected = search.confirm(actions, eval_prompts, eval_seeds, held_images, held_latents)
    expected.pop("actions")
    schedule = search.schedule(actions)
    schedule.fingerprint = fingerprint(ctx.transformer)
    schedule.guidance_mode = "shared"  # one action list for every CFG branch (each keeps its own cache)
    schedule.expected = expected | {"prompts": eval_prompts, "seeds": eval_seeds}
    schedule.search = {
        "objective": "block evaluations + lambda * sum of measured segment errors (relative L2 of the latents)",
        "constraints": {"min_full": config.min_full, "max_reuse": config.max_reuse, "last_step": "full"},
        "actions": list(config.actions),
        "calibration": calib.record(),
        "floor": {"psnr_mean_db": config.psnr_floor_db, "psnr_p5_db": config.psnr_p5_floor_db},
        "front": front,
        "seconds": round(time.perf_counter() - started, 1),
    }
    attach_cache(ctx.pipeline, schedule, ctx.spec.transformer_attr)  # the result runs as the package will
    return StepResult(
        modules={},
        record={
            "schedule": SCHEDULE_FILE,
            "actions": chosen["actions"],
            "block_evaluations_ratio": chosen["block_evaluations_ratio"],
            "calibration_psnr_mean": chosen["psnr_mean"],
            "expected": schedule.expected,
            "front_size": len(front),
        },
        files={SCHEDULE_FILE: schedule.to_dict(), PROFILE_FILE: prof, HEATMAP_FILE: heatmap_png(prof)},
    )
