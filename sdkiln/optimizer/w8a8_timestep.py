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

The in-memory pipeline gets a step tracker (``sdkiln.runtime.steps``), as ``sdkiln.load`` attaches
one to the loaded package, so both run the same rows at the same steps.
"""

from __future__ import annotations

import torch

from sdkiln.calibrate.loop import PromptLoop
from sdkiln.configs import W8A8TimestepConfig
from sdkiln.metrics import rel_l2
from sdkiln.optimizer.calibrated_layers import (
    calibrate,
    calibrated_targets,
    calibration_files,
    manifest_entry,
    replace,
    require_every_step,
)
from sdkiln.optimizer.registry import StepContext, StepResult, register_transform
from sdkiln.runtime.quant.w8a8_timestep import W8A8TimestepLinear
from sdkiln.runtime.steps import attach_step_tracker


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
def apply_w8a8_timestep(ctx: StepContext, config: W8A8TimestepConfig) -> StepResult:
    model = ctx.transformer
    targets, kept = calibrated_targets(ctx, config.exclude)
    observers, record = calibrate(ctx, [t.linear for t in targets], config.calib_samples, config.calib_steps)
    by_layer = {t.layer: observers[t.linear] for t in targets}
    num_steps = next(iter(by_layer.values())).num_steps
    require_every_step(by_layer)

    search = PromptLoop(ctx.spec, config.calib_samples, steps=record["steps"], first=config.calib_samples)
    reference = search.run(ctx.pipeline, capture_latents=True)
    quantized = []
    for target in targets:
        obs = observers[target.linear]
        lo, hi = window_range(obs.step_min, obs.step_max, config.step_window)
        module = W8A8TimestepLinear.from_linear(model.get_submodule(target.linear), lo, hi, dynamic_steps=0)
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

    return StepResult(
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
