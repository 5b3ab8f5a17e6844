"""What MindIE SD 3.1.0 computes from an Ascend export: a test-only emulation in plain torch.

Written from MindIE SD's documented loading behaviour (the buffers its quantized layer classes
hold, as ``docs/ascend.md`` describes them with its sources) and the torch_npu op contracts as
``tests/kernels/fake_torch_npu.py`` implements them, not from MindIE SD's code. ``quantize`` swaps
every Linear the description types for the layer MindIE SD builds, in the dtype it runs in (``dt``,
bfloat16 or float16), from the tensors of the weights file (N outputs, K inputs):

* every layer casts its input to ``dt``; a layer with ``<L>.div.mul_scale`` reads its tensors under
  ``<L>.linear.`` and multiplies the input by the multiplier cast to ``dt``, in ``dt``;
* W8A16 (``npu_weight_quant_batchmatmul``): weight [K, N] (the file's, transposed), weight_scale
  [1, N] cast to ``dt``; the bias cast to float32 for bfloat16 and passed as stored for float16;
  no ``antiquant_group_size``;
* W8A8_DYNAMIC (``npu_dynamic_quant`` then ``npu_quant_matmul`` with ``pertoken_scale``): weight
  [K, N], weight_scale [N] cast to ``dt`` (then float32 for float16), bias cast to ``dt``;
* W8A8 (``npu_quantize`` then ``npu_quant_matmul`` with the int32 ``quant_bias``): input_scale
  repeated to [K] and cast to ``dt`` for bfloat16, float32 for float16; input_offset repeated and
  cast to bfloat16, or int8 for float16; ``deq_scale`` as stored (float32, or the int64 form);
* W8A8_TIMESTEP: both; at denoising step ``t`` (``TimestepManager``) the policy's strategy for
  ``t`` under ``target="w8a8_static_linear"`` picks the W8A8 path with row ``t`` or the dynamic one.

``TimestepPolicyConfig`` emulates MindIE SD 3.1.0's documented policy API: ``register(step_range,
strategy, target="w4a4_linear")`` checks the strategy against the target's allowed values.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from .ascend_rules import AscendLayerView, read_ascend_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from fake_torch_npu import FakeTorchNpu  # noqa: E402

STRATEGIES = {
    "w8a8_static_linear": ("dynamic", "static"),
    "w4a4_linear": ("W4A4", "W4A8"),
    "fa": ("MXFP4", "FP8", "FLOAT"),
}
DEFAULTS = {"w8a8_static_linear": "dynamic", "w4a4_linear": "W4A4", "fa": "MXFP4"}


class TimestepPolicyConfig:
    def __init__(self):
        self.strategies = {target: {} for target in STRATEGIES}

    def register(self, step_range, strategy, target="w4a4_linear"):
        if strategy not in STRATEGIES[target]:
            raise ValueError(f"invalid policy type: {strategy}, allowed {STRATEGIES[target]}")
        for step in [step_range] if isinstance(step_range, int) else step_range:
            self.strategies[target][step] = strategy

    def get_strategy(self, step, target="w4a4_linear"):
        return self.strategies[target].get(step, DEFAULTS[target])


class TimestepManager:
    idx = 0

    @classmethod
    def set_timestep_idx(cls, i: int) -> None:
        cls.idx = i


class MindieLinear(nn.Module):
    """One quantized layer as MindIE SD builds it from the files; see the module docstring."""

    def __init__(self, view: AscendLayerView, dt: torch.dtype, policy: TimestepPolicyConfig | None):
        super().__init__()
        self.npu, self.scheme, self.dt, self.policy = FakeTorchNpu(), view.scheme, dt, policy
        t = view.tensors
        self.mul_scale = None if view.mul_scale is None else view.mul_scale.to(dt)
        self.weight_kn = t["weight"].T
        self.bias = t.get("bias")
        fp16 = dt == torch.float16
        if self.scheme == "W8A16":
            self.weight_scale = t["weight_scale"].T.to(dt)
            if self.bias is not None and not fp16:
                self.bias = self.bias.float()
        if self.scheme in ("W8A8_DYNAMIC", "W8A8_TIMESTEP"):
            self.weight_scale = t["weight_scale"].squeeze().to(dt)
            self.weight_scale = self.weight_scale.float() if fp16 else self.weight_scale
            self.bias = None if self.bias is None else self.bias.to(dt)
        if self.scheme in ("W8A8", "W8A8_TIMESTEP"):
            k = t["weight"].shape[1]
            reps = (k,) if self.scheme == "W8A8" else (1, k)  # [1] -> [K]; [T, 1] -> [T, K]
            self.input_scale = t["input_scale"].repeat(*reps)
            self.input_scale = self.input_scale.float() if fp16 else self.input_scale.to(dt)
            self.input_offset = t["input_offset"].repeat(*reps).to(torch.int8 if fp16 else dt)
            self.deq_scale, self.quant_bias = t["deq_scale"], t["quant_bias"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1]).to(self.dt)
        if self.mul_scale is not None:
            x = x * self.mul_scale
        return self._matmul(x).reshape(*lead, -1)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        npu = self.npu
        if self.scheme == "W8A16":
            return npu.npu_weight_quant_batchmatmul(x, self.weight_kn, self.weight_scale, bias=self.bias)
        static = self.scheme == "W8A8"
        row = None
        if self.scheme == "W8A8_TIMESTEP":
            policy = self.policy or TimestepPolicyConfig()
            row = TimestepManager.idx
            static = policy.get_strategy(row, target="w8a8_static_linear") == "static"
        if not static:
            x_q, scale = npu.npu_dynamic_quant(x)
            return npu.npu_quant_matmul(
                x_q,
                self.weight_kn,
                self.weight_scale,
                pertoken_scale=scale,
                bias=self.bias,
                output_dtype=self.dt,
            )
        pick = (lambda v: v) if row is None else (lambda v: v[row])
        x_q = npu.npu_quantize(x, pick(self.input_scale), pick(self.input_offset), torch.qint8, axis=-1)
        return npu.npu_quant_matmul(
            x_q, self.weight_kn, pick(self.deq_scale), bias=pick(self.quant_bias), output_dtype=self.dt
        )


def quantize(model: nn.Module, export_dir, dt: torch.dtype, policy: TimestepPolicyConfig | None = None):
    """Swap ``model``'s typed Linears (by name) for ``MindieLinear`` layers; returns the layers."""
    view = read_ascend_dir(export_dir)
    layers = {}
    for name, layer_view in view.layers.items():
        if not isinstance(model.get_submodule(name), nn.Linear):
            raise AssertionError(f"{name}: MindIE SD swaps only nn.Linear layers")
        parent, _, leaf = name.rpartition(".")
        layers[name] = MindieLinear(layer_view, dt, policy)
        setattr(model.get_submodule(parent), leaf, layers[name])
    return layers


