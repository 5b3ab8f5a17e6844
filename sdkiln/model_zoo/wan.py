"""Wan2.1 text-to-video: one list of DiT blocks with self-attention, text cross-attention and FFN.

Only Linear layers inside ``block_lists`` are quantized, so everything outside the blocks
(``patch_embedding``, ``condition_embedder`` with its time and text projections, ``norm_out``,
``proj_out``) stays in float without being listed. Unlike FLUX and SD3, a Wan block holds no
modulation Linear: its shift/scale/gate come from the per-block ``scale_shift_table`` parameter
added to the shared time projection computed outside the blocks, so ``float_layers`` is empty.

A ``WanTransformerBlock`` is called with ``hidden_states`` (and the text ``encoder_hidden_states``,
which it only reads, as cross-attention keys and values) and returns ``hidden_states``. The
pipeline exposes its latents ``(B, C, F, H, W)`` to ``callback_on_step_end`` as ``"latents"``.

Variants, by transformer width (heads of 128, UMT5 width 4096, 16 latent channels), with WanPipeline's
defaults (81 frames, 50 steps, guidance 5.0, 512 text tokens) at the resolution each model card runs:
Wan2.1-T2V-1.3B (12 heads, FFN 8960) at 480x832, Wan2.1-T2V-14B (40 heads, FFN 13824) at 720x1280.
The flow shift belongs to the scheduler (model_index.json), not to the call.

Wan2.2-TI2V-5B (24 heads, FFN 14336, 48 latent channels) is a ``WanPipeline`` with one transformer and
its own VAE (48 channels, 16x spatial compression: 32-pixel multiples, 704x1280 is a 44x80 latent, 22x40
tokens per frame) and ``expand_timesteps`` set in model_index.json: the pipeline gives the transformer a
per-token timestep [B, S], which the parallel plan splits with the video tokens. Its defaults are the
model card's: 121 frames at 704x1280, 50 steps, guidance 5.0.
Wan2.2-T2V-A14B has Wan2.1-14B's width but two experts, ``transformer`` for high noise and
``transformer_2`` below ``boundary_ratio``: a directory that sets both is the ``wan2.2-a14b`` family's
(``wan22_a14b.py``; TI2V-5B sets neither: ``transformer_2`` is [null, null], ``boundary_ratio`` null).
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
    TokenGrid,
    Variant,
)

if TYPE_CHECKING:
    from diffusers import WanPipeline

_SEED = 0
_TEXT_DIM = 32
_T5_MAX_LENGTH = 16


def tiny() -> WanPipeline:
    """A real ``WanPipeline`` at test size with fixed random weights (float32, eval mode).

    Transformer: 2 blocks, width 64 (2 heads of 32, so the 3D RoPE splits each head 12/10/10),
    FFN 128. The VAE keeps Wan's 4x temporal and 8x spatial compression at base width 8: 5 frames
    of 64x64 are a 2x8x8 latent, i.e. 2x4x4 = 32 tokens after the (1, 2, 2) patch.

    The diffusers and transformers imports live here so that reading the spec costs none of them.
    """
    import torch
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )

    from sdkiln.model_zoo import tiny_text

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=32,
            in_channels=16,
            out_channels=16,
            text_dim=_TEXT_DIM,
            freq_dim=64,
            ffn_dim=128,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
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
    return WanPipeline(
        tokenizer=tiny_text.t5_tokenizer(_T5_MAX_LENGTH),
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=transformer,
    )


_REAL_WIDTH = {"in_channels": 16, "attention_head_dim": 128, "text_dim": 4096}


def _published(height: int, width: int) -> dict:
    return {
        "num_inference_steps": 50,
        "guidance_scale": 5.0,
        "height": height,
        "width": width,
        "num_frames": 81,
        "max_sequence_length": 512,
        "output_type": "np",
    }


WAN_VARIANTS = (
    Variant(
        "Wan2.1-T2V-1.3B",
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers, 480p",
        match={**_REAL_WIDTH, "num_attention_heads": 12, "ffn_dim": 8960},
        call_defaults=_published(480, 832),
        sparse_block_size=128,
    ),
    Variant(
        "Wan2.1-T2V-14B",
        "Wan-AI/Wan2.1-T2V-14B-Diffusers, 720p",
        match={**_REAL_WIDTH, "num_attention_heads": 40, "ffn_dim": 13824},
        call_defaults=_published(720, 1280),
        sparse_block_size=128,
    ),
    Variant(
        "Wan2.2-TI2V-5B",
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers, 720p (its own 48-channel VAE, per-token timesteps)",
        match={
            "in_channels": 48,
            "attention_head_dim": 128,
            "text_dim": 4096,
            "num_attention_heads": 24,
            "ffn_dim": 14336,
        },
        call_defaults={**_published(704, 1280), "num_frames": 121},
        sparse_block_size=128,
        size_multiple=32,  # its VAE's 16x spatial compression times the 2x2 patch
    ),
    Variant(
        "tiny",
        "the test build (tiny() above): 2 heads of 32, FFN 128, text width 32",
        match={
            "in_channels": 16,
            "attention_head_dim": 32,
            "text_dim": _TEXT_DIM,
            "num_attention_heads": 2,
            "ffn_dim": 128,
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
    "a WanPipeline sets transformer_2 or boundary_ratio but not both: neither Wan's one transformer nor "
    "Wan2.2-A14B's two experts (the wan2.2-a14b family, which needs both)"
)

SPEC = ModelSpec(
    name="wan-tiny",
    family="wan",
    description="Wan2.1 text-to-video architecture at test size with random weights",
    pipeline_class="diffusers:WanPipeline",
    cfg_calls=("guidance_scale",),
    transformer_attr="transformer",
    block_lists=(BlockList("blocks", inputs=("hidden_states",), outputs=("hidden_states",)),),
    float_layers=(),
    # a video model's attention is most of its time: its default recipe adds calibrated sparse attention
    default_recipe="te-w8a16+quant-auto+cache-auto+sparse-attn",
    build=tiny,
    frame_step=4,  # Wan's VAE compresses time by 4: 4k + 1 frames
    eval_prompts=("a cat walking on grass", "waves breaking on a beach", "a car driving through rain"),
    calibration_prompts=("a dog running in a park", "clouds moving over mountains", "a candle flickering"),
    # attn1: self-attention over the video tokens; attn2: cross-attention, one call with the text tokens
    # as keys (image-to-video's attn2 adds a call over image keys first: wan_i2v.py's sites)
    attention=(
        AttentionSite("blocks.*.attn1", "WanAttnProcessor", "dispatch", "none", "none"),
        AttentionSite("blocks.*.attn2", "WanAttnProcessor", "dispatch", "none", "all"),
    ),
    # diffusers' WanTransformer3DModel._cp_plan as data: the video tokens are split after the patch
    # embedding (at the first block) with their RoPE tables, and a per-token timestep (Wan2.2's
    # [B, S]) with them; the text is only ever keys of the cross-attention, so it stays whole.
    parallel_plan=ParallelPlan(
        splits=(
            SequenceSplit("rope", 0, 1, 4, output=True),
            SequenceSplit("rope", 1, 1, 4, output=True),
            SequenceSplit("blocks.0", "hidden_states", 1, 3),
            SequenceSplit("", "timestep", 1, 2),
        ),
        gathers=(SequenceGather("proj_out", 1, 3),),
    ),
    # the latents [B, C, F, H, W], patchified (1, 2, 2) into tokens in (frame, row, column) order
    token_grid=TokenGrid("hidden_states", "latents", (1, 2, 2)),
    variants=WAN_VARIANTS,
    unsupported_layout={key: _HALF_LAYOUT for key in ("transformer_2", "boundary_ratio")},
).resolve("tiny")
