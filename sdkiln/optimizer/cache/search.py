"""Search a static cache schedule against measured final-output error (the ``cache_auto`` step).

1. **Profile and reference.** The model as the recipe left it (quantized first, when the recipe
   does that) runs uncached on ``calib_samples`` calibration prompts as one batch, recording how
   every block's residual changes from step to step (``calibrate.cache_profile``, kept in the
   package with a heatmap) and the latents before every step (``calibrate.trajectories``).
2. **Segment errors** (``plan`` has the model). A segment (s, L, a) is a full step s followed
   by L steps of reuse action a. For each full step s and action a, one partial run starts from the
   reference latents before s, runs s full, then a for up to ``max_reuse`` steps, and records the
   latents after every step: the relative L2 error after step s+L is the segment's local error for
   every L at once (a run's first L steps do not depend on what follows). The first action's runs
   continue full to the last step, which measures how an error after step j grows or shrinks by the
   final latents (the gain of step j). A segment's predicted final error is local x gain.
3. **Candidates.** Dynamic programming over the full steps and the block evaluations spent finds,
   for each of ``budgets`` budgets evenly spaced from the cheapest allowed schedule to all-full, the
   schedule of least predicted final error within it (the first ``min_full`` steps and the last step
   full, at most ``max_reuse`` reuse steps in a row); the fixed-interval schedules within the same
   constraints join them, all-full, and the recipe's ``candidates`` that fit (``optimize
   --match-quality`` gives another package's front: a search started where a related model's ended).
4. **Confirmation and refinement.** Every candidate runs end to end on the calibration samples: PSNR
   of the decoded images and relative L2 of the final latents against the uncached run (mean and
   5th/95th percentiles). From the cheapest schedule meeting the floor (mean PSNR >=
   ``psnr_floor_db``, 5th percentile >= ``psnr_p5_floor_db``), a local search tries one-move-cheaper
   neighbours (a full step turned into reuse, a segment's action made cheaper), best predicted first,
   each confirmed end to end, for up to ``refine`` runs. The Pareto front of every confirmed
   schedule (block evaluations -> PSNR) is kept in the package; the chosen schedule is the cheapest
   confirmed one meeting the floor (the presets differ only in the floor). It is then measured on
   held-out samples (``eval_samples`` of the family's eval prompts, other seeds) for ``expected``.
   Four calibration samples can flatter a schedule, and eight held-out ones are a sample too: where
   the held-out mean PSNR less ``held_out_margin_se`` standard errors of that mean misses the floor,
   the front's next safer schedule is measured there, up to ``held_out_retries`` times, and the first
   that meets the floor is chosen (else the last tried, with a warning; ``search.held_out`` keeps
   every try). A schedule that meets it by less than another margin (``_borderline``) is measured
   again on ``held_out_extend`` more held-out samples too, and judged on all of them.
5. **Guard** (``guard=True``). Before that held-out run, the chosen schedule runs once more on the
   calibration samples with a recording guard (``runtime.cache.guard``); each reuse step's threshold
   on the stack input's change is ``guard_quantile`` of what was seen there times ``guard_margin``.
   The held-out run then runs guarded and reports how often the guard forced a compute.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from sdkiln import metrics
from sdkiln.calibrate.cache_profile import HEATMAP_FILE, PROFILE_FILE, heatmap_png, profile
from sdkiln.calibrate.loop import PromptLoop
from sdkiln.calibrate.trajectories import Trajectories
from sdkiln.configs import CacheAutoConfig
from sdkiln.errors import RecipeError
from sdkiln.model_zoo.fingerprint import fingerprint
from sdkiln.optimizer.cache.layout import block_layout, run_sigmas
from sdkiln.optimizer.cache.plan import ErrorModel, Segment, fill_gaps
from sdkiln.optimizer.evaluate import PSNR_CAP_DB, generate
from sdkiln.optimizer.plan import Phase, register_plan
from sdkiln.optimizer.registry import TransformContext, TransformResult, register_transform
from sdkiln.runtime.cache import (
    BATCHED,
    FULL,
    SCHEDULE_FILE,
    Action,
    CacheSchedule,
    attach_cache,
    detach_cache,
)
from sdkiln.runtime.cache.guard import Guard
from sdkiln.runtime.cache.guard import calibrate as guard_thresholds

EVAL_SEED = 10_000
"""Held-out samples use the eval prompts with seeds from here, disjoint from calibration seeds."""


class Search:
    """The measurements and the schedules of one ``cache_auto`` step."""

    def __init__(self, ctx: TransformContext, config: CacheAutoConfig, prompts: list[str], seeds: list[int]):
        self.ctx, self.config = ctx, config
        self.traj = Trajectories(ctx.pipeline, ctx.spec, prompts, seeds, ctx.call_kwargs())
        self.num_steps = self.traj.num_steps
        self.blocks = block_layout(ctx.spec, ctx.transformer)
        self.num_blocks = sum(b.count for b in self.blocks)
        actions = [Action.parse(a) for a in config.actions]
        # a partial action needs a middle block to reuse: sd3-tiny's 2 blocks have none for partial:1:1
        self.actions = [a for a in actions if a.kind != "partial" or a.first + a.last < self.num_blocks]
        self.dropped = [str(a) for a in actions if a not in self.actions]
        if not self.actions:
            raise RecipeError(
                f"cache_auto: none of the actions {', '.join(config.actions)} fits a stack of "
                f"{self.num_blocks} blocks; add skip"
            )
        if self.dropped:
            tqdm.write(
                f"cache search: {', '.join(self.dropped)} left out: no middle block of {self.num_blocks} to reuse"
            )
        self.sigmas: list[float] = []
        self.first = 0
        """The run's first step this transformer computes; ``num_steps`` counts the steps it computes."""
        self.model = ErrorModel(self.num_steps, self.num_blocks, config.min_full, config.max_reuse)

    def own_steps(self, prof: dict[str, Any]) -> None:
        """Search over the steps the profile saw this transformer compute, a contiguous window of the
        run (all of them, unless it is one of a pipeline's experts: Wan2.2-A14B's low-noise
        ``transformer_2`` computes the steps after the boundary). Action lists, the error model and the
        segments count steps from the window's first; ``schedule`` places them in the run, the run's
        other steps full (never this transformer's)."""
        steps = sorted({row["step"] for rows in prof["branches"].values() for row in rows})
        if not steps:
            raise RecipeError(
                f"cache_auto: {self.ctx.spec.transformer_attr} computes none of the {self.traj.num_steps} "
                "steps the recipe deploys at (the pipeline's other transformer runs them all): deploy at more steps"
            )
        if steps != list(range(steps[0], steps[-1] + 1)):
            raise RecipeError(
                f"cache_auto: the transformer computes steps {steps}, not one window of the run"
            )
        self.first, self.num_steps = steps[0], len(steps)
        self.model = ErrorModel(self.num_steps, self.num_blocks, self.config.min_full, self.config.max_reuse)

    def given(self, texts: tuple[str, ...]) -> list[list[Action]]:
        """The config's ``candidates`` that fit this search: as many actions as the transformer's steps,
        each full or one of the search's actions, within its constraints (``ErrorModel.allowed``).
        Those that do not are left out, with one note."""
        fit = []
        for text in texts:
            actions = [Action.parse(a) for a in text.split(",")]
            if (
                len(actions) == self.num_steps
                and all(a == FULL or a in self.actions for a in actions)
                and self.model.allowed(actions)
            ):
                fit.append(actions)
        if len(fit) < len(texts):
            tqdm.write(
                f"cache search: {len(texts) - len(fit)} of {len(texts)} given schedules left out: not "
                f"{self.num_steps} steps of full and {', '.join(map(str, self.actions))} within min_full "
                f"{self.config.min_full} and max_reuse {self.config.max_reuse}"
            )
        return fit

    def schedule(self, actions: list[Action]) -> CacheSchedule:
        """The schedule of the run for ``actions`` over this transformer's steps."""
        after = self.traj.num_steps - self.first - len(actions)
        return CacheSchedule(
            actions={BATCHED: [FULL] * self.first + list(actions) + [FULL] * after},
            sigmas=self.sigmas,
            blocks=self.blocks,
            scheduler_class=type(self.ctx.pipeline.scheduler).__name__,
        )

    def segment_jobs(self) -> list[tuple[int, Action, int, int]]:
        """(full step s, action, reuse length L, last step run): one partial run each. The first action's
        runs continue full to the last step, which measures the gains; the others stop after the segment."""
        t, k = self.num_steps, self.config.max_reuse
        jobs = []
        for s in range(self.config.min_full - 1, t - 2):  # a segment's reuse ends before the last step
            length = min(k, t - 2 - s)
            for i, action in enumerate(self.actions):
                if action.extrapolate and s < 1:  # extrapolation needs two full steps before the reuse
                    continue
                jobs.append((s, action, length, t - 1 if i == 0 else s + length))
        return jobs

    def measure_segments(self, seconds_per_step: float) -> ErrorModel:
        reference = self.traj.reference()
        self.sigmas = run_sigmas(self.ctx.pipeline)
        t, jobs = self.num_steps, self.segment_jobs()
        planned = sum(stop - s + 1 + a.extrapolate for s, a, _, stop in jobs)
        confirmations = confirmation_bound(self.config)
        guard = ", the guard's calibrations" if self.config.guard else ""
        tries = 1 + self.config.held_out_retries
        tqdm.write(
            f"cache search: {len(jobs)} segment runs, {planned} steps of the calibration batch, about "
            f"{planned * seconds_per_step:.0f} s, then up to {1 + confirmations + self.config.guard * tries} "
            f"end-to-end runs of {t} steps of the calibration batch (about {t * seconds_per_step:.0f} s "
            f"each: the uncached one, up to {confirmations} schedules confirmed{guard}) and up to "
            f"{1 + tries} of {self.config.eval_samples} held-out samples (one of them on "
            f"{self.config.held_out_extend} more where it is narrow)"
        )
        gains: dict[int, list[float]] = {}
        o, end = self.first, self.traj.num_steps  # the window's first step in the run; the run's steps
        for s, action, length, stop in tqdm(jobs, desc="cache segments", unit="run", leave=False):
            acts = [FULL] * t
            acts[s + 1 : s + 1 + length] = [action] * length
            attach_cache(self.ctx.pipeline, self.schedule(acts), self.ctx.spec.transformer_attr)
            first = s - 1 if action.extrapolate else s  # extrapolation needs the full step before s too
            # the first action's runs go on to the run's last step (the other expert's steps too)
            last = end - 1 if stop == t - 1 else o + stop
            try:
                after = self.traj.run(start=o + first, stop=last)[s - first :]
            finally:
                detach_cache(self.ctx.transformer)
            for n in range(1, length + 1):  # after[n]: the latents after step s + n
                self.model.local[Segment(s, n, action)] = float(
                    metrics.rel_l2(reference[o + s + n + 1], after[n]).mean()
                )
            if stop == t - 1:
                local = self.model.local[Segment(s, length, action)]
                final = float(metrics.rel_l2(reference[end], after[-1]).mean())
                if local > 0:
                    gains.setdefault(s + length, []).append(final / local)
        self.model.gain = fill_gaps({j: float(np.mean(g)) for j, g in gains.items()}, t)
        return self.model

    def confirm(
        self, actions: list[Action], prompts, seeds, reference_images, reference_latents, guards=None
    ) -> dict[str, Any]:
        schedule = self.schedule(actions)
        schedule.guards = guards or {}
        call = self.ctx.call_kwargs()
        runner = attach_cache(self.ctx.pipeline, schedule, self.ctx.spec.transformer_attr)
        try:
            images, latents = generate(
                self.ctx.pipeline,
                call,
                prompts,
                seeds,
                len(prompts),
                "confirm",
                self.ctx.spec.condition(call, len(prompts)),
            )
        finally:
            detach_cache(self.ctx.transformer)
        psnr = np.minimum(metrics.psnr(reference_images, images), PSNR_CAP_DB)
        rel = metrics.rel_l2(reference_latents, latents)
        return {
            "actions": [str(a) for a in actions],
            # over this transformer's steps (the schedule's others are another expert's)
            "block_evaluations_ratio": sum(a.block_evaluations(self.num_blocks) for a in actions)
            / (self.num_blocks * len(actions)),
            "measured_block_evaluations": runner.block_evaluations,
            "psnr_mean": float(psnr.mean()),
            # the standard error of that mean (0 for one sample): the held-out check's margin
            "psnr_se": float(psnr.std(ddof=1) / math.sqrt(len(psnr))) if len(psnr) > 1 else 0.0,
            "psnr_p5": float(np.percentile(psnr, 5)),
            "rel_l2_mean": float(rel.mean()),
            "rel_l2_p95": float(np.percentile(rel, 95)),
            "ssim_mean": float(metrics.ssim(reference_images, images).mean()),
        } | ({"guard": {"checks": runner.guard_checks, "forced": runner.guard_forced}} if guards else {})

    def calibrate_guard(self, actions: list[Action], prompts, seeds) -> Guard:
        """Guard thresholds for ``actions``: the schedule runs on the calibration samples recording the
        input change at every reuse step; each step's threshold is ``guard_quantile`` of the values
        times ``guard_margin``."""
        recorder = Guard(record=True)
        call = self.ctx.call_kwargs()
        attach_cache(
            self.ctx.pipeline, self.schedule(actions), self.ctx.spec.transformer_attr, guard=recorder
        )
        try:
            generate(
                self.ctx.pipeline,
                call,
                prompts,
                seeds,
                len(prompts),
                "guard",
                self.ctx.spec.condition(call, len(prompts)),
            )
        finally:
            detach_cache(self.ctx.transformer)
        return guard_thresholds(
            recorder.values, self.traj.num_steps, self.config.guard_quantile, self.config.guard_margin
        )


