"""W8A8_DYNAMIC, FP8_DYNAMIC, W8A16 and W4A16: the schemes whose modules are built from the weight
alone, applied by one transform.

Each chosen layer (``layers.select_layers``) is replaced by the scheme's runtime class, built with
``from_linear(linear, **config.module_params())``. A layer the scheme cannot represent (W4A16 where
in_features is not a multiple of the group size) stays in float, is listed under the step's
``float`` layers and, with the reason, under ``not_applicable``, and the step warns. That keeps one
odd-sized layer from failing a whole model; a step that leaves nothing to quantize is an error.

With ``weight_rounding="gptq"`` (schemes with an integer weight grid) the scales stay those of
nearest rounding and the integers are rounded by GPTQ (``gptq``) against each layer's input second
moments from one calibration run on the float model. The record gives, per layer, GPTQ's
calibration output error ``tr(E H Eᵀ)`` relative to nearest rounding's (below 1: smaller).
"""

from __future__ import annotations

import warnings

from sdkiln.configs import FP8DynamicConfig, QuantStep, W4A16Config, W8A8DynamicConfig, W8A16Config
from sdkiln.optimizer.layers import manifest_entry, replace, select_layers
from sdkiln.optimizer.quant.calibration import CONFIG_FILE
from sdkiln.optimizer.quant.gptq import gptq_hessians, gptq_layer, gptq_record
from sdkiln.optimizer.registry import TransformContext, TransformResult, register_transform
from sdkiln.runtime.quant import by_recipe_kind


@register_transform(W8A8DynamicConfig, FP8DynamicConfig, W8A16Config, W4A16Config)
def apply_weight_scheme(ctx: TransformContext, config: QuantStep) -> TransformResult:
    cls = by_recipe_kind()[config.kind]
    model, params = ctx.transformer, config.module_params()
    targets, kept = select_layers(ctx, config.exclude, required_by=config.kind)
    built, not_applicable = {}, {}
    for target in targets:
        try:
            built[target] = cls.from_linear(model.get_submodule(target.linear), **params)
        except ValueError as exc:
            if target.smoothed:
                raise ValueError(
                    f"{config.kind}: smoothed layer {target.layer} cannot take it: {exc}"
                ) from None
            not_applicable[target.layer] = str(exc)
    if not built:
        raise ValueError(
            f"{config.kind} cannot take any of the {len(not_applicable)} layers it found: "
            f"{next(iter(not_applicable.values()))}"
        )
    if not_applicable:
        names = sorted(not_applicable)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        warnings.warn(
            f"{config.kind}: {len(names)} layers stay in float, the scheme cannot represent them: {shown} "
            f"({not_applicable[names[0]]})",
            stacklevel=2,
        )
    record = {
        "quantized": [t.layer for t in built],
        "float": kept + sorted(not_applicable),
        "not_applicable": not_applicable,
        **params,
        "calibration": None,
    }
    if any(t.smoothed for t in built):
        record["smoothed"] = [t.layer for t in built if t.smoothed]
    files = {}
    if getattr(config, "weight_rounding", "nearest") == "gptq":
        hessians, record["calibration"] = gptq_hessians(ctx, config, [t.linear for t in built])
        ratios = {}
        for target, module in built.items():
            values, ratios[target.layer] = gptq_layer(
                model.get_submodule(target.linear).weight,
                hessians.pop(target.linear),
                module.weight_scale,
                *cls.weight_range,
                config.gptq_damp,
            )
            module.set_values(values)
        record.update(gptq_record(ratios))
        files[CONFIG_FILE] = {config.kind: record["calibration"]}
    for target, module in built.items():
        replace(model, target, module)
    return TransformResult(
        modules={t.layer: manifest_entry(t, m) for t, m in built.items()}, record=record, files=files
    )
