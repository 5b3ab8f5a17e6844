"""SmoothQuant before an int8 step: move activation outliers into the weights.

For a Linear y = x W^T, dividing input channel k by s_k and multiplying weight column k by s_k
leaves y unchanged and flattens the activation range that int8 must cover (Xiao et al. 2023):
s_k = max|x_k|^alpha / max_n |W[n, k]|^(1 - alpha). A static step's range is per tensor; a dynamic
step's (W8A8_DYNAMIC) is per token, but a token's largest channel still sets the step of all its
others, so outlier channels cost the same there (msModelSlim smooths before W8A8_DYNAMIC too).

* Layers that read the same input share s: the consumers of one adaLN modulation (the spec's
  ``smooth_folds``, e.g. FLUX's to_q/to_k/to_v) get 1/s folded exactly into that float modulation
  Linear (``SmoothFold`` gives the algebra); nothing remains at run time. Every other layer gets
  its own s, kept as an input multiplier ``<layer>.div.mul_scale`` = 1/s (``SmoothedLinear``).
* alpha is searched per group (a fold's consumers, or one layer) over the config's ``alphas`` plus
  "no smoothing", by the output error of the int8 layer of the step it prepares (``W8A8StaticLinear``,
  its input range derived exactly from the per-channel min/max as min_k(min_k / s_k),
  max_k(max_k / s_k); or ``W8A8DynamicLinear``, per-token scales at run time) against the float layer, summed as relative squared error over the group's layers and over the
  calibration data. That needs two runs of the forward loop: one for the per-channel statistics,
  one streaming the candidates' errors; neither stores activations. With the default loop the
  second run uses the next ``calib_samples`` samples (other seeds), so the error includes the
  clipping of inputs that the calibrated range does not cover: scored on the data that set the
  range, a candidate never clips, which favours large alphas whose tight ranges generalize worse.
  A user's loop is run twice as given.

The step only prepares the model: the w8a8_static, w8a8_timestep or w8a8_dynamic step after it
calibrates the smoothed inputs (static) and quantizes (the recipe refuses smoothquant without one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sdkiln.calibrate.loop import PromptLoop
from sdkiln.calibrate.observers import InputObserver, observing
from sdkiln.configs import SmoothQuantConfig
from sdkiln.model_zoo.spec import SmoothFold
from sdkiln.optimizer.layers import select_layers
from sdkiln.optimizer.plan import Phase, loop_steps, register_plan
from sdkiln.optimizer.quant.calibration import STATS_FILE, calibrate, calibration_files
from sdkiln.optimizer.registry import TransformContext, TransformResult, register_transform
from sdkiln.runtime.quant import Ranges
from sdkiln.runtime.quant.scales import half_exact
from sdkiln.runtime.quant.smooth import SmoothedLinear
from sdkiln.runtime.quant.w8a8_dynamic import W8A8DynamicLinear
from sdkiln.runtime.quant.w8a8_static import W8A8StaticLinear

_EPS = 1e-5
NO_SMOOTHING = "none"


@dataclass
class Group:
    """Linears that read one input and so share one smoothing factor."""

    layers: list[str]
    source: str | None = None
    fold: SmoothFold | None = None
    """Where 1/s is folded; None: a single layer that keeps an input multiplier."""
    candidates: dict[str, torch.Tensor] = field(default_factory=dict)
    """Candidate name (``none`` or the alpha) -> s [K]."""
    errors: dict[str, float] = field(default_factory=dict)


def smoothing_groups(ctx: TransformContext, layers: list[str], use_folds: bool = True) -> list[Group]:
    """With ``use_folds``, the spec's folds whose consumers are all being quantized; then one group per
    other layer."""
    model, chosen = ctx.transformer, set(layers)
    groups, folded = [], set()
    for fold in ctx.spec.smooth_folds if use_folds else ():
        for i in range(len(model.get_submodule(fold.block_list))):
            prefix = f"{fold.block_list}.{i}."
            source, consumers = prefix + fold.source, [prefix + c for c in fold.consumers]
            _check_fold(model, fold, source, consumers)
            if source in chosen:
                raise ValueError(f"{source} is a modulation SmoothQuant folds into; it must stay in float")
            if all(c in chosen for c in consumers):
                groups.append(Group(consumers, source, fold))
                folded.update(consumers)
    return groups + [Group([name]) for name in layers if name not in folded]


def _check_fold(model: nn.Module, fold: SmoothFold, source: str, consumers: list[str]) -> None:
    src = model.get_submodule(source)
    width = {model.get_submodule(c).in_features for c in consumers}
    if len(width) != 1 or not isinstance(src, nn.Linear) or src.bias is None:
        raise ValueError(
            f"spec fold {fold}: {source} must be a Linear with bias feeding consumers of one width"
        )
    if src.out_features != fold.chunks * width.pop():
        raise ValueError(
            f"spec fold {fold}: {source} has {src.out_features} outputs, not {fold.chunks} chunks"
        )


def target_of(ctx: TransformContext, config: SmoothQuantConfig) -> str | None:
    """The int8 step whose layer scores alpha: the recipe's (its ``target`` or next one), else the
    config's own ``target`` for a step applied on its own."""
    return ctx.recipe.target_of(config) if ctx.recipe is not None else config.target