def fixed_interval(
    num_steps: int, first: int, every: int, action: Action | None = None, from_end: bool = False
) -> list[Action]:
    """The FORA-style baseline: steps ``0 .. first-1`` full, then every ``every``-th step full, the
    last step full, the others ``action`` (default ``skip``). ``from_end`` counts the period back from
    the last step instead of forward from ``first`` (the two phases differ when ``every`` does not
    divide the steps left)."""
    reuse = action or Action("skip")
    last = num_steps - 1

    def full(s: int) -> bool:
        return s < first or s == last or ((last - s) if from_end else (s - first)) % every == 0

    return [FULL if full(s) else reuse for s in range(num_steps)]


def fixed_settings(min_full: int, max_reuse: int) -> list[tuple[int, int, bool]]:
    """``(first, every, from_end)`` of every fixed-interval schedule the search tries: the first k
    steps full for k in {min_full, 2, 3, 4} (none below ``min_full``), then every n-th step for n in
    2 .. max_reuse + 1, counted from either end."""
    firsts = sorted({max(k, min_full) for k in (min_full, 2, 3, 4)})
    return [(f, n, e) for f in firsts for n in range(2, max_reuse + 2) for e in (False, True)]


def confirmation_bound(config: CacheAutoConfig) -> int:
    """The most schedules a search confirms end to end: one per budget, one per fixed-interval
    setting, all-full, one per given candidate, and ``refine`` (a schedule met twice is confirmed once)."""
    fixed = len(fixed_settings(config.min_full, config.max_reuse))
    return config.budgets + fixed + 1 + len(config.candidates) + config.refine


