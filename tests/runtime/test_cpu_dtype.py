"""16-bit weights computed in fp32 where the CPU has no fast 16-bit matmul (``runtime.cpu_dtype``)."""

import copy

import torch

from sdkiln.kernels import cpu_profile as cp
from sdkiln.metrics import sqnr_db
from sdkiln.runtime.cpu_dtype import unwiden, widen_slow_dtypes, widen_to_float32

WIDENED_MIN_SQNR_DB = 60.0  # against the fp32 copy; measured 81 dB; the bf16 model itself 45 dB


def _inputs(transformer, dtype):
    torch.manual_seed(0)
    cfg = transformer.config
    return dict(
        hidden_states=torch.randn(1, 16, cfg.in_channels).to(dtype),
        encoder_hidden_states=torch.randn(1, 8, cfg.joint_attention_dim).to(dtype),
        pooled_projections=torch.randn(1, cfg.pooled_projection_dim).to(dtype),
        timestep=torch.tensor([0.5]).to(dtype),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(8, 3),
        guidance=torch.tensor([3.5]).to(dtype) if cfg.guidance_embeds else None,
        return_dict=False,
    )


def test_widened_bf16_transformer_computes_as_its_fp32_copy(flux_tiny):
    """A bf16 FLUX transformer with widening hooks computes as the same weights in fp32 (bf16 ->
    fp32 is exact) up to the few values diffusers rounds to the model's dtype itself (the timestep
    embedding): far closer to it than the bf16 model, with its weights kept in bf16; it unhooks
    cleanly."""
    _, pipe = flux_tiny
    narrow = copy.deepcopy(pipe.transformer).to(torch.bfloat16)
    wide = copy.deepcopy(narrow).float()
    with torch.no_grad():
        expected = wide(
            **{k: v.float() if torch.is_tensor(v) else v for k, v in _inputs(wide, torch.bfloat16).items()}
        )[0]
        bf16_out = narrow(**_inputs(narrow, torch.bfloat16))[0].float()
        hooked = widen_to_float32(narrow)
        assert hooked > 0 and widen_to_float32(narrow) == 0
        out = narrow(**_inputs(narrow, torch.bfloat16))[0]
    assert out.dtype == torch.float32
    assert sqnr_db(expected, out) > WIDENED_MIN_SQNR_DB > sqnr_db(expected, bf16_out) + 10
    assert {p.dtype for p in narrow.parameters()} == {torch.bfloat16}
    unwiden(narrow)
    with torch.no_grad():
        assert narrow(**_inputs(narrow, torch.bfloat16))[0].dtype == torch.bfloat16


def test_widened_only_where_the_profile_says_slow(flux_tiny, monkeypatch):
    _, pipe = flux_tiny
    bf16 = type(pipe)(
        **{**pipe.components, "transformer": copy.deepcopy(pipe.transformer).to(torch.bfloat16)}
    )
    info = cp.CpuInfo("pretended", "x86_64", frozenset({"avx2", "fma"}), "AVX2")
    monkeypatch.setattr(cp, "cpu_profile", lambda: cp.CpuProfile(info, 1))
    assert widen_slow_dtypes(bf16) == {"transformer": "bfloat16"}
    unwiden(bf16.transformer)
    fast = cp.CpuInfo("pretended", "x86_64", frozenset({"avx512_bf16"}), "AVX512")
    monkeypatch.setattr(cp, "cpu_profile", lambda: cp.CpuProfile(fast, 1))
    assert widen_slow_dtypes(bf16) == {}
