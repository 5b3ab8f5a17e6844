"""W8A8_DYNAMIC: swap every block Linear (except the family's float list) for ``W8A8Linear``.

A layer SmoothQuant left an input multiplier in front of (``SmoothedLinear``) keeps it: its inner
``linear`` is quantized (``calibrated_layers`` has the naming).
"""

from __future__ import annotations

from sdkiln.configs import W8A8DynamicConfig
from sdkiln.optimizer.calibrated_layers import calibrated_targets, manifest_entry, replace
from sdkiln.optimizer.registry import StepContext, StepResult, register_transform
from sdkiln.runtime.quant.w8a8_dynamic import W8A8Linear


@register_transform(W8A8DynamicConfig)
def apply_w8a8_dynamic(ctx: StepContext, config: W8A8DynamicConfig) -> StepResult:
    model = ctx.transformer
    try:
        targets, kept = calibrated_targets(ctx, config.exclude)
    except ValueError as exc:
        raise ValueError(f"w8a8_dynamic: {exc}") from None
    modules = {}
    for target in targets:
        module = W8A8Linear.from_linear(model.get_submodule(target.linear))
        replace(model, target, module)
        modules[target.layer] = manifest_entry(target, module)
    record = {"quantized": [t.layer for t in targets], "float": kept, "calibration": None}
    if any(t.smoothed for t in targets):
        record["smoothed"] = [t.layer for t in targets if t.smoothed]
    return StepResult(modules=modules, record=record)