def fixed_family(model: ErrorModel, actions: list[Action]) -> list[list[Action]]:
    """The fixed-interval schedules within the search's constraints (first k full, then every n-th,
    counted from either end), each with the reuse action the model predicts best for it: candidates
    beside the DP's, so the search never returns less than the baselines give. The DP's summed error
    model misjudges regular patterns most (it is conservative for alternating extrapolated skips),
    which is why these are confirmed rather than predicted."""
    out: dict[tuple[str, ...], list[Action]] = {}
    for first, every, from_end in fixed_settings(model.min_full, model.max_reuse):
        trials = [fixed_interval(model.num_steps, first, every, a, from_end) for a in actions]
        trials = [t for t in trials if model.allowed(t)]
        if trials:
            best = min(trials, key=model.predict)
            out.setdefault(tuple(str(a) for a in best), best)
    return list(out.values())


def _feasible(point: dict[str, Any], config: CacheAutoConfig) -> bool:
    return point["psnr_mean"] >= config.psnr_floor_db and point["psnr_p5"] >= config.psnr_p5_floor_db


def _held_out_text(point: dict[str, Any], config: CacheAutoConfig) -> str:
    return (
        f"PSNR {point['psnr_mean']:.1f} dB less {config.held_out_margin_se:g} x its standard error "
        f"{point['psnr_se']:.2f} (5th percentile {point['psnr_p5']:.1f})"
    )


