"""Wan2.1 image-to-video: Wan's DiT blocks with a second, image context in their cross-attention.

The transformer is Wan2.1's (``wan.py``): one list of ``WanTransformerBlock``, each self-attention over
the video tokens (``attn1``), cross-attention (``attn2``) and FFN, modulated by the per-block
``scale_shift_table`` plus the shared time projection (no modulation Linear in a block, so
``float_layers`` and ``weight_only_layers`` are empty). What image-to-video adds:

* the latents the transformer reads are 36 channels: the 16 noisy latent channels, a 4-channel mask
  (1 on the first frame) and the 16 VAE latent channels of the conditioning image followed by zeros;
* a CLIP vision encoder (``image_encoder``, with ``image_processor``) turns the image into 257 tokens
  (its penultimate hidden states; the published models ship a ViT-H/14 ``CLIPVisionModelWithProjection``,
  the pipeline declares a ``CLIPVisionModel``, which the test build is);
  ``condition_embedder.image_embedder`` projects them to the model width and the transformer
  concatenates them *before* the text: ``[image tokens, 512 text tokens]`` is the context every
  block's ``attn2`` reads;
* ``attn2`` has the added key/value projections ``add_k_proj``/``add_v_proj``: diffusers'
  ``WanAttnProcessor`` cuts the context at ``length - 512`` (512 text tokens are hard-coded, so the
  pipeline must be called with ``max_sequence_length=512``), and makes two attention calls with the
  same queries: first over the image keys, then over the text keys, and adds the two outputs. The
  spec's ``attn2`` site says so (``key_calls=("image", "text")``), so the attention seam labels the
  first call's keys an image context, not text; both are context to the backends (whole on every
  rank, never sparsified).

A block is called with ``hidden_states`` (and the concatenated context as ``encoder_hidden_states``,
only read) and returns ``hidden_states``; the pipeline exposes its 16-channel latents to
``callback_on_step_end`` as ``"latents"``. The pipeline refuses to run without its ``image``:
offline calibration and evaluation give it the spec's fixed synthetic picture (``ModelSpec.condition``).

Variants, by transformer width: Wan2.1-I2V-14B (40 heads of 128, FFN 13824, image width 1280). Its
480P and 720P checkpoints have the same transformer config, so no directory tells them apart: the
variant's defaults are WanImageToVideoPipeline's and the 480P model card's (480x832, 81 frames, 50
steps, guidance 5.0, 512 text tokens); a 720P run deploys at 720x1280. Wan2.2-I2V-A14B (two experts,
``transformer`` and ``transformer_2`` below ``boundary_ratio``, and no image encoder) is this pipeline
class too: a directory that sets both entries is the ``wan2.2-a14b-i2v`` family's (``wan22_a14b_i2v.py``),
one that sets only one of them is refused before anything loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sdkiln.model_zoo.spec import AttentionSite, ModelSpec, Variant
from sdkiln.model_zoo.wan import SPEC as WAN_SPEC

if TYPE_CHECKING:
    from diffusers import WanImageToVideoPipeline

_SEED = 0
_TEXT_DIM = 32
_IMAGE_DIM = 128
_WIDTH = 64
_T5_MAX_LENGTH = 512  # WanAttnProcessor splits the context at length - 512: the text must be 512 tokens
_CLIP_SIZE = 32


def _clip_image_processor():
    """OpenAI CLIP's preprocessing (resize the short side, centre crop, CLIP mean/std) at ``_CLIP_SIZE``."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(
        size={"shortest_edge": _CLIP_SIZE},
        crop_size={"height": _CLIP_SIZE, "width": _CLIP_SIZE},
        do_resize=True,
        do_center_crop=True,
        do_normalize=True,
        do_rescale=True,
        do_convert_rgb=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )


def tiny() -> WanImageToVideoPipeline:
    """A real ``WanImageToVideoPipeline`` at test size with fixed random weights (float32, eval mode).

    Transformer: 2 blocks, width 64 (2 heads of 32), FFN 128, 36 input channels (16 + 4 mask + 16),
    image width 128 projected to 64 for ``attn2``'s added keys. CLIP vision: 2 layers, width 128, 32x32
    images in 8x8 patches, so 17 image tokens. (At image width 128 the saved transformer's safetensors
    header leaves every tensor 16-byte aligned; at 32 or 64 the memory-mapped weights that
    ``from_pretrained`` loads are 8-byte aligned, the CPU GEMM rounds differently and a round trip
    differs by 1e-6.) The VAE is wan.py's: 5 frames of 64x64 are a 2x8x8
    latent, 32 video tokens after the (1, 2, 2) patch.

    The diffusers and transformers imports live here so that reading the spec costs none of them.
    """
    import torch
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanImageToVideoPipeline,
        WanTransformer3DModel,
    )
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from sdkiln.model_zoo import tiny_text

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=32,
            in_channels=36,
            out_channels=16,
            text_dim=_TEXT_DIM,
            freq_dim=64,
            ffn_dim=128,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            image_dim=_IMAGE_DIM,
            added_kv_proj_dim=_WIDTH,
            rope_max_seq_len=32,
        ).eval()
        vae = AutoencoderKLWan(
            base_dim=8,
            z_dim=16,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        ).eval()
        text_encoder = tiny_text.umt5_text_encoder(_TEXT_DIM)
        image_encoder = CLIPVisionModel(
            CLIPVisionConfig(
                hidden_size=_IMAGE_DIM,
                intermediate_size=2 * _IMAGE_DIM,
                num_hidden_layers=2,
                num_attention_heads=4,
                image_size=_CLIP_SIZE,
                patch_size=8,
                projection_dim=_IMAGE_DIM,
            )
        ).eval()
    return WanImageToVideoPipeline(
        tokenizer=tiny_text.t5_tokenizer(_T5_MAX_LENGTH),
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        image_processor=_clip_image_processor(),
        image_encoder=image_encoder,
        transformer=transformer,
    )


