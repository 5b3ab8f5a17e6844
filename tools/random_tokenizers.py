"""The tokenizers of tools/random_model.py: real vocabulary sizes and special-token ids, made-up pieces.

Each is built in memory in a few seconds from synthetic merges, in the spirit of
``sdkiln/model_zoo/tiny_text.py``: the ids a text encoder's embedding sees are in the real range, the
special tokens sit at their real ids, and where a pipeline cuts a fixed number of tokens off its prompt
template (Qwen-Image 34, HunyuanVideo 95, HunyuanVideo-1.5 108) the template's fixed part is that many
tokens here too, so the cut lands where it does with the real tokenizer. Other text mostly splits into
pieces of one to three characters, more tokens per word than the real vocabularies give.

A byte-level BPE's merges here: first those that spell the words of the pipeline's template (so
that they are one token each), then filler pairs of letters, digits and the space symbol, and each
such symbol before each pair, up to the real size. A filler merge that could join two tokens of the
template's fixed part is left out, so the template splits the same with and without the fillers.
"""

from __future__ import annotations

import itertools
import json
import string
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    ByT5Tokenizer,
    CLIPTokenizer,
    LlamaTokenizerFast,
    Qwen2Tokenizer,
    T5Tokenizer,
    TokenizersBackend,
)

_BYTES = sorted(pre_tokenizers.ByteLevel.alphabet())
"""The 256 symbols of a byte-level BPE, in the order of CLIP's vocabulary ("!" = 0)."""
_ALNUM = string.ascii_lowercase + string.ascii_uppercase + string.digits


