"""Wan2.2-I2V-A14B: image-to-video with two experts of one width switched at a timestep boundary.

``WanImageToVideoPipeline`` holds two ``WanTransformer3DModel``s of Wan2.1-14B's width (40 heads of 128,
FFN 13824) that read 36 latent channels: ``transformer``, the high-noise expert, runs every step whose
timestep is at least ``boundary_ratio`` times the scheduler's ``num_train_timesteps`` (0.9 here), and
``transformer_2``, the low-noise expert, runs the steps below it, with guidance ``guidance_scale_2``. A
directory of this family sets both ``transformer_2`` and ``boundary_ratio`` in its model_index.json
(``layout``); a ``WanImageToVideoPipeline`` that sets neither is Wan2.1's (``wan_i2v.py``).

Unlike Wan2.1 image-to-video there is no CLIP image context: ``image_encoder`` and ``image_processor``
are null, the transformers have no ``image_dim`` and no ``added_kv_proj_dim`` (the pipeline computes
image embeddings only for a transformer with ``image_dim``), so every block's ``attn2`` is Wan's text
cross-attention, one call over the text keys (``wan.py``'s attention sites, and no 512-token cut of the
context). The picture enters only through the latents: 16 noisy channels, a 4-channel first-frame mask
and the 16 VAE latent channels of the picture followed by zeros. The pipeline still refuses to run
without its ``image``: offline calibration and evaluation give it the spec's fixed synthetic picture
(``ModelSpec.condition``), as in ``wan_i2v.py``.

Each expert is its own model (``ModelSpec.experts``), as in ``wan22_a14b.py``: every recipe step runs on
``transformer``, then on ``transformer_2``, each seeing only the steps its pipeline calls it on, and the
package holds both.

The variant's call defaults are Wan's ``wan_i2v_A14B`` config (40 steps, guidance 3.5 for both experts,
boundary 0.9; 81 frames from its shared config) at 720x1280, the size Wan's ``generate.py`` defaults to
(for image-to-video its area; the aspect follows the picture), not WanImageToVideoPipeline's 480x832.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from sdkiln.model_zoo.spec import Variant
from sdkiln.model_zoo.wan import SPEC as WAN_SPEC
from sdkiln.model_zoo.wan import tiny as wan_tiny
from sdkiln.model_zoo.wan22_a14b import SPEC as WAN22_A14B_SPEC
from sdkiln.model_zoo.wan22_a14b import TINY_BOUNDARY, second_expert
from sdkiln.model_zoo.wan_i2v import SPEC as WAN_I2V_SPEC

if TYPE_CHECKING:
    from diffusers import WanImageToVideoPipeline

_SEED = 0
_IN_CHANNELS = 36  # 16 noisy latent channels + 4 mask + 16 picture latents
_NO_IMAGE_CONTEXT = {"image_dim": None, "added_kv_proj_dim": None}


def tiny() -> WanImageToVideoPipeline:
    """A real ``WanImageToVideoPipeline`` at test size with fixed random weights (float32, eval mode).

    Wan's test build (``wan.tiny``: 2 blocks, width 64, FFN 128, text width 32, 16 text tokens, its
    VAE, tokenizer, text encoder and scheduler) with its transformer remade for 36 input channels and no
    image context, a second expert of the same size and other random weights (``wan22_a14b.second_expert``),
    no image encoder and ``boundary_ratio`` 0.75: of 8 steps, ``transformer`` runs steps 0-3 and
    ``transformer_2`` steps 4-7.
    """
    import torch
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

    base = wan_tiny()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        transformer = WanTransformer3DModel.from_config(
            {**base.transformer.config, "in_channels": _IN_CHANNELS, **_NO_IMAGE_CONTEXT}
        ).eval()
    return WanImageToVideoPipeline(
        tokenizer=base.tokenizer,
        text_encoder=base.text_encoder,
        vae=base.vae,
        scheduler=base.scheduler,
        transformer=transformer,
        transformer_2=second_expert(transformer),
        boundary_ratio=TINY_BOUNDARY,
    )


WAN22_A14B_I2V_VARIANTS = (
    Variant(
        "Wan2.2-I2V-A14B",
        "Wan-AI/Wan2.2-I2V-A14B-Diffusers, 720p (two experts of Wan2.1-14B's width reading 36 channels, "
        "no image encoder, boundary 0.9)",
        match={
            "in_channels": _IN_CHANNELS,
            "attention_head_dim": 128,
            "text_dim": 4096,
            "num_attention_heads": 40,
            "ffn_dim": 13824,
            **_NO_IMAGE_CONTEXT,
        },
        call_defaults={
            "num_inference_steps": 40,
            "guidance_scale": 3.5,
            "guidance_scale_2": 3.5,
            "height": 720,
            "width": 1280,
            "num_frames": 81,
            "max_sequence_length": 512,
            "output_type": "np",
        },
        sparse_block_size=128,
    ),
    Variant(
        "tiny",
        "the test build (tiny() above): Wan's at 36 channels, twice, boundary 0.75, 8 steps (4 per expert)",
        match={
            **next(v for v in WAN_SPEC.variants if v.name == "tiny").match,
            "in_channels": _IN_CHANNELS,
            **_NO_IMAGE_CONTEXT,
        },
        call_defaults={**WAN_SPEC.call_defaults, "num_inference_steps": 8, "guidance_scale_2": 4.0},
        sparse_block_size=16,
    ),
)

SPEC = dataclasses.replace(
    WAN_I2V_SPEC,
    name="wan2.2-a14b-i2v-tiny",
    family="wan2.2-a14b-i2v",
    description="Wan2.2-A14B image-to-video (two experts, no image encoder) at test size with random weights",
    build=tiny,
    # attn1 over the video tokens, attn2 one call over the text keys: there are no added image keys
    attention=WAN_SPEC.attention,
    variants=WAN22_A14B_I2V_VARIANTS,
    unsupported_layout={},
    experts=("transformer_2",),
    layout=("transformer_2", "boundary_ratio"),
    # one transformer on the device mesh and in the Ascend and ONNX exports, as for text-to-video
    refusals=dict(WAN22_A14B_SPEC.refusals),
).resolve("tiny")
