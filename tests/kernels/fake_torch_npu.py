"""A fake ``torch_npu``: each op the Ascend paths use, computed in plain torch from its API
reference (hiascend.com, torch_npu 6.0/7.0; CANN's aclnn pages for what they add; the op-plugin
repository's ``docs/`` for the ops added since, up to 26.0.0), with the shapes and dtypes the
reference allows checked. It records every call as (op, args, kwargs).

``tests/kernels/test_npu_mapping.py`` puts it in ``sys.modules`` to check sdkiln's NPU kernels;
``tests/export/mindie_emulation.py`` calls it to compute what MindIE SD's layers compute. It cannot
show that the real kernels behave as documented: that needs an Ascend machine (``docs/ascend.md``).
The math is exact (float64 for products and sums, then one rounding to the output dtype), where the
hardware's internal order and precision are not documented.
"""

import importlib.machinery
import math
import types

import torch

HALF = [torch.float16, torch.bfloat16]
FLOATS = [torch.float16, torch.bfloat16, torch.float32]
# npu_rms_norm on Atlas A2/A3: the gamma dtypes each input dtype may take.
RMS_NORM_GAMMA = {
    torch.float16: (torch.float16, torch.float32),
    torch.bfloat16: (torch.bfloat16, torch.float32),
    torch.float32: (torch.float32,),
}
# npu_rotary_mul (jit_compile=False, Atlas A2/A3): the r1/r2 shapes each input layout takes, per
# rotary_mode, over the layout's letters ("1" is a broadcast axis).
ROTARY_LAYOUTS = {
    "half": {
        "BNSD": ("11SD", "B1SD", "BNSD"),
        "BSND": ("1S1D", "BS1D", "BSND"),
        "SBND": ("S11D", "SB1D", "SBND"),
    },
    "interleave": {"BNSD": ("11SD",), "BSND": ("1S1D",), "SBND": ("S11D",)},
}
FP19_KEPT = ~0x1FFF  # aclnnTransQuantParam: a float32 scale keeps its top 19 bits for the hardware


def int64_scale_as_fp32(scale: torch.Tensor) -> torch.Tensor:
    """An int64 quant-matmul scale (float16 output) as the float32 the hardware applies: the low 32
    bits are the float32's bits (msModelSlim's ``deqscale2int64``), of which the top 19 are kept."""
    return ((scale & 0xFFFFFFFF).to(torch.int64) & FP19_KEPT).to(torch.int32).view(torch.float32)


