"""Stable Diffusion 3 (MMDiT): one list of joint transformer blocks.

Only Linear layers inside ``block_lists`` are quantized, so everything outside the blocks
(``pos_embed``, ``context_embedder``, ``time_text_embed``, ``norm_out``, ``proj_out``) stays in
float without being listed. ``weight_only_layers`` names the in-block adaLN modulation linears,
whose outputs (shift, scale, gate) multiply every activation of the block: steps that quantize
activations keep them float, weight-only steps (W8A16) take them.

A ``JointTransformerBlock`` is called with ``hidden_states`` and ``encoder_hidden_states`` and
returns ``(encoder_hidden_states, hidden_states)``. The last block is built with
``context_pre_only=True``: it reads the text stream but does not update it and returns ``None``
in the ``encoder_hidden_states`` slot, and its ``norm1_context`` is an ``AdaLayerNormContinuous``
(whose modulation Linear is also named ``linear``, so the same pattern names it). Code
that walks the blocks must accept that ``None``. The pipeline exposes its latents
``(B, C, H, W)`` to ``callback_on_step_end`` as ``"latents"``.

Variants, by transformer width (heads of 64, T5 width 4096, CLIP pooled 2048) and QK norm, with the
steps and classifier-free ``guidance_scale`` of their model cards, 1024x1024 and the pipeline's 256
text tokens: SD3-medium (24 heads, no QK norm; 28 steps, 7.0), SD3.5-medium (24 heads, RMS QK norm;
40 steps, 4.5), SD3.5-large (38 heads; 28 steps, 3.5). SD3.5-large-turbo has SD3.5-large's config
byte for byte, so it is recognised as SD3.5-large: give it its 4 steps and guidance 0 explicitly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sdkiln.model_zoo.spec import AttentionSite, BlockList, ModelSpec, Variant

if TYPE_CHECKING:
    from diffusers import StableDiffusion3Pipeline

_SEED = 0
_CLIP_DIM = 32
_T5_DIM = 64
"""At least the two CLIP widths together: the pipeline pads their concatenation to T5's width."""
_T5_MAX_LENGTH = 16


def tiny() -> StableDiffusion3Pipeline:
    """A real ``StableDiffusion3Pipeline`` at test size with fixed random weights (float32, eval).

    Transformer: 2 joint blocks (SD3-medium layout: no dual attention, no QK norm), width 64
    (4 heads of 16), patch 2. The VAE has one 2x downsample: a 32x32 image is a 16x16x16 latent,
    i.e. 8x8 = 64 image tokens.

    The diffusers and transformers imports live here so that reading the spec costs none of them.
    """
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    from sdkiln.model_zoo import tiny_text

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        transformer = SD3Transformer2DModel(
            sample_size=16,
            patch_size=2,
            in_channels=16,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=_T5_DIM,
            caption_projection_dim=64,
            pooled_projection_dim=2 * _CLIP_DIM,
            out_channels=16,
            pos_embed_max_size=16,
        ).eval()
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(16, 16),
            layers_per_block=1,
            latent_channels=16,
            norm_num_groups=8,
            sample_size=32,
            scaling_factor=1.5305,
            shift_factor=0.0609,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ).eval()
        text_encoder = tiny_text.clip_text_encoder(_CLIP_DIM, projection_dim=_CLIP_DIM)
        text_encoder_2 = tiny_text.clip_text_encoder(_CLIP_DIM, projection_dim=_CLIP_DIM)
        text_encoder_3 = tiny_text.t5_text_encoder(_T5_DIM)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tiny_text.clip_tokenizer(),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tiny_text.clip_tokenizer(),
        text_encoder_3=text_encoder_3,
        tokenizer_3=tiny_text.t5_tokenizer(_T5_MAX_LENGTH),
    )


_REAL_WIDTH = {
    "in_channels": 16,
    "attention_head_dim": 64,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 2048,
}


def _published(steps: int, guidance: float) -> dict:
    return {
        "num_inference_steps": steps,
        "guidance_scale": guidance,
        "height": 1024,
        "width": 1024,
        "max_sequence_length": 256,
        "output_type": "np",
    }


SD3_VARIANTS = (
    Variant(
        "SD3-medium",
        "stabilityai/stable-diffusion-3-medium-diffusers",
        match={**_REAL_WIDTH, "num_attention_heads": 24, "caption_projection_dim": 1536, "qk_norm": None},
        call_defaults=_published(28, 7.0),
    ),
    Variant(
        "SD3.5-medium",
        "stabilityai/stable-diffusion-3.5-medium (MMDiT-X)",
        match={
            **_REAL_WIDTH,
            "num_attention_heads": 24,
            "caption_projection_dim": 1536,
            "qk_norm": "rms_norm",
        },
        call_defaults=_published(40, 4.5),
    ),
    Variant(
        "SD3.5-large",
        "stabilityai/stable-diffusion-3.5-large",
        match={
            **_REAL_WIDTH,
            "num_attention_heads": 38,
            "caption_projection_dim": 2432,
            "qk_norm": "rms_norm",
        },
        call_defaults=_published(28, 3.5),
    ),
    Variant(
        "tiny",
        "the test build (tiny() above): 4 heads of 16, T5 width 64",
        match={
            "in_channels": 16,
            "attention_head_dim": 16,
            "num_attention_heads": 4,
            "joint_attention_dim": _T5_DIM,
            "caption_projection_dim": 64,
            "pooled_projection_dim": 2 * _CLIP_DIM,
            "qk_norm": None,
        },
        call_defaults={
            "num_inference_steps": 4,
            "guidance_scale": 4.0,
            "height": 32,
            "width": 32,
            "max_sequence_length": _T5_MAX_LENGTH,
            "output_type": "np",
        },
    ),
)

SPEC = ModelSpec(
    name="sd3-tiny",
    family="sd3",
    description="Stable Diffusion 3 architecture (joint MMDiT blocks) at test size with random weights",
    pipeline_class="diffusers:StableDiffusion3Pipeline",
    transformer_attr="transformer",
    block_lists=(
        BlockList(
            "transformer_blocks",
            inputs=("hidden_states", "encoder_hidden_states"),
            outputs=("encoder_hidden_states", "hidden_states"),
        ),
    ),
    float_layers=(),
    weight_only_layers=(
        "transformer_blocks.*.norm1.linear",
        "transformer_blocks.*.norm1_context.linear",
    ),
    default_recipe="te-w8a16+quant-auto+cache-auto",
    build=tiny,
    eval_prompts=("a photo of a cat", "a red car on a mountain road", "a bowl of fruit, oil painting"),
    calibration_prompts=("a photo of a dog", "a city skyline at night", "a watercolor of a lighthouse"),
    # JointAttnProcessor2_0 calls F.scaled_dot_product_attention on [B, H, S, D], image tokens first
    attention=(AttentionSite("transformer_blocks.*.attn", "JointAttnProcessor2_0", "sdpa", "last", "last"),),
    refusals={
        "ulysses": "no sequence-parallel plan yet: SD3's pipeline batches both guidance branches in one call "
        "and its transformer has no diffusers _cp_plan to follow; it runs with CFG parallel",
        "ring": "no sequence-parallel plan yet (see ulysses)",
        "sparse": "no token grid: SD3's patchified latents carry no position ids, and its joint attention "
        "at 1024x1024 (4096 tokens) is a small share of a step",
    },
    variants=SD3_VARIANTS,
).resolve("tiny")
