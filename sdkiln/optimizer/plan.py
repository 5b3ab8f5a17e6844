"""What an ``optimize`` run will do, said before it starts, and what it did, measured as it goes.

Before the first forward, ``make_plan`` counts the transformer forwards each phase will run (a
phase: one recipe step, the float reference images of the quality report, the optimized model's
images) and estimates the run's peak memory; ``optimize`` prints it. A recipe step's count comes
from the plan function registered for its config class (``register_plan``); a step whose count
depends on what it measures (the cache search confirms as many schedules as its search finds) says
"at most" and gives its bound. While the run goes, ``PhaseMeter`` counts the forwards the
transformer actually runs, shows a progress bar with an ETA per phase, and records each phase's
forwards, seconds and the memory high-water mark so far; the package keeps both as
``report/optimize.json``.

A pipeline run of ``steps`` denoising steps calls the transformer ``steps`` times, twice as often
when its classifier-free guidance runs the unconditional branch as a separate call
(``ModelSpec.cfg_calls``: FLUX's true CFG, Wan's CFG; SD3 batches both branches into one call).
"""

from __future__ import annotations

import importlib
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from sdkiln.configs import RecipeStep
from sdkiln.optimizer.quant.gptq import FLOAT64_MAX_K
from sdkiln.optimizer.registry import TransformContext
from sdkiln.runtime.memory.sizes import module_bytes
from sdkiln.runtime.memory.sizes import tokens as call_tokens

OPTIMIZE_LOG = "report/optimize.json"
"""The package file with the run's plan and what each phase measured."""

Plan = Callable[[TransformContext, RecipeStep], list["Phase"]]
_PLANS: dict[type[RecipeStep], Plan] = {}


@dataclass
class Phase:
    """One part of the run: ``steps`` denoising steps at the deployment in all (a pipeline run of T
    steps counts T however many samples it batches; a partial run counts the steps it calls the
    transformer for), each ``calls`` transformer calls (2 when CFG's branches are separate calls).
    ``bound`` is ``"exact"`` or ``"at most"``; None steps: a user's forward loop, whose length is the
    user's."""

    name: str
    steps: int | None
    bound: str = "exact"
    calls: int = 1

    @property
    def forwards(self) -> int | None:
        return None if self.steps is None else self.steps * self.calls


def register_plan(*config_classes: type[RecipeStep]) -> Callable[[Plan], Plan]:
    """Decorator: ``fn(ctx, config)`` lists the phases of a recipe step of these config classes."""

    def wrap(fn: Plan) -> Plan:
        for cls in config_classes:
            if cls in _PLANS:
                raise ValueError(f"a plan for {cls.__name__} is registered twice")
            _PLANS[cls] = fn
        return fn

    return wrap


def cfg_factor(spec, call: dict[str, Any]) -> int:
    """Transformer calls per denoising step at ``call``: two when the guidance runs the
    unconditional branch as its own call (``spec.cfg_calls``: the guidance argument above 1 and
    every further argument set; a guider component's classifier-free guidance, counted as on), else one."""
    if spec.guidance_arg is None:  # a guider component: two calls per step unless its scale is 1
        return 2
    names = spec.cfg_calls
    if names:
        scale = call.get(names[0])
        if scale is not None and float(scale) > 1 and all(call.get(n) is not None for n in names[1:]):
            return 2
    return 1


def loop_steps(ctx: TransformContext, samples: int) -> int | None:
    """Denoising steps of a calibration loop of ``samples`` (the default loop runs them one at a
    time); None with a user's loop."""
    return samples * ctx.num_inference_steps if ctx.forward_loop is None else None


def step_phases(ctx: TransformContext, config: RecipeStep) -> list[Phase]:
    """The phases of one recipe step, each with its transformer calls per sample filled in."""
    if type(config) not in _PLANS:
        importlib.import_module(config.transform_module)  # registers the transform and its plan
    fn = _PLANS.get(type(config))
    phases = fn(ctx, config) if fn is not None else [Phase(config.kind, None, "unknown")]
    calls = cfg_factor(ctx.spec, ctx.call_kwargs())
    for phase in phases:
        phase.calls = calls
    return phases


def pipeline_bytes(pipeline) -> int:
    """The bytes of every tensor of every torch component of ``pipeline``."""
    return sum(module_bytes(c) for c in pipeline.components.values() if isinstance(c, torch.nn.Module))


def _linear_shapes(transformer: torch.nn.Module) -> list[tuple[int, int]]:
    return [(m.out_features, m.in_features) for m in transformer.modules() if isinstance(m, torch.nn.Linear)]