@dataclass(frozen=True)
class ClipBpe:
    """CLIP's byte-level BPE at its real size: the 256 byte symbols, the same with ``</w>``, byte-pair
    merges up to 49406 entries, then ``<|startoftext|>`` = 49406 and ``<|endoftext|>`` = 49407, the
    ids of the real vocabulary (CLIP pools at the largest id when its config's ``eos_token_id`` is 2)."""

    pad_token: str = "<|endoftext|>"
    vocab_size: int = 49408
    model_max_length: int = 77

    def merges(self) -> list[tuple[str, str]]:
        symbols = [*_BYTES, *(c + "</w>" for c in _BYTES)]
        pairs = ((a, b) for a in _BYTES for b in symbols)
        return list(itertools.islice(pairs, self.vocab_size - 2 - len(symbols)))

    def build(self) -> CLIPTokenizer:
        merges = self.merges()
        vocab = [*_BYTES, *(c + "</w>" for c in _BYTES), *(a + b for a, b in merges)]
        vocab += ["<|startoftext|>", "<|endoftext|>"]
        return CLIPTokenizer(
            vocab={token: i for i, token in enumerate(vocab)},
            merges=merges,
            pad_token=self.pad_token,
            model_max_length=self.model_max_length,
        )

    def save(self, tokenizer: CLIPTokenizer, path: Path) -> None:
        """``save_pretrained`` writes tokenizer.json; vocab.json and merges.txt are the real repos' files."""
        tokenizer.save_pretrained(path)
        vocab = dict(sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]))
        (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
        merges = "".join(f"{a} {b}\n" for a, b in self.merges())
        (path / "merges.txt").write_text("#version: 0.2\n" + merges)


def _words():
    for n in itertools.count(2):
        for letters in itertools.product(string.ascii_lowercase, repeat=n):
            word = "".join(letters)
            yield ("\u2581" + word, -1.0 - n)
            yield (word, -2.0 - n)


@dataclass(frozen=True)
class T5Unigram:
    """A Unigram in T5's SentencePiece layout: ``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2, printable
    characters and lowercase words up to ``pieces``, then the sentinels with ``<extra_id_0>`` last: the
    real tokenizer's length, below the encoder's padded vocabulary."""

    pieces: int
    extra_ids: int
    model_max_length: int = 512

    def build(self) -> T5Tokenizer:
        chars = [c for c in string.printable if not c.isspace()]
        head = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
        head += [(c, -5.0) for c in chars] + [("\u2581" + c, -5.0) for c in chars]
        vocab = list(itertools.islice(itertools.chain(head, _words()), self.pieces))
        vocab += [(f"<extra_id_{i}>", 0.0) for i in reversed(range(self.extra_ids))]
        return T5Tokenizer(vocab=vocab, extra_ids=self.extra_ids, model_max_length=self.model_max_length)

    def save(self, tokenizer: T5Tokenizer, path: Path) -> None:
        tokenizer.save_pretrained(path)


def _spell(vocab: dict[str, int], words: Iterable[str], ignore_merges: bool = True) -> list[tuple[str, str]]:
    """The merges that make each word one token, their pieces added to ``vocab`` in place. For a BPE
    that looks a word up whole before merging (``ignore_merges``), the word letter by letter:
    (w[:1], w[1]), (w[:2], w[2]), ... Without that, while the merges so far split the word, the merge
    of its first two pieces: the same for most words, doubling for a run of one symbol (the BPE joins
    every pair of spaces in a run of eight before anything else: (Ġ, Ġ), (ĠĠ, ĠĠ), (ĠĠĠĠ, ĠĠĠĠ))."""
    if ignore_merges:
        merges = []
        for word in words:
            for i in range(1, len(word)):
                if word[: i + 1] not in vocab:
                    merges.append((word[:i], word[i]))
                    vocab[word[: i + 1]] = len(vocab)
        return merges
    ranks: dict[tuple[str, str], int] = {}
    for word in words:
        while len(pieces := _merge(word, ranks)) > 1:
            ranks[pieces[0], pieces[1]] = len(ranks)
            vocab.setdefault(pieces[0] + pieces[1], len(vocab))
    return list(ranks)


def _merge(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """``word`` split by a BPE with the merges ``ranks``: the lowest-ranked adjacent pair joined first,
    the leftmost of equals."""
    pieces = list(word)
    while len(pieces) > 1:
        rank, i = min((ranks.get(pair, len(ranks)), i) for i, pair in enumerate(itertools.pairwise(pieces)))
        if rank == len(ranks):
            break
        pieces[i : i + 2] = [pieces[i] + pieces[i + 1]]
    return pieces


def _fill(
    vocab: dict[str, int], merges: list[tuple[str, str]], symbols: str, size: int, keep_apart: set
) -> None:
    """Extend ``vocab`` (and ``merges``) in place with merges over ``symbols`` up to ``size`` entries:
    every pair of symbols, then each symbol before each pair; none whose two sides are in ``keep_apart``
    as a pair, none that makes a piece already in the vocabulary."""
    pairs = ((a, b) for a in symbols for b in symbols)
    triples = ((a, b + c) for b in symbols for c in symbols for a in symbols)
    for a, b in itertools.chain(pairs, triples):
        if len(vocab) >= size:
            return
        if a + b in vocab or (a, b) in keep_apart or b not in vocab:
            continue
        merges.append((a, b))
        vocab[a + b] = len(vocab)
    raise ValueError(f"filler merges ran out at {len(vocab)} of {size} entries")


def _adjacent(tokens: list[str]) -> set[tuple[str, str]]:
    return set(itertools.pairwise(tokens))


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]], pattern: str) -> Tokenizer:
    """A byte-level BPE with ``pattern`` splitting the text first (GPT-2 style)."""
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_level_words(pattern: str, texts: Iterable[str]) -> list[str]:
    split = _bpe({}, [], pattern).pre_tokenizer
    return list(dict.fromkeys(w for text in texts for w, _ in split.pre_tokenize_str(text)))


QWEN_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)  # fmt: skip
"""Qwen2.5's 22 special tokens, ids 151643 to 151664 (``<|image_pad|>`` = 151655, the encoder's
``image_token_id``)."""
QWEN_VISION = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
"""The special tokens a Qwen2.5-VL prompt template holds a picture's place with: the processor expands
``<|image_pad|>`` to the picture's merged patches."""


