"""HunyuanVideo-1.5 text-to-video: one list of 54 dual-stream (MMDiT) blocks over one joint sequence.

Only Linear layers inside ``block_lists`` are quantized, so everything outside the blocks stays in
float without being listed: ``x_embedder`` (a Conv3d patch embedding), ``context_embedder`` (a 2-block
token refiner over the Qwen2.5-VL text), ``context_embedder_2`` (the ByT5 glyph projection),
``image_embedder`` (SigLIP image tokens, zero for text-to-video), ``time_embed``, ``norm_out`` and
``proj_out``. ``weight_only_layers`` names each block's two adaLN modulation Linears (``norm1.linear``
for the video stream, ``norm1_context.linear`` for the text stream), as in FLUX.

A ``HunyuanVideo15TransformerBlock`` is called with ``(hidden_states, encoder_hidden_states, temb,
attention_mask, freqs_cis)`` and returns ``(hidden_states, encoder_hidden_states)``. The text stream
that reaches the blocks is not the transformer's ``encoder_hidden_states`` argument alone: the
transformer concatenates, per sample, the image tokens (729 SigLIP tokens, all masked out in
text-to-video), the ByT5 glyph tokens (256) and the refined Qwen tokens (1000), valid tokens first and
padding after, into 1985 context tokens. The block's joint attention (``HunyuanVideo15AttnProcessor2_0``,
through ``dispatch_attention_fn``) concatenates ``[video, context]``: the context tokens are *last*
among queries and keys, and a [B, 1, S, S] boolean mask drops the padding rows and columns. The token
refiner's self-attention (``AttnProcessor2_0``, through SDPA) sees text tokens only.

The pipeline takes its guidance from a ``guider`` component (diffusers' ``ClassifierFreeGuidance``,
saved as ``guider/guider_config.json`` and kept in the package), not from a call argument
(``guidance_arg`` None: ``--guidance`` is refused in one line): with its ``guidance_scale`` != 1 it
runs the transformer twice per step, in the cache contexts ``"pred_cond"`` and ``"pred_uncond"``,
which the cache schedule keeps apart and CFG parallel splits like FLUX's ``"cond"``/``"uncond"``.
The pipeline has no ``callback_on_step_end``: calibration, the report and the cache search read the
latents through its scheduler's step (``calibrate.steps``). Its prompt lengths are fixed in
``HunyuanVideo15Pipeline.__init__`` (1000 Qwen tokens after a 108-token template crop, 256 ByT5 tokens),
so no call argument sets them either. The latents are ``(B, 32, F, H, W)`` (16x spatial, 4x temporal
VAE); the transformer reads them concatenated with the zero condition latents and mask (65 channels)
and patchifies them (1, 1, 1). The VAE's causal attention mask is wrong for a batch above 1 (diffusers
0.42.1 builds it [B, S, S] for [B, 1, S, S] queries): the report decodes one sample at a time
(``bounded_decode``), as ``sdkiln run`` does.

The transformer's forward branches on its data before the blocks (whether ``image_embeds`` are all
zero) and gathers the valid context tokens with boolean masks, so Dynamo cannot trace it as one graph:
``compile_regional`` has ``sdkiln.load`` compile its repeated blocks one graph per kind.

Variants, by transformer width (16 heads of 128, Qwen width 3584, ByT5 width 1472, SigLIP 1152) and
``target_size``, the resolution each checkpoint was trained at (the 480p and 720p configs differ in
nothing else): HunyuanVideo-1.5-480p_t2v at 480x848 and HunyuanVideo-1.5-720p_t2v at 720x1280, with
the pipeline's defaults of 121 frames and 50 steps; both guiders are ``guidance_scale=6.0``, the flow
shifts (the scheduler's, in model_index.json) 5.0 and 9.0.

Refused (``refusals``): block-sparse attention (the joint attention always carries a padding mask),
Ulysses and ring attention (diffusers gives the transformer no ``_cp_plan``) and ONNX (the
transformer's forward is data-dependent, which torch.export cannot trace).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sdkiln.model_zoo.spec import AttentionSite, BlockList, ModelSpec, TokenGrid, Variant

if TYPE_CHECKING:
    from diffusers import HunyuanVideo15Pipeline

_SEED = 0
_TEXT_DIM = 32
_LATENT_CHANNELS = 8

# Qwen2.5-VL's chat markup, as its tokenizer's template renders the pipeline's system + user messages.
_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def qwen2_tokenizer():
    """A byte-level BPE in Qwen2's class with no merges: every string tokenizes byte by byte; the chat
    markup tokens are single special tokens, ``<|endoftext|>`` (0) pads on the right as in the
    published pipeline's tokenizer."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    symbols = [*_QWEN_SPECIALS, *sorted(pre_tokenizers.ByteLevel.alphabet())]
    tokenizer = Qwen2Tokenizer(
        vocab={s: i for i, s in enumerate(symbols)},
        merges=[],
        padding_side="right",
        additional_special_tokens=list(_QWEN_SPECIALS[1:]),
    )
    tokenizer.chat_template = _QWEN_CHAT_TEMPLATE
    return tokenizer