def mindie_fa(query, key, value, q_rot, k_rot, out_dtype=torch.bfloat16):
    """MindIE SD's ``FP8RotateQuantFA`` on [B, S, N, D] tensors (B = 1, as its block quantization
    squeezes the batch): Q and K times the exported rotations, to BNSD, Q per block of 128 tokens and
    K, V per 256 by ``npu_dynamic_block_quant`` to FP8, then ``npu_fused_infer_attention_score_v2``
    with the three quant modes 7 and ``softmax_scale = 1 / sqrt(D)`` (``mindiesd/quantization/layer.py``,
    ``mindiesd/layers/quant/block_quant.py``, as quoted in docs/ascend.md)."""
    import math

    npu = FakeTorchNpu()
    query, key = torch.matmul(query.float(), q_rot.float()), torch.matmul(key.float(), k_rot.float())
    q, k, v = (t.transpose(1, 2).to(out_dtype) for t in (query, key, value))  # BNSD
    (q8, qs), (k8, ks), (v8, vs) = (
        npu.npu_dynamic_block_quant(
            t.squeeze(0), dst_type=torch.float8_e4m3fn, row_block_size=rb, col_block_size=128
        )
        for t, rb in ((q, 128), (k, 256), (v, 256))
    )
    n, d = q.shape[1], q.shape[-1]
    out, _ = npu.npu_fused_infer_attention_score_v2(
        q8[None], k8[None], v8[None], input_layout="BNSD", num_query_heads=n, softmax_scale=1.0 / math.sqrt(d),
        query_quant_mode=7, key_quant_mode=7, value_quant_mode=7, dequant_scale_query=qs[None],
        dequant_scale_key=ks[None], dequant_scale_value=vs[None], out_dtype=out_dtype,
    )  # fmt: skip
    return out.transpose(1, 2)