def _feasible_held_out(point: dict[str, Any], config: CacheAutoConfig) -> bool:
    """The floor on the held-out samples, their mean PSNR less ``held_out_margin_se`` standard errors."""
    bound = point["psnr_mean"] - config.held_out_margin_se * point["psnr_se"]
    return bound >= config.psnr_floor_db and point["psnr_p5"] >= config.psnr_p5_floor_db


def _borderline(point: dict[str, Any], config: CacheAutoConfig) -> bool:
    """Met by the held-out check, but not with twice its margin: worth more samples."""
    bound = point["psnr_mean"] - 2 * config.held_out_margin_se * point["psnr_se"]
    return _feasible_held_out(point, config) and bound < config.psnr_floor_db


class HeldOut:
    """The held-out samples (the family's eval prompts, seeds from ``EVAL_SEED``) and the uncached
    model's images and latents on them, made at once and grown by ``extend`` (once)."""

    def __init__(self, ctx: TransformContext, call: dict[str, Any], count: int):
        self.ctx, self.call = ctx, call
        self.prompts: list[str] = []
        self.seeds: list[int] = []
        self.images = self.latents = None
        self.extended = False
        self._add(count)

    def _add(self, count: int) -> None:
        first, eval_prompts = len(self.seeds), self.ctx.spec.eval_prompts
        prompts = [eval_prompts[i % len(eval_prompts)] for i in range(first, first + count)]
        seeds = [EVAL_SEED + i for i in range(first, first + count)]
        images, latents = generate(
            self.ctx.pipeline, self.call, prompts, seeds, len(prompts), "held-out",
            self.ctx.spec.condition(self.call, len(prompts)),
        )  # fmt: skip
        self.prompts, self.seeds = self.prompts + prompts, self.seeds + seeds
        self.images = images if self.images is None else np.concatenate([self.images, images])
        self.latents = latents if self.latents is None else torch.cat([self.latents, latents])

    def extend(self, count: int) -> bool:
        """Add ``count`` samples unless done before; whether the set grew."""
        if self.extended:
            return False
        self._add(count)
        self.extended = True
        return True

    def samples(self) -> tuple[list[str], list[int], Any, Any]:
        return self.prompts, self.seeds, self.images, self.latents