class FakeTorchNpu(types.ModuleType):
    """Records every call as (op, args, kwargs) and computes what the documentation says."""

    def __init__(self):
        super().__init__("torch_npu")
        self.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
        self.calls = []

    def _record(self, op, *args, **kwargs):
        self.calls.append((op, args, kwargs))

    def npu_dynamic_quant(self, x, *, smooth_scales=None):
        self._record("npu_dynamic_quant", x, smooth_scales=smooth_scales)
        assert x.dtype in HALF and x.dim() > 1 and smooth_scales is None
        scale = x.float().abs().amax(dim=-1) / 127  # aclnnDynamicQuant: row_max(|x|) / 127
        return torch.round(x.float() / scale.unsqueeze(-1)).to(torch.int8), scale

    def npu_quant_matmul(
        self, x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None
    ):
        self._record("npu_quant_matmul", x1, x2, scale, offset=offset, pertoken_scale=pertoken_scale, bias=bias,
                     output_dtype=output_dtype)  # fmt: skip
        m, k = x1.shape
        assert x1.dtype == x2.dtype == torch.int8 and x2.shape[0] == k and x2.dim() == 2
        n = x2.shape[1]
        assert tuple(scale.shape) in ((1,), (n,)) and output_dtype in HALF and offset is None
        # float32 scales (or bfloat16 ones for bfloat16 output); int64 (trans_quant_param) for float16
        assert scale.dtype in (torch.float32, torch.bfloat16, torch.int64)
        assert scale.dtype != torch.int64 or (output_dtype == torch.float16 and pertoken_scale is None)
        assert scale.dtype != torch.bfloat16 or output_dtype == torch.bfloat16
        assert pertoken_scale is None or (
            pertoken_scale.dtype == torch.float32 and tuple(pertoken_scale.shape) == (m,)
        )
        assert bias is None or (
            tuple(bias.shape) == (n,) and bias.dtype in (torch.int32, torch.float32, output_dtype)
        )
        acc = x1.double() @ x2.double()  # exact for int8 inputs
        if bias is not None and bias.dtype == torch.int32:
            acc = acc + bias.double()
        y = acc * (int64_scale_as_fp32(scale) if scale.dtype == torch.int64 else scale).double()
        if pertoken_scale is not None:
            y = y * pertoken_scale.double().unsqueeze(-1)
        if bias is not None and bias.dtype != torch.int32:
            y = y + bias.double()
        return y.to(output_dtype)

    def npu_quantize(self, input, scales, zero_points, dtype, axis=1, div_mode=True):
        self._record("npu_quantize", input, scales, zero_points, dtype, axis, div_mode)
        assert dtype == torch.qint8 and axis == -1 and div_mode
        assert scales.dtype in (torch.float32, torch.bfloat16) and scales.dim() == 1
        assert zero_points.dtype in (torch.int8, torch.bfloat16) and zero_points.shape == scales.shape
        assert scales.numel() in (1, input.shape[-1])
        # div_mode: round(input / scales + zero_points), saturated to int8
        q = torch.round(input.float() / scales.float() + zero_points.float())
        return q.clamp(-128, 127).to(torch.int8)

    def npu_convert_weight_to_int4pack(self, weight, inner_k_tiles=0):
        self._record("npu_convert_weight_to_int4pack", weight, inner_k_tiles=inner_k_tiles)
        assert weight.dtype == torch.int32 and weight.is_contiguous() and weight.shape[-1] % 8 == 0
        assert int(weight.min()) >= -8 and int(weight.max()) <= 7
        nib = (weight & 0xF).reshape(*weight.shape[:-1], -1, 8)
        return sum(nib[..., i] << (4 * i) for i in range(8)).to(torch.int32)  # the fake's own word layout

    @staticmethod
    def _unpack_words(packed_kn):
        """The fake's int4 words, [K/8, N] (a transposed [N, K/8]), back to values [K, N]."""
        words = packed_kn.t()
        nib = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1).flatten(-2)
        return torch.where(nib >= 8, nib - 16, nib).t()

    def npu_weight_quant_batchmatmul(self, x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                     quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0):  # fmt: skip
        self._record("npu_weight_quant_batchmatmul", x, weight, antiquant_scale, bias=bias,
                     antiquant_group_size=antiquant_group_size)  # fmt: skip
        assert x.dtype in HALF and x.dim() == 2 and antiquant_scale.dtype == x.dtype
        values = self._unpack_words(weight) if weight.dtype == torch.int32 else weight
        k, n = values.shape
        assert k == x.shape[1]
        groups = k // antiquant_group_size if antiquant_group_size else 1
        assert tuple(antiquant_scale.shape) == (groups, n)
        assert bias is None or bias.dtype == (torch.float32 if x.dtype == torch.bfloat16 else torch.float16)
        w = values.double() * antiquant_scale.double().repeat_interleave(k // groups, dim=0)
        y = x.double() @ w
        return (y if bias is None else y + bias.double()).to(x.dtype)

    def npu_rms_norm(self, input, gamma, epsilon=1e-6):
        self._record("npu_rms_norm", input, gamma, epsilon=epsilon)
        assert input.dtype in FLOATS and 2 <= input.dim() <= 8
        assert gamma.dtype in RMS_NORM_GAMMA[input.dtype]
        assert 0 < gamma.dim() < input.dim() and gamma.shape == input.shape[input.dim() - gamma.dim() :]
        axes = tuple(range(input.dim() - gamma.dim(), input.dim()))
        x = input.double()
        rstd = torch.rsqrt(x.square().mean(dim=axes, keepdim=True) + epsilon)
        # rstd: float32, the input's leading axes (those gamma does not cover)
        return (x * rstd * gamma.double()).to(input.dtype), rstd.float().reshape(input.shape[: axes[0]])

    def npu_gelu(self, input, *, approximate="none"):
        self._record("npu_gelu", input, approximate=approximate)
        assert approximate in ("none", "tanh") and input.dtype in FLOATS and input.dim() <= 8
        x = input.double()
        if approximate == "tanh":  # erf replaced by the tanh approximation (its standard constants)
            y = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
        else:
            y = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
        return y.to(input.dtype)

    def npu_rotary_mul(self, input, r1, r2, rotary_mode="half"):
        self._record("npu_rotary_mul", input, r1, r2, rotary_mode=rotary_mode)
        assert rotary_mode in ROTARY_LAYOUTS and input.dim() == 4 and r1.dim() == 4 and r1.shape == r2.shape
        # The reference lists float16/bfloat16/float32 for each; it never mixes them in an example.
        assert input.dtype in FLOATS and r1.dtype == r2.dtype == input.dtype
        d = input.shape[-1]
        assert d % 2 == 0 and d < 896
        fitting = []  # torch_npu infers the layout from the shapes: every reading that fits must be in limits
        for layout, tables in ROTARY_LAYOUTS[rotary_mode].items():
            axes = dict(zip(layout, input.shape, strict=True))
            if any(tuple(r1.shape) == tuple(1 if c == "1" else axes[c] for c in table) for table in tables):
                fitting.append(axes)
        assert fitting, f"r1 {tuple(r1.shape)} fits no documented layout of input {tuple(input.shape)}"
        for axes in fitting:
            if rotary_mode == "interleave":
                assert axes["B"] * axes["N"] < 1000
            else:
                assert axes["B"] < 1000 and axes["N"] < 1000
        x = input.double()
        if rotary_mode == "half":
            x1, x2 = torch.chunk(x, 2, dim=-1)
            rotated = torch.cat((-x2, x1), dim=-1)
        else:
            rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        return (r1.double() * x + r2.double() * rotated).to(input.dtype)

    @staticmethod
    def _masked_softmax_attention(q, k, v, masked_out, scale):
        """q [B, N, Sq, D], k/v [B, N, Sk, D] in float64, masked_out True where a logit is dropped:
        (out, row max, row sum of exp(logit - max)). A row with nothing left gives NaN, as the formula."""
        logits = (q @ k.transpose(-1, -2)) * scale
        if masked_out is not None:
            logits = logits.masked_fill(masked_out, -math.inf)
        row_max = logits.amax(dim=-1, keepdim=True)
        e = torch.exp(logits - row_max)
        row_sum = e.sum(dim=-1, keepdim=True)
        return (e / row_sum) @ v, row_max, row_sum

    def npu_fusion_attention(self, query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                             atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647,
                             next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                             actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False):  # fmt: skip
        self._record("npu_fusion_attention", query, key, value, head_num, input_layout, atten_mask=atten_mask,
                     scale=scale, keep_prob=keep_prob, sparse_mode=sparse_mode, inner_precise=inner_precise)  # fmt: skip
        assert input_layout == "BSND", "the fake implements the BSND layout only"
        assert pse is None and padding_mask is None and prefix is None and actual_seq_qlen is None
        assert keep_prob == 1.0 and sparse_mode == 0 and pre_tockens == next_tockens == 2147483647
        assert query.dtype in HALF and key.dtype == value.dtype == query.dtype
        b, sq, n, d = query.shape
        sk, nkv = key.shape[1], key.shape[2]
        assert key.dim() == value.dim() == 4 and key.shape[:3] == value.shape[:3] and key.shape[0] == b
        assert head_num == n and n % nkv == 0 and key.shape[3] == d and value.shape[3] <= d <= 768
        if atten_mask is not None:  # True (1) drops the position
            assert atten_mask.dtype in (torch.bool, torch.uint8)
            assert tuple(atten_mask.shape) in ((b, n, sq, sk), (b, 1, sq, sk), (1, 1, sq, sk), (sq, sk))
            atten_mask = atten_mask.bool()
        heads = n // nkv
        q, k, v = (t.double().transpose(1, 2) for t in (query, key, value))
        k, v = k.repeat_interleave(heads, dim=1), v.repeat_interleave(heads, dim=1)
        out, row_max, row_sum = self._masked_softmax_attention(q, k, v, atten_mask, scale)
        # softmax_max/softmax_sum: float32 [B, N, Sq, 8] (torch_npu's meta registration), each row's value
        # in all 8 (op-plugin's test_npu_flash_attention_grad.py builds them with expand(..., 8)).
        stats = [t.float().expand(b, n, sq, 8).contiguous() for t in (row_max, row_sum)]
        out = out.transpose(1, 2).to(query.dtype)
        return out, stats[0], stats[1], query.new_empty(0), 0, 0, 0

    def npu_dynamic_block_quant(
        self, x, *, dst_type=torch.float8_e4m3fn, row_block_size=1, col_block_size=128
    ):
        """[..., R, C] -> (values in ``dst_type``, float32 scales [..., ceil(R / rb), ceil(C / cb)]): one
        scale per block of ``row_block_size`` rows x ``col_block_size`` columns, absmax / 448 (e4m3),
        the values rounded to nearest. MindIE SD's FP8RotateQuantFA calls it with blocks of 128 (Q) and
        256 (K, V) tokens by 128 channels (``mindiesd/layers/quant/block_quant.py``); torch_npu's public
        page documents int8 with 1 x 128 blocks only, so this follows MindIE SD's use."""
        self._record("npu_dynamic_block_quant", x, dst_type=dst_type, row_block_size=row_block_size,
                     col_block_size=col_block_size)  # fmt: skip
        assert dst_type == torch.float8_e4m3fn, "the fake implements the float8_e4m3fn output only"
        *lead, r, c = x.shape
        rb, cb = row_block_size, col_block_size
        pad = torch.nn.functional.pad(x.float(), (0, (-c) % cb, 0, (-r) % rb))
        blocks = pad.unflatten(-1, (-1, cb)).unflatten(-3, (-1, rb))  # [..., R/rb, rb, C/cb, cb]
        scale = blocks.abs().amax(dim=(-3, -1)) / 448.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (blocks / scale[..., :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        q = q.flatten(-2).flatten(-3, -2)[..., :r, :c]
        return q, scale

    def npu_fused_infer_attention_score_v2(self, query, key, value, *, input_layout="BSH", num_query_heads=1,
                                           softmax_scale=1.0, query_quant_mode=0, key_quant_mode=0,
                                           value_quant_mode=0, dequant_scale_query=None, dequant_scale_key=None,
                                           dequant_scale_value=None, out_dtype=None, **unused):  # fmt: skip
        """Only the FP8 per-block full quantization (modes 7; CANN's aclnnFusedInferAttentionScoreV5, Ascend
        950) in BNSD: q, k, v float8_e4m3fn with float32 scales [B, N, ceil(S / 128), 1] (Q) and
        [B, N, ceil(S / 256), 1] (K, V); each value dequantized with its block's scale, then attention in
        float64. How the hardware rounds P is not documented: P stays exact here."""
        self._record("npu_fused_infer_attention_score_v2", query, key, value, input_layout=input_layout,
                     num_query_heads=num_query_heads, softmax_scale=softmax_scale, query_quant_mode=query_quant_mode,
                     key_quant_mode=key_quant_mode, value_quant_mode=value_quant_mode, out_dtype=out_dtype)  # fmt: skip
        assert not unused, f"the fake does not implement {sorted(unused)}"
        assert input_layout == "BNSD" and query_quant_mode == key_quant_mode == value_quant_mode == 7
        assert query.dtype == key.dtype == value.dtype == torch.float8_e4m3fn and out_dtype in HALF
        b, n, sq, d = query.shape
        sk = key.shape[2]
        assert num_query_heads == n and key.shape == value.shape == (b, n, sk, d) and d <= 128
        for scale, block, s in ((dequant_scale_query, 128, sq), (dequant_scale_key, 256, sk),
                                (dequant_scale_value, 256, sk)):  # fmt: skip
            assert scale.dtype == torch.float32 and tuple(scale.shape) == (b, n, math.ceil(s / block), 1)

        def dequant(t, scale, block):
            return t.double() * scale.double().repeat_interleave(block, dim=2)[:, :, : t.shape[2]]

        q, k, v = (
            dequant(query, dequant_scale_query, 128),
            dequant(key, dequant_scale_key, 256),
            dequant(value, dequant_scale_value, 256),
        )
        out, _, _ = self._masked_softmax_attention(q, k, v, None, softmax_scale)
        return out.to(out_dtype), query.new_zeros(1, dtype=torch.float32)

    def npu_block_sparse_attention(self, query, key, value, block_sparse_mask, block_shape, *,
                                   q_input_layout="TND", kv_input_layout="TND", num_key_value_heads=1,
                                   scale_value=0.0, inner_precise=1, actual_seq_lengths=None,
                                   actual_seq_lengths_kv=None, softmax_lse_flag=0):  # fmt: skip
        self._record("npu_block_sparse_attention", query, key, value, block_sparse_mask, block_shape,
                     q_input_layout=q_input_layout, kv_input_layout=kv_input_layout,
                     num_key_value_heads=num_key_value_heads, scale_value=scale_value,
                     inner_precise=inner_precise, softmax_lse_flag=softmax_lse_flag)  # fmt: skip
        assert q_input_layout == kv_input_layout == "BNSD", "the fake implements the BNSD layout only"
        assert (actual_seq_lengths is None) == (actual_seq_lengths_kv is None)
        assert query.dtype in HALF and key.dtype == value.dtype == query.dtype and key.shape == value.shape
        assert query.dtype != torch.bfloat16 or inner_precise == 0
        b, n, sq, d = query.shape
        nkv, sk = key.shape[1], key.shape[2]
        assert key.shape[0] == b and key.shape[3] == d and d in (64, 128)  # forward: headDim 64 or 128
        assert num_key_value_heads == nkv and n % nkv == 0
        bx, by = block_shape[:2]
        assert bx > 0 and by > 0 and by % 128 == 0
        assert block_sparse_mask.dtype == torch.int8
        assert tuple(block_sparse_mask.shape) == (b, n, math.ceil(sq / bx), math.ceil(sk / by))
        kept = block_sparse_mask.bool().repeat_interleave(bx, dim=2).repeat_interleave(by, dim=3)
        q, k, v = query.double(), key.double(), value.double()
        k, v = k.repeat_interleave(n // nkv, dim=1), v.repeat_interleave(n // nkv, dim=1)
        out, row_max, row_sum = self._masked_softmax_attention(q, k, v, ~kept[:, :, :sq, :sk], scale_value)
        lse = (row_max + torch.log(row_sum)).float() if softmax_lse_flag == 1 else query.new_empty(0)
        return out.to(query.dtype), lse