def tiny() -> HunyuanVideo15Pipeline:
    """A real ``HunyuanVideo15Pipeline`` at test size with fixed random weights (float32, eval mode).

    Transformer: 2 dual-stream blocks and 2 refiner blocks, width 64 (2 heads of 32, RoPE split
    8/12/12), FFN 256. Text: a 3-layer Qwen2.5-VL text model and a 2-layer T5 encoder for ByT5, both
    width 32. The VAE keeps the 4x temporal compression at 4x spatial (two down blocks of width 16,
    8 latent channels): 5 frames of 32x32 are a 2x8x8 latent, 128 video tokens beside the 1985 context
    tokens the pipeline always sends.
    """
    import torch
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import (
        ByT5Tokenizer,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        T5Config,
        T5EncoderModel,
    )

    tokenizer = qwen2_tokenizer()
    tokenizer_2 = ByT5Tokenizer(extra_ids=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        transformer = HunyuanVideo15Transformer3DModel(
            in_channels=2 * _LATENT_CHANNELS + 1,
            out_channels=_LATENT_CHANNELS,
            num_attention_heads=2,
            attention_head_dim=32,
            num_layers=2,
            num_refiner_layers=2,
            mlp_ratio=4.0,
            patch_size=1,
            patch_size_t=1,
            text_embed_dim=_TEXT_DIM,
            text_embed_2_dim=_TEXT_DIM,
            image_embed_dim=_TEXT_DIM,
            rope_axes_dim=(8, 12, 12),
            target_size=32,
            task_type="t2v",
        ).eval()
        vae = AutoencoderKLHunyuanVideo15(
            latent_channels=_LATENT_CHANNELS,
            block_out_channels=(16, 16),
            layers_per_block=1,
            spatial_compression_ratio=4,
            temporal_compression_ratio=4,
            downsample_match_channel=False,
            upsample_match_channel=False,
        ).eval()
        text_encoder = Qwen2_5_VLTextModel(
            Qwen2_5_VLTextConfig(
                vocab_size=len(tokenizer),
                hidden_size=_TEXT_DIM,
                intermediate_size=2 * _TEXT_DIM,
                num_hidden_layers=3,
                num_attention_heads=2,
                num_key_value_heads=2,
                max_position_embeddings=2048,
                rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]},
                rope_theta=1000000.0,
                pad_token_id=0,
                bos_token_id=0,
                eos_token_id=2,
            )
        ).eval()
        text_encoder_2 = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer_2),
                d_model=_TEXT_DIM,
                d_kv=_TEXT_DIM // 4,
                d_ff=2 * _TEXT_DIM,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                pad_token_id=0,
                eos_token_id=1,
                decoder_start_token_id=0,
            )
        ).eval()
    return HunyuanVideo15Pipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )


_REAL_WIDTH = {
    "in_channels": 65,
    "out_channels": 32,
    "num_attention_heads": 16,
    "attention_head_dim": 128,
    "text_embed_dim": 3584,
    "text_embed_2_dim": 1472,
    "image_embed_dim": 1152,
    "task_type": "t2v",
}


def _published(height: int, width: int) -> dict:
    return {
        "num_inference_steps": 50,
        "height": height,
        "width": width,
        "num_frames": 121,
        "output_type": "np",
    }


