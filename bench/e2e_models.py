"""The two transformers bench/e2e.py runs, FLUX.1-dev and Wan2.1-T2V-14B (or a small config of the
same class on CPU): their configs, the inputs of one forward, and the seeded build on the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SEED = 0

FLUX_DEV = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}
FLUX_SMALL = FLUX_DEV | {
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 32,
    "num_attention_heads": 4,
    "joint_attention_dim": 64,
    "pooled_projection_dim": 32,
    "axes_dims_rope": [8, 12, 12],
}
WAN_14B = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}
WAN_SMALL = WAN_14B | {
    "num_attention_heads": 2,
    "attention_head_dim": 32,
    "text_dim": 32,
    "freq_dim": 64,
    "ffn_dim": 128,
    "num_layers": 2,
    "rope_max_seq_len": 32,
}


@dataclass(frozen=True)
class Model:
    """A transformer class at one config and the inputs of one forward."""

    name: str
    diffusers_class: str
    spec: str
    """the model-zoo spec whose block lists and float layers apply (the tiny spec of the same class)"""
    config: dict[str, Any]
    inputs: dict[str, Any]
    """what ``make_inputs`` builds: latent grid, text tokens, timestep"""


def flux(small: bool) -> Model:
    config = FLUX_SMALL if small else FLUX_DEV
    size = 256 if small else 1024  # pixels; 16 pixels a token after the VAE and the 2x2 packing
    inputs = {
        "height": size,
        "width": size,
        "text_tokens": 32 if small else 512,
        "timestep": 0.5,
        "guidance": 3.5,
    }
    return Model("flux", "FluxTransformer2DModel", "flux-tiny", config, inputs)


def wan(small: bool) -> Model:
    config = WAN_SMALL if small else WAN_14B
    frames, height, width = (9, 128, 128) if small else (81, 480, 832)
    inputs = {
        "frames": frames,
        "height": height,
        "width": width,
        "latent": [16, (frames - 1) // 4 + 1, height // 8, width // 8],
        "text_tokens": 16 if small else 512,
        "timestep": 500.0,
    }
    return Model("wan", "WanTransformer3DModel", "wan-tiny", config, inputs)


MODELS: dict[str, Callable[[bool], Model]] = {"flux": flux, "wan": wan}


def make_inputs(model: Model, device, dtype) -> dict[str, Any]:
    """The forward's keyword arguments, drawn on CPU from ``SEED`` and moved to the device."""
    gen = torch.Generator().manual_seed(SEED)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    c, i = model.config, model.inputs
    if model.name == "flux":
        h, w = i["height"] // 16, i["width"] // 16
        ids = torch.zeros(h, w, 3)
        ids[..., 1] += torch.arange(h)[:, None]
        ids[..., 2] += torch.arange(w)[None, :]
        return {
            "hidden_states": rand(1, h * w, c["in_channels"]),
            "encoder_hidden_states": rand(1, i["text_tokens"], c["joint_attention_dim"]),
            "pooled_projections": rand(1, c["pooled_projection_dim"]),
            "timestep": torch.full((1,), i["timestep"], device=device, dtype=dtype),
            "img_ids": ids.reshape(h * w, 3).to(device, dtype),
            "txt_ids": torch.zeros(i["text_tokens"], 3, device=device, dtype=dtype),
            "guidance": torch.full((1,), i["guidance"], device=device, dtype=dtype),
            "return_dict": False,
        }
    return {
        "hidden_states": rand(1, *i["latent"]),
        "encoder_hidden_states": rand(1, i["text_tokens"], c["text_dim"]),
        "timestep": torch.full((1,), i["timestep"], device=device, dtype=dtype),
        "return_dict": False,
    }


def tokens(model: Model) -> int:
    i = model.inputs
    if model.name == "flux":
        return (i["height"] // 16) * (i["width"] // 16)
    _, f, h, w = i["latent"]
    pt, ph, pw = model.config["patch_size"]
    return (f // pt) * (h // ph) * (w // pw)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build(model: Model, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The transformer with seed-``SEED`` random weights, built on ``device`` in ``dtype``; the
    parameters of the class's ``_keep_in_fp32_modules`` (Wan's norms, time embedder, modulation
    table) in float32, as diffusers' ``from_pretrained(torch_dtype=...)`` keeps them."""
    import diffusers

    torch.manual_seed(SEED)
    with torch.device(device), _default_dtype(dtype):
        transformer = getattr(diffusers, model.diffusers_class)(**model.config)
    keep = getattr(transformer, "_keep_in_fp32_modules", None) or []
    for name, param in transformer.named_parameters():
        if any(k in name.split(".") for k in keep):
            param.data = param.data.float()
    return transformer.eval().requires_grad_(False)


def weights_checksum(transformer: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in transformer.parameters()))
