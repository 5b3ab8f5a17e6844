"""tools/random_tokenizers.py through tools/random_model.py's variants: every tokenizer (and processor
folder) has the real length and special ids, stays inside its encoder's embedding and loads with the class
model_index.json names; the prompt templates split where their pipelines cut them."""

import importlib
import inspect
import json
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import random_model as rm  # noqa: E402
import random_tokenizers as rt  # noqa: E402

TOKENIZER_LENGTHS = {
    "CLIPTokenizer": 49408,
    "T5TokenizerFast": {32128: 32100, 256384: 256300},
    "Qwen2Tokenizer": 151665,
    "Qwen2TokenizerFast": 151665,
    "Qwen2VLProcessor": 151665,
    "LlamaTokenizerFast": 128259,
    "PixtralProcessor": 131072,
    "ByT5Tokenizer": 1510,
}
"""What the real tokenizers report as ``len``: CLIP's full vocabulary; T5 32000 pieces + 100 sentinels
under a 32128-row embedding, UMT5 256000 + 300 under 256384; Qwen2.5's 151643 + 22 special tokens
(``Qwen2TokenizerFast`` is the same class in transformers 5; Qwen-Image-Edit's processor
holds the same tokenizer); Llama-3's 128256 and llava-llama-3's
<unk>, <image> and <pad>; Tekken's 131072 (1000 control tokens); ByT5's 384 and Glyph-SDXL-v2's 138
color and 988 font tokens."""


@cache
def _round_trip(tokenizer_spec, class_name: str, root: Path):
    """The tokenizer built, saved and loaded back by the class model_index.json names, once per spec;
    a processor's tokenizer as the processor loads it (the processors need torchvision)."""
    path = root / f"tokenizer-{type(tokenizer_spec).__name__}-{abs(hash(tokenizer_spec))}"
    tokenizer_spec.save(tokenizer_spec.build(), path)
    class_name = {"PixtralProcessor": "TokenizersBackend", "Qwen2VLProcessor": "Qwen2Tokenizer"}.get(
        class_name, class_name
    )
    return path, getattr(importlib.import_module("transformers"), class_name).from_pretrained(path)


def _vocab_size(config: dict) -> int:
    return config["vocab_size"] if "vocab_size" in config else config["text_config"]["vocab_size"]


@pytest.mark.parametrize("variant", list(rm.VARIANTS))
def test_tokenizers_have_the_real_length_and_ids_inside_the_embedding(variant, tmp_path_factory):
    spec = rm.VARIANTS[variant]
    index, configs = rm.model_index(variant), rm.component_configs(variant)
    for name, tokenizer_spec in spec.tokenizers.items():
        class_name = index[name][1]
        path, tokenizer = _round_trip(tokenizer_spec, class_name, tmp_path_factory.getbasetemp())
        encoder = configs[name.replace("tokenizer", "text_encoder").replace("processor", "text_encoder")][2]
        expected = TOKENIZER_LENGTHS[class_name]
        assert len(tokenizer) == (expected if isinstance(expected, int) else expected[encoder["vocab_size"]])
        ids = tokenizer("A photo of a cat, 4K; <extra_id_0> ünïcode 猫").input_ids
        assert max(ids) < _vocab_size(encoder)
        if class_name == "CLIPTokenizer":
            assert (ids[0], ids[-1]) == (49406, 49407) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
            assert len(json.loads((path / "vocab.json").read_text())) == 49408
        elif class_name == "T5TokenizerFast":
            assert (tokenizer.pad_token_id, tokenizer.eos_token_id, ids[-1]) == (0, 1, 1)
            assert tokenizer.convert_tokens_to_ids("<extra_id_0>") == len(tokenizer) - 1
        elif class_name in ("Qwen2Tokenizer", "Qwen2TokenizerFast", "Qwen2VLProcessor"):
            assert tokenizer.convert_tokens_to_ids(list(rt.QWEN_SPECIALS)) == list(range(151643, 151665))
            image_token_id = encoder.get("image_token_id", 151655)  # none in the text model's config
            assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == image_token_id
            assert (tokenizer.pad_token, tokenizer.eos_token) == ("<|endoftext|>", "<|im_end|>")
            assert tokenizer.padding_side == "right"
            if class_name == "Qwen2VLProcessor":  # the image processor makes the vision tower's patches
                vision, processor = (
                    encoder["vision_config"],
                    json.loads((path / "preprocessor_config.json").read_text()),
                )
                assert (
                    processor["patch_size"],
                    processor["temporal_patch_size"],
                    processor["merge_size"],
                ) == (
                    vision["patch_size"],
                    vision["temporal_patch_size"],
                    vision["spatial_merge_size"],
                )
                assert tokenizer.chat_template == rt.QWEN2_VL_CHAT_TEMPLATE
        elif class_name == "ByT5Tokenizer":  # bytes shifted by 3, then the sentinels and glyph tokens
            assert ids[:3] == [x + 3 for x in b"A p"] and ids[-1] == tokenizer.eos_token_id == 1
            assert tokenizer.convert_tokens_to_ids(["<color-0>", "<en-font-0>", "<kr-font-121>"]) == [
                384,
                384 + rt.GLYPH_COLORS,
                1509,
            ]
        elif class_name == "LlamaTokenizerFast":
            assert tokenizer.convert_tokens_to_ids(list(rt.LLAMA3_SPECIALS)) == list(range(128000, 128259))
            assert (ids[0], tokenizer.bos_token_id, tokenizer.eos_token_id) == (128000, 128000, 128001)
            assert (tokenizer.pad_token_id, tokenizer.padding_side) == (128258, "right")
        else:  # the PixtralProcessor's tokenizer, with the processor's and image processor's configs
            assert tokenizer.convert_tokens_to_ids(list(rt.TEKKEN_SPECIALS)) == list(range(1000))
            assert tokenizer.convert_tokens_to_ids("[IMG]") == encoder["image_token_index"]
            assert json.loads((path / "processor_config.json").read_text())["processor_class"] == class_name
            processor = json.loads((path / "preprocessor_config.json").read_text())
            assert processor["patch_size"]["height"] == encoder["vision_config"]["patch_size"]
            assert processor["size"]["longest_edge"] == encoder["vision_config"]["image_size"]


