"""Quantized attention at run time: the plan a package carries, the ``"quantized"`` attention backend
that runs it, putting it on a pipeline, and the ``attention_quant`` package section.

``attention/attention_quant.json`` says, for one transformer, which attention layers run
``sdkiln::quantized_attention`` at which denoising steps, in which formats (``qk``: INT8 or FP8 Q and
K; ``pv``: FP8, INT8 or float P and V) and whether each layer rotates Q and K by a Hadamard matrix
(``layout="mindie"``: ``sdkiln::fp8_block_attention``, MindIE SD's FP8 blocks, the form Ascend runs);
every other call runs as the unrouted diffusers processor would (``AttentionCall.native``). The
decisions were measured per layer and step on calibration prompts (``sdkiln.optimizer.quant.attention``)
and apply to the deployment's step count; a run with another count follows the plan by its position
in the trajectory (step ``i`` of ``M`` reads the plan's step ``i * N // M``).

With a block-sparse attention plan on the same transformer the two share the one route: the sparse
backend runs the calls its plan makes sparse (in float) and hands every other call to this plan
(``AttentionRoute.quantized``). Under Ulysses the parallel backend hands it each rank's heads over
the whole sequence after its all-to-all, which quantizes as one device does (Q per token, K over
every key); ring attention with it is refused (``runtime.parallel.apply``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from sdkiln import kernels
from sdkiln.errors import PackageError, SdkilnError
from sdkiln.kernels.ops.quantized_attention import PV_FORMATS, QK_FORMATS
from sdkiln.runtime.attention.backends import AttentionCall, register_backend
from sdkiln.runtime.attention.route import attention_route, route_attention, unroute_attention
from sdkiln.runtime.denoising import attach_step_tracker
from sdkiln.runtime.restore import RestoreContext, Section, section_file, transformer_spec

PLAN_FILE = "attention/attention_quant.json"
NAME = "attention_quant"
LAYOUTS = ("sage", "mindie")
"""``sage``: ``sdkiln::quantized_attention`` (SageAttention's blocks, K smoothed, P quantized), on every
device; ``mindie``: ``sdkiln::fp8_block_attention`` (MindIE SD's FP8RotateQuantFA: FP8 Q per 128 tokens,
K and V per 256, no smoothing), what ``export-ascend`` writes as MindIE SD's FA quantization."""


@dataclass
class AttentionQuantPlan:
    qk: str
    pv: str
    num_steps: int
    """The deployment's denoising steps, which ``steps`` lists."""
    layers: dict[str, dict[str, Any]]
    """Attention module name -> ``{"rotate": bool, "steps": [bool] * num_steps}`` (True: quantized)."""
    config_hash: str = ""
    record: dict[str, Any] = field(default_factory=dict)
    """What calibration measured (per layer and step): for audit, not read."""
    layout: str = "sage"
    version: int = 1

    def __post_init__(self) -> None:
        if self.qk not in QK_FORMATS or self.pv not in PV_FORMATS:
            raise ValueError(
                f"qk is one of {QK_FORMATS} and pv one of {PV_FORMATS}, got {self.qk!r}, {self.pv!r}"
            )
        check_layout(self.layout, self.qk, self.pv)
        if isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ValueError(f"num_steps must be a positive integer, got {self.num_steps!r}")
        if not isinstance(self.layers, dict):
            raise ValueError("layers maps attention module names to {rotate, steps}")
        for name, entry in self.layers.items():
            if not isinstance(entry, dict) or set(entry) != {"rotate", "steps"}:
                raise ValueError(f"layer {name!r}: an object with 'rotate' and 'steps', got {entry!r}")
            steps = entry["steps"]
            if (
                not isinstance(entry["rotate"], bool)
                or not isinstance(steps, list)
                or len(steps) != self.num_steps
            ):
                raise ValueError(f"layer {name!r}: rotate is a boolean and steps {self.num_steps} booleans")
            if not all(isinstance(s, bool) for s in steps):
                raise ValueError(f"layer {name!r}: steps are booleans")

    def quantized(self, name: str, step: int, num_steps: int) -> dict[str, Any] | None:
        """The layer's entry when it runs quantized at ``step`` of a ``num_steps``-step run, else None."""
        entry = self.layers.get(name)
        if entry is None:
            return None
        return entry if entry["steps"][step * self.num_steps // num_steps] else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "qk": self.qk,
            "pv": self.pv,
            "layout": self.layout,
            "num_steps": self.num_steps,
            "config_hash": self.config_hash,
            "layers": self.layers,
            "record": self.record,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = PLAN_FILE) -> AttentionQuantPlan:
        if not isinstance(data, dict):
            raise PackageError(f"{where}: an attention-quantization plan is a JSON object")
        if data.get("version") != 1:
            raise PackageError(f"{where}: plan version {data.get('version')!r}; this sdkiln reads version 1")
        known = {"version", "qk", "pv", "layout", "num_steps", "config_hash", "layers", "record"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PackageError(f"{where}: unknown field {unknown[0]!r}")
        missing = sorted({"qk", "pv", "num_steps", "layers"} - set(data))
        if missing:
            raise PackageError(f"{where}: missing field {missing[0]!r}")
        if not isinstance(data.get("config_hash", ""), str) or not isinstance(data.get("record", {}), dict):
            raise PackageError(f"{where}: config_hash is a string and record an object")
        try:
            return cls(
                qk=data["qk"], pv=data["pv"], num_steps=data["num_steps"], layers=data["layers"],
                config_hash=data.get("config_hash", ""), record=data.get("record", {}),
                layout=data.get("layout", "sage"),
            )  # fmt: skip
        except ValueError as exc:
            raise PackageError(f"{where}: {exc}") from None


class QuantizedAttention:
    """The plan of one transformer at run time, and what it ran (``stats``)."""

    def __init__(self, plan: AttentionQuantPlan, tracker):
        self.plan = plan
        self.tracker = tracker
        self.stats = {"quantized_calls": 0, "float_calls": 0}

    def __call__(self, call: AttentionCall) -> Tensor:
        if self.tracker.step is None:
            raise SdkilnError(
                "quantized attention follows the denoising step; run the transformer through its pipeline"
            )
        entry = self.plan.quantized(call.name, self.tracker.step, self.tracker.num_steps)
        if entry is None:
            self.stats["float_calls"] += 1
            return call.native(call.query, call.key, call.value, attn_mask=call.mask, scale=call.scale)
        self.stats["quantized_calls"] += 1
        return quantized_call(call, self.plan.qk, self.plan.pv, entry["rotate"], self.plan.layout)


def check_layout(layout: str, qk: str, pv: str) -> None:
    """ValueError unless ``layout`` is one of ``LAYOUTS`` and, for ``mindie``, the formats are FP8."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout is one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "mindie" and (qk, pv) != ("fp8", "fp8"):
        raise ValueError(f"the mindie layout is FP8 throughout (qk and pv fp8), got {qk!r}, {pv!r}")


def quantized_call(call: AttentionCall, qk: str, pv: str, rotate: bool, layout: str = "sage") -> Tensor:
    """The routed call's attention through ``sdkiln::quantized_attention`` in those formats, or for the
    ``mindie`` layout through ``sdkiln::fp8_block_attention``."""
    if layout == "mindie":
        return kernels.fp8_block_attention(call.query, call.key, call.value, call.mask, call.scale, rotate)
    out, _ = kernels.quantized_attention(
        call.query, call.key, call.value, call.mask, call.scale, qk, pv, rotate
    )
    return out


@register_backend("quantized")
def quantized_backend(call: AttentionCall) -> torch.Tensor:
    """Every routed call through the transformer's attention-quantization plan."""
    if call.parallel_config is not None or call.sequence is not None:
        raise SdkilnError(
            f"{call.name}: quantized attention runs on one device's whole sequence; this call's sequence is "
            "sharded (diffusers' enable_parallelism)"
        )
    return call.processor._sdkiln_route.quantized(call)


def attach_attention_quant(pipeline: Any, spec, plan: AttentionQuantPlan) -> QuantizedAttention:
    """Route ``pipeline``'s transformer (family ``spec``) through ``plan``; a transformer routed for
    block-sparse attention keeps its route and hands its dense calls to the plan.
    ValueError when the plan names a layer that is not one of the family's attention modules."""
    transformer = getattr(pipeline, spec.transformer_attr)
    transformer = getattr(transformer, "_orig_mod", transformer)
    tracker = attach_step_tracker(pipeline, spec.transformer_attr)  # before routing: a failure routes nothing
    route = attention_route(transformer)
    joined = route is not None
    if joined and route.sparse is None:
        raise SdkilnError(
            f"this transformer's attention is routed to {route.backend_name!r}; quantized attention joins only a sparse route"
        )
    route = route if joined else route_attention(transformer, spec, "quantized")
    unknown = sorted(set(plan.layers) - set(route.routed))
    rotated = [n for n, e in plan.layers.items() if e["rotate"] and n in route.routed]
    odd = [n for n in rotated if not _power_of_two_heads(route.routed[n][0])]
    if unknown or odd:
        if not joined:
            unroute_attention(transformer)
        if unknown:
            raise ValueError(
                f"the plan names {unknown[0]!r}, which is not a routed attention module of {spec.name}"
            )
        raise ValueError(f"{odd[0]}: the plan rotates it, and its head dim is no power of two")
    route.quantized = QuantizedAttention(plan, tracker)
    return route.quantized


def _power_of_two_heads(module) -> bool:
    """Whether the attention module's head dim (its query projection's width over its heads) is a power
    of two; True where the module does not say (the op then refuses at the call)."""
    heads, to_q = getattr(module, "heads", None), getattr(module, "to_q", None)
    if not isinstance(heads, int) or heads < 1 or not hasattr(to_q, "out_features"):
        return True
    d = to_q.out_features // heads
    return d > 0 and not d & (d - 1)


def attention_quant_of(transformer) -> QuantizedAttention | None:
    route = attention_route(transformer)
    return None if route is None else route.quantized


def detach_attention_quant(transformer) -> None:
    """Remove the plan (and the route, unless a sparse plan or the parallel runtime still uses it)."""
    route = attention_route(transformer)
    if route is None or route.quantized is None:
        return
    route.quantized = None
    if route.sparse is None and route.backend_name != "parallel":  # the parallel runtime keeps its route
        unroute_attention(transformer)


def _attach(ctx: RestoreContext) -> None:
    from sdkiln.model_zoo.fingerprint import config_hash

    where = section_file(ctx.manifest, NAME)
    plan = AttentionQuantPlan.from_dict(ctx.package.read_json(where), where)
    if plan.config_hash != config_hash(ctx.transformer.config):
        raise PackageError(f"{where}: the plan was calibrated for another transformer config")
    try:
        ctx.notes[NAME] = attach_attention_quant(ctx.pipeline, transformer_spec(ctx), plan)
    except ValueError as exc:
        raise PackageError(f"{where}: {exc}") from None


SECTION = Section(
    name=NAME, present=lambda manifest: section_file(manifest, NAME) is not None, attach=_attach
)
