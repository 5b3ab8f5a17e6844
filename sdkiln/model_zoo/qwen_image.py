"""Qwen-Image: 60 double-stream (MMDiT) blocks, text from Qwen2.5-VL's last hidden state.

Every ``QwenImageTransformerBlock`` keeps two streams, the image tokens (``hidden_states``) and the
text tokens (``encoder_hidden_states``), each with its own adaLN modulation Linear (``img_mod.1``,
``txt_mod.1``: shift, scale and gate for the attention and for the MLP, six chunks), its own Q/K/V
projections and its own GELU MLP. The two meet in one joint attention,
``QwenDoubleStreamAttnProcessor2_0``: the text tokens come first in the joint sequence, every token
attends to every other, and the output is split back (``to_out.0`` for the image, ``to_add_out`` for the
text). There is no single-stream block. A block is called with ``hidden_states`` and
``encoder_hidden_states`` and returns ``(encoder_hidden_states, hidden_states)``.

Only Linear layers inside ``block_lists`` are quantized: ``img_in``, ``txt_norm``, ``txt_in``,
``time_text_embed``, ``norm_out`` and ``proj_out`` stay float without being listed. The two
modulation Linears are a third of every block's parameters (12 x 3072^2 of 36 x 3072^2; 6.8B of the
20.4B): they are ``weight_only_layers``, as in FLUX.

The text is the prompt in a chat template whose system part (``prompt_template_encode_start_idx`` =
34 tokens) is dropped after the encoder; the prompt is not padded to a fixed length, so the number of
text tokens is the prompt's (at most ``max_sequence_length``) and differs between the prompt and the
negative prompt. Guidance is true classifier-free guidance: ``true_cfg_scale`` > 1 with a
``negative_prompt`` runs a second transformer call per step (the published model has no guidance
embedding). The pipeline's image-token positions reach the transformer as ``img_shapes`` (a list of
(frames, rows, columns)), not as a tensor of ids or latents: block-sparse attention has no token grid
to tile by.

Variants, by transformer width (24 heads of 128, text width 3584, 64 packed latent channels):
Qwen-Image (``Qwen/Qwen-Image``), with QwenImagePipeline's defaults (50 steps, ``true_cfg_scale`` 4.0,
512 text tokens) at the model card's 1:1 resolution 1328x1328 and its negative prompt " "; the
zoo's tiny build.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from sdkiln.model_zoo.spec import (
    AttentionSite,
    BlockList,
    ModelSpec,
    ParallelPlan,
    SequenceGather,
    SequenceSplit,
    SmoothFold,
    Variant,
)

if TYPE_CHECKING:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

_SEED = 0
TINY_TEXT_DIM = 32
_MAX_TEXT_TOKENS = 16

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
"""QwenImagePipeline's ``prompt_template_encode``: the tiny tokenizer is built so that the part before
the prompt is ``prompt_template_encode_start_idx`` (34) tokens, as with the real Qwen2 tokenizer."""
TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def qwen2_tokenizer(
    template: str = PROMPT_TEMPLATE, specials: tuple[str, ...] = TINY_SPECIALS
) -> Qwen2Tokenizer:
    """A byte-level Qwen2 BPE whose merges spell the words of a pipeline's chat template ``template``.

    The ``specials`` take the first ids, ``<|endoftext|>`` = 0 (also pad), ``<|im_start|>`` = 1,
    ``<|im_end|>`` = 2 and any others after them, then come the 256 byte symbols, then one symbol per
    merge. The merges build every word of the template letter by letter, so its system part is one token
    per word and punctuation mark, as the real 152k-token tokenizer makes it (34 tokens for
    :data:`PROMPT_TEMPLATE`): the pipeline drops exactly the system part. Other text is mostly single
    bytes.
    """
    from tokenizers import AddedToken, Regex, pre_tokenizers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    split = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    plain = template.replace("{}", "")
    for special in specials:
        plain = plain.replace(special, "\n")
    vocab = {s: i for i, s in enumerate((*specials, *sorted(pre_tokenizers.ByteLevel.alphabet())))}
    merges: list[tuple[str, str]] = []
    for word in dict.fromkeys(w for w, _ in split.pre_tokenize_str(plain)):
        for i in range(1, len(word)):
            if (word[:i], word[i]) not in merges:
                merges.append((word[:i], word[i]))
                vocab.setdefault(word[: i + 1], len(vocab))
    # A merge of two letters can outrank a word's own spelling (QwenImageEditPipeline's "color" makes
    # "co" before " consistency" makes " c"): the template's words (between its special tokens) that
    # come out in pieces have their merges moved first until each is one token (Qwen-Image's template
    # needs no move).
    segments = re.split("|".join(map(re.escape, specials)), template.replace("{}", ""))
    words = list(dict.fromkeys(w for segment in segments for w, _ in split.pre_tokenize_str(segment)))
    for _ in range(len(words)):
        tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=32768)
        pieces = [w for w in words if len(tokenizer.backend_tokenizer.model.tokenize(w)) > 1]
        if not pieces:
            break
        first = list(dict.fromkeys((w[:i], w[i]) for w in pieces for i in range(1, len(w))))
        merges = first + [merge for merge in merges if merge not in first]
    else:
        raise ValueError(f"no order of the spelling merges makes {pieces[:3]} one token each")
    tokenizer.add_tokens([AddedToken(s, special=True) for s in specials[1:]])
    return tokenizer


def qwen2_5_vl_text_encoder(
    hidden_size: int, vocab_size: int, **token_ids: int
) -> Qwen2_5_VLForConditionalGeneration:
    """A 2-layer Qwen2.5-VL (2 heads, so head size ``hidden_size / 2`` split by M-RoPE 1/4, 3/8, 3/8)
    with a 2-block vision tower of width 16 (14-pixel patches, merged 2x2), which the text-to-image
    pipeline never calls and the edit pipeline runs on its input image. ``token_ids``: the config's
    vision token ids (``image_token_id``, ``vision_start_token_id``, ...) in the tokenizer's vocabulary."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    half_head = hidden_size // 4
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [
                    half_head // 4,
                    3 * half_head // 8,
                    half_head - half_head // 4 - 3 * half_head // 8,
                ],
            },
            "bos_token_id": 0,
            "eos_token_id": 2,
            "pad_token_id": 0,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": hidden_size,
            "fullatt_block_indexes": [1],
        },
        **token_ids,
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def tiny_transformer() -> QwenImageTransformer2DModel:
    """The test builds' transformer: 2 double-stream blocks, width 128 (4 heads of 32, RoPE axes 8/12/12),
    text width 32, drawn from torch's current random state."""
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=2,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=TINY_TEXT_DIM,
        axes_dims_rope=(8, 12, 12),
    ).eval()