def test_the_prompt_templates_split_where_their_pipelines_cut_them(tmp_path_factory):
    """QwenImagePipeline drops the first 34 tokens of its template's encoding, QwenImageEditPipeline the
    first 64 (the picture's placeholders follow them) and HunyuanVideoPipeline the first 95 (with the
    begin-of-text token): each is the template's fixed part here, and what follows starts a token of its
    own. FLUX.2's system message is one token per word."""
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    root = tmp_path_factory.getbasetemp()
    _, qwen = _round_trip(rm.VARIANTS["qwen-image"].tokenizers["tokenizer"], "Qwen2Tokenizer", root)
    template, drop = rt.Qwen2Bpe.template()
    ids = qwen(template.format("zebra")).input_ids
    assert len(qwen(template.split("{}")[0]).input_ids) == drop == 34
    assert qwen.decode(ids[drop:]).startswith("zebra<|im_end|>")
    _, edit = _round_trip(rm.VARIANTS["qwen-image-edit"].tokenizers["tokenizer"], "Qwen2Tokenizer", root)
    template, drop = rt.Qwen2EditBpe.template()
    ids = edit(template.format("zebra")).input_ids
    assert len(edit(template.split("<|vision_start|>")[0]).input_ids) == drop == 64
    assert edit.decode(ids[drop:]).startswith("<|vision_start|><|image_pad|><|vision_end|>zebra<|im_end|>")
    _, llama = _round_trip(rm.VARIANTS["hunyuan-video"].tokenizers["tokenizer"], "LlamaTokenizerFast", root)
    template, crop = DEFAULT_PROMPT_TEMPLATE["template"], DEFAULT_PROMPT_TEMPLATE["crop_start"]
    ids = llama(template.format("zebra")).input_ids
    assert len(llama(template.split("{}")[0]).input_ids) == crop == 95
    assert llama.decode(ids[crop:]) == "zebra<|eot_id|>"
    _, tekken = _round_trip(rm.VARIANTS["flux2-dev"].tokenizers["tokenizer"], "PixtralProcessor", root)
    chat = tekken.apply_chat_template(
        format_input(["zebra"], SYSTEM_MESSAGE), tokenize=True, return_dict=True
    )
    tokens = tekken.convert_ids_to_tokens(chat["input_ids"][0])
    words = [w for w, _ in tekken.backend_tokenizer.pre_tokenizer.pre_tokenize_str(SYSTEM_MESSAGE)]
    assert tokens[: len(words) + 3] == ["<s>", "[SYSTEM_PROMPT]", *words, "[/SYSTEM_PROMPT]"]
    assert tokens[len(words) + 3] == "[INST]" and tokens[-1] == "[/INST]"


def test_hunyuan_video15_chat_template_splits_where_the_pipeline_cuts_it(tmp_path_factory):
    """HunyuanVideo15Pipeline renders its system message and the prompt through the tokenizer's chat
    template, pads on the right to crop_start + 1000 tokens and drops the first crop_start (108): the
    fixed part ends with the user turn's header, and the prompt is what follows."""
    from diffusers import HunyuanVideo15Pipeline
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

    defaults = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters
    crop, system = defaults["crop_start"].default, defaults["system_message"].default
    spec = rm.VARIANTS["hunyuan-video-1.5-480p"].tokenizers["tokenizer"]
    _, qwen = _round_trip(spec, "Qwen2TokenizerFast", tmp_path_factory.getbasetemp())
    chat = qwen.apply_chat_template(
        format_text_input(["zebra"], system),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        padding="max_length",
        max_length=crop + 1000,
        truncation=True,
    )
    ids, mask = chat["input_ids"][0], chat["attention_mask"][0]
    assert crop == 108 and len(ids) == crop + 1000
    assert qwen.decode(ids[:crop]).endswith(".<|im_end|>\n<|im_start|>user\n")
    assert qwen.decode(ids[crop : sum(mask)]) == "zebra<|im_end|>\n<|im_start|>assistant\n"
    assert set(ids[sum(mask) :]) == {qwen.pad_token_id}
