"""A pipeline's processor component (a transformers ``ProcessorMixin``: Qwen-Image-Edit's Qwen2-VL
processor) in a package: written as JSON, its chat template in chat_template.json and never a .jinja
file, loaded from the verified bytes as the processor that was saved, and a forged one refused in
one line before anything runs.

Exact comparisons: a processor's outputs are token ids and pixel arrays."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import sdkiln
from sdkiln.configs import RecipeConfig
from sdkiln.errors import PackageError
from sdkiln.export.package_writer import _save_component
from sdkiln.model_zoo import get_spec
from sdkiln.model_zoo.qwen_image_edit import CHAT_TEMPLATE, EDIT_TEMPLATE
from sdkiln.model_zoo.spec import calibration_image
from sdkiln.runtime.package import open_package

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
from fuzz_mutate import resign  # noqa: E402

ZOO_PROCESSOR = ["sdkiln.model_zoo.qwen_vl_processor", "Qwen2VLImageTextProcessor"]


@pytest.fixture(scope="module")
def edit(tmp_path_factory):
    """Qwen-Image-Edit's test build packaged as it is (no recipe step)."""
    out = tmp_path_factory.mktemp("edit") / "pkg"
    return sdkiln.optimize("qwen-image-edit-tiny", RecipeConfig("none"), out, eval_samples=0, progress=False)


def _inputs(processor) -> dict[str, torch.Tensor]:
    text = [EDIT_TEMPLATE.format("make the sky purple")]
    return dict(processor(text=text, images=[calibration_image(64, 48)], padding=True, return_tensors="pt"))


def test_the_processor_is_json_and_loads_as_it_was_saved(edit):
    files = [rel for rel in open_package(edit.package).manifest["files"] if rel.startswith("processor/")]
    assert "processor/chat_template.json" in files and "processor/processor_config.json" in files
    assert not [rel for rel in open_package(edit.package).manifest["files"] if rel.endswith(".jinja")]
    index = json.loads((edit.package / "model_index.json").read_text())
    assert index["processor"] == ZOO_PROCESSOR

    saved = edit.pipeline.processor
    loaded = sdkiln.load(edit.package, device="cpu").processor
    assert type(loaded) is type(saved)
    assert loaded.chat_template == saved.chat_template == CHAT_TEMPLATE
    assert loaded.tokenizer.get_vocab() == saved.tokenizer.get_vocab()
    assert loaded.image_processor.to_dict() == saved.image_processor.to_dict()
    ours, theirs = _inputs(loaded), _inputs(saved)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)


def test_a_tokenizer_template_beside_the_processor_template_stays_the_tokenizers(tmp_path):
    """transformers writes both templates to one chat_template.jinja; the package keeps the
    processor's in chat_template.json and the tokenizer's in its tokenizer_config.json."""
    processor = get_spec("qwen-image-edit-tiny").build().processor
    processor.tokenizer.chat_template = "{{ messages[0]['content'] }}"
    _save_component(processor, tmp_path, "processor")
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json"] * 4
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == "{{ messages[0]['content'] }}"
    loaded = type(processor).from_pretrained(tmp_path, local_files_only=True)
    assert loaded.chat_template == CHAT_TEMPLATE
    assert loaded.tokenizer.chat_template == "{{ messages[0]['content'] }}"


def test_several_processor_templates_are_refused(tmp_path):
    processor = get_spec("qwen-image-edit-tiny").build().processor
    processor.chat_template = {"default": CHAT_TEMPLATE, "tools": CHAT_TEMPLATE}
    with pytest.raises(PackageError, match="several chat templates"):
        _save_component(processor, tmp_path, "processor")


def _add_tokens(tokenizer: dict, count: int = 32) -> None:
    """``count`` added tokens in a tokenizer.json: more than the text encoder's rounded-up rows."""
    first = 1 + max([*tokenizer["model"]["vocab"].values(), *(t["id"] for t in tokenizer["added_tokens"])])
    entry = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    tokenizer["added_tokens"] += [{"id": first + i, "content": f"<|new_{i}|>", **entry} for i in range(count)]


FORGED = {
    "a zoo class that is no processor": (
        "model_index.json",
        lambda index: index.update(processor=["sdkiln.model_zoo.spec", "ModelSpec"]),
        "is sdkiln's ModelSpec, not a processor",
    ),
    "a class from elsewhere in sdkiln": (
        "model_index.json",
        lambda index: index.update(processor=["sdkiln.runtime.loader", "Package"]),
        "comes from 'sdkiln.runtime.loader'",
    ),
    "a processor tokenizer the text encoder cannot embed": (
        "processor/tokenizer.json",
        _add_tokens,
        "processor/: the tokenizer has .* tokens, but text_encoder embeds only",
    ),
    "a processor tokenizer padding to a billion tokens": (
        "processor/tokenizer_config.json",
        lambda config: config.update(model_max_length=10**9),
        "model_max_length",
    ),
}


@pytest.mark.parametrize("name", list(FORGED))
def test_a_forged_processor_is_one_package_error(edit, tmp_path, name):
    rel, change, words = FORGED[name]
    root = Path(shutil.copytree(edit.package, tmp_path / "pkg"))
    data = json.loads((root / rel).read_text())
    change(data)
    (root / rel).write_text(json.dumps(data))
    resign(root)
    with pytest.raises(PackageError, match=words) as caught:
        sdkiln.load(root, device="cpu")
    assert "\n" not in str(caught.value)


def test_a_published_qwen2vl_processor_loads_without_torchvision(edit, tmp_path, monkeypatch, caplog):
    """A package (or directory, ``tests/model_zoo/test_qwen_image_edit.py``) naming transformers'
    ``Qwen2VLProcessor``, as a published Qwen-Image-Edit does: where torchvision is absent (faked here
    where it is installed) it loads as the zoo's processor with one warning, and processes as saved."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "torchvision" else find_spec(n, *a)
    )
    root = Path(shutil.copytree(edit.package, tmp_path / "pkg"))
    index = json.loads((root / "model_index.json").read_text())
    (root / "model_index.json").write_text(
        json.dumps(index | {"processor": ["transformers", "Qwen2VLProcessor"]})
    )
    resign(root)
    with caplog.at_level("WARNING", logger="sdkiln.load"):
        loaded = sdkiln.load(root, device="cpu").processor
    assert type(loaded).__name__ == ZOO_PROCESSOR[1]
    [warning] = [r.getMessage() for r in caplog.records if "torchvision" in r.getMessage()]
    assert warning.startswith("processor: transformers' Qwen2VLProcessor builds a video processor")
    ours, theirs = _inputs(loaded), _inputs(edit.pipeline.processor)
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)
