"""W8A16 and W4A16: swap block Linears for weight-only quantized modules; activations stay float.

W4A16 quantizes groups of ``group_size`` consecutive inputs, so a layer whose in_features is not a
multiple of the group size cannot take it. Such a layer stays in float, is listed under the step's
``float`` layers (which ``sdkiln inspect`` reports) and, with its in_features, under
``not_divisible``, and the step warns. That keeps one odd-sized layer from failing a whole model;
a step that leaves nothing to quantize is an error.

With ``weight_rounding="gptq"`` the scales stay those of nearest rounding and the integers are
rounded by GPTQ (``sdkiln.optimizer.gptq``) against one calibration run's input second moments.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

from torch import nn

from sdkiln.configs import W4A16Config, W8A16Config
from sdkiln.optimizer.calibrated_layers import CONFIG_FILE
from sdkiln.optimizer.gptq import gptq_hessians, gptq_layer, gptq_record
from sdkiln.optimizer.layers import block_linears, replace_linears
from sdkiln.optimizer.registry import StepContext, StepResult, register_transform
from sdkiln.runtime.quant.weight_only import INT4_QMAX, W4A16Linear, W8A16Linear


def _swap(
    ctx: StepContext,
    config: W8A16Config | W4A16Config,
    names: list[str],
    build: Callable[[nn.Linear], nn.Module],
    qrange: tuple[int, int],
    record: dict,
) -> StepResult:
    """Swap the named Linears for ``build(linear)``; with GPTQ, re-round each module's integers on
    its own grid and record the calibration."""
    hessians, files = {}, {}
    if config.weight_rounding == "gptq":
        hessians, record["calibration"] = gptq_hessians(ctx, config, names)
    ratios = {}
    name_of = {id(ctx.transformer.get_submodule(n)): n for n in names}

    def build_rounded(linear: nn.Linear) -> nn.Module:
        module = build(linear)
        if hessians:
            name = name_of[id(linear)]
            values, ratios[name] = gptq_layer(
                linear.weight, hessians.pop(name), module.weight_scale, *qrange, config.gptq_damp
            )
            module.set_values(values)
        return module

    modules = replace_linears(ctx.transformer, names, build_rounded)
    if ratios:
        record.update(gptq_record(ratios))
        files[CONFIG_FILE] = {config.kind: record["calibration"]}
    return StepResult(modules=modules, record=record, files=files)


@register_transform(W8A16Config)
def apply_w8a16(ctx: StepContext, config: W8A16Config) -> StepResult:
    chosen, kept = block_linears(ctx, config.exclude)
    if not chosen:
        raise ValueError("w8a16 found no Linear layer to quantize inside the transformer blocks")
    record = {"quantized": chosen, "float": kept, "calibration": None}
    return _swap(ctx, config, chosen, W8A16Linear.from_linear, (-128, 127), record)


@register_transform(W4A16Config)
def apply_w4a16(ctx: StepContext, config: W4A16Config) -> StepResult:
    model = ctx.transformer
    candidates, kept = block_linears(ctx, config.exclude)
    in_features = {name: model.get_submodule(name).in_features for name in candidates}
    not_divisible = {name: k for name, k in in_features.items() if k % config.group_size}
    chosen = [name for name in candidates if name not in not_divisible]
    if not chosen:
        why = f": the in_features of all {len(not_divisible)} candidates are not multiples of group_size"
        raise ValueError(
            "w4a16 found no Linear layer to quantize inside the transformer blocks"
            + (f"{why} {config.group_size}" if not_divisible else "")
        )
    if not_divisible:
        names = sorted(not_divisible)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        warnings.warn(
            f"w4a16: {len(names)} layers stay in float because their in_features is not a multiple of "
            f"group_size {config.group_size}: {shown}",
            stacklevel=2,
        )
    build = functools.partial(W4A16Linear.from_linear, group_size=config.group_size)
    record = {
        "quantized": chosen,
        "float": kept + sorted(not_divisible),
        "not_divisible": not_divisible,
        "group_size": config.group_size,
        "calibration": None,
    }
    return _swap(ctx, config, chosen, build, (-INT4_QMAX, INT4_QMAX), record)
