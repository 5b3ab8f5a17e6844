"""HunyuanVideo text-to-video: 20 dual-stream blocks then 40 single-stream blocks, with a token refiner.

``HunyuanVideoTransformer3DModel`` patchifies the latents [B, 16, F, H, W] by (1, 2, 2) into video
tokens and runs the LLaMA text tokens through ``context_embedder`` (a 2-block self-attention
*token refiner*) before the main blocks. Both main block kinds attend over one joint sequence with
the video tokens FIRST and the text LAST: the dual block (``transformer_blocks``) projects the two
streams separately and concatenates them inside ``HunyuanVideoAttnProcessor2_0``; the single block
(``single_transformer_blocks``) concatenates them before its norm and splits them after. Both are
called with ``hidden_states`` and ``encoder_hidden_states`` and return them in that order. Every
joint attention is passed a key mask [B, 1, 1, video + text] that leaves out the text padding.

Only Linear layers inside ``block_lists`` are quantized: the token refiner, the patch and condition
embedders, ``norm_out`` and ``proj_out`` stay float unlisted (the refiner sees the text tokens only,
a few hundred against a video's tens of thousands). ``weight_only_layers`` names the adaLN
modulation Linears, as in FLUX: the dual block's AdaLayerNormZero pair and the single block's
AdaLayerNormZeroSingle, whose chunk layout is FLUX's, so FLUX's SmoothQuant folds hold name for name.

Guidance is distilled: ``guidance_scale`` (6.0) is an input of the transformer, one pass per step.
True classifier-free guidance is the pipeline's option: ``true_cfg_scale`` above 1 with a
``negative_prompt`` runs a second, unconditional pass per step (``cfg_calls``).

The LLaMA prompt goes through a chat template whose first ``crop_start`` (95) tokens -- the system
prompt and headers, as Llama-3's tokenizer splits them -- are cut from the text encoder's output, so
the transformer sees ``max_sequence_length`` tokens of the user's prompt. The tiny build's tokenizer
is a ``LlamaTokenizerFast`` of the real class whose merges are learned, in memory, from that template
until its fixed part is 95 tokens, so the crop lands on the user's prompt as it does with Llama-3.

Variant: hunyuanvideo-community/HunyuanVideo (24 heads of 128, LLaMA width 4096, CLIP pooled 768),
with HunyuanVideoPipeline's defaults: 50 steps, embedded guidance 6.0, 720x1280, 129 frames, 256 text
tokens.
"""

from __future__ import annotations

import collections
import itertools
import string
from typing import TYPE_CHECKING

from sdkiln.model_zoo.flux import FLUX_SMOOTH_FOLDS
from sdkiln.model_zoo.spec import AttentionSite, BlockList, ModelSpec, TokenGrid, Variant

if TYPE_CHECKING:
    from diffusers import HunyuanVideoPipeline
    from transformers import LlamaModel, LlamaTokenizerFast

_SEED = 0
_TEXT_DIM = 32
_TEXT_TOKENS = 16
_CROP_START = 95
"""HunyuanVideoPipeline's DEFAULT_PROMPT_TEMPLATE crop: the template's fixed part in Llama-3 tokens."""
_LLAMA_SPECIALS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
_BOS, _EOS, _UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"


def _words(symbols: list[str]) -> list[tuple[str, ...]]:
    """Character symbols cut into the units merges may join: special tokens and newlines stand
    alone, and a word starts at each ``▁`` (Metaspace's space)."""
    specials = (*_LLAMA_SPECIALS, _BOS)
    words, word = [], []
    for s in symbols:
        starts = s in specials or s == "\n" or s.startswith("\u2581") or word[-1:] == ["\n"]
        if starts and word:
            words.append(tuple(word))
            word = []
        if s not in specials:
            word.append(s)
    if word:
        words.append(tuple(word))
    return words