def working_bytes(
    ctx: TransformContext, steps: list[RecipeStep], eval_samples: int, eval_batch: int
) -> dict[str, int]:
    """What each kind of work adds to the model's bytes at its peak (an estimate): the activations
    of one transformer call, the largest layer's quantization work, GPTQ's Hessian group and
    inverse, the quality report's image arrays."""
    call = ctx.call_kwargs()
    transformer = ctx.transformer
    dtype_size = next(transformer.parameters()).element_size()
    width = max((k for _, k in _linear_shapes(transformer)), default=0)
    frames = int(call.get("num_frames") or 1)
    tokens = call_tokens(ctx.spec, call)
    # one call at the largest batch a phase runs (the report's, times 2 for batched CFG), the widest
    # layer's input and output, about 8 such tensors alive
    rows = 2 * (min(eval_batch, eval_samples) if eval_samples else 1)
    out = {"activations": rows * tokens * width * max(dtype_size, 4) * 8}
    shapes = _linear_shapes(transformer)
    if shapes:
        n, k = max(shapes, key=lambda s: s[0] * s[1])
        # a layer's candidates (two int8 copies) and the product of one, or a weight-only swap
        out["one layer's quantization"] = 2 * n * k + 4 * n * k
    for config in steps:
        if getattr(config, "weight_rounding", None) == "gptq" and shapes:
            kmax = max(k for _, k in shapes)
            hessians = min(
                sum(4 * k * k for _, k in shapes), max(config.max_hessian_mb * 2**20, 4 * kmax * kmax)
            )
            out["gptq"] = hessians + 2 * kmax * kmax * (8 if kmax <= FLOAT64_MAX_K else 4)
    pixels = int(call.get("height", 0)) * int(call.get("width", 0)) * frames * 3 * 4
    out["quality report images"] = pixels * (2 * eval_samples + eval_batch) if eval_samples else 0
    return out


@dataclass
class RunPlan:
    phases: list[Phase]
    model_bytes: int
    working: dict[str, int]
    device: str

    @property
    def estimated_peak_bytes(self) -> int:
        return self.model_bytes + max(self.working.values(), default=0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "phases": [
                {
                    "name": p.name,
                    "denoising_steps": p.steps,
                    "transformer_calls_per_step": p.calls,
                    "forwards": p.forwards,
                    "bound": p.bound,
                }
                for p in self.phases
            ],  # fmt: skip
            "model_bytes": self.model_bytes,
            "working_bytes": self.working,
            "estimated_peak_bytes": self.estimated_peak_bytes,
            "device": self.device,
        }

    def lines(self) -> list[str]:
        gib = 2**30
        rows = [f"plan on {self.device}: transformer forwards per phase"]
        total, bounded = 0, False
        for p in self.phases:
            if p.forwards is None:
                why = (
                    "no plan registered for it"
                    if p.bound == "unknown"
                    else "as many as the forward loop runs"
                )
                rows.append(f"  {p.name:<34} {'?':>8} forwards ({why})")
                continue
            word = "" if p.bound == "exact" else f" ({p.bound})"
            rows.append(f"  {p.name:<34} {p.forwards:>8} forwards{word}")
            total += p.forwards
            bounded |= p.bound != "exact"
        rows.append(f"  {'total':<34} {total:>8} forwards{' (at most)' if bounded else ''}")
        rows.append(
            f"memory: model {self.model_bytes / gib:.2f} GiB, estimated peak {self.estimated_peak_bytes / gib:.2f} GiB "
            f"(largest addition: {max(self.working, key=self.working.get) if self.working else 'none'})"
        )
        return rows


def make_plan(
    ctx: TransformContext, recipe_steps: list[RecipeStep], eval_samples: int, eval_batch: int, device
) -> RunPlan:
    """The run's phases in order (the quality report's original images first: the model is then
    optimized in place) and its memory estimate."""
    phases: list[Phase] = []
    for config in recipe_steps:
        for attr in ctx.transformers_of(config):
            label = ctx.step_label(config, attr)
            for phase in step_phases(ctx.for_transformer(attr), config):
                phase.name = label if phase.name == config.kind else f"{label}: {phase.name}"
                if ctx.spec.experts and phase.steps is not None:
                    phase.bound = "at most"  # an expert's window of the run is known once it has run
                phases.append(phase)
    if eval_samples:
        calls = cfg_factor(ctx.spec, ctx.call_kwargs())
        steps = -(-eval_samples // eval_batch) * ctx.num_inference_steps
        phases.insert(0, Phase("report: original model", steps, calls=calls))
        phases.append(Phase("report: optimized model", steps, calls=calls))
    working = working_bytes(ctx, recipe_steps, eval_samples, eval_batch)
    return RunPlan(phases, pipeline_bytes(ctx.pipeline), working, str(device))


def peak_host_bytes() -> int:
    """This process's resident-memory high-water mark (Linux: ``ru_maxrss`` in KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@dataclass
class PhaseMeter:
    """Counts the transformer's forwards (a pre-hook on it), one phase at a time, with a progress bar
    over the phase's planned forwards; ``records`` is what each phase measured."""

    transformers: list[torch.nn.Module]
    """Every transformer of the pipeline (Wan2.2-A14B's two experts): a step calls one of them."""
    device: torch.device
    show: bool = True
    records: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.count = 0
        self._bar = None
        self._handles = [t.register_forward_pre_hook(self._tick) for t in self.transformers]

    def _tick(self, *_):
        self.count += 1
        if self._bar is not None:
            self._bar.update()

    def run(self, phase_name: str, planned: int | None, fn: Callable[[], Any]) -> Any:
        start_count, started = self.count, time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._bar = tqdm(total=planned, desc=phase_name, unit="fwd", disable=not self.show, leave=False)
        try:
            return fn()
        finally:
            self._bar.close()
            self._bar = None
            record = {
                "name": phase_name,
                "forwards": self.count - start_count,
                "planned_forwards": planned,
                "seconds": round(time.perf_counter() - started, 3),
                "peak_host_bytes_so_far": peak_host_bytes(),
            }
            if self.device.type == "cuda":
                record["peak_device_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
            self.records.append(record)
            if self.show:
                tqdm.write(
                    f"  {phase_name}: {record['forwards']} forwards in {record['seconds']:.1f} s",
                    file=sys.stderr,
                )

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
