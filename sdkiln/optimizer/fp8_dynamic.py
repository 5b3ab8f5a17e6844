"""FP8_DYNAMIC: swap every block Linear (except the family's float list) for ``FP8Linear``."""

from __future__ import annotations

from sdkiln.configs import FP8DynamicConfig
from sdkiln.optimizer.layers import block_linears, replace_linears
from sdkiln.optimizer.registry import StepContext, StepResult, register_transform
from sdkiln.runtime.quant.fp8_dynamic import FP8Linear


@register_transform(FP8DynamicConfig)
def apply_fp8_dynamic(ctx: StepContext, config: FP8DynamicConfig) -> StepResult:
    chosen, kept = block_linears(ctx, config.exclude)
    if not chosen:
        raise ValueError("fp8_dynamic found no Linear layer to quantize inside the transformer blocks")
    modules = replace_linears(ctx.transformer, chosen, FP8Linear.from_linear)
    return StepResult(modules=modules, record={"quantized": chosen, "float": kept, "calibration": None})