@dataclass(frozen=True)
class Qwen2Bpe:
    """Qwen2.5-VL's byte-level BPE at its real size: 151643 regular tokens (the 256 byte symbols, the
    words of QwenImagePipeline's prompt template, fillers), then :data:`QWEN_SPECIALS`; pad
    ``<|endoftext|>``, eos ``<|im_end|>``. The template's system part is ``prompt_template_encode_start_idx``
    (34) tokens, as the pipeline drops. The picture's placeholders (:data:`QWEN_VISION`) are taken out
    of the template before it is counted: they are special tokens, and no pipeline drops them."""

    regular: int = 151643
    model_max_length: int = 131072

    @staticmethod
    def template() -> tuple[str, int]:
        """QwenImagePipeline's prompt template and the tokens it drops (its system part)."""
        from diffusers import QwenImagePipeline

        pipe = QwenImagePipeline(
            scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None
        )
        return pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx

    def build(self) -> Qwen2Tokenizer:
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        template, drop = self.template()
        for vision in QWEN_VISION:  # special tokens: the processor expands them, the pipeline keeps them
            template = template.replace(vision, "")
        texts = template.replace("{}", "").replace("<|im_start|>", "\n").split("<|im_end|>")
        words = _byte_level_words(PRETOKENIZE_REGEX, texts)
        vocab = {s: i for i, s in enumerate(_BYTES)}
        merges = _spell(vocab, words, ignore_merges=False)  # as transformers builds a Qwen2Tokenizer
        spelled = _bpe(dict(vocab), list(merges), PRETOKENIZE_REGEX)
        keep_apart = set().union(*(_adjacent(spelled.encode(t).tokens) for t in texts))
        _fill(vocab, merges, _ALNUM + "\u0120", self.regular, keep_apart)
        tokenizer = Qwen2Tokenizer(
            vocab=vocab,
            merges=merges,
            unk_token=None,
            eos_token=QWEN_SPECIALS[0],
            pad_token=QWEN_SPECIALS[0],
            model_max_length=self.model_max_length,
        )
        tokenizer.add_tokens([AddedToken(s, special=True) for s in QWEN_SPECIALS[1:]])
        tokenizer.eos_token = "<|im_end|>"
        fixed = len(tokenizer(template.split("{}")[0]).input_ids)
        if fixed != drop:
            raise ValueError(
                f"the Qwen2 tokenizer splits its template's fixed part into {fixed} tokens, not {drop}"
            )
        return tokenizer

    def save(self, tokenizer: Qwen2Tokenizer, path: Path) -> None:
        tokenizer.save_pretrained(path)


QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2-VL's and Qwen2.5-VL's chat template, as their published tokenizers carry it (the one
transformers' Qwen2-VL processor tests use)."""


@dataclass(frozen=True)
class Qwen2ChatBpe(Qwen2Bpe):
    """HunyuanVideo-1.5's Qwen2.5-VL tokenizer: :class:`Qwen2Bpe` over the words of the pipeline's
    system message instead of QwenImagePipeline's, with :data:`QWEN2_VL_CHAT_TEMPLATE`, through which
    HunyuanVideo15Pipeline renders its system and user messages (``apply_chat_template``, padded on the
    right to 1108 tokens). The rendered fixed part, up to the user's text, is the ``crop_start`` (108)
    tokens the pipeline drops: 105 pre-tokenizer pieces (words, punctuation, the system message's runs
    of spaces) one token each, and three special tokens."""

    @staticmethod
    def template() -> tuple[str, int]:
        """The chat template rendered for HunyuanVideo15Pipeline's system message and a user message
        ``{}``, and the tokens the pipeline drops (the defaults of ``_get_mllm_prompt_embeds``)."""
        import inspect

        from diffusers import HunyuanVideo15Pipeline
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input
        from transformers.utils.chat_template_utils import render_jinja_template

        defaults = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters
        (text,), _ = render_jinja_template(
            format_text_input(["{}"], defaults["system_message"].default),
            chat_template=QWEN2_VL_CHAT_TEMPLATE,
            add_generation_prompt=True,
        )
        return text, defaults["crop_start"].default

    def build(self) -> Qwen2Tokenizer:
        tokenizer = super().build()
        tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
        tokenizer.padding_side = "right"
        return tokenizer


@dataclass(frozen=True)
class Qwen2EditBpe(Qwen2Bpe):
    """Qwen-Image-Edit's tokenizer: :class:`Qwen2Bpe` over the words of QwenImageEditPipeline's
    template, whose system part (up to the user turn's header, before the picture's placeholders) is
    the ``prompt_template_encode_start_idx`` (64) tokens the pipeline drops."""

    @staticmethod
    def template() -> tuple[str, int]:
        from diffusers import QwenImageEditPipeline

        pipe = QwenImageEditPipeline(
            scheduler=None, vae=None, text_encoder=None, tokenizer=None, processor=None, transformer=None
        )
        return pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx


QWEN2_VL_IMAGE_PROCESSOR = {
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 16384,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}
"""Qwen2.5-VL-7B-Instruct's image processor: 14-pixel patches, 2 frames a patch, merged 2x2 (the vision
tower's config), pictures resized to between 3136 and 12845056 pixels, CLIP's normalization."""


@dataclass(frozen=True)
class Qwen2VLProcessorFiles(Qwen2EditBpe):
    """Qwen-Image-Edit's ``processor`` folder: the tokenizer of :class:`Qwen2EditBpe` with Qwen2.5-VL's
    chat template (:data:`QWEN2_VL_CHAT_TEMPLATE`) and the image processor's config
    (:data:`QWEN2_VL_IMAGE_PROCESSOR`). ``build`` returns the tokenizer; the pipeline uses the processor
    for the picture and the templated prompt. ``Qwen2VLProcessor`` itself also builds a video processor,
    which needs torchvision."""

    def build(self) -> Qwen2Tokenizer:
        tokenizer = super().build()
        tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
        return tokenizer

    def save(self, tokenizer: Qwen2Tokenizer, path: Path) -> None:
        tokenizer.save_pretrained(path)
        (path / "preprocessor_config.json").write_text(json.dumps(QWEN2_VL_IMAGE_PROCESSOR, indent=2) + "\n")


GLYPH_COLORS = 138
GLYPH_FONTS = (("en", 512), ("cn", 143), ("jp", 211), ("kr", 122))
"""Glyph-SDXL-v2's color list (``color_idx.json``: 138 named colors) and its multilingual font list
(``multilingual_10-lang_idx.json``: fonts numbered from 0 within each language, the languages in
this order), which HunyuanVideo-1.5's ByT5 tokenizer adds as tokens."""


@dataclass(frozen=True)
class ByT5Glyph:
    """HunyuanVideo-1.5's ByT5 tokenizer: google/byt5-small's (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, the
    256 bytes, 125 sentinels: 384 ids, nothing but its config to store) with the Glyph-SDXL-v2 tokens
    that diffusers' converter adds as special tokens (``add_special_token``): ``<color-0>`` to
    ``<color-137>``, then ``<en-font-0>`` ... ``<kr-font-121>`` (:data:`GLYPH_FONTS`), ids 384 to 1509,
    the rows of the encoder's resized embedding."""

    def build(self) -> ByT5Tokenizer:
        tokenizer = ByT5Tokenizer(extra_ids=125)
        colors = [f"<color-{i}>" for i in range(GLYPH_COLORS)]
        fonts = [f"<{language}-font-{i}>" for language, count in GLYPH_FONTS for i in range(count)]
        tokenizer.add_tokens(colors + fonts, special_tokens=True)
        return tokenizer

    def save(self, tokenizer: ByT5Tokenizer, path: Path) -> None:
        tokenizer.save_pretrained(path)


LLAMA3_SPECIALS = (
    "<|begin_of_text|>", "<|end_of_text|>", *(f"<|reserved_special_token_{i}|>" for i in range(4)),
    "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(5, 251)),
    "<unk>", "<image>", "<pad>",
)  # fmt: skip
"""Llama-3's 256 special tokens from id 128000 (``<|begin_of_text|>``), then the three that
llava-llama-3-8b adds (``<unk>`` = 128256, ``<image>`` = 128257, ``<pad>`` = 128258)."""


@dataclass(frozen=True)
class Llama3Bpe:
    """HunyuanVideo's LLaMA tokenizer (llava-llama-3-8b's) at its real size and ids: 128000 regular
    tokens, :data:`LLAMA3_SPECIALS` from 128000, pad ``<pad>`` on the right, bos added.

    The real one is Llama-3's byte-level BPE, but the class model_index.json names for it,
    ``LlamaTokenizerFast``, rebuilds whatever tokenizer.json it loads (in transformers 5) as a
    SentencePiece-style BPE: ``▁`` for spaces, byte fallback. So it is built in that form, the one the
    pipeline gets: the 256 byte-fallback pieces, ``▁``, newline and printable characters, the merges
    that sdkiln's tiny HunyuanVideo tokenizer learns from the pipeline's prompt template (so that the
    template's fixed part is its ``crop_start``, 95 tokens), then fillers."""

    regular: int = 128000

    def build(self) -> LlamaTokenizerFast:
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

        from sdkiln.model_zoo.hunyuan_video import llama_tokenizer

        tiny = llama_tokenizer()
        merges = [tuple(m) for m in json.loads(tiny.backend_tokenizer.to_str())["model"]["merges"]]
        printable = [c for c in string.printable if not c.isspace()]
        symbols = [*(f"<0x{i:02X}>" for i in range(256)), "\u2581", "\n", *printable]
        vocab = {s: i for i, s in enumerate(symbols)}
        for a, b in merges:
            vocab.setdefault(a + b, len(vocab))
        prefix = DEFAULT_PROMPT_TEMPLATE["template"].split("{}")[0]
        _fill(vocab, merges, _ALNUM + "\u2581", self.regular, _adjacent(tiny.tokenize(prefix)))
        vocab.update({s: self.regular + i for i, s in enumerate(LLAMA3_SPECIALS)})
        tokenizer = LlamaTokenizerFast(
            vocab=vocab,
            merges=merges,
            bos_token="<|begin_of_text|>",
            eos_token="<|end_of_text|>",
            unk_token="<unk>",
            pad_token="<pad>",
            add_bos_token=True,
            add_prefix_space=False,
            padding_side="right",
            legacy=True,
        )
        tokenizer.add_tokens([AddedToken(s, special=True, normalized=False) for s in LLAMA3_SPECIALS])
        fixed = len(tokenizer(prefix).input_ids)
        if fixed != DEFAULT_PROMPT_TEMPLATE["crop_start"]:
            raise ValueError(
                f"the LLaMA tokenizer splits HunyuanVideo's template into {fixed} tokens, "
                f"not {DEFAULT_PROMPT_TEMPLATE['crop_start']}"
            )
        return tokenizer

    def save(self, tokenizer: LlamaTokenizerFast, path: Path) -> None:
        tokenizer.save_pretrained(path)


TEKKEN_SPECIALS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
    "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
    *(f"<SPECIAL_{i}>" for i in range(20, 1000)),
)  # fmt: skip
"""Tekken's 1000 control tokens, ids 0 to 999 (``[IMG]`` = 10, the encoder's ``image_token_index``)."""
TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
    r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
