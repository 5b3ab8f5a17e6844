"""FLUX.1: 19 double-stream (MMDiT) blocks then 38 single-stream blocks.

Only Linear layers inside ``block_lists`` are quantized, so everything outside the blocks
(``x_embedder``, ``context_embedder``, ``time_text_embed``, ``norm_out``, ``proj_out``) stays in
float without being listed. ``weight_only_layers`` names the adaLN modulation linears, whose
outputs (shift, scale, gate) multiply every activation of the block, so their error is amplified
rather than averaged out: a step that quantizes activations keeps them float, a weight-only step
(W8A16) takes them. They are 27% of FLUX.1-dev's transformer (3.2B of 11.9B parameters):
``w8a8-dynamic+w8a16`` stores them int8 with float activations, for a transformer about half the
bf16 one's size instead of 0.64 of it.

Both block kinds are called with ``hidden_states`` and ``encoder_hidden_states`` and return
``(encoder_hidden_states, hidden_states)``; the single block concatenates the two streams inside
and splits them again at its end. The pipeline exposes its packed latents ``(B, tokens, 4 * C)``
to ``callback_on_step_end`` as ``"latents"``.

Variants, by transformer width (24 heads of 128, T5 width 4096, CLIP pooled 768):

* FLUX.1-dev is guidance-distilled (``guidance_embeds=True``): its guidance is ``guidance_scale``, an
  input of the transformer, one pass per step and no negative prompt. Defaults are FluxPipeline's
  own (28 steps, guidance 3.5, 512 text tokens, 1024x1024); the model card's example runs 50 steps.
* FLUX.1-schnell is timestep-distilled (``guidance_embeds=False``): 4 steps, ``guidance_scale`` 0 (it
  has no guidance input), at most 256 text tokens, 1024x1024, as the model card and diffusers' docs say.
* The tiny build has ``guidance_embeds=False`` too, and its guidance is true classifier-free guidance:
  ``true_cfg_scale`` > 1 together with a ``negative_prompt`` runs a second, unconditional transformer
  pass per step, so that the test build exercises the two-pass path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sdkiln.model_zoo.spec import (
    AttentionSite,
    BlockList,
    ModelSpec,
    ParallelPlan,
    SequenceGather,
    SequenceSplit,
    SmoothFold,
    TokenGrid,
    Variant,
)

if TYPE_CHECKING:
    from diffusers import FluxPipeline

_SEED = 0
_TEXT_DIM = 32
_T5_MAX_LENGTH = 16
TINY_TEXT_DIM = _TEXT_DIM
TINY_T5_MAX_LENGTH = _T5_MAX_LENGTH


def tiny() -> FluxPipeline:
    """A real ``FluxPipeline`` at test size with fixed random weights (float32, eval mode).

    Transformer: 2 double + 2 single blocks, width 128 (4 heads of 32), so every block Linear has
    in/out features that are multiples of 16 and int8 weights plus scales weigh about 0.26x fp32. The VAE has one 2x downsample: a 32x32 image is a
    16x16x16 latent, packed into 8x8 = 64 image tokens.
    """
    from diffusers import FluxPipeline

    return FluxPipeline(**tiny_components(guidance_embeds=False))


def tiny_components(guidance_embeds: bool) -> dict:
    """The components of :func:`tiny` (and of FLUX.1-Kontext's test build, with ``guidance_embeds``).

    The diffusers and transformers imports live here so that reading the spec costs none of them.
    """
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    from sdkiln.model_zoo import tiny_text

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=32,
            num_attention_heads=4,
            joint_attention_dim=_TEXT_DIM,
            pooled_projection_dim=_TEXT_DIM,
            guidance_embeds=guidance_embeds,
            axes_dims_rope=(8, 12, 12),
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
            scaling_factor=0.3611,
            shift_factor=0.1159,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ).eval()
        text_encoder = tiny_text.clip_text_encoder(_TEXT_DIM)
        text_encoder_2 = tiny_text.t5_text_encoder(_TEXT_DIM)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return dict(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tiny_text.clip_tokenizer(),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tiny_text.t5_tokenizer(_T5_MAX_LENGTH),
        transformer=transformer,
    )


# SmoothQuant folds (see SmoothFold). AdaLayerNormZero's modulation Linear gives (shift_msa,
# scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp): the msa pair modulates norm1's output,
# which only the attention projections read; the mlp pair modulates norm2's output, which only the
# feed-forward's first Linear reads. AdaLayerNormZeroSingle gives (shift, scale, gate), and its output
# feeds the attention projections and proj_mlp. attn.to_out.0, attn.to_add_out, ff.net.2,
# ff_context.net.2 and the single blocks' proj_out read attention outputs or GELU outputs, which no
# static affine precedes: they keep an input multiplier.
_QKV = ("attn.to_q", "attn.to_k", "attn.to_v")
_ADDED_QKV = ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")
FLUX_SMOOTH_FOLDS = (
    SmoothFold("transformer_blocks", "norm1.linear", _QKV, chunks=6, shift=0, scale=1),
    SmoothFold("transformer_blocks", "norm1.linear", ("ff.net.0.proj",), chunks=6, shift=3, scale=4),
    SmoothFold("transformer_blocks", "norm1_context.linear", _ADDED_QKV, chunks=6, shift=0, scale=1),
    SmoothFold(
        "transformer_blocks", "norm1_context.linear", ("ff_context.net.0.proj",), chunks=6, shift=3, scale=4
    ),
    SmoothFold("single_transformer_blocks", "norm.linear", (*_QKV, "proj_mlp"), chunks=3, shift=0, scale=1),
)

# Both block kinds attend over one joint sequence, text tokens first: the double block concatenates
# the projected text and image streams inside FluxAttnProcessor, the single block concatenates the
# streams before its attention.
FLUX_ATTENTION = (
    AttentionSite("transformer_blocks.*.attn", "FluxAttnProcessor", "dispatch", "first", "first"),
    AttentionSite("single_transformer_blocks.*.attn", "FluxAttnProcessor", "dispatch", "first", "first"),
)

# Sequence parallelism with the text replicated: diffusers' FluxTransformer2DModel._cp_plan without
# its encoder_hidden_states and txt_ids splits. Every rank embeds the whole text and its shard of the
# image tokens (and their ids: the RoPE of the joint sequence is computed from the ids); proj_out
# reads the image stream only, so its output is gathered.
# FLUX's img_ids hold each image token's (frame, row, column): block-sparse attention tiles by them.
FLUX_GRID = TokenGrid("img_ids", "ids")

FLUX_PARALLEL = ParallelPlan(
    splits=(SequenceSplit("", "hidden_states", 1, 3), SequenceSplit("", "img_ids", 0, 2)),
    gathers=(SequenceGather("proj_out", 1, 3),),
)

FLUX_REAL_WIDTH = {
    "in_channels": 64,
    "num_attention_heads": 24,
    "attention_head_dim": 128,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
}
FLUX_VARIANTS = (
    Variant(
        "FLUX.1-dev",
        "guidance-distilled FLUX.1 (black-forest-labs/FLUX.1-dev)",
        match={**FLUX_REAL_WIDTH, "guidance_embeds": True},
        call_defaults={
            "num_inference_steps": 28,
            "guidance_scale": 3.5,
            "height": 1024,
            "width": 1024,
            "max_sequence_length": 512,
            "output_type": "np",
        },
    ),
    Variant(
        "FLUX.1-schnell",
        "timestep-distilled FLUX.1 (black-forest-labs/FLUX.1-schnell)",
        match={**FLUX_REAL_WIDTH, "guidance_embeds": False},
        call_defaults={
            "num_inference_steps": 4,
            "guidance_scale": 0.0,
            "height": 1024,
            "width": 1024,
            "max_sequence_length": 256,
            "output_type": "np",
        },
    ),
    Variant(
        "tiny",
        "the test build (tiny() above): 4 heads of 32, text width 32, true CFG",
        match={
            "in_channels": 64,
            "num_attention_heads": 4,
            "attention_head_dim": 32,
            "joint_attention_dim": _TEXT_DIM,
            "pooled_projection_dim": _TEXT_DIM,
            "guidance_embeds": False,
        },
        call_defaults={
            "num_inference_steps": 4,
            "true_cfg_scale": 2.0,
            "negative_prompt": "",
            "height": 32,
            "width": 32,
            "max_sequence_length": _T5_MAX_LENGTH,
            "output_type": "np",
        },
        guidance_arg="true_cfg_scale",
        sparse_block_size=16,
    ),
)

SPEC = ModelSpec(
    name="flux-tiny",
    family="flux",
    description="FLUX.1 architecture (double + single stream MMDiT) at test size with random weights",
    pipeline_class="diffusers:FluxPipeline",
    cfg_calls=("true_cfg_scale", "negative_prompt"),
    transformer_attr="transformer",
    block_lists=(
        BlockList(
            "transformer_blocks",
            inputs=("hidden_states", "encoder_hidden_states"),
            outputs=("encoder_hidden_states", "hidden_states"),
        ),
        BlockList(
            "single_transformer_blocks",
            inputs=("hidden_states", "encoder_hidden_states"),
            outputs=("encoder_hidden_states", "hidden_states"),
        ),
    ),
    float_layers=(),
    weight_only_layers=(
        "transformer_blocks.*.norm1.linear",
        "transformer_blocks.*.norm1_context.linear",
        "single_transformer_blocks.*.norm.linear",
    ),
    default_recipe="te-w8a16+quant-auto+cache-auto",
    build=tiny,
    eval_prompts=("a photo of a cat", "a red car on a mountain road", "a bowl of fruit, oil painting"),
    calibration_prompts=("a photo of a dog", "a city skyline at night", "a watercolor of a lighthouse"),
    smooth_folds=FLUX_SMOOTH_FOLDS,
    attention=FLUX_ATTENTION,
    parallel_plan=FLUX_PARALLEL,
    token_grid=FLUX_GRID,
    variants=FLUX_VARIANTS,
).resolve("tiny")
