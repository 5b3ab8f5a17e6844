"""The cases bench/kernels.py measures: each op of ``OPS`` at a model's activation sizes, with a
maker of its inputs, our call, the torch formula it is measured against, the kernels that run it,
its rate (flops or bytes) and its peers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sdkiln import kernels
from sdkiln.kernels.ops.weight_only import dequantize_weight
from sdkiln.runtime.quant.fp8_dynamic import FP8DynamicLinear
from sdkiln.runtime.quant.w8a8_dynamic import W8A8DynamicLinear
from sdkiln.runtime.quant.weight_only import W4A16Linear, W8A16Linear

EPS = 1e-6
INT4_GROUP = 128
SPARSITIES = (0.5, 0.8, 0.9)
OPS = (
    "rms_norm",
    "layer_norm_modulate",
    "rope",
    "gelu_tanh",
    "mul_add",
    "quantize_per_token_int8",
    "fp8_quantize_per_token",
    "rms_norm_quantize",
    "layer_norm_modulate_quantize",
    "w8a8_linear",
    "fp8_linear",
    "weight_only_linear",
    "attention",
    "block_sparse_attention",
    "quantized_attention",
)
QUANTIZED_ATTENTION = (("int8", "fp8"), ("fp8", "fp8"))
"""(QKᵀ, PV) formats of the quantized attention rows (SageAttention2's and the all-FP8 one)"""
QDTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class Shape:
    """One model's activation sizes. ``tokens`` is M of the block Linears (image or video tokens),
    ``seq`` the attention sequence (FLUX attends over image + 512 text tokens)."""

    name: str
    tokens: int
    seq: int
    hidden: int
    ffn: int
    heads: int
    head_dim: int
    block: int
    """block-sparse attention's block size"""


GPU_SHAPES = (
    Shape("flux-1024px", 4096, 4608, 3072, 12288, 24, 128, 128),
    Shape("flux-2048px", 16384, 16896, 3072, 12288, 24, 128, 128),
    Shape("wan2.1-14b-480p-81f", 32760, 32760, 5120, 13824, 40, 128, 128),
)
CPU_SHAPES = (
    Shape("small", 256, 256, 256, 1024, 4, 64, 32),
    Shape("small-x4", 1024, 1024, 512, 2048, 8, 64, 64),
)


@dataclass
class Case:
    op: str
    shape: dict[str, Any]
    make: Callable[[], tuple]
    """one set of inputs, fresh tensors on the device"""
    ours: Callable
    eager: Callable
    kernels: Callable[[tuple], dict[str, str]]
    """op -> the kernel that runs it for this set"""
    flops: float = 0.0
    bound: str = "memory"
    """the rate ``fraction_of_peak`` uses: "compute" (TFLOP/s) or "memory" (GB/s)"""
    reads: Callable[[tuple], list[Tensor]] | None = None
    """the tensors ours reads (default: the whole set)"""
    peers: dict[str, Callable] = field(default_factory=dict)
    compiled_peers: tuple[str, ...] = ()
    """peers that ``torch.compile`` wraps here (others compile themselves, or not at all)"""
    compare: bool = True
    """whether outputs are compared with eager's (not when eager computes something else by design)"""
    reference_guard: dict[str, tuple[int, Callable[[tuple], str]]] = field(default_factory=dict)
    """implementation -> (bytes a reference op would allocate, what runs it): on an accelerator an
    implementation that would run a reference op whose memory does not fit is skipped"""


# ---------------------------------------------------------------------------------------------
# The torch formulas (eager and compiled baselines)


def rms_norm_formula(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


def layer_norm_modulate_formula(x, scale, shift):
    return F.layer_norm(x, (x.shape[-1],), eps=EPS) * (1 + scale[:, None]) + shift[:, None]


def rope_formula(x, cos, sin):
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    return x * cos + torch.stack([-imag, real], dim=-1).flatten(-2) * sin


def gelu_tanh_formula(x):
    return F.gelu(x, approximate="tanh")


def mul_add_formula(x, y, z):
    return x * y + z


def _per_token(x: Tensor, qmax: float) -> tuple[Tensor, Tensor]:
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / qmax
    return xf, torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_int8_formula(x):
    xf, scale = _per_token(x, 127.0)
    return torch.round(xf / scale).clamp(-127, 127).to(torch.int8), scale


def quantize_fp8_formula(x):
    xf, scale = _per_token(x, 448.0)
    return (xf / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


QUANTIZE_FORMULAS = {torch.int8: quantize_int8_formula, torch.float8_e4m3fn: quantize_fp8_formula}


def sdpa_formula(q, k, v):
    """diffusers' native attention backend: [B, S, H, D] in and out, SDPA on transposed views."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def int_mm_formula(x, w, b, wq, ws):
    """W8A8 dynamic as Inductor sees it in torchao: per-token int8, ``torch._int_mm``, rescale."""
    q, s = quantize_int8_formula(x)
    acc = torch._int_mm(q.reshape(-1, q.shape[-1]), wq.t())
    y = acc.float() * s.reshape(-1, 1) * ws.reshape(1, -1) + b.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def scaled_mm_formula(x, w, b, wq, ws):
    """FP8 row-wise: per-token float8, ``torch._scaled_mm`` with both scales and the bias."""
    q, s = quantize_fp8_formula(x)
    y = torch._scaled_mm(
        q.reshape(-1, q.shape[-1]),
        wq.t(),
        scale_a=s.reshape(-1, 1),
        scale_b=ws.reshape(1, -1),
        bias=b,
        out_dtype=x.dtype,
    )
    return y.reshape(*x.shape[:-1], -1)


# ---------------------------------------------------------------------------------------------
# Cases


def _op(name: str):
    return getattr(torch.ops.sdkiln, name).default


def _impl(op: str, device: torch.device, *args) -> str:
    return kernels.implementation(op, device.type, *args)


def quantized_like(x: Tensor, qdtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Example arguments of a quantized op that reads what a quantize op wrote from x."""
    return torch.empty_like(x, dtype=qdtype), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


def _linear(k: int, n: int, device, dtype) -> nn.Linear:
    return nn.Linear(k, n, bias=True, device=device, dtype=dtype)


def elementwise_cases(s: Shape, device, dtype) -> list[Case]:
    m, d, f = s.tokens, s.hidden, s.ffn
    rand = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
    shape = {"shape": s.name, "tokens": m, "hidden": d}
    cases = [
        Case(
            "rms_norm",
            shape | {"x": [1, m, d]},
            lambda: (rand(1, m, d), rand(d)),
            lambda x, w: _op("rms_norm")(x, w, EPS),
            rms_norm_formula,
            lambda a: {"rms_norm": _impl("rms_norm", device, *a, EPS)},
        ),
        Case(
            "layer_norm_modulate",
            shape | {"x": [1, m, d], "scale": [1, d]},
            lambda: (rand(1, m, d), rand(1, d), rand(1, d)),
            lambda x, sc, sh: _op("layer_norm_modulate")(x, sc, sh, EPS),
            layer_norm_modulate_formula,
            lambda a: {"layer_norm_modulate": _impl("layer_norm_modulate", device, *a, EPS)},
        ),
        Case(
            "rope",
            shape
            | {"x": [1, s.seq, s.heads, s.head_dim], "cos": [s.seq, 1, s.head_dim], "interleaved": True},
            lambda: (
                rand(1, s.seq, s.heads, s.head_dim),
                rand(s.seq, 1, s.head_dim),
                rand(s.seq, 1, s.head_dim),
            ),
            lambda x, c, sn: _op("rope")(x, c, sn, True),
            rope_formula,
            lambda a: {"rope": _impl("rope", device, *a, True)},
        ),
        Case(
            "gelu_tanh",
            shape | {"x": [1, m, f]},
            lambda: (rand(1, m, f),),
            lambda x: _op("gelu_tanh")(x),
            gelu_tanh_formula,
            lambda a: {"gelu_tanh": _impl("gelu_tanh", device, *a)},
        ),
        Case(
            "mul_add",
            shape | {"x": [1, m, d], "y": [1, 1, d], "z": [1, m, d]},
            lambda: (rand(1, m, d), rand(1, 1, d), rand(1, m, d)),
            lambda x, y, z: _op("mul_add")(x, y, z),
            mul_add_formula,
            lambda a: {"mul_add": _impl("mul_add", device, *a)},
        ),
        Case(
            "quantize_per_token_int8",
            shape | {"x": [1, m, d]},
            lambda: (rand(1, m, d),),
            lambda x: _op("quantize_per_token_int8")(x),
            quantize_int8_formula,
            lambda a: {"quantize_per_token_int8": _impl("quantize_per_token_int8", device, *a)},
        ),
        Case(
            "fp8_quantize_per_token",
            shape | {"x": [1, m, d]},
            lambda: (rand(1, m, d),),
            lambda x: _op("fp8_quantize_per_token")(x),
            quantize_fp8_formula,
            lambda a: {"fp8_quantize_per_token": _impl("fp8_quantize_per_token", device, *a)},
        ),
    ]
    for name, qdtype in QDTYPES.items():
        quantize = QUANTIZE_FORMULAS[qdtype]
        cases += [
            Case(
                "rms_norm_quantize",
                shape | {"x": [1, m, d], "qdtype": name},
                lambda: (rand(1, m, d), rand(d)),
                lambda x, w, q=qdtype: _op("rms_norm_quantize")(x, w, EPS, q),
                lambda x, w, quantize=quantize: quantize(rms_norm_formula(x, w)),
                lambda a, q=qdtype: {"rms_norm_quantize": _impl("rms_norm_quantize", device, *a, EPS, q)},
            ),
            Case(
                "layer_norm_modulate_quantize",
                shape | {"x": [1, m, d], "scale": [1, d], "qdtype": name},
                lambda: (rand(1, m, d), rand(1, d), rand(1, d)),
                lambda x, sc, sh, q=qdtype: _op("layer_norm_modulate_quantize")(x, sc, sh, EPS, q),
                lambda x, sc, sh, quantize=quantize: quantize(layer_norm_modulate_formula(x, sc, sh)),
                lambda a, q=qdtype: {
                    "layer_norm_modulate_quantize": _impl("layer_norm_modulate_quantize", device, *a, EPS, q)
                },
            ),
        ]
    return cases


def _gemm_sets(m: int, k: int, n: int, device, dtype, module: type) -> Callable[[], tuple]:
    """(x, float weight, bias, quantized weight, weight scale), the quantized pair from the runtime
    module a package loads (``module.from_linear``)."""

    def make():
        linear = _linear(k, n, device, dtype)
        quantized = module.from_linear(linear)
        x = torch.randn(1, m, k, device=device, dtype=dtype)
        return x, linear.weight.detach(), linear.bias.detach(), quantized.weight, quantized.weight_scale

    return make


def w8a8(x, w, b, wq, ws):
    q, s = _op("quantize_per_token_int8")(x)
    return _op("w8a8_linear")(q, s, wq, ws, b, x.dtype)


def fp8(x, w, b, wq, ws):
    q, s = _op("fp8_quantize_per_token")(x)
    return _op("fp8_linear")(q, s, wq, ws, b, x.dtype)


def gemm_shapes(s: Shape, quick: bool) -> list[tuple[int, int]]:
    """(K, N) of the block Linears: attention projection, MLP up, MLP down."""
    shapes = [(s.hidden, s.hidden), (s.hidden, s.ffn), (s.ffn, s.hidden)]
    return shapes[:2] if quick else shapes


def linear_cases(s: Shape, device, dtype, quick: bool) -> list[Case]:
    m = s.tokens
    cases = []
    for k, n in gemm_shapes(s, quick):
        shape = {"shape": s.name, "M": m, "K": k, "N": n, "bias": True}
        flops = 2.0 * m * k * n
        cases.append(
            Case(
                "w8a8_linear",
                shape | {"includes": "quantize_per_token_int8 + w8a8_linear"},
                _gemm_sets(m, k, n, device, dtype, W8A8DynamicLinear),
                w8a8,
                lambda x, w, b, wq, ws: F.linear(x, w, b),
                lambda a: {
                    "quantize_per_token_int8": _impl("quantize_per_token_int8", device, a[0]),
                    "w8a8_linear": _impl(
                        "w8a8_linear", device, *quantized_like(a[0], torch.int8), a[3], a[4], a[2], dtype
                    ),
                },
                flops=flops,
                bound="compute",
                reads=lambda a: [a[0], a[2], a[3], a[4]],
                peers={"int8 formula (_int_mm), compiled": int_mm_formula},
                compiled_peers=("int8 formula (_int_mm), compiled",),
            )
        )
        cases.append(
            Case(
                "fp8_linear",
                shape | {"includes": "fp8_quantize_per_token + fp8_linear"},
                _gemm_sets(m, k, n, device, dtype, FP8DynamicLinear),
                fp8,
                lambda x, w, b, wq, ws: F.linear(x, w, b),
                lambda a: {
                    "fp8_quantize_per_token": _impl("fp8_quantize_per_token", device, a[0]),
                    "fp8_linear": _impl(
                        "fp8_linear",
                        device,
                        *quantized_like(a[0], torch.float8_e4m3fn),
                        a[3],
                        a[4],
                        a[2],
                        dtype,
                    ),
                },
                flops=flops,
                bound="compute",
                reads=lambda a: [a[0], a[2], a[3], a[4]],
                peers={"fp8 formula (_scaled_mm), compiled": scaled_mm_formula},
                compiled_peers=("fp8 formula (_scaled_mm), compiled",),
            )
        )
    return cases


def weight_only_cases(s: Shape, device, dtype, quick: bool) -> list[Case]:
    k, n = s.hidden, s.ffn
    rows = (1, 16, s.tokens) if quick else (1, 4, 16, s.tokens)
    schemes = {
        "int8": (lambda lin: W8A16Linear.from_linear(lin), 0),
        "int4": (lambda lin: W4A16Linear.from_linear(lin, group_size=INT4_GROUP), INT4_GROUP),
    }
    cases = []
    for bits, (quantize, group) in schemes.items():
        for m in rows:

            def make(m=m, quantize=quantize):
                linear = _linear(k, n, device, dtype)
                quantized = quantize(linear)
                x = torch.randn(1, m, k, device=device, dtype=dtype)
                return (
                    x,
                    linear.weight.detach(),
                    linear.bias.detach(),
                    quantized.weight,
                    quantized.weight_scale,
                )

            cases.append(
                Case(
                    "weight_only_linear",
                    {
                        "shape": s.name,
                        "weight": bits,
                        "group_size": group,
                        "M": m,
                        "K": k,
                        "N": n,
                        "bias": True,
                    },
                    make,
                    lambda x, w, b, wq, ws, g=group: _op("weight_only_linear")(x, wq, ws, b, g),
                    lambda x, w, b, wq, ws: F.linear(x, w, b),
                    lambda a, g=group: {
                        "weight_only_linear": _impl("weight_only_linear", device, a[0], a[3], a[4], a[2], g)
                    },
                    flops=2.0 * m * k * n,
                    bound="memory" if m <= 16 else "compute",
                    reads=lambda a: [a[0], a[2], a[3], a[4]],
                    peers={
                        "dequantize + matmul, compiled": lambda x, w, b, wq, ws, g=group: F.linear(
                            x, dequantize_weight(wq, ws, g).to(x.dtype), b
                        )
                    },
                    compiled_peers=("dequantize + matmul, compiled",),
                )
            )
    return cases


def kept_blocks(b: int, h: int, nq: int, nk: int, keep: int, device) -> Tensor:
    """A random plan keeping ``keep`` distinct key blocks per query block: int32 [B, H, nq, keep]."""
    order = torch.rand(b, h, nq, nk, device=device).argsort(dim=-1)[..., :keep]
    return order.sort(dim=-1).values.to(torch.int32).contiguous()


def _flex_peer(block: int, seq: int) -> Callable:
    """FlexAttention over the block mask that ``kept`` stands for; the mask is built once per set."""
    compiled, masks = [], {}

    def run(q, k, v, kept):
        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        if not compiled:
            compiled.append(torch.compile(flex_attention, dynamic=False))
        key = kept.data_ptr()
        if key not in masks:
            nk = math.ceil(seq / block)
            indices = F.pad(kept, (0, nk - kept.shape[-1]))
            masks[key] = BlockMask.from_kv_blocks(
                (kept >= 0).sum(-1, dtype=torch.int32), indices, BLOCK_SIZE=block, seq_lengths=(seq, seq)
            )
        out = compiled[0](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=masks[key])
        return out.transpose(1, 2)

    return run


def attention_cases(s: Shape, device, dtype, quick: bool) -> list[Case]:
    b, h, sq, d = 1, s.heads, s.seq, s.head_dim
    qkv = lambda: tuple(torch.randn(b, sq, h, d, device=device, dtype=dtype) for _ in range(3))  # noqa: E731
    dense_flops = 4.0 * b * h * sq * sq * d
    dense_reference = 3 * 4 * b * h * sq * sq  # fp32 logits, their exponentials, the probabilities
    dense_kernel = lambda a: _impl("attention", device, a[0], a[1], a[2], None, None)  # noqa: E731
    cases = [
        Case(
            "attention",
            {"shape": s.name, "B": b, "S": sq, "H": h, "D": d, "layout": "BSHD"},
            qkv,
            lambda q, k, v: _op("attention")(q, k, v, None, None),
            sdpa_formula,
            lambda a: {"attention": _impl("attention", device, *a, None, None)},
            flops=dense_flops,
            bound="compute",
            reference_guard={"ours": (dense_reference, dense_kernel)},
        )
    ]
    for qk, pv in QUANTIZED_ATTENTION[:1] if quick else QUANTIZED_ATTENTION:
        quantized = lambda a, qk=qk, pv=pv: _impl("quantized_attention", device, *a, None, None, qk, pv, True)  # noqa: E731
        cases.append(
            Case(
                "quantized_attention",
                {"shape": s.name, "B": b, "S": sq, "H": h, "D": d, "layout": "BSHD", "qk": qk, "pv": pv},
                qkv,
                lambda q, k, v, qk=qk, pv=pv: _op("quantized_attention")(q, k, v, None, None, qk, pv, True),
                sdpa_formula,
                lambda a, quantized=quantized: {"quantized_attention": quantized(a)},
                flops=dense_flops,
                bound="compute",
                peers={"ours dense attention": lambda q, k, v: _op("attention")(q, k, v, None, None)},
                # the reference's float64 logits, probabilities and blocks of P
                reference_guard={"ours": (4 * 8 * b * h * sq * sq, quantized)},
            )
        )
    nq = math.ceil(sq / s.block)
    for sparsity in SPARSITIES[::2] if quick else SPARSITIES:
        keep = max(1, round(nq * (1 - sparsity)))

        def make(keep=keep):
            return (*qkv(), kept_blocks(b, h, nq, nq, keep, device))

        peers = {"ours dense attention": lambda q, k, v, kept: _op("attention")(q, k, v, None, None)}
        if device.type == "cuda":
            peers["flex_attention with this block mask, compiled"] = _flex_peer(s.block, sq)
        gathered = b * h * nq * keep * s.block  # key (and value) rows each query block reads
        sparse_reference = 4 * gathered * (2 * d + 3 * s.block) + 12 * b * h * nq * s.block * d
        cases.append(
            Case(
                "block_sparse_attention",
                {
                    "shape": s.name,
                    "B": b,
                    "S": sq,
                    "H": h,
                    "D": d,
                    "block_size": s.block,
                    "sparsity": sparsity,
                    "kept_blocks_per_query_block": keep,
                    "kept_fraction": keep / nq,
                    "baseline": "dense SDPA (outputs differ by design: no SQNR)",
                },
                make,
                lambda q, k, v, kept, bs=s.block: _op("block_sparse_attention")(q, k, v, kept, bs, None),
                lambda q, k, v, kept: sdpa_formula(q, k, v),
                lambda a, bs=s.block: {
                    "block_sparse_attention": _impl("block_sparse_attention", device, *a, bs, None)
                },
                flops=4.0 * gathered * s.block * d,
                bound="compute",
                peers=peers,
                compare=False,
                reference_guard={
                    "ours": (
                        sparse_reference,
                        lambda a, bs=s.block: _impl("block_sparse_attention", device, *a, bs, None),
                    ),
                    "ours dense attention": (dense_reference, dense_kernel),
                },
            )
        )
    return cases


def build_cases(shapes: tuple[Shape, ...], device, dtype, quick: bool, ops: tuple[str, ...]) -> list[Case]:
    cases = []
    for s in shapes:
        cases += elementwise_cases(s, device, dtype)
        cases += linear_cases(s, device, dtype, quick)
        cases += weight_only_cases(s, device, dtype, quick)
        cases += attention_cases(s, device, dtype, quick)
    return [c for c in cases if c.op in ops]