"""Tekken's pre-tokenizer split (the corrected regex transformers applies with ``fix_mistral_regex``)."""
PIXTRAL_PROCESSOR = {
    "image_break_token": "[IMG_BREAK]",
    "image_end_token": "[IMG_END]",
    "image_token": "[IMG]",
    "patch_size": 14,
    "processor_class": "PixtralProcessor",
    "spatial_merge_size": 2,
}
PIXTRAL_IMAGE_PROCESSOR = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "PixtralImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": {"height": 14, "width": 14},
    "processor_class": "PixtralProcessor",
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"longest_edge": 1540},
}
"""Mistral-Small-3.1's Pixtral processor: 14-pixel patches merged 2x2 (the encoder's vision config),
images up to 1540 pixels on the long side, CLIP's normalization."""


@dataclass(frozen=True)
class TekkenBpe:
    """FLUX.2's ``PixtralProcessor`` (Mistral-Small-3.1's): a Tekken-style byte-level BPE of 131072 ids
    (:data:`TEKKEN_SPECIALS`, the 256 byte symbols from id 1000, the words of Flux2Pipeline's system
    message, fillers) with the chat template of ``sdkiln.model_zoo.flux2``, and the processor's and
    image processor's configs beside it. ``build`` returns the tokenizer, which is what the pipeline
    uses of the processor (``apply_chat_template``); the processor class itself needs torchvision."""

    vocab_size: int = 131072
    model_max_length: int = 131072

    def build(self) -> TokenizersBackend:
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        from sdkiln.model_zoo.flux2 import CHAT_TEMPLATE

        vocab = {s: i for i, s in enumerate((*TEKKEN_SPECIALS, *_BYTES))}
        merges = _spell(vocab, _byte_level_words(TEKKEN_PATTERN, [SYSTEM_MESSAGE]))
        spelled = _bpe(dict(vocab), list(merges), TEKKEN_PATTERN)
        _fill(
            vocab,
            merges,
            _ALNUM + "\u0120",
            self.vocab_size,
            _adjacent(spelled.encode(SYSTEM_MESSAGE).tokens),
        )
        backend = _bpe(vocab, merges, TEKKEN_PATTERN)
        backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in TEKKEN_SPECIALS])
        return TokenizersBackend(
            tokenizer_object=backend,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="<pad>",
            model_max_length=self.model_max_length,
            chat_template=CHAT_TEMPLATE,
            processor_class="PixtralProcessor",
        )

    def save(self, tokenizer: TokenizersBackend, path: Path) -> None:
        tokenizer.save_pretrained(path)
        (path / "processor_config.json").write_text(json.dumps(PIXTRAL_PROCESSOR, indent=2) + "\n")
        (path / "preprocessor_config.json").write_text(json.dumps(PIXTRAL_IMAGE_PROCESSOR, indent=2) + "\n")
