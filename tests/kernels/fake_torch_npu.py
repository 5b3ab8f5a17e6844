"""A fake ``torch_npu``: each op the Ascend paths use, computed in plain torch from its API
reference (hiascend.com, torch_npu 6.0/7.0; CANN's aclnn pages for what they add), with the shapes
and dtypes the reference allows checked. It records every call as (op, args, kwargs).

``tests/kernels/test_npu_mapping.py`` puts it in ``sys.modules`` to check sdkiln's NPU kernels;
``tests/export/mindie_emulation.py`` calls it to compute what MindIE SD's layers compute. It cannot
show that the real kernels behave as documented: that needs an Ascend machine (``docs/ascend.md``).
The math is exact (float64 for products and sums, then one rounding to the output dtype), where the
hardware's internal order and precision are not documented.
"""

import importlib.machinery
import types

import torch

HALF = [torch.float16, torch.bfloat16]
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