def tiny_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Qwen-Image's scheduler (exponential dynamic shift over 256..8192 tokens, 0.5..0.9) without its
    ``shift_terminal`` 0.02, with which diffusers' scheduler makes NaN timesteps for a 1-step call (0 / 0
    when stretching the one sigma): tests and tools run the test builds for single steps."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=8192,
        max_shift=0.9,
        shift=1.0,
        time_shift_type="exponential",
        use_dynamic_shifting=True,
    )


def tiny() -> QwenImagePipeline:
    """A real ``QwenImagePipeline`` at test size with fixed random weights (float32, eval mode).

    Transformer: :func:`tiny_transformer`. The VAE keeps Qwen-Image's 8x spatial compression and 16
    latent channels at base width 8, so a 128x128 image is a 16x16x16 latent, packed 2x2 into 8x8 = 64
    image tokens of 64 channels. The text encoder is a 2-layer Qwen2.5-VL of width 32. The scheduler:
    :func:`tiny_scheduler`.

    The diffusers and transformers imports live here so that reading the spec costs none of them.
    """
    import torch
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline

    tokenizer = qwen2_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        transformer = tiny_transformer()
        vae = AutoencoderKLQwenImage(
            base_dim=8,
            z_dim=16,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        ).eval()
        # At this width the decoder's images are grey within +-0.05; a 4x output convolution spreads
        # them over most of [0, 1], so that image metrics see what the transformer changes.
        with torch.no_grad():
            vae.decoder.conv_out.weight.mul_(4.0)
            vae.decoder.conv_out.bias.mul_(4.0)
        text_encoder = qwen2_5_vl_text_encoder(TINY_TEXT_DIM, 16 * -(-len(tokenizer) // 16))
    return QwenImagePipeline(
        scheduler=tiny_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


# SmoothQuant folds (see SmoothFold). Each stream's modulation Linear (``img_mod.1``, ``txt_mod.1``) gives
# six chunks, split in two halves of (shift, scale, gate): the first pair modulates norm1's output
# (a LayerNorm without affine), which only that stream's attention projections read; the second pair
# modulates norm2's output, which only that stream's first MLP Linear reads. attn.to_out.0,
# attn.to_add_out and the MLPs' second Linears read attention or GELU outputs: they keep an input multiplier.
QWEN_IMAGE_SMOOTH_FOLDS = (
    SmoothFold("transformer_blocks", "img_mod.1", ("attn.to_q", "attn.to_k", "attn.to_v"), 6, 0, 1),
    SmoothFold("transformer_blocks", "img_mod.1", ("img_mlp.net.0.proj",), 6, 3, 4),
    SmoothFold(
        "transformer_blocks", "txt_mod.1", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), 6, 0, 1
    ),
    SmoothFold("transformer_blocks", "txt_mod.1", ("txt_mlp.net.0.proj",), 6, 3, 4),
)

# Sequence parallelism with the text replicated: diffusers' QwenImageTransformer2DModel._cp_plan without
# its text splits (encoder_hidden_states, encoder_hidden_states_mask, the text RoPE table pos_embed[1]).
# The image tokens are split where the first block reads them, with their RoPE table (pos_embed's
# output 0, [S_image, head / 2] complex); proj_out reads the image stream only and is gathered.
# (modulate_index, the per-token modulation choice of zero_cond_t models, is not split: such a
# model is not a variant here.)
QWEN_IMAGE_PARALLEL = ParallelPlan(
    splits=(
        SequenceSplit("pos_embed", 0, 0, 2, output=True),
        SequenceSplit("transformer_blocks.0", "hidden_states", 1, 3),
    ),
    gathers=(SequenceGather("proj_out", 1, 3),),
)

QWEN_IMAGE_REAL_WIDTH = {
    "in_channels": 64,
    "out_channels": 16,
    "num_attention_heads": 24,
    "attention_head_dim": 128,
    "joint_attention_dim": 3584,
}
QWEN_IMAGE_ONE_STREAM = {
    "guidance_embeds": False,
    "zero_cond_t": False,
    "use_additional_t_cond": False,
    "use_layer3d_rope": False,
}
QWEN_IMAGE_VARIANTS = (
    Variant(
        "Qwen-Image",
        "Qwen/Qwen-Image, 20B MMDiT, 1328x1328",
        match={**QWEN_IMAGE_REAL_WIDTH, **QWEN_IMAGE_ONE_STREAM},
        call_defaults={
            "num_inference_steps": 50,
            "true_cfg_scale": 4.0,
            "negative_prompt": " ",
            "height": 1328,
            "width": 1328,
            "max_sequence_length": 512,
            "output_type": "np",
        },
        guidance_arg="true_cfg_scale",
    ),
    Variant(
        "tiny",
        "the test build (tiny() above): 4 heads of 32, text width 32",
        match={
            "in_channels": 64,
            "out_channels": 16,
            "num_attention_heads": 4,
            "attention_head_dim": 32,
            "joint_attention_dim": TINY_TEXT_DIM,
            **QWEN_IMAGE_ONE_STREAM,
        },
        call_defaults={
            "num_inference_steps": 4,
            "true_cfg_scale": 4.0,
            "negative_prompt": " ",
            "height": 128,
            "width": 128,
            "max_sequence_length": _MAX_TEXT_TOKENS,
            "output_type": "np",
        },
        guidance_arg="true_cfg_scale",
    ),
)

SPEC = ModelSpec(
    name="qwen-image-tiny",
    family="qwen-image",
    description="Qwen-Image architecture (double-stream MMDiT, Qwen2.5-VL text) at test size with random weights",
    pipeline_class="diffusers:QwenImagePipeline",
    cfg_calls=("true_cfg_scale", "negative_prompt"),
    transformer_attr="transformer",
    block_lists=(
        BlockList(
            "transformer_blocks",
            inputs=("hidden_states", "encoder_hidden_states"),
            outputs=("encoder_hidden_states", "hidden_states"),
        ),
    ),
    float_layers=(),
    weight_only_layers=("transformer_blocks.*.img_mod.1", "transformer_blocks.*.txt_mod.1"),
    default_recipe="te-w8a16+quant-auto+cache-auto",
    build=tiny,
    size_multiple=16,  # the VAE's 8x and the 2x2 packing
    max_text_tokens=1024,  # QwenImagePipeline.check_inputs refuses more
    eval_prompts=("a photo of a cat", "a red car on a mountain road", "a bowl of fruit, oil painting"),
    calibration_prompts=("a photo of a dog", "a city skyline at night", "a watercolor of a lighthouse"),
    smooth_folds=QWEN_IMAGE_SMOOTH_FOLDS,
    # one joint attention per block, text tokens first (QwenDoubleStreamAttnProcessor2_0 concatenates
    # [text, image] and calls dispatch_attention_fn)
    attention=(
        AttentionSite(
            "transformer_blocks.*.attn", "QwenDoubleStreamAttnProcessor2_0", "dispatch", "first", "first"
        ),
    ),
    parallel_plan=QWEN_IMAGE_PARALLEL,
    variants=QWEN_IMAGE_VARIANTS,
    refusals={
        "sparse": (
            "the transformer gets its image-token grid as img_shapes, a Python list, not as position ids or "
            "latents a TokenGrid can read, so block-sparse attention has no tiling"
        ),
        "onnx": (
            "its RoPE tables are complex tensors (QwenEmbedRope's torch.polar), which torch.onnx cannot convert "
            "(no decomposition of aten.split_with_sizes for a complex input), and its img_shapes input is a "
            "Python list, not a tensor the exporter can pass"
        ),
    },
).resolve("tiny")
