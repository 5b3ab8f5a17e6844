"""W8A8_TIMESTEP: per-step static activation parameters, dynamic for the first k steps.

1. One calibration run observes every chosen layer's input range per denoising step (the step
   index read from the scheduler, both CFG branches of a step in one row); each layer gets one
   static row per step (``W8A8TimestepLinear.from_linear``).
2. k is chosen from the config's ``dynamic_steps`` candidates (capped at the step count T: k = T is
   all-dynamic) by final-output error: ``calib_samples`` samples of the family's calibration prompts
   run through the float model once and through the quantized model once per candidate, with the
   same seeds; the candidate with the smallest mean relative L2 error of the final latents wins, the
   smaller k on a tie (static steps are the cheaper ones). These samples follow the default loop's
   (other seeds), so the error includes inputs that the calibrated ranges do not cover.

The in-memory pipeline gets a step tracker (``sdkiln.runtime.denoising``), as ``sdkiln.load`` attaches
one to the loaded package, so both run the same rows at the same steps.
"""

from __future__ import annotations

import torch

from sdkiln.calibrate.loop import PromptLoop
from sdkiln.configs import W8A8TimestepConfig
from sdkiln.metrics import rel_l2
from sdkiln.optimizer.layers import manifest_entry, replace, select_layers
from sdkiln.optimizer.plan import Phase, loop_steps, register_plan
from sdkiln.optimizer.quant.calibration import calibrate, calibration_files, require_every_step
from sdkiln.optimizer.registry import TransformContext, TransformResult, register_transform
from sdkiln.runtime.denoising import attach_step_tracker
from sdkiln.runtime.quant import Ranges
from sdkiln.runtime.quant.w8a8_timestep import W8A8TimestepLinear


def window_range(
    step_min: torch.Tensor, step_max: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per step t, the union of the ranges of steps t-window .. t+window ([T] each)."""
    if window == 0:
        return step_min, step_max
    lo = -torch.nn.functional.max_pool1d((-step_min).reshape(1, 1, -1), 2 * window + 1, 1, window)
    hi = torch.nn.functional.max_pool1d(step_max.reshape(1, 1, -1), 2 * window + 1, 1, window)
    return lo.flatten(), hi.flatten()


@register_transform(W8A8TimestepConfig)
def apply_w8a8_timestep(ctx: TransformContext, config: W8A8TimestepConfig) -> TransformResult:
    model = ctx.transformer
    targets, kept = select_layers(ctx, config.exclude, required_by=config.kind)
    observers, record = calibrate(ctx, [t.linear for t in targets], config.calib_samples)
    by_layer = {t.layer: observers[t.linear] for t in targets}
    require_every_step(ctx, by_layer)
    num_steps = ctx.num_inference_steps

    search = PromptLoop(ctx.spec, config.calib_samples, ctx.call_kwargs(), first=config.calib_samples)
    reference = search.run(ctx.pipeline, capture_latents=True)
    quantized = []
    for target in targets:
        obs = observers[target.linear]
        lo, hi = window_range(obs.step_min, obs.step_max, config.step_window)
        module = W8A8TimestepLinear.from_linear(
            model.get_submodule(target.linear), Ranges(step_min=lo, step_max=hi)
        )
        replace(model, target, module)
        quantized.append((target, module))
    attach_step_tracker(ctx.pipeline, ctx.spec.transformer_attr)

    errors = {}
    for k in sorted({min(k, num_steps) for k in config.dynamic_steps}):
        for _, module in quantized:
            module.dynamic_steps = k
        errors[k] = float(rel_l2(reference, search.run(ctx.pipeline, capture_latents=True)).mean())
    best = min(errors, key=lambda k: (errors[k], k))
    for _, module in quantized:
        module.dynamic_steps = best

    return TransformResult(
        modules={t.layer: manifest_entry(t, m) for t, m in quantized},
        record={
            "quantized": [t.layer for t in targets],
            "float": kept,
            "smoothed": [t.layer for t in targets if t.smoothed],
            "num_steps": num_steps,
            "dynamic_steps": best,
            "step_window": config.step_window,
            "dynamic_steps_search": {
                "metric": "mean relative L2 of the final latents against the float model",
                "prompts": search.record()["prompts"],
                "seeds": search.record()["seeds"],
                "errors": {str(k): e for k, e in errors.items()},
            },
            "calibration": record,
        },
        files=calibration_files(W8A8TimestepConfig.kind, by_layer, record),
    )


@register_plan(W8A8TimestepConfig)
def plan_w8a8_timestep(ctx: TransformContext, config: W8A8TimestepConfig) -> list[Phase]:
    """Calibration, then the dynamic-steps search on held-out samples: a float reference run and
    one run per distinct setting."""
    t = ctx.num_inference_steps
    settings = len({min(k, t) for k in config.dynamic_steps})
    return [
        Phase("calibration", loop_steps(ctx, config.calib_samples)),
        Phase("dynamic steps search", config.calib_samples * t * (1 + settings)),
    ]
