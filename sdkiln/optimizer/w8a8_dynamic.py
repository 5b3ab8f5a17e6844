"""W8A8_DYNAMIC: swap every block Linear (except the family's float list) for ``W8A8Linear``.

A layer SmoothQuant left an input multiplier in front of (``SmoothedLinear``) keeps it: its inner
``linear`` is quantized (``calibrated_layers`` has the naming), and GPTQ sees that inner layer's
input, the smoothed one.

``weight_rounding="gptq"`` keeps the per-channel scales and rounds the integers by GPTQ
(``sdkiln.optimizer.gptq``) against each layer's input second moments from one calibration run.
The record gives, per layer, the calibration output error ``tr(E H Eᵀ)`` of GPTQ's weight relative
to nearest rounding's (below 1: GPTQ's is smaller on the calibration inputs).
"""

from __future__ import annotations

from sdkiln.configs import W8A8DynamicConfig
from sdkiln.optimizer.calibrated_layers import CONFIG_FILE, calibrated_targets, manifest_entry, replace
from sdkiln.optimizer.gptq import gptq_hessians, gptq_layer, gptq_record
from sdkiln.optimizer.registry import StepContext, StepResult, register_transform
from sdkiln.runtime.quant.w8a8_dynamic import W8A8Linear


@register_transform(W8A8DynamicConfig)
def apply_w8a8_dynamic(ctx: StepContext, config: W8A8DynamicConfig) -> StepResult:
    model = ctx.transformer
    try:
        targets, kept = calibrated_targets(ctx, config.exclude)
    except ValueError as exc:
        raise ValueError(f"w8a8_dynamic: {exc}") from None
    hessians, calibration = {}, None
    if config.weight_rounding == "gptq":
        hessians, calibration = gptq_hessians(ctx, config, [t.linear for t in targets])
    modules, ratios = {}, {}
    for target in targets:
        linear = model.get_submodule(target.linear)
        module = W8A8Linear.from_linear(linear)
        if hessians:
            values, ratios[target.layer] = gptq_layer(
                linear.weight, hessians.pop(target.linear), module.weight_scale, -128, 127, config.gptq_damp
            )
            module.weight.copy_(values.to(module.weight.dtype))
        replace(model, target, module)
        modules[target.layer] = manifest_entry(target, module)
    record = {"quantized": [t.layer for t in targets], "float": kept, "calibration": calibration}
    if any(t.smoothed for t in targets):
        record["smoothed"] = [t.layer for t in targets if t.smoothed]
    files = {}
    if ratios:
        record.update(gptq_record(ratios))
        files[CONFIG_FILE] = {W8A8DynamicConfig.kind: calibration}
    return StepResult(modules=modules, record=record, files=files)
