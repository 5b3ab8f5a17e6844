"""Calibrate quantized attention per layer and denoising step (the ``attention_quant`` recipe step).

1. **Float reference.** The calibration samples run with the model as the recipe left it (quantized
   linears, float attention): their images are the reference.
2. **Per-call error.** They run again with every routed attention call computed in float (what the
   run continues with) and through ``sdkiln::quantized_attention`` in the step's formats (the ``mindie``
   layout: ``sdkiln::fp8_block_attention``, MindIE SD's arithmetic), with and
   without the Hadamard rotation (``rotate="auto"``; only a power-of-two head dim can rotate); per
   layer, denoising step and rotation the lowest SQNR of the quantized output against the float one,
   over the samples (each CFG branch a sample) and the layer's calls at that step, is kept. Computing
   the error at every call of one float run measures each layer's own error, not that of the layers
   before it.
3. **Decisions.** Per layer, the rotation of higher mean SQNR over the steps (or the one the config
   fixes); a (layer, step) runs quantized where its SQNR reaches the floor. Early and late steps are
   measured like the others: no step is assumed safe.
4. **End to end.** The plan runs on the calibration samples; where the images' mean PSNR against the
   float reference misses ``psnr_floor_db``, the per-call floor rises by ``floor_step_db`` and the
   decisions are made again, up to ``retries`` times (else the best plan tried, with a warning).

The chosen plan is attached to the pipeline, so later steps (block-sparse attention, the cache
search) and the quality report measure the model as the package runs it; the plan file, and in the
manifest the per-layer, per-step decisions with the SQNR each was made on, record it.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from sdkiln.calibrate.loop import PromptLoop
from sdkiln.configs.quant import AttentionQuantConfig
from sdkiln.errors import RecipeError
from sdkiln.metrics import psnr
from sdkiln.model_zoo.fingerprint import config_hash
from sdkiln.optimizer.evaluate import generate
from sdkiln.optimizer.plan import Phase, register_plan
from sdkiln.optimizer.registry import TransformContext, TransformResult, register_transform
from sdkiln.runtime.attention import AttentionCall, route_attention, unroute_attention
from sdkiln.runtime.attention.quantized import (
    NAME,
    PLAN_FILE,
    AttentionQuantPlan,
    attach_attention_quant,
    detach_attention_quant,
    quantized_call,
)
from sdkiln.runtime.denoising import attach_step_tracker

SQNR_CAP_DB = 200.0
"""An output the quantization leaves unchanged (zeros) counts as this, not infinity."""


def per_sample_sqnr(reference: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """SQNR in dB of each batch element ([B, ...] tensors), capped at ``SQNR_CAP_DB``."""
    ref = reference.double().flatten(1)
    noise = (approx.double().flatten(1) - ref).square().sum(1)
    signal = ref.square().sum(1)
    db = 10 * torch.log10(signal.clamp_min(1e-300) / noise.clamp_min(1e-300))
    return torch.where(noise == 0, torch.full_like(db, SQNR_CAP_DB), db.clamp(max=SQNR_CAP_DB))


class ErrorProbe:
    """The route's quantized-attention runner during calibration: every call runs in float and its
    quantized twins are measured (``sqnr``: (layer, step, rotate) -> the lowest SQNR seen)."""

    def __init__(self, config: AttentionQuantConfig, rotations: tuple[bool, ...], tracker, num_steps: int):
        self.config, self.rotations, self.tracker, self.num_steps = config, rotations, tracker, num_steps
        self.sqnr: dict[tuple[str, int, bool], float] = {}

    def __call__(self, call: AttentionCall) -> torch.Tensor:
        ref = call.native(call.query, call.key, call.value, attn_mask=call.mask, scale=call.scale)
        # the plan's step (the run's, mapped as the runtime maps it: second-order schedulers run more)
        step, d = self.tracker.step * self.num_steps // self.tracker.num_steps, call.query.shape[-1]
        power_of_two = not d & (d - 1)
        if self.rotations == (True,) and not power_of_two:
            raise RecipeError(
                f"attention_quant: rotate='on' needs a power-of-two head dim; {call.name} has {d}"
            )
        for rotate in self.rotations:
            if rotate and not power_of_two:  # measured without the rotation only
                continue
            out = quantized_call(call, self.config.qk, self.config.pv, rotate, self.config.layout)
            low = float(per_sample_sqnr(ref, out).min())
            key = (call.name, step, rotate)
            self.sqnr[key] = min(self.sqnr.get(key, math.inf), low)
        return ref


def decide(
    probe: ErrorProbe, layers: list[str], num_steps: int, floor: float, fixed: bool | None
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """(plan layers, their record) at per-call floor ``floor``: per layer the rotation (``fixed``, or
    the one of higher mean SQNR) and per step whether its SQNR reaches the floor; a step the layer did
    not run at (another expert's) stays float. Layers with no quantized step are left out of the plan."""
    plan, record = {}, {}
    for name in layers:
        by_rotation = {r: [probe.sqnr.get((name, s, r)) for s in range(num_steps)] for r in probe.rotations}
        seen = {r: [x for x in v if x is not None] for r, v in by_rotation.items()}
        seen = {r: v for r, v in seen.items() if v}  # a head dim that is no power of two: never rotated
        if not seen:
            continue
        rotate = fixed if fixed is not None else max(seen, key=lambda r: (float(np.mean(seen[r])), not r))
        values = by_rotation[rotate]
        steps = [x is not None and x >= floor for x in values]
        record[name] = {
            "rotate": rotate,
            "steps": steps,
            "sqnr_db": [None if x is None else round(x, 2) for x in values],
        }
        if any(steps):
            plan[name] = {"rotate": rotate, "steps": steps}
    return plan, record


@register_transform(AttentionQuantConfig)
def apply_attention_quant(ctx: TransformContext, config: AttentionQuantConfig) -> TransformResult:
    spec = ctx.spec
    if not spec.attention:
        raise RecipeError(f"model family {spec.name!r} names no attention sites: no quantized attention")
    started = time.perf_counter()
    call = ctx.call_kwargs()
    num_steps = int(call["num_inference_steps"])
    prompts, seeds = PromptLoop(spec, config.calib_samples, call).plan()
    condition = spec.condition(call, len(prompts))
    reference, _ = generate(ctx.pipeline, call, prompts, seeds, len(prompts), "float attention", condition)

    fixed = {"on": True, "off": False}.get(config.rotate)
    rotations = (fixed,) if fixed is not None else (False, True)
    tracker = attach_step_tracker(
        ctx.pipeline, spec.transformer_attr
    )  # before routing: a failure routes nothing
    route = route_attention(ctx.transformer, spec, "quantized")
    layers = list(route.routed)
    probe = ErrorProbe(config, rotations, tracker, num_steps)
    route.quantized = probe
    try:
        generate(ctx.pipeline, call, prompts, seeds, len(prompts), "attention errors", condition)
    finally:
        route.quantized = None
        unroute_attention(ctx.transformer)
    if not probe.sqnr:
        raise RecipeError(
            "attention_quant calibration saw no attention call; did the pipeline run its transformer?"
        )

    hash_ = config_hash(ctx.transformer.config)
    tries: list[dict[str, Any]] = []
    chosen: tuple[float | None, float, AttentionQuantPlan | None, dict] | None = None
    floors = [config.sqnr_floor_db + i * config.floor_step_db for i in range(config.retries + 1)]
    for floor in tqdm(floors, desc="attention quantization: floors", unit="run", leave=False):
        layers_plan, layer_record = decide(probe, layers, num_steps, floor, fixed)
        if not layers_plan:  # every call float: exact
            tries.append({"sqnr_floor_db": floor, "quantized_fraction": 0.0, "psnr_mean": None})
            chosen = (None, floor, None, layer_record)
            break
        plan = AttentionQuantPlan(config.qk, config.pv, num_steps, layers_plan, hash_, layout=config.layout)
        attach_attention_quant(ctx.pipeline, spec, plan)
        try:
            images, _ = generate(
                ctx.pipeline, call, prompts, seeds, len(prompts), "quantized attention", condition
            )
        finally:
            detach_attention_quant(ctx.transformer)
        measured = float(np.mean(psnr(reference, images)))
        tries.append({
            "sqnr_floor_db": floor, "quantized_fraction": round(_fraction(layers_plan, layers, num_steps), 4),
            "psnr_mean": round(measured, 3),
        })  # fmt: skip
        if chosen is None or measured > chosen[0] or measured >= config.psnr_floor_db:
            chosen = (measured, floor, plan, layer_record)
        if measured >= config.psnr_floor_db:
            break
    measured, floor, plan, layer_record = chosen
    met = measured is None or measured >= config.psnr_floor_db
    if not met:
        warnings.warn(
            f"attention_quant: no plan reached {config.psnr_floor_db} dB on the calibration samples; chose the "
            f"per-call floor {floor} dB at {measured:.2f} dB (the record says so)",
            stacklevel=2,
        )
    record: dict[str, Any] = {
        "qk": config.qk,
        "pv": config.pv,
        "layout": config.layout,
        "rotate": config.rotate,
        "num_steps": num_steps,
        "calibration": {"prompts": prompts, "seeds": seeds},
        "sqnr_floor_db": floor,
        "psnr_floor_db": config.psnr_floor_db,
        "floor_met": met,
        "tries": tries,
        "quantized_fraction": 0.0 if plan is None else round(_fraction(plan.layers, layers, num_steps), 4),
        "layers": layer_record,
        "seconds": round(time.perf_counter() - started, 1),
    }
    if plan is None:
        return TransformResult(modules={}, record=record)
    plan.record = {k: v for k, v in record.items() if k != "layers"}
    attach_attention_quant(ctx.pipeline, spec, plan)  # the rest of the recipe runs it as the package will
    return TransformResult(
        modules={},
        record=record | {"plan": PLAN_FILE},
        files={PLAN_FILE: plan.to_dict()},
        sections={NAME: {"file": PLAN_FILE}},
    )


def _fraction(plan_layers: dict[str, dict[str, Any]], layers: list[str], num_steps: int) -> float:
    """Quantized (layer, step) pairs over every routed layer's steps."""
    return sum(sum(e["steps"]) for e in plan_layers.values()) / (len(layers) * num_steps)


@register_plan(AttentionQuantConfig)
def plan_attention_quant(ctx: TransformContext, config: AttentionQuantConfig) -> list[Phase]:
    """The float reference, the error run (each call computed once in float and once or twice
    quantized), then one run per per-call floor tried until one meets the PSNR floor."""
    t = ctx.num_inference_steps
    return [
        Phase("float reference", t),
        Phase("attention errors", t),
        Phase("floors tried", (config.retries + 1) * t, "at most"),
    ]
