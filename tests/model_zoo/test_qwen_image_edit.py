"""Qwen-Image-Edit's test build against what QwenImageEditPipeline does with it, and the batching of
image-per-prompt inputs (``ModelSpec.image_per_prompt``) that offline calibration and evaluation use.

Exact comparisons only (one CPU thread, the same seed on the same weights)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from sdkiln.errors import ModelError
from sdkiln.model_zoo import get_spec, load_model
from sdkiln.model_zoo.qwen_image_edit import EDIT_TEMPLATE
from sdkiln.optimizer.evaluate import generate

VISION_TOKENS = 16
"""The tiny processor's 112x112 picture: 8x8 patches of 14, merged 2x2."""


@pytest.fixture(scope="module")
def edit():
    spec = get_spec("qwen-image-edit-tiny")
    pipe = spec.build()
    pipe.set_progress_bar_config(disable=True)
    return spec, pipe


def test_the_template_system_part_is_what_the_pipeline_drops(edit):
    _, pipe = edit
    system = EDIT_TEMPLATE.split("<|vision_start|>")[0]
    assert len(pipe.processor.tokenizer(system).input_ids) == pipe.prompt_template_encode_start_idx == 64
    assert EDIT_TEMPLATE == pipe.prompt_template_encode


def test_the_picture_enters_as_vision_tokens_and_as_appended_latent_tokens(edit):
    """The transformer's text is the picture's vision tokens and the prompt after the system part; its
    image tokens are the output's (256x256: 4x4) followed by the picture's (1024x1024: 16x16)."""
    spec, pipe = edit
    seen = {}

    def record(_module, _args, kwargs):
        seen.setdefault("call", kwargs)

    call = spec.call_kwargs(num_inference_steps=1, output_type="latent")
    prompt = "make it red"
    handle = pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        pipe(prompt=prompt, generator=torch.Generator().manual_seed(0), **call, **spec.condition(call))
    finally:
        handle.remove()
    kwargs = seen["call"]
    rest = EDIT_TEMPLATE.split("<|image_pad|>")[1].format(prompt)
    assert kwargs["encoder_hidden_states"].shape[1] == 1 + VISION_TOKENS + len(pipe.tokenizer(rest).input_ids)
    assert kwargs["img_shapes"] == [[(1, 4, 4), (1, 16, 16)]]
    assert kwargs["hidden_states"].shape[1] == 4 * 4 + 16 * 16


def test_a_call_of_several_prompts_gets_the_picture_once_per_prompt(edit):
    spec, _ = edit
    call = spec.call_kwargs()
    images = spec.condition(call, 3)["image"]
    assert len(images) == 3 and all(image is images[0] for image in images)
    assert images[0].size == (call["width"], call["height"])
    kontext = get_spec("flux-kontext-tiny")
    assert not isinstance(kontext.condition(kontext.call_kwargs(), 3)["image"], list)


def test_generate_cuts_one_picture_per_prompt_into_the_batches(edit):
    """Three prompts in batches of two: each batch gets as many pictures as prompts (the processor
    refuses any other count), and a prompt's sample is its own whatever batch it is in."""
    spec, pipe = edit
    call = spec.call_kwargs(num_inference_steps=1)
    prompts, seeds = list(spec.eval_prompts[:3]), [0, 1, 2]
    images, latents = generate(pipe, call, prompts, seeds, 2, inputs=spec.condition(call, 3))
    assert images.shape == (3, call["height"], call["width"], 3) and latents.shape[0] == 3
    alone, _ = generate(pipe, call, prompts[2:], seeds[2:], 2, inputs=spec.condition(call, 1))
    assert np.array_equal(images[2:], alone)


def test_a_saved_test_build_loads_as_a_directory(edit, tmp_path, monkeypatch, caplog):
    """Its processor's class is the zoo's (``qwen_vl_processor``), which diffusers loads only once
    imported: ``load_model`` imports the zoo modules a model_index.json names, and nothing else. Named
    as published (transformers' ``Qwen2VLProcessor``), it loads as the zoo's where torchvision is absent."""
    spec, pipe = edit
    pipe.save_pretrained(tmp_path / "edit")
    loaded, found, _ = load_model(str(tmp_path / "edit"))
    assert found.family == spec.family and type(loaded.processor) is type(pipe.processor)
    index = json.loads((tmp_path / "edit" / "model_index.json").read_text())
    # as published: transformers' class, which builds only with torchvision (absent, or faked absent)
    find_spec = importlib.util.find_spec
    with monkeypatch.context() as patch:
        patch.setattr(
            importlib.util, "find_spec", lambda n, *a: None if n == "torchvision" else find_spec(n, *a)
        )
        (tmp_path / "edit" / "model_index.json").write_text(
            json.dumps(index | {"processor": ["transformers", "Qwen2VLProcessor"]})
        )
        with caplog.at_level("WARNING", logger="sdkiln.load"):
            published, _, _ = load_model(str(tmp_path / "edit"))
    assert type(published.processor) is type(pipe.processor)
    assert (
        "needs torchvision (not installed); loading it as sdkiln.model_zoo.qwen_vl_processor" in caplog.text
    )
    index["processor"] = ["sdkiln.model_zoo.no_such_module", "Qwen2VLProcessor"]
    (tmp_path / "edit" / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(
        ModelError, match="component library 'sdkiln.model_zoo.no_such_module' is not in sdkiln"
    ):
        load_model(str(tmp_path / "edit"))
