"""W8A8_DYNAMIC, FP8_DYNAMIC, W8A16 and W4A16: the schemes whose modules are built from the weight
alone, applied by one transform.

Each chosen layer (``layers.select_layers``) is replaced by the scheme's runtime class, built with
``from_linear(linear, **config.module_params())`` on the weight's device, and swapped in as soon as
it is built: the float layer is freed before the next layer is built, so the step never holds a
second copy of the model. A layer the scheme cannot represent (W4A16 where
in_features is not a multiple of the group size) stays in float, is listed under the step's
``float`` layers and, with the reason, under ``not_applicable``, and the step warns. That keeps one
odd-sized layer from failing a whole model; a step that leaves nothing to quantize is an error.

With ``weight_rounding="gptq"`` (schemes with an integer weight grid) the scales stay those of
nearest rounding and the integers are rounded by GPTQ (``gptq``) against each layer's input second
moments. The Hessians are collected one group at a time (``max_hessian_mb``; FLUX.1-dev's 12288-wide
inputs take 600 MB each): a group's layers are rounded, swapped in and their matrices freed before
the next group's calibration pass, which therefore runs with the earlier groups already quantized
(as GPTQ's reference implementation feeds each block the quantized blocks' outputs). A model whose
Hessians fit the budget together takes one pass on the float model. The record gives, per layer, GPTQ's
calibration output error ``tr(E H Eᵀ)`` relative to nearest rounding's (below 1: smaller).
"""

from __future__ import annotations

import warnings

from sdkiln.configs import FP8DynamicConfig, QuantStep, W4A16Config, W8A8DynamicConfig, W8A16Config
from sdkiln.optimizer.layers import Target, manifest_entry, replace, select_layers
from sdkiln.optimizer.plan import Phase, loop_steps, register_plan
from sdkiln.optimizer.quant.calibration import CONFIG_FILE
from sdkiln.optimizer.quant.gptq import gptq_groups, gptq_layer, gptq_passes, gptq_record
from sdkiln.optimizer.registry import TransformContext, TransformResult, register_transform
from sdkiln.runtime.quant import by_recipe_kind


def _build(cls, model, target: Target, params, not_applicable: dict[str, str]):
    """The scheme's module for ``target`` (on its weight's device), or None with the reason recorded."""
    try:
        return cls.from_linear(model.get_submodule(target.linear), **params)
    except ValueError as exc:
        if target.smoothed:
            raise ValueError(
                f"{cls.recipe_kind}: smoothed layer {target.layer} cannot take it: {exc}"
            ) from None
        not_applicable[target.layer] = str(exc)
        return None


@register_transform(W8A8DynamicConfig, FP8DynamicConfig, W8A16Config, W4A16Config)
def apply_weight_scheme(ctx: TransformContext, config: QuantStep) -> TransformResult:
    cls = by_recipe_kind()[config.kind]
    model, params = ctx.transformer, config.module_params()
    weight_only = not cls.quantizes_activations
    targets, kept = select_layers(ctx, config.exclude, required_by=config.kind, weight_only=weight_only)
    built, not_applicable, files, calibration, ratios = {}, {}, {}, None, {}
    gptq = getattr(config, "weight_rounding", "nearest") == "gptq"
    if gptq:
        by_linear = {t.linear: t for t in targets}
        groups, calibration = gptq_groups(ctx, config, list(by_linear))
        for hessians in groups:  # one group's Hessians alive at a time
            for name in list(hessians):
                target = by_linear[name]
                module = _build(cls, model, target, params, not_applicable)
                if module is not None:
                    values, ratios[target.layer] = gptq_layer(
                        model.get_submodule(name).weight,
                        hessians[name],
                        module.weight_scale,
                        *cls.weight_range,
                        config.gptq_damp,
                    )
                    module.set_values(values)
                    del values
                    replace(model, target, module)  # the float layer goes as the module comes
                    built[target] = manifest_entry(target, module)
                del hessians[name]
    else:
        for target in targets:
            module = _build(cls, model, target, params, not_applicable)
            if module is not None:
                replace(model, target, module)
                built[target] = manifest_entry(target, module)
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
        "calibration": calibration,
    }
    if any(t.smoothed for t in built):
        record["smoothed"] = [t.layer for t in built if t.smoothed]
    if gptq:
        record.update(gptq_record(ratios))
        files[CONFIG_FILE] = {config.kind: calibration}
    return TransformResult(modules={t.layer: entry for t, entry in built.items()}, record=record, files=files)


@register_plan(W8A8DynamicConfig, FP8DynamicConfig, W8A16Config, W4A16Config)
def plan_weight_scheme(ctx: TransformContext, config: QuantStep) -> list[Phase]:
    """GPTQ's calibration passes, one per Hessian group; nearest rounding runs no forward."""
    if getattr(config, "weight_rounding", "nearest") != "gptq":
        return []
    weight_only = not by_recipe_kind()[config.kind].quantizes_activations
    targets, _ = select_layers(ctx, config.exclude, required_by=config.kind, weight_only=weight_only)
    passes = gptq_passes(ctx, config, [t.linear for t in targets])
    steps = loop_steps(ctx, config.calib_samples)
    name = f"gptq hessians, {passes} group{'s' if passes > 1 else ''}"
    return [Phase(name, None if steps is None else passes * steps)]
