"""The embedded model's denoiser: a small diffusers ``FluxTransformer2DModel`` in pixel space.

There is no VAE. A 32x32 grayscale canvas in [-1, 1] is packed 2x2 exactly like FLUX packs its
latents, giving 256 tokens of 4 channels; ``img_ids`` carry row and column in rope axes 1 and 2
and ``txt_ids`` are zeros, as in FLUX. The shipped weights live in ``weights/transformer/``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import FluxTransformer2DModel

from sdkiln.model_zoo.fmnist.data import CANVAS_SIZE

TRANSFORMER_DIR = Path(__file__).parent / "weights" / "transformer"
PACKED_SIDE = CANVAS_SIZE // 2
NUM_TOKENS = PACKED_SIDE * PACKED_SIDE
PACKED_CHANNELS = 4

TRANSFORMER_CONFIG = dict(
    patch_size=1,
    in_channels=PACKED_CHANNELS,
    out_channels=None,
    num_layers=2,
    num_single_layers=4,
    attention_head_dim=32,
    num_attention_heads=4,
    joint_attention_dim=384,
    pooled_projection_dim=384,
    guidance_embeds=False,
    axes_dims_rope=(8, 12, 12),
)


def new_transformer() -> FluxTransformer2DModel:
    """A randomly initialised transformer of the embedded model's shape (float32)."""
    return FluxTransformer2DModel(**TRANSFORMER_CONFIG)


def load_transformer(
    path: Path = TRANSFORMER_DIR, dtype: torch.dtype = torch.float32
) -> FluxTransformer2DModel:
    """The shipped (bf16 on disk) weights, cast to ``dtype``."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"embedded transformer weights missing under {path}; "
            "train them with `python tools/fmnist/train_transformer.py --steps N` (in the source tree)"
        )
    return FluxTransformer2DModel.from_pretrained(path, torch_dtype=dtype, local_files_only=True).eval()


def pack(images: torch.Tensor) -> torch.Tensor:
    """``[B,1,32,32]`` -> ``[B,256,4]`` (FluxPipeline._pack_latents)."""
    b, c, h, w = images.shape
    x = images.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(latents: torch.Tensor) -> torch.Tensor:
    """``[B,256,4]`` -> ``[B,1,32,32]`` (FluxPipeline._unpack_latents)."""
    b, _, ch = latents.shape
    x = latents.view(b, PACKED_SIDE, PACKED_SIDE, ch // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, ch // 4, CANVAS_SIZE, CANVAS_SIZE)


def image_ids(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[256, 3]`` position ids: 0, row, column (FluxPipeline._prepare_latent_image_ids)."""
    ids = torch.zeros(PACKED_SIDE, PACKED_SIDE, 3)
    ids[..., 1] = torch.arange(PACKED_SIDE)[:, None]
    ids[..., 2] = torch.arange(PACKED_SIDE)[None, :]
    return ids.reshape(NUM_TOKENS, 3).to(device=device, dtype=dtype)


def text_ids(
    num_tokens: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return torch.zeros(num_tokens, 3, device=device, dtype=dtype)
