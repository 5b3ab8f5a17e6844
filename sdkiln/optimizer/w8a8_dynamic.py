"""W8A8_DYNAMIC: swap every block Linear (except the family's float list) for ``W8A8Linear``."""

from __future__ import annotations

from sdkiln.configs import W8A8DynamicConfig
from sdkiln.optimizer.layers import block_linears, replace_linears
from sdkiln.optimizer.registry import StepContext, StepResult, register_transform
from sdkiln.runtime.quant.w8a8_dynamic import W8A8Linear


@register_transform(W8A8DynamicConfig)
def apply_w8a8_dynamic(ctx: StepContext, config: W8A8DynamicConfig) -> StepResult:
    model = ctx.transformer
    chosen, kept = block_linears(ctx, config.exclude)
    if not chosen:
        raise ValueError("w8a8_dynamic found no Linear layer to quantize inside the transformer blocks")
    modules = replace_linears(model, chosen, W8A8Linear.from_linear)
    return StepResult(modules=modules, record={"quantized": chosen, "float": kept, "calibration": None})