HUNYUAN_VIDEO15_VARIANTS = (
    Variant(
        "HunyuanVideo-1.5-480p_t2v",
        "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v (8.3B), 480p",
        match={**_REAL_WIDTH, "target_size": 640},
        call_defaults=_published(480, 848),
        guidance_arg=None,  # the guider component's guidance_scale
        sparse_block_size=128,
    ),
    Variant(
        "HunyuanVideo-1.5-720p_t2v",
        "hunyuanvideo-community/HunyuanVideo-1.5-720p_t2v (8.3B), 720p",
        match={**_REAL_WIDTH, "target_size": 960},
        call_defaults=_published(720, 1280),
        guidance_arg=None,  # the guider component's guidance_scale
        sparse_block_size=128,
    ),
    Variant(
        "tiny",
        "the test build (tiny() above): 2 heads of 32, text widths 32, 8 latent channels",
        match={
            "in_channels": 2 * _LATENT_CHANNELS + 1,
            "out_channels": _LATENT_CHANNELS,
            "num_attention_heads": 2,
            "attention_head_dim": 32,
            "text_embed_dim": _TEXT_DIM,
            "text_embed_2_dim": _TEXT_DIM,
            "image_embed_dim": _TEXT_DIM,
            "task_type": "t2v",
            "target_size": 32,
        },
        call_defaults={
            "num_inference_steps": 4,
            "height": 32,
            "width": 32,
            "num_frames": 5,
            "output_type": "np",
        },
        guidance_arg=None,
        sparse_block_size=16,
    ),
)

_NO_SEQUENCE_PARALLEL = (
    "diffusers' HunyuanVideo15Transformer3DModel has no _cp_plan, and its attention processor pads the "
    "text mask to the sequence it holds into a [B, 1, S, S] mask, which a sharded sequence cannot use"
)

SPEC = ModelSpec(
    name="hunyuan-video-1.5-tiny",
    family="hunyuan-video-1.5",
    description="HunyuanVideo-1.5 text-to-video architecture (dual-stream MMDiT) at test size with random weights",
    pipeline_class="diffusers:HunyuanVideo15Pipeline",
    transformer_attr="transformer",
    # cfg_calls stays empty: the guider (a component, not a call argument) runs the two branches as two
    # transformer calls per step whenever its guidance_scale is not 1, which no call argument says
    # (plan.cfg_factor counts two for guidance_arg None)
    block_lists=(
        BlockList(
            "transformer_blocks",
            inputs=("hidden_states", "encoder_hidden_states"),
            outputs=("hidden_states", "encoder_hidden_states"),
        ),
    ),
    float_layers=(),
    weight_only_layers=("transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm1_context.linear"),
    default_recipe="te-w8a16+quant-auto+cache-auto",
    build=tiny,
    size_multiple=16,  # the VAE's 16x spatial compression, patch 1
    frame_step=4,  # the VAE compresses time by 4: 4k + 1 frames
    max_text_tokens=1000,
    eval_prompts=(
        "a cat walking on grass",
        'a neon sign that reads "OPEN" flickering at night',
        "waves breaking on a beach",
    ),
    calibration_prompts=(
        "a dog running in a park",
        'a chalkboard with "HELLO" written on it',
        "a candle flickering",
    ),
    # the blocks' joint attention: [video, context] with the 1985 context tokens last (the count the
    # seam reads from text_arg is the 1000 Qwen tokens alone); the refiner's self-attention: text only
    attention=(
        AttentionSite(
            "transformer_blocks.*.attn", "HunyuanVideo15AttnProcessor2_0", "dispatch", "last", "last"
        ),
        AttentionSite(
            "context_embedder.token_refiner.refiner_blocks.*.attn", "AttnProcessor2_0", "sdpa", "all", "all"
        ),
    ),
    # the latents [B, C, F, H, W] (with the condition channels), patchified (1, 1, 1) in (frame, row, column) order
    token_grid=TokenGrid("hidden_states", "latents", (1, 1, 1)),
    variants=HUNYUAN_VIDEO15_VARIANTS,
    compile_regional=(
        "its forward branches on the data before the blocks (whether image_embeds are all zero) and "
        "gathers the valid context tokens with boolean masks, which Dynamo cannot trace in one graph"
    ),
    refusals={
        "sparse": (
            "its joint attention always passes a [B, 1, S, S] padding mask over the context tokens, and "
            "sdkiln's block-sparse attention takes no attention mask"
        ),
        "onnx": (
            "torch.export cannot trace diffusers' HunyuanVideo15Transformer3DModel.forward: it branches on "
            "the data (whether image_embeds are all zero) and gathers the valid context tokens with boolean masks"
        ),
        "ulysses": _NO_SEQUENCE_PARALLEL,
        "ring": _NO_SEQUENCE_PARALLEL,
    },
).resolve("tiny")