WAN_I2V_VARIANTS = (
    Variant(
        "Wan2.1-I2V-14B",
        "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers and -720P-Diffusers (one transformer config), 480p defaults",
        match={
            "in_channels": 36,
            "attention_head_dim": 128,
            "num_attention_heads": 40,
            "ffn_dim": 13824,
            "text_dim": 4096,
            "image_dim": 1280,
            "added_kv_proj_dim": 5120,
        },
        call_defaults={
            "num_inference_steps": 50,
            "guidance_scale": 5.0,
            "height": 480,
            "width": 832,
            "num_frames": 81,
            "max_sequence_length": 512,
            "output_type": "np",
        },
        sparse_block_size=128,
    ),
    Variant(
        "tiny",
        "the test build (tiny() above): 2 heads of 32, FFN 128, text width 32, image width 128",
        match={
            "in_channels": 36,
            "attention_head_dim": 32,
            "num_attention_heads": 2,
            "ffn_dim": 128,
            "text_dim": _TEXT_DIM,
            "image_dim": _IMAGE_DIM,
            "added_kv_proj_dim": _WIDTH,
        },
        call_defaults={
            "num_inference_steps": 4,
            "guidance_scale": 5.0,
            "height": 64,
            "width": 64,
            "num_frames": 5,
            "max_sequence_length": _T5_MAX_LENGTH,
            "output_type": "np",
        },
        sparse_block_size=16,
    ),
)
_HALF_LAYOUT = (
    "a WanImageToVideoPipeline sets transformer_2 or boundary_ratio but not both: neither Wan2.1-I2V's one "
    "transformer nor Wan2.2-I2V-A14B's two experts (the wan2.2-a14b-i2v family, which needs both)"
)

SPEC = ModelSpec(
    name="wan-i2v-tiny",
    family="wan-i2v",
    description="Wan2.1 image-to-video architecture at test size with random weights",
    pipeline_class="diffusers:WanImageToVideoPipeline",
    cfg_calls=("guidance_scale",),
    transformer_attr="transformer",
    block_lists=WAN_SPEC.block_lists,
    float_layers=(),
    default_recipe="te-w8a16+quant-auto+cache-auto+sparse-attn",
    build=tiny,
    frame_step=4,
    eval_prompts=(
        "the scene comes alive, gentle motion",
        "the camera slowly pans right",
        "wind moves through it",
    ),
    calibration_prompts=("the picture starts to move", "a slow zoom in", "light flickers across the scene"),
    # attn1: self-attention over the video tokens. attn2: two calls per module with the same queries,
    # first over the image keys (the CLIP tokens, labelled "image"), then over the text keys ("all" text):
    # both context, whole on every rank and dense
    attention=(
        AttentionSite("blocks.*.attn1", "WanAttnProcessor", "dispatch", "none", "none"),
        AttentionSite("blocks.*.attn2", "WanAttnProcessor", "dispatch", "none", "all", ("image", "text")),
    ),
    # the same transformer class as Wan text-to-video: its _cp_plan (the video tokens split at the first
    # block with their RoPE tables; the context, image tokens then text, whole on every rank) and its
    # latent grid
    parallel_plan=WAN_SPEC.parallel_plan,
    token_grid=WAN_SPEC.token_grid,
    variants=WAN_I2V_VARIANTS,
    image_arg="image",
    image_required=True,
    refusals={
        "onnx": "diffusers' WanAttnProcessor cuts attn2's context at its length minus 512 (the text length "
        "it hard-codes), and with the token axes the ONNX export makes dynamic, torch.export cannot size "
        "that slice (a data-dependent guard in the image-key attention)",
    },
    unsupported_layout={key: _HALF_LAYOUT for key in ("transformer_2", "boundary_ratio")},
).resolve("tiny")