def _candidates(
    group: Group, model: nn.Module, stats: dict[str, InputObserver], alphas: tuple[float, ...]
) -> None:
    """s per alpha from the group's input absmax and its weights' column absmax; 1 on dead channels."""
    act = torch.stack([stats[n].channel_absmax for n in group.layers]).amax(0)
    weight = torch.stack([model.get_submodule(n).weight.detach().abs().amax(0).float() for n in group.layers])
    weight = weight.amax(0).to(act.device)
    dead = (act <= 0) | (weight <= 0)
    group.candidates[NO_SMOOTHING] = torch.ones_like(act)
    for alpha in alphas:
        s = (act.clamp_min(_EPS).pow(alpha) / weight.clamp_min(_EPS).pow(1 - alpha)).clamp_min(_EPS)
        group.candidates[str(alpha)] = torch.where(dead, torch.ones_like(s), s)


class _CandidateErrors:
    """An input callback that streams, per candidate s, the squared output error of the int8 layer
    on the input smoothed by s, against the float layer: static (the calibrated range; ``ranges``)
    or dynamic (``ranges`` None)."""

    def __init__(
        self, linear: nn.Linear, stats: InputObserver, candidates: dict[str, torch.Tensor], static: bool
    ):
        self.linear, self.candidates = linear, candidates
        self.ranges = (
            {
                c: (float((stats.channel_min / s).min()), float((stats.channel_max / s).max()))
                for c, s in candidates.items()
            }
            if static
            else None
        )
        self.sse = dict.fromkeys(candidates, 0.0)
        self.energy = 0.0

    def __call__(self, x: torch.Tensor, step: int, num_steps: int) -> None:
        # F.linear, not self.linear(x): calling the module would re-enter this hook.
        reference = F.linear(x, self.linear.weight, self.linear.bias).double()
        self.energy += float(reference.pow(2).sum())
        for c, s in self.candidates.items():
            scaled = _meta_linear(self.linear.weight.detach().float() * s, self.linear.bias)
            if self.ranges is None:
                quant = W8A8DynamicLinear.from_linear(scaled)
            else:
                quant = W8A8StaticLinear.from_linear(scaled, Ranges(*self.ranges[c]))
            smoothed = (x.float() * (1.0 / s)).to(x.dtype)
            self.sse[c] += float((quant(smoothed).double() - reference).pow(2).sum())

    def relative(self, candidate: str) -> float:
        return self.sse[candidate] / max(self.energy, 1e-30)


