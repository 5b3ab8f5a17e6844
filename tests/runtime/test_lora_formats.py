"""A FLUX LoRA in the diffusers/peft format and in kohya's (sd-scripts') format, made here at flux-tiny's
size with those formats' real key names, loads onto a flux-tiny package and gives what diffusers' own
loading (peft) gives on the float pipeline.

Comparisons (STYLE habit 12): a package without a recipe step holds the float weights, so our branch
and peft's compute the same sums in fp32 in another order: ``FP32_TOL`` on the images. The W8A8 package
differs from the float pipeline by its quantization; what the LoRA changes in its image must be what
it changes in the float pipeline's, within ``EFFECT_TOL`` (relative L2)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import sdkiln
from sdkiln.model_zoo import get_spec

sys.path.insert(0, str(Path(__file__).parent))
from lora_helpers import tiny_images  # noqa: E402  (tests/runtime/lora_helpers.py)

pytest.importorskip("peft")  # the test extra installs it: diffusers' own LoRA loading is the oracle

FP32_TOL = 1e-5
EFFECT_TOL = 0.1
RANK, ALPHA = 4, 2.0


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-formats")
    return {
        recipe: sdkiln.optimize("flux-tiny", recipe, root / recipe, eval_samples=0, progress=False).package
        for recipe in ("none", "w8a8-dynamic")
    }


def _float_pipe():
    pipe = get_spec("flux-tiny").build()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pair(g, down: tuple[int, int], up: int) -> tuple[torch.Tensor, torch.Tensor]:
    """lora_down [r, K], lora_up [N, r]: large enough to change the image visibly."""
    return torch.randn(RANK, down[1], generator=g) / down[1] ** 0.5, torch.randn(up, RANK, generator=g)


def diffusers_lora(transformer) -> dict[str, torch.Tensor]:
    """peft's keys as diffusers saves them (``transformer.<module>.lora_A.weight``), with alphas."""
    g = torch.Generator().manual_seed(1)
    state = {}
    for name, module in transformer.named_modules():
        if name.endswith(
            ("attn.to_q", "attn.to_v", "attn.add_k_proj", "ff.net.2", "proj_mlp", "norm1.linear")
        ):
            a, b = _pair(g, (RANK, module.in_features), module.out_features)
            state |= {f"transformer.{name}.lora_A.weight": a, f"transformer.{name}.lora_B.weight": b}
    return state


def kohya_lora(transformer) -> dict[str, torch.Tensor]:
    """sd-scripts' FLUX keys (``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight``, ``.alpha``):
    the fused qkv that diffusers' converter splits into to_q/to_k/to_v, the MLPs, the modulations and
    the single blocks' output projection. (``single_blocks_N_linear1`` is left out: diffusers' converter
    splits it at FLUX.1's own widths.)"""
    g = torch.Generator().manual_seed(2)
    d = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    mlp = transformer.transformer_blocks[0].ff.net[0].proj.out_features
    single_in = transformer.single_transformer_blocks[0].proj_out.in_features
    shapes = {}
    for i in range(len(transformer.transformer_blocks)):
        for stream in ("img", "txt"):
            shapes[f"double_blocks_{i}_{stream}_attn_qkv"] = (d, 3 * d)
            shapes[f"double_blocks_{i}_{stream}_attn_proj"] = (d, d)
            shapes[f"double_blocks_{i}_{stream}_mlp_0"] = (d, mlp)
            shapes[f"double_blocks_{i}_{stream}_mlp_2"] = (mlp, d)
            shapes[f"double_blocks_{i}_{stream}_mod_lin"] = (d, 6 * d)
    for i in range(len(transformer.single_transformer_blocks)):
        shapes[f"single_blocks_{i}_linear2"] = (single_in, d)
        shapes[f"single_blocks_{i}_modulation_lin"] = (d, 3 * d)
    state = {}
    for key, (k, n) in shapes.items():
        down, up = _pair(g, (RANK, k), n)
        state |= {
            f"lora_unet_{key}.lora_down.weight": down,
            f"lora_unet_{key}.lora_up.weight": up,
            f"lora_unet_{key}.alpha": torch.tensor(ALPHA),
        }
    return state


@pytest.mark.parametrize("fmt", ["diffusers", "kohya"])
def test_a_lora_file_matches_diffusers_own_loading(packages, fmt, tmp_path):
    from safetensors.torch import save_file

    reference = _float_pipe()
    make = diffusers_lora if fmt == "diffusers" else kohya_lora
    state = make(reference.transformer)
    if fmt == "diffusers":  # a peft alpha per layer: scale alpha / r
        state |= {
            k.replace("lora_A.weight", "alpha"): torch.tensor(ALPHA) for k in list(state) if "lora_A" in k
        }
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "lora.safetensors")
    plain = tiny_images(reference)
    reference.load_lora_weights(str(tmp_path / "lora.safetensors"), adapter_name="x")
    want = tiny_images(reference)
    assert np.abs(want - plain).max() > 0.02  # the LoRA visibly changes the image

    ours = sdkiln.load(packages["none"], device="cpu")
    ours.load_lora_weights(tmp_path / "lora.safetensors", adapter_name="x")
    np.testing.assert_allclose(tiny_images(ours), want, atol=FP32_TOL, rtol=0)

    quantized = sdkiln.load(packages["w8a8-dynamic"], device="cpu")
    before = tiny_images(quantized)
    quantized.load_lora_weights(tmp_path / "lora.safetensors", adapter_name="x")
    effect, float_effect = tiny_images(quantized) - before, want - plain
    assert np.linalg.norm(effect - float_effect) < EFFECT_TOL * np.linalg.norm(float_effect)


def test_the_strength_is_diffusers_adapter_weight(packages, tmp_path):
    reference = _float_pipe()
    state = diffusers_lora(reference.transformer)
    reference.load_lora_weights(dict(state), adapter_name="x")
    reference.set_adapters("x", 0.4)
    want = tiny_images(reference)
    ours = sdkiln.load(packages["none"], device="cpu")
    ours.load_lora_weights(dict(state), adapter_name="x")
    ours.set_adapters("x", 0.4)
    np.testing.assert_allclose(tiny_images(ours), want, atol=FP32_TOL, rtol=0)