def _merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if word[i : i + 2] == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _llama(merges: list[tuple[str, str]]) -> LlamaTokenizerFast:
    from transformers import LlamaTokenizerFast

    symbols = [
        _UNK, _BOS, _EOS, *_LLAMA_SPECIALS, *(f"<0x{i:02X}>" for i in range(256)), "\u2581", "\n",
        *(c for c in string.printable if not c.isspace()),
    ]  # fmt: skip
    vocab = {s: i for i, s in enumerate(symbols)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return LlamaTokenizerFast(
        vocab=vocab,
        merges=merges,
        bos_token=_BOS,
        eos_token=_EOS,
        pad_token=_EOS,
        unk_token=_UNK,
        add_bos_token=True,
        add_prefix_space=False,
        padding_side="right",
        additional_special_tokens=list(_LLAMA_SPECIALS),
    )


def llama_tokenizer() -> LlamaTokenizerFast:
    """A byte-fallback BPE ``LlamaTokenizerFast`` (Llama-3's special tokens, right padding) whose
    merges are learned from HunyuanVideo's prompt template until the template's fixed part -- the
    text before the prompt, with the beginning-of-text token -- is ``_CROP_START`` tokens.

    The merges never join across a space or a newline, so a prompt after the template's last
    ``\\n\\n`` starts a token of its own. Each merge is the most frequent adjacent pair, ties broken by
    the pair's text: the same merges on every machine.
    """
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    template = DEFAULT_PROMPT_TEMPLATE
    if template["crop_start"] != _CROP_START:
        raise ValueError(
            f"HunyuanVideoPipeline's template crops {template['crop_start']} tokens, not {_CROP_START}"
        )
    prefix = template["template"].split("{}")[0]
    plain = _llama([])
    fixed = 1 + sum(prefix.count(s) for s in _LLAMA_SPECIALS)  # the BOS and the special tokens
    words = collections.Counter(_words(plain.tokenize(prefix)))
    merges: list[tuple[str, str]] = []
    while fixed + sum(len(w) * n for w, n in words.items()) > _CROP_START:
        pairs = collections.Counter()
        for w, n in words.items():
            for pair in itertools.pairwise(w):
                pairs[pair] += n
        pair = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(pair)
        words = collections.Counter({_merge(w, pair): n for w, n in words.items()})
    tokenizer = _llama(merges)
    if len(tokenizer(prefix).input_ids) != _CROP_START:
        raise ValueError(
            f"the tiny LLaMA tokenizer splits HunyuanVideo's template into {len(tokenizer(prefix).input_ids)} "
            f"tokens, not {_CROP_START}"
        )
    return tokenizer


def llama_text_encoder(vocab_size: int) -> LlamaModel:
    """A 3-layer LLaMA: the pipeline reads the hidden states of its third-to-last layer output."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=_TEXT_DIM,
        intermediate_size=2 * _TEXT_DIM,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    return LlamaModel(config).eval()


def tiny() -> HunyuanVideoPipeline:
    """A real ``HunyuanVideoPipeline`` at test size with fixed random weights (float32, eval mode).

    Transformer: 2 dual + 2 single blocks and a 2-block token refiner, width 64 (2 heads of 32, the
    3D RoPE splitting each head 8/12/12), MLP 256. The VAE keeps HunyuanVideo's 4x temporal and 8x
    spatial compression at width 8: 5 frames of 64x64 are a 2x8x8 latent, 2x4x4 = 32 video tokens
    after the (1, 2, 2) patch, next to 16 text tokens.

    The diffusers and transformers imports live here so that reading the spec costs none of them.
    """
    import torch
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )

    from sdkiln.model_zoo import tiny_text

    tokenizer = llama_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        transformer = HunyuanVideoTransformer3DModel(
            in_channels=16,
            out_channels=16,
            num_attention_heads=2,
            attention_head_dim=32,
            num_layers=2,
            num_single_layers=2,
            num_refiner_layers=2,
            mlp_ratio=4.0,
            patch_size=2,
            patch_size_t=1,
            qk_norm="rms_norm",
            guidance_embeds=True,
            text_embed_dim=_TEXT_DIM,
            pooled_projection_dim=_TEXT_DIM,
            rope_theta=256.0,
            rope_axes_dim=(8, 12, 12),
        ).eval()
        vae = AutoencoderKLHunyuanVideo(
            in_channels=3,
            out_channels=3,
            latent_channels=16,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            norm_num_groups=4,
            spatial_compression_ratio=8,
            temporal_compression_ratio=4,
        ).eval()
        text_encoder = llama_text_encoder(len(tokenizer))
        text_encoder_2 = tiny_text.clip_text_encoder(_TEXT_DIM)
    return HunyuanVideoPipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tiny_text.clip_tokenizer(),
    )


_NO_MASKED_ATTENTION = (
    "HunyuanVideo's transformer passes every joint attention a key mask (the text padding), and "
    "{what} takes no attention mask"
)

HUNYUAN_VIDEO_VARIANTS = (
    Variant(
        "HunyuanVideo",
        "hunyuanvideo-community/HunyuanVideo (13B, guidance-distilled), 720p",
        match={
            "in_channels": 16,
            "num_attention_heads": 24,
            "attention_head_dim": 128,
            "text_embed_dim": 4096,
            "pooled_projection_dim": 768,
            "guidance_embeds": True,
        },
        call_defaults={
            "num_inference_steps": 50,
            "guidance_scale": 6.0,
            "height": 720,
            "width": 1280,
            "num_frames": 129,
            "max_sequence_length": 256,
            "output_type": "np",
        },
        sparse_block_size=128,
    ),
    Variant(
        "tiny",
        "the test build (tiny() above): 2 heads of 32, text width 32, embedded guidance",
        match={
            "in_channels": 16,
            "num_attention_heads": 2,
            "attention_head_dim": 32,
            "text_embed_dim": _TEXT_DIM,
            "pooled_projection_dim": _TEXT_DIM,
            "guidance_embeds": True,
        },
        call_defaults={
            "num_inference_steps": 4,
            "guidance_scale": 6.0,
            "height": 64,
            "width": 64,
            "num_frames": 5,
            "max_sequence_length": _TEXT_TOKENS,
            "output_type": "np",
        },
        sparse_block_size=16,
    ),
)

SPEC = ModelSpec(
    name="hunyuan-video-tiny",
    family="hunyuan-video",
    description="HunyuanVideo text-to-video architecture (dual + single stream) at test size with random weights",
    pipeline_class="diffusers:HunyuanVideoPipeline",
    cfg_calls=("true_cfg_scale", "negative_prompt"),
    transformer_attr="transformer",
    block_lists=(
        BlockList(
            "transformer_blocks",
            inputs=("hidden_states", "encoder_hidden_states"),
            outputs=("hidden_states", "encoder_hidden_states"),
        ),
        BlockList(
            "single_transformer_blocks",
            inputs=("hidden_states", "encoder_hidden_states"),
            outputs=("hidden_states", "encoder_hidden_states"),
        ),
    ),
    float_layers=(),
    weight_only_layers=(
        "transformer_blocks.*.norm1.linear",
        "transformer_blocks.*.norm1_context.linear",
        "single_transformer_blocks.*.norm.linear",
    ),
    # block-sparse attention takes no attention mask (refusals), so the default stops at quant + cache
    default_recipe="te-w8a16+quant-auto+cache-auto",
    build=tiny,
    size_multiple=16,  # the VAE's 8x times the 2x2 patch
    frame_step=4,  # the VAE compresses time by 4: 4k + 1 frames
    max_text_tokens=256,
    eval_prompts=("a cat walking on grass", "waves breaking on a beach", "a car driving through rain"),
    calibration_prompts=("a dog running in a park", "clouds moving over mountains", "a candle flickering"),
    smooth_folds=FLUX_SMOOTH_FOLDS,
    # video tokens first, text last, in both block kinds; the token refiner's self-attention over the
    # text alone (diffusers' AttnProcessor2_0, through SDPA) runs before the blocks
    attention=(
        AttentionSite(
            "transformer_blocks.*.attn", "HunyuanVideoAttnProcessor2_0", "dispatch", "last", "last"
        ),
        AttentionSite(
            "single_transformer_blocks.*.attn", "HunyuanVideoAttnProcessor2_0", "dispatch", "last", "last"
        ),
        AttentionSite(
            "context_embedder.token_refiner.refiner_blocks.*.attn", "AttnProcessor2_0", "sdpa", "all", "all"
        ),
    ),
    # the latents [B, C, F, H, W], patchified (1, 2, 2) into tokens in (frame, row, column) order
    token_grid=TokenGrid("hidden_states", "latents", (1, 2, 2)),
    variants=HUNYUAN_VIDEO_VARIANTS,
    refusals={
        "sparse": _NO_MASKED_ATTENTION.format(what="block-sparse attention"),
        "ulysses": _NO_MASKED_ATTENTION.format(what="sequence-parallel attention"),
        "ring": _NO_MASKED_ATTENTION.format(what="sequence-parallel attention"),
        "onnx": (
            "HunyuanVideo's transformer builds its attention mask with masked_fill on a bool tensor, which "
            "exports as an ONNX Where over bools that onnxruntime's CPU provider does not implement"
        ),
    },
).resolve("tiny")
