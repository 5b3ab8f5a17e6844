"""What the calibrated int8 steps (SmoothQuant, W8A8, W8A8_TIMESTEP) share: the layers they take,
one calibration run over them, and the files that record it.

The layers are the ``nn.Linear`` layers inside the spec's blocks minus the family's float list and
the step's ``exclude`` patterns, as for every quantization step (``layers.block_linears``), with one
difference: a layer that SmoothQuant wrapped in ``SmoothedLinear`` counts as the layer itself. Its
manifest name stays the original Linear's (the runtime finds a Linear there), patterns match that
name, and the module that is observed and quantized is the inner ``<layer>.linear``.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from torch import nn

from sdkiln.calibrate.loop import resolve_loop
from sdkiln.calibrate.observers import InputObserver, collect_input_stats, stats_tensors
from sdkiln.errors import StepError
from sdkiln.optimizer.registry import StepContext
from sdkiln.runtime.quant.smooth import SmoothedLinear

STATS_FILE = "calibration/stats.safetensors"
CONFIG_FILE = "calibration/config.json"


@dataclass(frozen=True)
class Target:
    layer: str
    """The manifest name: the original ``nn.Linear``'s name in the transformer."""
    smoothed: bool
    """SmoothQuant left an input multiplier in front of it (``<layer>.div``)."""

    @property
    def linear(self) -> str:
        """The ``nn.Linear`` whose input is observed and which the quantized module replaces."""
        return f"{self.layer}.linear" if self.smoothed else self.layer


def calibrated_targets(ctx: StepContext, exclude: tuple[str, ...]) -> tuple[list[Target], list[str]]:
    """(layers to quantize, layer names kept in float). A smoothed layer may not stay float: its
    ``div`` and ``linear`` have no runtime module without a quantization scheme."""
    prefixes = ctx.spec.block_prefixes()
    chosen, kept, inner = [], [], set()
    for name, module in ctx.transformer.named_modules():
        if name in inner or not name.startswith(prefixes):
            continue
        smoothed = isinstance(module, SmoothedLinear)
        if not (smoothed or isinstance(module, nn.Linear)):
            continue
        if smoothed:
            inner.add(f"{name}.linear")
        if ctx.spec.is_float_layer(name) or any(fnmatch.fnmatchcase(name, p) for p in exclude):
            if smoothed:
                raise ValueError(
                    f"{name} was smoothed with an input multiplier but this step keeps it in float; "
                    "give the smoothquant step the same exclude patterns"
                )
            kept.append(name)
        else:
            chosen.append(Target(name, smoothed))
    if not chosen:
        raise ValueError("found no Linear layer to quantize inside the transformer blocks")
    return chosen, kept


def replace(model: nn.Module, target: Target, module: nn.Module) -> None:
    parent, _, leaf = target.linear.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


def manifest_entry(target: Target, module: nn.Module) -> dict[str, Any]:
    return {"scheme": module.scheme, **module.params(), **({"smooth": True} if target.smoothed else {})}


def calibrate(
    ctx: StepContext, names: list[str], samples: int, steps: int | None
) -> tuple[dict[str, InputObserver], dict[str, Any]]:
    """Observe the inputs of the named modules over one run of the forward loop (the user's, or the
    family's calibration prompts): (observers by name, the calibration record)."""
    loop, record = resolve_loop(ctx.spec, ctx.forward_loop, samples, steps)
    observers = collect_input_stats(ctx.pipeline, ctx.spec.transformer_attr, names, loop)
    if record["loop"] == "user":  # every layer runs in every transformer call, so all saw one count
        record["steps"] = next(iter(observers.values())).num_steps
    return observers, record


def require_every_step(observers: dict[str, InputObserver]) -> None:
    """Refuse per-step statistics with a gap: a step the loop never ran has no range to calibrate."""
    for layer, obs in observers.items():
        missing = (~obs.steps_seen()).nonzero().flatten().tolist()
        if missing:
            raise StepError(
                f"{layer}: the calibration loop never ran denoising step(s) {missing} of {obs.num_steps}; "
                "W8A8_TIMESTEP needs every step (run the pipeline from its first step)"
            )


def calibration_files(
    kind: str, observers: dict[str, InputObserver], record: dict[str, Any]
) -> dict[str, Any]:
    """The step's share of ``calibration/stats.safetensors`` (tensors under ``<kind>/``) and of
    ``calibration/config.json`` (its record under ``<kind>``); optimize merges the steps' shares."""
    return {STATS_FILE: stats_tensors(kind, observers), CONFIG_FILE: {kind: record}}
