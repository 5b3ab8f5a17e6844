"""W8A8 static: calibrate each block Linear's input range, then swap in ``W8A8StaticLinear``.

One calibration run observes every chosen layer's input (after SmoothQuant, if it ran: the inputs
the quantized matmuls will see); each layer's per-tensor [min, max] sets its activation scale and
offset (``sdkiln.runtime.quant.w8a8_static`` has the formulas). The statistics go into the package
so the parameters can be re-derived, or derived differently, without running the model again.
"""

from __future__ import annotations

from sdkiln.configs import W8A8StaticConfig
from sdkiln.optimizer.layers import manifest_entry, replace, select_layers
from sdkiln.optimizer.plan import Phase, loop_steps, register_plan
from sdkiln.optimizer.quant.calibration import calibrate, calibration_files
from sdkiln.optimizer.registry import TransformContext, TransformResult, register_transform
from sdkiln.runtime.quant.w8a8_static import W8A8StaticLinear


@register_transform(W8A8StaticConfig)
def apply_w8a8_static(ctx: TransformContext, config: W8A8StaticConfig) -> TransformResult:
    model = ctx.transformer
    targets, kept = select_layers(ctx, config.exclude, required_by=config.kind)
    observers, record = calibrate(ctx, [t.linear for t in targets], config.calib_samples)
    modules = {}
    for target in targets:
        module = W8A8StaticLinear.from_linear(model.get_submodule(target.linear), observers[target.linear])
        replace(model, target, module)
        modules[target.layer] = manifest_entry(target, module)
    by_layer = {t.layer: observers[t.linear] for t in targets}
    return TransformResult(
        modules=modules,
        record={
            "quantized": [t.layer for t in targets],
            "float": kept,
            "smoothed": [t.layer for t in targets if t.smoothed],
            "calibration": record,
        },
        files=calibration_files(W8A8StaticConfig.kind, by_layer, record),
    )


@register_plan(W8A8StaticConfig)
def plan_w8a8_static(ctx: TransformContext, config: W8A8StaticConfig) -> list[Phase]:
    return [Phase("calibration", loop_steps(ctx, config.calib_samples))]
