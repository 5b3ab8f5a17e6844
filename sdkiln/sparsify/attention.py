"""Calibrate a block-sparse attention plan (``sparse_attention`` recipe step).

Sparsity patterns of diffusion transformers are stable across inputs and differ between layers and
heads (SVOO, HASTE), so the choice is made here, once, offline, and shipped as data:

1. **Per-layer error.** Calibration samples run with dense attention; at every call of every
   self-attention layer the output under each sparsity of the grid is computed too (the runtime's
   own tiling, selection and kernel) and its L1 error against dense attention summed per head
   group and denoising step. Computing the error at every call of one dense run measures each
   layer's own error, not that of the layers before it.
2. **Per-layer sparsity.** For each number ``d`` of initial dense denoising steps, each layer (head
   group) takes the largest grid sparsity whose relative L1 error over the steps from ``d`` on is
   within the budget (none: the layer stays dense).
3. **Dense steps.** The fewest ``d`` whose plan, run end to end on the calibration samples, gives
   final outputs with a mean PSNR against dense attention of at least the floor. When no candidate
   reaches it, the best one is chosen and the record says the floor was missed.

A uniform plan (``sparsity`` or ``mass`` given) skips 1 and 2. The chosen plan is attached to the
pipeline being optimized, so later recipe steps (a cache search) and the quality report measure the
model as the package will run it.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from sdkiln.calibrate.loop import PromptLoop, resolve_loop
from sdkiln.configs.sparse import SparseAttentionConfig
from sdkiln.errors import RecipeError
from sdkiln.metrics import psnr
from sdkiln.model_zoo.fingerprint import config_hash
from sdkiln.optimizer.evaluate import generate
from sdkiln.optimizer.plan import Phase, loop_steps, register_plan
from sdkiln.optimizer.registry import TransformContext, TransformResult, register_transform
from sdkiln.runtime.attention import AttentionCall
from sdkiln.runtime.sparse import (
    PLAN_FILE,
    SparseAttentionPlan,
    attach_sparse_attention,
    detach_sparse_attention,
)
from sdkiln.runtime.sparse.attention import SparseAttention
from sdkiln.runtime.sparse.tiling import default_tile, token_coords


class ErrorProbe(SparseAttention):
    """Runs every call dense and measures, per layer, head group, denoising step and grid sparsity,
    the L1 error of the sparse output (``errors``) and the L1 norm of the dense one (``norms``)."""

    def __init__(self, plan: SparseAttentionPlan, grid, transformer, heads, tracker, *, sparsities, groups):
        super().__init__(plan, grid, transformer, heads, tracker)
        self.sparsities = sparsities
        self.groups = groups
        self.errors: dict[str, dict[int, torch.Tensor]] = {}
        self.norms: dict[str, dict[int, torch.Tensor]] = {}

    def __call__(self, call: AttentionCall, head_offset: int = 0) -> torch.Tensor:
        dense = call.native(call.query, call.key, call.value, attn_mask=call.mask, scale=call.scale)
        if call.name not in self.plan.layers:  # the plan lists the self-attention layers
            return dense
        step, layout = self.step(), self.layout(call)
        h = call.query.shape[2]
        group_of = self.head_values(call, list(range(self.groups)), head_offset).long().to(dense.device)

        def per_group(x: torch.Tensor) -> torch.Tensor:  # [B, S, H, D] -> L1 per head group [G]
            return torch.zeros(self.groups, dtype=torch.float64, device=x.device).index_add_(
                0, group_of, x.abs().sum((0, 1, 3)).double()
            )

        errors = torch.stack([
            per_group(self.compute(call, layout, torch.full((h,), s, device=dense.device))[0].float() - dense.float())
            for s in self.sparsities
        ])  # fmt: skip
        layer_errors, layer_norms = (
            self.errors.setdefault(call.name, {}),
            self.norms.setdefault(call.name, {}),
        )
        layer_errors[step] = layer_errors.get(step, 0) + errors
        layer_norms[step] = layer_norms.get(step, 0) + per_group(dense.float())
        return dense

    def relative_errors(self, name: str, dense_steps: int) -> torch.Tensor | None:
        """[grid, groups]: the layer's relative L1 error at each grid sparsity over the steps from
        ``dense_steps`` on (None: no such step)."""
        by_step = self.errors[name]
        steps = [s for s in by_step if s >= dense_steps]
        if not steps:
            return None
        return sum(by_step[s] for s in steps) / sum(self.norms[name][s] for s in steps).clamp(min=1e-30)

    def choose(
        self, budget: float, dense_steps: int
    ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        """(layer -> per-group sparsity, layer -> per-group relative L1 error at it) over the steps from
        ``dense_steps`` on; a layer whose groups all stay dense is left out."""
        layers, chosen_errors = {}, {}
        for name in self.errors:
            rel = self.relative_errors(name, dense_steps)
            if rel is None:
                continue
            values, errs = [], []
            for g in range(self.groups):
                ok = [i for i in range(len(self.sparsities)) if rel[i, g] <= budget]
                values.append(self.sparsities[ok[-1]] if ok else 0.0)
                errs.append(round(float(rel[ok[-1], g]), 5) if ok else 0.0)
            if any(values):
                layers[name], chosen_errors[name] = values, errs
        return layers, chosen_errors


@register_transform(SparseAttentionConfig)
def apply_sparse_attention(ctx: TransformContext, config: SparseAttentionConfig) -> TransformResult:
    spec = ctx.spec
    if spec.token_grid is None or not spec.attention:
        raise RecipeError(
            f"model family {spec.name!r} has no token grid or attention sites: no sparse attention"
        )
    started = time.perf_counter()
    call = ctx.call_kwargs()
    steps = int(call["num_inference_steps"])
    block_size = config.block_size or spec.sparse_block_size
    names = [  # self-attention: a cross-attention's keys are context (text, an image), which stays dense
        n for n, _ in ctx.transformer.named_modules()
        if (site := spec.attention_site(n)) is not None and site.attends_own_tokens
    ]  # fmt: skip
    prompts, seeds = PromptLoop(spec, config.calib_samples, call).plan()
    ref_images, frames = _dense_reference(ctx, call, prompts, seeds)
    base = dict(
        block_size=block_size, tile=default_tile(block_size, frames), first_frame_dense=config.first_frame_dense,
        mask_reuse=config.mask_reuse, config_hash=config_hash(ctx.transformer.config),
    )  # fmt: skip
    record: dict[str, Any] = {
        "block_size": block_size,
        "tile": list(base["tile"]),
        "layers_considered": len(names),
    }
    probe = None
    if config.calibrated:
        loop, record["calibration"] = resolve_loop(spec, ctx.forward_loop, config.calib_samples, call)
        plan = SparseAttentionPlan(layers={n: [0.0] * config.head_groups for n in names}, **base)
        probe = attach_sparse_attention(
            ctx.pipeline,
            spec,
            plan,
            functools.partial(ErrorProbe, sparsities=list(config.grid), groups=config.head_groups),
        )
        try:
            loop(ctx.pipeline)
        finally:
            detach_sparse_attention(ctx.transformer)
        if not probe.errors:
            raise RecipeError(
                "sparse_attention calibration saw no self-attention call; did the forward loop run the pipeline?"
            )

    def plan_for(dense_steps: int) -> tuple[SparseAttentionPlan, dict[str, list[float]]]:
        if probe is None:
            value = config.sparsity if config.sparsity is not None else config.mass
            layers, errs = {n: [value] * config.head_groups for n in names}, {}
        else:
            layers, errs = probe.choose(config.budget, dense_steps)
        selection = "mass" if config.mass is not None else "topk"
        return SparseAttentionPlan(layers=layers, selection=selection, dense_steps=dense_steps, **base), errs

    max_dense = config.max_dense_steps if config.max_dense_steps is not None else math.ceil(steps / 4)
    candidates = (
        [config.dense_steps] if config.dense_steps is not None else list(range(min(max_dense, steps - 1) + 1))
    )
    tried = []
    for d in tqdm(candidates, desc="sparse attention: dense steps", unit="run", leave=False):
        plan, errs = plan_for(d)
        if not plan.layers:
            tried.append({"dense_steps": d, "layers": 0, "psnr_mean": None})  # every layer dense: exact
            break
        images = _run(ctx, plan, call, prompts, seeds)
        tried.append({
            "dense_steps": d, "layers": len(plan.layers), "mean_sparsity": _mean_sparsity(plan, names),
            "psnr_mean": round(float(np.mean(psnr(ref_images, images))), 3),
        })  # fmt: skip
        if tried[-1]["psnr_mean"] >= config.psnr_floor_db:
            break
    feasible = [t for t in tried if t["psnr_mean"] is None or t["psnr_mean"] >= config.psnr_floor_db]
    pick = feasible[0] if feasible else max(tried, key=lambda t: t["psnr_mean"])
    if not feasible:
        warnings.warn(
            f"sparse_attention: no plan reached {config.psnr_floor_db} dB on the calibration samples; chose "
            f"dense_steps={pick['dense_steps']} at {pick['psnr_mean']} dB (the record says so)",
            stacklevel=2,
        )
    plan, errs = plan_for(pick["dense_steps"])
    mode = "calibrated" if probe is not None else "uniform mass" if config.mass is not None else "uniform"
    record |= {
        "mode": mode,
        "dense_steps": plan.dense_steps,
        "mean_sparsity": _mean_sparsity(plan, names),
        "layers": plan.layers,
        "layer_rel_l1": errs,
        "dense_step_search": tried,
        "psnr_floor_db": config.psnr_floor_db,
        "floor_met": bool(feasible),
        "seconds": round(time.perf_counter() - started, 1),
    }
    plan.record = record
    if plan.layers:  # the rest of the recipe runs it as the package will
        attach_sparse_attention(ctx.pipeline, spec, plan)
    return TransformResult(
        modules={},
        record={k: v for k, v in record.items() if k not in ("layers", "layer_rel_l1")} | {"plan": PLAN_FILE},
        files={PLAN_FILE: plan.to_dict()} if plan.layers else {},
        sections={"sparse_attention": {"file": PLAN_FILE}} if plan.layers else {},
    )


def _mean_sparsity(plan: SparseAttentionPlan, names: list[str]) -> float | None:
    """Mean planned sparsity over every self-attention layer and head group (dense ones count 0);
    for a mass plan, None (its sparsity is what each call selects)."""
    if plan.selection == "mass":
        return None
    values = [v for n in names for v in plan.layers.get(n, [0.0] * plan.head_groups)]
    return round(sum(values) / len(values), 4)


def _run(ctx: TransformContext, plan: SparseAttentionPlan, call, prompts, seeds) -> np.ndarray:
    attach_sparse_attention(ctx.pipeline, ctx.spec, plan)
    try:
        images, _ = generate(
            ctx.pipeline,
            call,
            prompts,
            seeds,
            len(prompts),
            "sparse attention",
            ctx.spec.condition(call, len(prompts)),
        )
    finally:
        detach_sparse_attention(ctx.transformer)
    return images


def _dense_reference(ctx: TransformContext, call, prompts, seeds) -> tuple[np.ndarray, int]:
    """The calibration samples' images under dense attention, and the latent frames the transformer
    saw (1 for an image model; the tile is chosen for them)."""
    grid, frames = ctx.spec.token_grid, []

    def read(module, args, kwargs):
        if not frames and kwargs.get(grid.arg) is not None:
            frames.append(int(token_coords(grid, kwargs[grid.arg])[:, 0].max()) + 1)

    handle = ctx.transformer.register_forward_pre_hook(read, with_kwargs=True)
    try:
        images, _ = generate(
            ctx.pipeline,
            call,
            prompts,
            seeds,
            len(prompts),
            "dense attention",
            ctx.spec.condition(call, len(prompts)),
        )
    finally:
        handle.remove()
    if not frames:
        raise RecipeError(f"sparse_attention: the transformer was called without {grid.arg!r}")
    return images, frames[0]


@register_plan(SparseAttentionConfig)
def plan_sparse_attention(ctx: TransformContext, config: SparseAttentionConfig) -> list[Phase]:
    """The dense reference, the calibration loop (calibrated plans), then one run per dense-steps
    setting tried until one meets the floor (at most every setting)."""
    t = ctx.num_inference_steps
    max_dense = config.max_dense_steps if config.max_dense_steps is not None else math.ceil(t / 4)
    tries = 1 if config.dense_steps is not None else min(max_dense, t - 1) + 1
    phases = [Phase("dense reference", t)]
    if config.calibrated:
        phases.append(Phase("calibration", loop_steps(ctx, config.calib_samples)))
    phases.append(Phase("dense steps search", tries * t, "at most"))
    return phases
