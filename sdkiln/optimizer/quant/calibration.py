"""What the calibrated quantization steps share: one calibration run over their layers' inputs at
the recipe's deployment, and the package files that record it (``calibration/stats.safetensors``
and ``calibration/config.json``, each step's entries under its kind)."""

from __future__ import annotations

from typing import Any

from sdkiln.calibrate.loop import resolve_loop
from sdkiln.calibrate.observers import InputObserver, collect_input_stats, stats_tensors
from sdkiln.errors import RecipeError, StepError
from sdkiln.optimizer.registry import TransformContext

STATS_FILE = "calibration/stats.safetensors"
CONFIG_FILE = "calibration/config.json"


def calibrate(
    ctx: TransformContext, names: list[str], samples: int
) -> tuple[dict[str, InputObserver], dict[str, Any]]:
    """Observe the inputs of the named modules over one run of the forward loop (the user's, or the
    family's calibration prompts at the deployment call): (observers by name, the calibration record)."""
    loop, record = resolve_loop(ctx.spec, ctx.forward_loop, samples, ctx.call_kwargs())
    observers = collect_input_stats(ctx.pipeline, ctx.spec.transformer_attr, names, loop)
    if record["loop"] == "user":  # every layer runs in every transformer call, so all saw one count
        record["steps"] = next(iter(observers.values())).num_steps
    return observers, record


def require_every_step(ctx: TransformContext, observers: dict[str, InputObserver]) -> None:
    """Refuse per-step statistics that do not describe the deployment: a run at another step count
    (a user's loop), or a step the loop never ran (it has no range to calibrate)."""
    for layer, obs in observers.items():
        if obs.num_steps != ctx.num_inference_steps:
            raise RecipeError(
                f"the calibration loop ran {obs.num_steps} denoising steps but the recipe deploys at "
                f"{ctx.num_inference_steps}; per-step schemes need both to agree: run the loop at "
                f"{ctx.num_inference_steps} steps or set the recipe's deployment num_inference_steps"
            )
        missing = (~obs.steps_seen()).nonzero().flatten().tolist()
        if missing and ctx.spec.several_transformers:
            ran = sorted(set(range(obs.num_steps)) - set(missing))
            raise RecipeError(
                f"W8A8_TIMESTEP calibrates every denoising step, and {ctx.spec.transformer_attr}, one of "
                f"{ctx.spec.name}'s experts, runs steps {ran[0]}-{ran[-1]} of {obs.num_steps} only: per-step "
                "schemes are not supported on a pipeline's experts yet (use w8a8-dynamic or w8a8)"
            )
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
