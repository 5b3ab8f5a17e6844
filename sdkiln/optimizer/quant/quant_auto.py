"""quant_auto: mixed precision under a quality floor.

One scheme rarely suits every layer of a diffusion transformer: a few layers see rare, huge
activations that a per-tensor static range cannot hold without crushing everything else, while
most are fine with it. So each layer gets the first scheme of ``(scheme, *fallbacks)`` whose output
is close enough to the float layer's, and stays in float if none is:

1. Range pass (only if a candidate scheme's runtime class ``needs_ranges``: w8a8_static,
   w8a8_timestep): the static steps' calibration (``calibration.calibrate``) over ``calib_samples`` samples; its
   statistics go into ``calibration/stats.safetensors`` under ``quant_auto/``, as the static step's do.
2. Sensitivity pass: every candidate layer's input, as the float model computes it, goes through
   the float layer and through each candidate scheme's module (built from the layer and its ranges
   for that call and dropped after it: at most one layer's candidates exist at a time);
   ``LayerSensitivity`` adds up the float output's power and each candidate's error power, two
   floats per candidate and no activations. SQNR = 10 log10(signal / error) in dB over all tokens,
   steps and samples. With the default loop this pass runs ``sensitivity_samples`` samples that
   follow the range pass's (other seeds), so a static range is scored on data it was not fitted to
   and its clipping counts, as SmoothQuant's alpha search does; a user's loop runs again as given.
3. The plan: per layer the first scheme whose SQNR reaches ``sqnr_floor_db`` (``choose``), else float.
   The manifest's ``modules`` gets each layer's own scheme; the step record keeps, per layer, every
   candidate's SQNR and the choice, and the counts per scheme.

A W8A8_TIMESTEP candidate is scored and kept with ``dynamic_steps`` 0 (static at every step): its
per-step ranges are what sets it apart from W8A8. A candidate that cannot represent a layer (W4A16
where in_features is not a multiple of the group size; a static bias that overflows int32) is
recorded under ``not_applicable`` with the reason and is not chosen.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sdkiln.calibrate.loop import ForwardLoop, resolve_loop
from sdkiln.calibrate.observers import InputObserver, observing
from sdkiln.configs import RECIPE_STEPS, QuantAutoConfig
from sdkiln.metrics import ratio_db
from sdkiln.optimizer.layers import manifest_entry, replace, select_layers
from sdkiln.optimizer.plan import Phase, loop_steps, register_plan
from sdkiln.optimizer.quant.calibration import calibrate, calibration_files, require_every_step
from sdkiln.optimizer.registry import TransformContext, TransformResult, register_transform
from sdkiln.runtime.denoising import attach_step_tracker
from sdkiln.runtime.quant import by_recipe_kind

FLOAT = "float"
SQNR_CAP_DB = 100.0
"""An error-free candidate has infinite SQNR; the record caps it here so the JSON stays standard."""


@functools.cache
def _default_params(kind: str) -> dict[str, Any]:
    return RECIPE_STEPS[kind]().module_params()


def build_candidate(kind: str, linear: nn.Linear, ranges: InputObserver | None) -> nn.Module:
    """Scheme ``kind``'s runtime module for one layer, from the float layer and its input ranges,
    with the parameters of that kind's default recipe step (W4A16's group size); a W8A8_TIMESTEP
    candidate runs static at every step (``dynamic_steps`` 0)."""
    return by_recipe_kind()[kind].from_linear(linear, ranges, **_default_params(kind))


class LayerSensitivity:
    """An input callback for one layer: streams the float output's power and, per candidate scheme,
    the power of its error against the float output. Its state is two floats per candidate.

    The candidate modules are built from the float layer on each call (``build``) and dropped after
    it, so however many layers are scored in one pass, at most one layer's candidates exist at a time
    (a 12B model's two int8 candidates of every layer would be 0.5x the model again). Building is
    deterministic, so every call scores the same modules the plan later swaps in."""

    def __init__(self, linear: nn.Linear, build: Callable[[], dict[str, nn.Module]], schemes: list[str]):
        self.linear, self.build = linear, build
        self.signal = 0.0
        self.noise = dict.fromkeys(schemes, 0.0)
        self.num_steps: int | None = None

    def __call__(self, x: torch.Tensor, step: int, num_steps: int) -> None:
        # F.linear, not self.linear(x): calling the module would re-enter this hook. Differences
        # are taken in fp32 (exact enough for a power) and the powers summed in fp64.
        reference = F.linear(x, self.linear.weight, self.linear.bias).float()
        self.signal += float(torch.sum(reference.square(), dtype=torch.float64))
        for name, module in self.build().items():
            if getattr(module, "needs_step", False):  # runs beside the model: tell it the step
                module.set_step(step, num_steps)
            error = module(x).float() - reference
            self.noise[name] += float(torch.sum(error.square(), dtype=torch.float64))
            del module, error
        self.num_steps = num_steps

    def sqnr_db(self) -> dict[str, float]:
        return {
            name: max(-SQNR_CAP_DB, min(SQNR_CAP_DB, ratio_db(self.signal, noise)))
            for name, noise in self.noise.items()
        }


def sensitivity_pass(
    pipeline: Any, transformer_attr: str, layers: dict[str, LayerSensitivity], forward_loop: ForwardLoop
) -> None:
    """Run ``forward_loop(pipeline)`` once with each ``LayerSensitivity`` on its layer's input."""
    with observing(pipeline, transformer_attr, layers):
        forward_loop(pipeline)
    for name, sens in layers.items():
        if sens.num_steps is None:
            raise ValueError(
                f"the sensitivity pass saw no input for {name}: the forward loop must run the pipeline"
            )


def choose(sqnr_db: dict[str, float | None], order: tuple[str, ...], floor_db: float) -> str:
    """The first scheme in ``order`` whose SQNR reaches ``floor_db`` (None: not applicable); else float."""
    return next((s for s in order if sqnr_db.get(s) is not None and sqnr_db[s] >= floor_db), FLOAT)


def _candidates(linear: nn.Linear, schemes: tuple[str, ...], ranges) -> dict[str, nn.Module]:
    return {scheme: build_candidate(scheme, linear, ranges) for scheme in schemes}


def candidate_modules(
    linear: nn.Linear, order: tuple[str, ...], ranges: InputObserver | None
) -> tuple[dict[str, nn.Module], dict[str, str]]:
    """(the candidate modules, the reasons of the schemes that cannot represent this layer)."""
    modules, reasons = {}, {}
    for scheme in order:
        try:
            modules[scheme] = build_candidate(scheme, linear, ranges)
        except ValueError as exc:
            reasons[scheme] = str(exc)
    return modules, reasons


@register_transform(QuantAutoConfig)
def apply_quant_auto(ctx: TransformContext, config: QuantAutoConfig) -> TransformResult:
    model = ctx.transformer
    order = (config.scheme, *config.fallbacks)
    classes = [by_recipe_kind()[kind] for kind in order]
    weight_only = not any(cls.quantizes_activations for cls in classes)  # then it takes adaLN layers too
    targets, kept = select_layers(ctx, config.exclude, required_by=config.kind, weight_only=weight_only)
    if any(t.smoothed for t in targets):
        raise ValueError("quant_auto does not take smoothed layers; smoothquant prepares one int8 scheme")
    layers = [t.layer for t in targets]
    ranges, range_record, files = {}, None, {}
    if any(cls.needs_ranges for cls in classes):
        ranges, range_record = calibrate(ctx, layers, config.calib_samples)
        if any(cls.needs_step for cls in classes):
            require_every_step(ctx, ranges)
        files = calibration_files(QuantAutoConfig.kind, ranges, range_record)

    first = config.calib_samples if ranges else 0
    loop, sens_record = resolve_loop(
        ctx.spec, ctx.forward_loop, config.sensitivity_samples, ctx.call_kwargs(), first
    )
    sensitivities, not_applicable = {}, {}
    for name in layers:
        linear, layer_ranges = model.get_submodule(name), ranges.get(name)
        modules, reasons = candidate_modules(linear, order, layer_ranges)  # which schemes apply
        schemes = list(modules)
        del modules  # rebuilt per call while scoring, then once for the choice
        sensitivities[name] = LayerSensitivity(
            linear, functools.partial(_candidates, linear, tuple(schemes), layer_ranges), schemes
        )
        if reasons:
            not_applicable[name] = reasons
    del linear
    sensitivity_pass(ctx.pipeline, ctx.spec.transformer_attr, sensitivities, loop)
    if sens_record["loop"] == "user":
        sens_record["steps"] = next(iter(sensitivities.values())).num_steps

    plan, modules = {}, {}
    for name in list(sensitivities):
        # popped: the scorer holds the float layer, which must go when its module comes in
        measured = sensitivities.pop(name).sqnr_db()
        sqnr = {s: measured.get(s) for s in order}
        choice = choose(sqnr, order, config.sqnr_floor_db)
        plan[name] = {"choice": choice, "sqnr_db": sqnr}
        if choice != FLOAT:
            target = next(t for t in targets if t.layer == name)
            module = build_candidate(choice, model.get_submodule(name), ranges.get(name))
            replace(model, target, module)
            modules[name] = manifest_entry(target, module)
    if any(getattr(m, "needs_step", False) for m in model.modules()):
        attach_step_tracker(ctx.pipeline, ctx.spec.transformer_attr)
    below = [n for n, p in plan.items() if p["choice"] == FLOAT]
    if len(below) == len(layers):
        warnings.warn(
            f"quant_auto: no layer reached {config.sqnr_floor_db} dB with {', '.join(order)}; the model stays float",
            stacklevel=2,
        )
    return TransformResult(
        modules=modules,
        record={
            "quantized": list(modules),
            "float": kept + below,
            "below_floor": below,
            "order": list(order),
            "sqnr_floor_db": config.sqnr_floor_db,
            "counts": {s: sum(p["choice"] == s for p in plan.values()) for s in (*order, FLOAT)},
            "plan": plan,
            "not_applicable": not_applicable,
            "metric": "output SQNR in dB of the layer against the float layer, on the float model's inputs",
            "calibration": range_record,
            "sensitivity_data": sens_record,
        },
        files=files,
    )


@register_plan(QuantAutoConfig)
def plan_quant_auto(ctx: TransformContext, config: QuantAutoConfig) -> list[Phase]:
    """The range pass (when a candidate needs ranges), then the sensitivity pass."""
    order = (config.scheme, *config.fallbacks)
    phases = []
    if any(by_recipe_kind()[kind].needs_ranges for kind in order):
        phases.append(Phase("ranges", loop_steps(ctx, config.calib_samples)))
    phases.append(Phase("sensitivity", loop_steps(ctx, config.sensitivity_samples)))
    return phases