def _pick(points: list[dict[str, Any]], config: CacheAutoConfig) -> dict[str, Any]:
    ok = [p for p in points if _feasible(p, config)]
    if not ok:
        return min(points, key=lambda p: -p["psnr_mean"])  # all-full is confirmed and always passes
    return min(ok, key=lambda p: (p["block_evaluations_ratio"], -p["psnr_mean"]))


def pareto(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The points no other point beats on both block evaluations and mean PSNR, cheapest first."""
    front: list[dict[str, Any]] = []
    for p in sorted(points, key=lambda p: (p["block_evaluations_ratio"], -p["psnr_mean"])):
        if not front or p["psnr_mean"] > front[-1]["psnr_mean"]:
            front.append(p)
    return front


def _given_record(config: CacheAutoConfig, given: list[list[Action]], confirmed: Confirmed) -> dict[str, Any]:
    """How the given candidates that fit measured here (cheapest first): a related package's front on
    this model."""
    points = [confirmed.points[tuple(str(a) for a in actions)] for actions in given]
    keys = ("block_evaluations_ratio", "psnr_mean", "psnr_p5")
    return {
        "candidates": len(config.candidates),
        "fit": len(given),
        "confirmed": sorted(({k: p[k] for k in keys} for p in points), key=lambda p: p[keys[0]]),
    }


class Confirmed:
    """Every schedule run end to end on the calibration samples, once each."""

    def __init__(self, search: Search, prompts, seeds, images, latents):
        self.search, self.args = search, (prompts, seeds, images, latents)
        self.points: dict[tuple[str, ...], dict[str, Any]] = {}

    def __call__(self, actions: list[Action], source: str) -> dict[str, Any]:
        key = tuple(str(a) for a in actions)
        if key not in self.points:
            point = self.search.confirm(actions, *self.args)
            predicted = self.search.model.predict(actions)
            self.points[key] = point | {
                "source": source,
                "predicted_rel_l2": predicted if math.isfinite(predicted) else None,
            }
        return self.points[key]


def refine(confirmed: Confirmed, start: list[Action], config: CacheAutoConfig, bar) -> int:
    """Local search, in two parts sharing ``config.refine`` end-to-end confirmations.

    1. From the cheapest schedule meeting the floor: try its cheaper neighbours, best predicted
       first (``config.refine_tries`` per round), move to the first that still meets the floor when
       confirmed; stop when none does.
    2. With what is left: the best-predicted untried cheaper neighbour of each point on the current
       Pareto front, round after round (a neighbour that joins the front is refined in the next
       round), the points the model most overrates in error first (predicted / measured relative
       L2): the model is conservative for some patterns (alternating extrapolated skips measure far
       better than it predicts), and this fills the front around them.

    Returns the confirmations used."""
    model, search, current, used = confirmed.search.model, confirmed.search, start, 0

    def key(actions: list[Action]) -> tuple[str, ...]:
        return tuple(str(a) for a in actions)

    while used < config.refine:
        moved = False
        for trial in model.cheaper_neighbours(current, search.actions)[: config.refine_tries]:
            if key(trial) not in confirmed.points:
                used += 1
                bar.update()
            point = confirmed(trial, "refine")  # confirmed once; a repeat is looked up
            if _feasible(point, config):
                current, moved = trial, True
                break
            if used >= config.refine:
                break
        if not moved:
            break
    while used < config.refine:
        progressed = False
        front = [
            p
            for p in pareto(list(confirmed.points.values()))
            if p["predicted_rel_l2"] and p["rel_l2_mean"] > 0
        ]
        for point in sorted(front, key=lambda p: -p["predicted_rel_l2"] / p["rel_l2_mean"]):
            if used >= config.refine:
                break
            actions = [Action.parse(a) for a in point["actions"]]
            fresh = [
                c for c in model.cheaper_neighbours(actions, search.actions) if key(c) not in confirmed.points
            ]
            if fresh:
                confirmed(fresh[0], "refine front")
                used, progressed = used + 1, True
                bar.update()
        if not progressed:
            break
    return used


@register_transform(CacheAutoConfig)
def apply_cache_auto(ctx: TransformContext, config: CacheAutoConfig) -> TransformResult:
    started = time.perf_counter()
    calib = PromptLoop(ctx.spec, config.calib_samples, ctx.call_kwargs())
    prompts, seeds = calib.plan()
    search = Search(ctx, config, prompts, seeds)
    prof = profile(search.traj, search.blocks)
    search.own_steps(prof)
    seconds_per_step = (time.perf_counter() - started) / search.num_steps
    model = search.measure_segments(seconds_per_step)

    call = ctx.call_kwargs()
    ref_images, ref_latents = generate(
        ctx.pipeline, call, prompts, seeds, len(prompts), "uncached", ctx.spec.condition(call, len(prompts))
    )
    confirmed = Confirmed(search, prompts, seeds, ref_images, ref_latents)
    full = search.num_steps * search.num_blocks
    candidates = [(model.solve(b), f"dp budget={b / full:.3f}") for b in model.budgets(config.budgets)]
    candidates += [(a, "fixed interval") for a in fixed_family(model, search.actions)]
    given = search.given(config.candidates)
    candidates += [(a, "given") for a in given]
    candidates.append(([FULL] * search.num_steps, "all full"))
    distinct = len({tuple(str(a) for a in actions) for actions, _ in candidates})
    with tqdm(total=distinct + config.refine, desc="cache schedules", unit="run", leave=False) as bar:
        for actions, source in candidates:
            if tuple(str(a) for a in actions) not in confirmed.points:
                bar.update()
            confirmed(actions, source)
        start = _pick(list(confirmed.points.values()), config)
        refined = refine(confirmed, [Action.parse(a) for a in start["actions"]], config, bar)
    points = list(confirmed.points.values())
    chosen = _pick(points, config)
    front = pareto(points)
    if chosen not in front:  # a cheaper point with a higher mean may miss the 5th-percentile floor
        front = sorted([*front, chosen], key=lambda p: p["block_evaluations_ratio"])

    held = HeldOut(ctx, call, config.eval_samples)
    safer = [p for p in front if p["block_evaluations_ratio"] > chosen["block_evaluations_ratio"]]
    tries: list[dict[str, Any]] = []
    while True:
        actions = [Action.parse(a) for a in chosen["actions"]]
        schedule = search.schedule(actions)
        if config.guard:
            schedule.guards = search.calibrate_guard(actions, prompts, seeds).to_dict()
        expected = search.confirm(actions, *held.samples(), schedule.guards)
        if config.held_out_extend and _borderline(expected, config) and held.extend(config.held_out_extend):
            tqdm.write(
                f"cache search: held-out {_held_out_text(expected, config)} meets the floor narrowly; "
                f"measuring it on {config.held_out_extend} more held-out samples"
            )
            expected = search.confirm(actions, *held.samples(), schedule.guards)
        expected.pop("actions")
        tries.append({
            k: expected[k] for k in ("block_evaluations_ratio", "psnr_mean", "psnr_se", "psnr_p5")
        } | {"samples": len(held.prompts)})  # fmt: skip
        if _feasible_held_out(expected, config) or len(tries) > config.held_out_retries or not safer:
            break
        chosen = safer.pop(0)
        tqdm.write(
            f"cache search: held-out {_held_out_text(expected, config)} misses the floor "
            f"({config.psnr_floor_db:g} / {config.psnr_p5_floor_db:g}); measuring the front's next safer "
            f"schedule ({chosen['block_evaluations_ratio']:.2f} of the block evaluations) there"
        )
    if not _feasible_held_out(expected, config):
        tqdm.write(
            f"cache search: warning: the chosen schedule's held-out {_held_out_text(expected, config)} "
            f"misses the floor after {len(tries)} tries; the package's report carries it (raise "
            "held_out_retries, or calib_samples, or the floor)"
        )
    schedule.fingerprint = fingerprint(ctx.transformer)
    schedule.guidance_mode = "shared"  # one action list for every CFG branch (each keeps its own cache)
    schedule.expected = expected | {"prompts": held.prompts, "seeds": held.seeds}
    schedule.search = {
        "objective": (
            "least predicted final error within each block-evaluation budget (predicted error: sum over "
            "segments of the measured relative L2 after the segment times the measured gain of that step "
            "to the final latents), confirmed end to end"
        ),
        "constraints": {"min_full": config.min_full, "max_reuse": config.max_reuse, "last_step": "full"},
        "steps": [search.first, search.first + search.num_steps - 1],
        "actions": [str(a) for a in search.actions],
        "actions_left_out": search.dropped,
        **({"given": _given_record(config, given, confirmed)} if config.candidates else {}),
        "calibration": calib.record(),
        "floor": {
            "psnr_mean_db": config.psnr_floor_db,
            "psnr_p5_db": config.psnr_p5_floor_db,
            "held_out_margin_se": config.held_out_margin_se,
        },
        "front": front,
        "held_out": tries,
        "confirmed": len(points),
        "refine_confirmations": refined,
        "gain": [round(g, 4) for g in model.gain],
        "seconds": round(time.perf_counter() - started, 1),
    }
    attach_cache(ctx.pipeline, schedule, ctx.spec.transformer_attr)  # the result runs as the package will
    return TransformResult(
        modules={},
        record={
            "schedule": SCHEDULE_FILE,
            "actions": chosen["actions"],
            "block_evaluations_ratio": chosen["block_evaluations_ratio"],
            "calibration_psnr_mean": chosen["psnr_mean"],
            "source": chosen["source"],
            "expected": schedule.expected,
            "front_size": len(front),
            "confirmed": len(points),
        },
        files={SCHEDULE_FILE: schedule.to_dict(), PROFILE_FILE: prof, HEATMAP_FILE: heatmap_png(prof)},
        sections={"cache_schedule": {"file": SCHEDULE_FILE}},
    )


@register_plan(CacheAutoConfig)
def plan_cache_auto(ctx: TransformContext, config: CacheAutoConfig) -> list[Phase]:
    """The profile run, the segment runs (a run from step ``first`` calls the transformer for steps
    0..stop, the steps before ``first`` replayed by a stub), the uncached reference, the confirmed
    schedules (at most ``confirmation_bound``), the held-out reference, and per held-out try the
    guard's calibration and the held-out confirmation: every run one batch of all its samples."""
    search = Search(ctx, config, [], [])  # reads the block layout and the actions; runs nothing
    t = search.num_steps
    segments = sum(stop + 1 for _, _, _, stop in search.segment_jobs())
    return [
        Phase("profile and segments", t + segments),
        Phase("confirm schedules", (1 + confirmation_bound(config)) * t, "at most"),
        Phase(
            "held-out check",  # a narrow result: the extra samples' reference, then one more confirmation
            (1 + (1 + config.guard) * (1 + config.held_out_retries) + 2 * bool(config.held_out_extend)) * t,
            "at most",
        ),
    ]
