"""Fusion patterns: subgraphs of diffusers' transformer blocks replaced by ``sdkiln`` ops.

Each pattern is written as the torch calls the diffusers code makes (``nn.RMSNorm``'s
``F.rms_norm``, diffusers' own ``RMSNorm`` arithmetic, ``AdaLayerNormZero``'s
``norm(x) * (1 + scale[:, None]) + shift[:, None]``, Wan's fp32 ``FP32LayerNorm`` modulation,
``apply_rotary_emb``'s interleaved rotation, FeedForward's tanh GELU, the gated residuals) and
traced by Inductor's pattern matcher (``register_replacement`` with ``fwd_only``) with the
decompositions Inductor itself applies, once per activation dtype: the traced op sequence, not the
formula, is what has to match (an RMSNorm written from its formula matched none of FLUX's norms,
the traced one all of them). The patterns run on the post-grad graph (Inductor's
``post_grad_custom_pre_pass``), where the quantized linears already appear as ``sdkiln`` ops, so
``norm_quantize`` can fuse an adaLN or RMSNorm with the per-token quantization of the linears that
read it (after ``dedupe_quantize`` merged identical quantizations of one tensor: Q, K and V
projections read the same normalized activation).

``PATTERNS`` names the switches (``CompileConfig.fusions``). Every match is recorded with where it
happened (the module path Dynamo kept in the node's ``nn_module_stack``) and logged on the
``sdkiln.compile`` logger at DEBUG.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, fwd_only, register_replacement

log = logging.getLogger("sdkiln.compile")
ops = torch.ops.sdkiln
EPS = float(torch.tensor(1e-6, dtype=torch.float32))
"""The eps patterns are traced with: an fp32 value, as the norms' decompositions cast it, so the
tracer finds it and the matched graph's own eps becomes an argument (``scalar_workaround``)."""
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MatchRecord:
    pattern: str
    where: str


_recorder: list[MatchRecord] | None = None


@contextlib.contextmanager
def recording(into: list[MatchRecord]) -> Iterator[None]:
    global _recorder
    previous, _recorder = _recorder, into
    try:
        yield
    finally:
        _recorder = previous


def _where(match: Match) -> str:
    """The deepest module path Dynamo recorded for the match's nodes, as ``transformer_blocks.0.norm1``."""
    paths = []
    for node in match.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            path = list(stack.values())[-1][0]
            path = re.sub(r"__dict__\['_modules'\]\['([^']*)'\]", r"\1", path)
            path = re.sub(r"\['([^']*)'\]|\[(\d+)\]", lambda m: "." + (m.group(1) or m.group(2)), path)
            # diffusers' HookRegistry wraps forward: Dynamo reaches a hooked module through the wrapper
            path = re.sub(
                r"\.forward\.func\.__closure__\.\d+\.cell_contents\.original_forward\.__self__", "", path
            )
            paths.append(re.sub(r"^L\.(self|function_reference\.forward\.__self__)\.?", "", path))
    return max(paths, key=lambda p: p.count("."), default="") or "<root>"


def trace_post_grad_form(fn: Callable, args: list, **kwargs) -> torch.fx.GraphModule:
    """``fwd_only`` of the functionalized ``fn``, views then written as ``reshape``: the form
    Inductor's post-grad graph has when the custom pass sees it (in-place writes such as Wan's
    ``out[..., 0::2] = ...`` are ``slice_scatter``s there, a decomposition's ``add_`` an ``add``)."""
    from torch._inductor.fx_passes.post_grad import view_to_reshape

    gm = fwd_only(torch.func.functionalize(fn), args, **kwargs)
    view_to_reshape(gm)
    for node in gm.graph.nodes:  # what functionalization leaves: a decomposition's own add_ on a temporary
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
            name = target.overloadpacket.__name__
            functional = getattr(torch.ops.aten, name[:-1], None) if name.endswith("_") else None
            if functional is not None and len(node.args[0].users) == 1:
                node.target = getattr(functional, target._overloadname)
    gm.recompile()
    return gm


def _dtype(node) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _recorded(name: str, keeps_dtype_of: str | None) -> Callable[[Match], bool]:
    """The match check: the replacement returns the dtype of its ``keeps_dtype_of`` input, which
    must be the matched subgraph's output dtype (bf16 x with fp32 modulation promotes to fp32 in
    eager diffusers; the fused op would not), then the match is recorded."""

    def check(match: Match) -> bool:
        if keeps_dtype_of is not None and _dtype(match.output_node()) != _dtype(
            match.kwargs.get(keeps_dtype_of)
        ):
            return False
        record = MatchRecord(name, _where(match))
        log.debug("sdkiln.compile: %s matched at %s", record.pattern, record.where)
        if _recorder is not None:
            _recorder.append(record)
        return True

    return check


