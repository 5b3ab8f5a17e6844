"""The text side of the tiny test pipelines: tokenizers built in memory, random-weight encoders.

The real FLUX/SD3/Wan tokenizers are a 49k-merge CLIP BPE and a 32k-piece (U)MT5 SentencePiece
model; a tiny pipeline only needs a tokenizer of the same *class*, so the pipeline code paths
(padding to ``model_max_length``, truncation, attention masks, save/load) are the real ones and
no hub download is needed.

Both are character-level: CLIP is a byte-level BPE with no merges over the 256 byte symbols, so
every string tokenizes without unknowns; T5 is a Unigram over printable ASCII characters. Both
are ``tokenizers``-backed transformers classes, so ``save_pretrained`` writes only
``tokenizer.json`` and ``tokenizer_config.json`` (no SentencePiece protobuf, no pickle).
"""

from __future__ import annotations

import string

import transformers
from tokenizers import pre_tokenizers
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)

if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(
        f"sdkiln's tiny pipelines need transformers>=5, whose CLIPTokenizer/T5Tokenizer build from an "
        f"in-memory vocabulary; found transformers {transformers.__version__}"
    )

CLIP_MAX_LENGTH = 77
"""The CLIP text encoders' position-embedding length; the pipelines pad every prompt to it."""

_CLIP_SPECIALS = ("<|startoftext|>", "<|endoftext|>")
_T5_SPECIALS = ("<pad>", "</s>", "<unk>")
_T5_CHARS = tuple(c for c in string.printable if not c.isspace())


def clip_vocab_size() -> int:
    return len(_CLIP_SPECIALS) + 2 * len(pre_tokenizers.ByteLevel.alphabet())


def t5_vocab_size() -> int:
    return len(_T5_SPECIALS) + 1 + 2 * len(_T5_CHARS)


def clip_tokenizer() -> CLIPTokenizer:
    """A byte-level CLIP BPE: ``<|startoftext|>`` = 0, ``<|endoftext|>`` = 1 (also the pad token)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    symbols = [*_CLIP_SPECIALS, *alphabet, *(c + "</w>" for c in alphabet)]
    return CLIPTokenizer(
        vocab={s: i for i, s in enumerate(symbols)}, merges=[], model_max_length=CLIP_MAX_LENGTH
    )


def t5_tokenizer(model_max_length: int = 512) -> T5Tokenizer:
    """A character Unigram in T5's layout: ``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2, no sentinels."""
    pieces = [
        *((s, 0.0) for s in _T5_SPECIALS),
        ("\u2581", -2.0),
        *((c, -5.0) for c in _T5_CHARS),
        *(("\u2581" + c, -5.0) for c in _T5_CHARS),
    ]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def clip_text_encoder(
    hidden_size: int, projection_dim: int | None = None
) -> CLIPTextModel | CLIPTextModelWithProjection:
    """A 2-layer CLIP text encoder for :func:`clip_tokenizer`; with ``projection_dim`` the SD3 kind.

    ``eos_token_id`` must name the tokenizer's end token: CLIP pools the hidden state at the first
    ``eos_token_id``, and the default 2 switches it to the legacy argmax-of-ids pooling.
    """
    config = CLIPTextConfig(
        vocab_size=clip_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=CLIP_MAX_LENGTH,
        projection_dim=projection_dim or hidden_size,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    model_cls = CLIPTextModel if projection_dim is None else CLIPTextModelWithProjection
    return model_cls(config).eval()


def _t5_config_kwargs(d_model: int) -> dict:
    return dict(
        vocab_size=t5_vocab_size(),
        d_model=d_model,
        d_kv=d_model // 4,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )


def t5_text_encoder(d_model: int) -> T5EncoderModel:
    """A 2-layer T5 encoder for :func:`t5_tokenizer` (FLUX, SD3)."""
    return T5EncoderModel(T5Config(**_t5_config_kwargs(d_model))).eval()


def umt5_text_encoder(d_model: int) -> UMT5EncoderModel:
    """A 2-layer UMT5 encoder for :func:`t5_tokenizer` (Wan)."""
    return UMT5EncoderModel(UMT5Config(**_t5_config_kwargs(d_model))).eval()