def _meta_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` around existing tensors (built on meta, so no initialization runs)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias is not None, device="meta")
    lin.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return lin


def _search(
    ctx: TransformContext, config: SmoothQuantConfig, groups: list[Group], stats: dict[str, InputObserver]
) -> dict[str, Any]:
    """Score every group's candidates over one more run of the loop; returns that run's record."""
    static = target_of(ctx, config) != "w8a8_dynamic"  # None (applied on its own): static
    scores = {
        n: _CandidateErrors(ctx.transformer.get_submodule(n), stats[n], g.candidates, static)
        for g in groups
        for n in g.layers
    }
    if ctx.forward_loop is None:
        loop = PromptLoop(ctx.spec, config.calib_samples, ctx.call_kwargs(), first=config.calib_samples)
        record = loop.record()
    else:
        loop, record = ctx.forward_loop, {"loop": "user"}
    with observing(ctx.pipeline, ctx.spec.transformer_attr, scores):
        loop(ctx.pipeline)
    for g in groups:
        g.errors = {c: sum(scores[n].relative(c) for n in g.layers) for c in g.candidates}
    return record


def _fold(model: nn.Module, group: Group, s: torch.Tensor) -> None:
    """1/s into the modulation's shift and scale rows, s into the consumers' weight columns."""
    fold, src = group.fold, model.get_submodule(group.source)
    k = s.numel()
    s64 = s.double().to(src.weight.device)
    w, b = src.weight.detach().double(), src.bias.detach().double()
    for chunk in (fold.shift, fold.scale):
        rows = slice(chunk * k, (chunk + 1) * k)
        w[rows] /= s64[:, None]
        b[rows] = (b[rows] + 1) / s64 - 1 if chunk == fold.scale else b[rows] / s64
    with torch.no_grad():
        src.weight.copy_(w)
        src.bias.copy_(b)
        for name in group.layers:
            consumer = model.get_submodule(name)
            consumer.weight.copy_(consumer.weight.double() * s64)


def apply_smoothing(model: nn.Module, group: Group, s: torch.Tensor) -> None:
    """Smooth ``group`` by s: folded into its modulation, or an input multiplier on its one layer."""
    if group.fold is not None:
        _fold(model, group, s)
        return
    (name,) = group.layers
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, SmoothedLinear.from_linear(model.get_submodule(name), s))


@register_transform(SmoothQuantConfig)
def apply_smoothquant(ctx: TransformContext, config: SmoothQuantConfig) -> TransformResult:
    model = ctx.transformer
    targets, kept = select_layers(ctx, config.exclude, required_by=config.kind)
    if any(t.smoothed for t in targets):
        raise ValueError("the model is already smoothed; apply smoothquant once")
    layers = [t.layer for t in targets]
    groups = smoothing_groups(ctx, layers, config.fold)
    stats, record = calibrate(ctx, layers, config.calib_samples)
    for g in groups:
        _candidates(g, model, stats, config.alphas)
    search_record = _search(ctx, config, groups, stats)

    files = calibration_files(SmoothQuantConfig.kind, stats, record)
    decisions = []
    for g in groups:
        best = min(g.candidates, key=lambda c: g.errors[c])
        if best != NO_SMOOTHING:
            # 1/s, the multiplier, on half_exact's grid: MindIE SD casts it to the model's dtype.
            s = 1.0 / half_exact(1.0 / g.candidates[best].double(), up=False).double()
            apply_smoothing(model, g, s)
            files[STATS_FILE].update(
                {
                    f"{SmoothQuantConfig.kind}/{n}.smooth_scale": s.detach().float().cpu().clone()
                    for n in g.layers
                }
            )
        decisions.append(
            {
                "layers": g.layers,
                "alpha": None if best == NO_SMOOTHING else float(best),
                "fold": g.source if best != NO_SMOOTHING and g.fold is not None else None,
                "errors": g.errors,
            }
        )
    return TransformResult(
        modules={},
        record={
            "target": target_of(ctx, config),
            "groups": decisions,
            "folded": [n for d in decisions if d["fold"] for n in d["layers"]],
            "mul_scale": [
                n for d in decisions if d["alpha"] is not None and not d["fold"] for n in d["layers"]
            ],
            "unsmoothed": [n for d in decisions if d["alpha"] is None for n in d["layers"]],
            "float": kept,
            "calibration": record,
            "alpha_search_data": search_record,
        },
        files=files,
    )


@register_plan(SmoothQuantConfig)
def plan_smoothquant(ctx: TransformContext, config: SmoothQuantConfig) -> list[Phase]:
    """Calibration, then one more run of the loop scoring every alpha."""
    return [
        Phase("calibration", loop_steps(ctx, config.calib_samples)),
        Phase("alpha search", loop_steps(ctx, config.calib_samples)),
    ]