# ---- search functions: what diffusers' blocks compute, call for call --------------------------


def _rms_norm_torch(x, weight, eps):  # torch.nn.RMSNorm (FLUX's and Wan's q/k norms)
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def _rms_norm_diffusers(x, weight, eps):  # diffusers.models.normalization.RMSNorm (SD3.5 q/k norms)
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(variance + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        y = y.to(weight.dtype)
    return y * weight


def _rms_norm_replacement(x, weight, eps):
    return ops.rms_norm.default(x, weight, eps)


def _adaln_dit(x, scale, shift, eps):  # AdaLayerNormZero (FLUX, SD3) and FLUX's norm2 inline
    return (
        torch.nn.functional.layer_norm(x, (x.shape[-1],), None, None, eps) * (1 + scale[:, None])
        + shift[:, None]
    )


def _adaln_dit_replacement(x, scale, shift, eps):
    return ops.layer_norm_modulate.default(x, scale, shift, eps)


def _adaln_wan(x, scale, shift, eps):  # Wan: FP32LayerNorm(x.float()) * (1 + scale) + shift, type_as(x)
    y = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), None, None, eps).to(torch.float32)
    return (y * (1 + scale) + shift).type_as(x)


def _adaln_wan_replacement(x, scale, shift, eps):
    return ops.layer_norm_modulate.default(x, scale, shift, eps).type_as(x)


def _rope_interleaved(x, cos, sin):  # diffusers' apply_rotary_emb(use_real_unbind_dim=-1), [B, S, H, D]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def _rope_interleaved_replacement(x, cos, sin):
    return ops.rope.default(x, cos[None, :, None, :], sin[None, :, None, :], True)


def _rope_wan(x, freqs_cos, freqs_sin):  # WanAttnProcessor's apply_rotary_emb, [B, S, H, D]
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def _rope_wan_replacement(x, freqs_cos, freqs_sin):
    """Wan reads cos at even and sin at odd positions for both members of a pair: the same rotation
    as ``rope`` with those tables repeated pairwise (exactly, whatever the tables hold)."""
    cos = freqs_cos[..., 0::2].repeat_interleave(2, -1)
    sin = freqs_sin[..., 1::2].repeat_interleave(2, -1)
    return ops.rope.default(x, cos, sin, True)


