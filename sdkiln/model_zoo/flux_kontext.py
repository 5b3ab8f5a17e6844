"""FLUX.1-Kontext: FLUX.1's transformer, conditioned on an image by appending its tokens.

``FluxKontextPipeline`` encodes the conditioning image with the VAE, packs it like the latents and
appends its tokens after the image tokens (``hidden_states = cat(latents, image_latents)``, their ids
with frame index 1 after the latents' ids); the transformer's output is cut back to the latents'
tokens. The transformer is ``FluxTransformer2DModel`` with FLUX.1-dev's config (guidance-distilled:
one call per step), so the blocks, float layers, SmoothQuant folds, attention sites (text first) and
sequence-parallel plan are FLUX.1's (sdkiln/model_zoo/flux.py): the split ``hidden_states`` and
``img_ids`` carry the conditioning tokens with the rest, and block-sparse attention tiles them as a
second frame of the ``img_ids`` grid.

The pipeline scales its output to ``max_area`` pixels whatever height and width it is given; the
call defaults carry ``max_area``, which ``ModelSpec.call_kwargs`` and ``sdkiln run`` keep at height x
width. Without an image the pipeline generates from text alone; offline calibration and evaluation give it
``ModelSpec.condition``'s fixed picture at the call's size (``_auto_resize=False``: the published
pipeline would otherwise resize every image to the nearest of its trained resolutions, about 1 MP).

Refused: CFG parallel. The pipeline calls its transformer outside diffusers' ``cache_context``, so
the true-CFG branches (``true_cfg_scale`` > 1 with a negative prompt) cannot be told apart, and it
slices the conditional output before the unconditional call, which CFG parallel fills later
(docs/parallel.md); Kontext-dev's published guidance is distilled, one call per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sdkiln.model_zoo.flux import (
    FLUX_ATTENTION,
    FLUX_GRID,
    FLUX_PARALLEL,
    FLUX_REAL_WIDTH,
    FLUX_SMOOTH_FOLDS,
    TINY_T5_MAX_LENGTH,
    TINY_TEXT_DIM,
    tiny_components,
)
from sdkiln.model_zoo.flux import (
    SPEC as FLUX_SPEC,
)
from sdkiln.model_zoo.spec import ModelSpec, Variant

if TYPE_CHECKING:
    from diffusers import FluxKontextPipeline


def tiny() -> FluxKontextPipeline:
    """A real ``FluxKontextPipeline`` over FLUX's test build (flux.tiny_components) with the guidance
    embedding on, as in FLUX.1-Kontext-dev: a 32x32 call with a 32x32 image is 64 + 64 image tokens."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**tiny_components(guidance_embeds=True))


KONTEXT_VARIANTS = (
    Variant(
        "FLUX.1-Kontext-dev",
        "image-conditioned, guidance-distilled FLUX.1 (black-forest-labs/FLUX.1-Kontext-dev)",
        match={**FLUX_REAL_WIDTH, "guidance_embeds": True},
        # the model card: 28 steps (the pipeline's default), guidance_scale 2.5, 1024x1024
        call_defaults={
            "num_inference_steps": 28,
            "guidance_scale": 2.5,
            "height": 1024,
            "width": 1024,
            "max_sequence_length": 512,
            "max_area": 1024 * 1024,
            "output_type": "np",
        },
    ),
    Variant(
        "tiny",
        "the test build (tiny() above): FLUX's test build with the guidance embedding",
        match={
            "in_channels": 64,
            "num_attention_heads": 4,
            "attention_head_dim": 32,
            "joint_attention_dim": TINY_TEXT_DIM,
            "pooled_projection_dim": TINY_TEXT_DIM,
            "guidance_embeds": True,
        },
        call_defaults={
            "num_inference_steps": 4,
            "guidance_scale": 2.5,
            "height": 32,
            "width": 32,
            "max_sequence_length": TINY_T5_MAX_LENGTH,
            "max_area": 32 * 32,
            "output_type": "np",
        },
        sparse_block_size=16,
    ),
)

SPEC = ModelSpec(
    name="flux-kontext-tiny",
    family="flux-kontext",
    description="FLUX.1-Kontext (FLUX.1 with appended image-conditioning tokens) at test size",
    pipeline_class="diffusers:FluxKontextPipeline",
    cfg_calls=("true_cfg_scale", "negative_prompt"),
    transformer_attr="transformer",
    block_lists=FLUX_SPEC.block_lists,
    float_layers=(),
    weight_only_layers=FLUX_SPEC.weight_only_layers,
    default_recipe="te-w8a16+quant-auto+cache-auto",
    build=tiny,
    eval_prompts=("make the sky purple", "add a hat to the figure", "turn it into a watercolor"),
    calibration_prompts=("make it night", "replace the background with a forest", "add snow"),
    smooth_folds=FLUX_SMOOTH_FOLDS,
    attention=FLUX_ATTENTION,
    parallel_plan=FLUX_PARALLEL,
    token_grid=FLUX_GRID,
    image_arg="image",
    condition_kwargs={"_auto_resize": False},
    refusals={
        "cfg-parallel": "FluxKontextPipeline calls its transformer outside diffusers' cache_context, so the "
        "two guidance branches cannot be told apart, and it slices the conditional output before the "
        "unconditional call (Kontext-dev's guidance is distilled: one call per step)",
    },
    variants=KONTEXT_VARIANTS,
).resolve("tiny")