def _gelu_tanh(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


def _gelu_tanh_replacement(x):
    return ops.gelu_tanh.default(x)


def _gate_add_dit(residual, gate, branch):  # FLUX/SD3: residual + gate.unsqueeze(1) * branch
    return residual + gate.unsqueeze(1) * branch


def _gate_add_dit_replacement(residual, gate, branch):
    return ops.mul_add.default(gate.unsqueeze(1), branch, residual)


def _gate_add_dit_after(residual, gate, branch):  # HunyuanVideo's single block: the residual added last
    return gate.unsqueeze(1) * branch + residual


def _gate_add_wan(residual, gate, branch):  # Wan: (residual.float() + branch * gate).type_as(residual)
    return (residual.float() + branch * gate).type_as(residual)


def _gate_add_wan_replacement(residual, gate, branch):
    return ops.mul_add.default(branch, gate, residual.float()).type_as(residual)


def _norm_quantize(quantize: str, norm: str) -> tuple[Callable, Callable]:
    qdtype = torch.int8 if quantize == "quantize_per_token_int8" else torch.float8_e4m3fn
    fused = ops.rms_norm_quantize.default if norm == "rms_norm" else ops.layer_norm_modulate_quantize.default

    if norm == "rms_norm":

        def search(x, weight, eps):
            return getattr(ops, quantize).default(ops.rms_norm.default(x, weight, eps))

        def replace(x, weight, eps):
            return fused(x, weight, eps, qdtype)
    else:

        def search(x, scale, shift, eps):
            return getattr(ops, quantize).default(ops.layer_norm_modulate.default(x, scale, shift, eps))

        def replace(x, scale, shift, eps):
            return fused(x, scale, shift, eps, qdtype)

    return search, replace


def _examples(kind: str, dtype: torch.dtype) -> list[torch.Tensor]:
    b, s, h, d = 2, 8, 2, 16
    x = torch.empty(b, s, h * d, dtype=dtype)
    per_sample = torch.empty(b, h * d, dtype=dtype)
    return {
        "row": [x, torch.empty(h * d, dtype=dtype)],
        "adaln": [x, per_sample, per_sample.clone()],
        "adaln_wan": [x, torch.empty(b, 1, h * d), torch.empty(b, 1, h * d)],
        "rope": [torch.empty(b, s, h, d, dtype=dtype), torch.empty(s, d), torch.empty(s, d)],
        "rope_wan": [torch.empty(b, s, h, d, dtype=dtype), torch.empty(1, s, 1, d), torch.empty(1, s, 1, d)],
        "one": [x],
        "gate": [x, per_sample, x.clone()],
        "gate_wan": [x, torch.empty(b, 1, h * d), x.clone().float()],
    }[kind]


# name -> [(search, replacement, example kind, scalar arguments, input whose dtype the replacement
# returns (None: the replacement computes the same dtype as the search by construction))]
PATTERNS: dict[str, list[tuple[Callable, Callable, str, dict, str | None]]] = {
    "rms_norm": [
        (_rms_norm_torch, _rms_norm_replacement, "row", {"eps": EPS}, "x"),
        (_rms_norm_diffusers, _rms_norm_replacement, "row", {"eps": EPS}, "x"),
    ],
    "adaln": [
        (_adaln_dit, _adaln_dit_replacement, "adaln", {"eps": EPS}, "x"),
        (_adaln_wan, _adaln_wan_replacement, "adaln_wan", {"eps": EPS}, None),
    ],
    "rope": [
        (_rope_interleaved, _rope_interleaved_replacement, "rope", {}, None),
        (_rope_wan, _rope_wan_replacement, "rope_wan", {}, "x"),
    ],
    "gelu_tanh": [(_gelu_tanh, _gelu_tanh_replacement, "one", {}, None)],
    "gate_add": [
        (_gate_add_dit, _gate_add_dit_replacement, "gate", {}, None),
        (_gate_add_dit_after, _gate_add_dit_replacement, "gate", {}, None),
        (_gate_add_wan, _gate_add_wan_replacement, "gate_wan", {}, None),
    ],
    "norm_quantize": [
        (*_norm_quantize(q, n), "row" if n == "rms_norm" else "adaln", {"eps": EPS}, None)
        for q in ("quantize_per_token_int8", "fp8_quantize_per_token")
        for n in ("rms_norm", "layer_norm_modulate")
    ],
}
"""Applied in this order: the float patterns first, so ``norm_quantize`` sees their sdkiln ops."""


@functools.cache
def matcher_passes(enabled: tuple[str, ...]) -> tuple[PatternMatcherPass, ...]:
    """The enabled patterns, traced once per process and set of switches: one pass for the float
    patterns and one for ``norm_quantize`` (which matches what the first pass wrote)."""
    first = PatternMatcherPass(pass_name="sdkiln_fusion")
    second = PatternMatcherPass(pass_name="sdkiln_norm_quantize")
    for name in enabled:
        target = second if name == "norm_quantize" else first
        for search, replace, kind, scalars, keeps_dtype_of in PATTERNS[name]:
            for dtype in DTYPES:
                register_replacement(
                    search, replace, _examples(kind, dtype), trace_post_grad_form, target,
                    extra_check=_recorded(name, keeps_dtype_of), scalar_workaround=scalars or None,
                    skip_duplicates=True,
                )  # fmt: skip
    return first, second


QUANTIZE_OPS = ("quantize_per_token_int8", "fp8_quantize_per_token")


def dedupe_quantize(graph: torch.fx.Graph) -> int:
    """Merge per-token quantizations of one tensor into one, and their duplicate ``getitem``s (the
    sdkiln ops are pure): the Q, K, V (and MLP) projections of a block quantize the same normalized
    activation. Returns how many nodes were removed."""
    targets = {getattr(ops, name).default for name in QUANTIZE_OPS}
    seen: dict[tuple, torch.fx.Node] = {}
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in targets or (node.target is operator.getitem and node.args[0].target in targets):
            key = (node.target, node.args, tuple(sorted(node.kwargs.items())))
            if key in seen:
                node.replace_all_uses_with(seen[key])
                graph.erase_node(node)
                removed += 1
            else:
                seen[key] = node
    return removed
