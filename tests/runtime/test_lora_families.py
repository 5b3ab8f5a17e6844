"""A random LoRA on a W8A8 package of flux-tiny, wan-tiny and the embedded model, against the float
model with the same LoRA merged into its weights; and the trained LoRA fixture on the embedded model.

Comparison (STYLE habit 12, quantized vs float as SQNR): the transformer's output with the LoRA must be
as close to the float model's with the LoRA as the package's is to the float model's without it, less
``SLACK_DB`` (the LoRA's activations pass through the quantized layers after it; the branch itself adds
no error: ``test_lora.py`` checks that per layer and scheme)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import sdkiln
from sdkiln.metrics import sqnr_db
from sdkiln.model_zoo import get_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_helpers import transformer_inputs  # noqa: E402  (tests/runtime/compile_helpers.py)

SLACK_DB = 3.0
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "fmnist_frame_lora.safetensors"


def _random_lora(transformer, seed: int) -> dict[str, torch.Tensor]:
    g, state = torch.Generator().manual_seed(seed), {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and (
            "attn" in name or name.endswith(("ffn.net.2", "ff.net.2"))
        ):
            k, n = module.in_features, module.out_features
            state[f"transformer.{name}.lora_A.weight"] = torch.randn(4, k, generator=g) / k**0.5
            state[f"transformer.{name}.lora_B.weight"] = torch.randn(n, 4, generator=g) * 0.3
    return state


def _merged(transformer, state):
    out = copy.deepcopy(transformer)
    with torch.no_grad():
        for key, a in state.items():
            if key.endswith("lora_A.weight"):
                layer = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
                b = state[key.replace("lora_A", "lora_B")]
                out.get_submodule(layer).weight += b @ a
    return out


@pytest.mark.parametrize("family", ["flux-tiny", "wan-tiny", "fmnist-flux"])
def test_a_lora_on_a_w8a8_package_keeps_its_quality(family, tmp_path):
    spec = get_spec(family)
    package = sdkiln.optimize(
        family, "w8a8-dynamic", tmp_path / "pkg", eval_samples=0, progress=False
    ).package
    pipe = sdkiln.load(package, device="cpu")
    float_transformer = spec.build().transformer
    args, kwargs = transformer_inputs(spec, pipe)
    state = _random_lora(float_transformer, 0)
    assert len(state) >= 8

    def out(model):
        with torch.no_grad():
            return model(*args, **{**kwargs, "return_dict": False})[0]

    plain = sqnr_db(out(float_transformer), out(pipe.transformer))
    pipe.load_lora_weights(state)
    reference = out(_merged(float_transformer, state))
    assert (reference - out(float_transformer)).abs().max() > 1e-2  # the LoRA changes the output
    assert sqnr_db(reference, out(pipe.transformer)) > plain - SLACK_DB


def test_the_trained_fixture_is_a_diffusers_lora_of_the_embedded_model(tmp_path):
    """``tools/fmnist/train_lora.py``'s output: diffusers' keys, every one applied to the package."""
    state = load_file(FIXTURE)
    assert all(k.startswith("transformer.") and k.endswith(("lora_A.weight", "lora_B.weight")) for k in state)
    package = sdkiln.optimize("fmnist-flux", "none", tmp_path / "pkg", eval_samples=0, progress=False).package
    pipe = sdkiln.load(package, device="cpu")
    pipe.load_lora_weights(FIXTURE, adapter_name="frame")
    assert len(pipe.sdkiln_lora.adapters["frame"].layers) == len(state) // 2


def test_the_branch_is_stored_in_the_packages_dtype(tmp_path):
    """A bf16 package: A and B in bf16 on quantized layers too (whose own weights are int8 and may have
    no float bias), so the branch runs in the model's dtype on a GPU kernel that takes one dtype."""
    package = sdkiln.optimize(
        "flux-tiny", "w8a8-dynamic", tmp_path / "pkg", eval_samples=0, progress=False, dtype=torch.bfloat16
    ).package
    pipe = sdkiln.load(package, device="cpu")
    pipe.load_lora_weights(_random_lora(get_spec("flux-tiny").build().transformer, 0))
    quantized = [n for n in pipe.sdkiln_manifest["modules"] if n in pipe.sdkiln_lora.hooks]
    assert quantized
    for layer in quantized:
        module = pipe.sdkiln_lora.transformer.get_submodule(layer)
        assert module.lora_a.dtype == module.lora_b.dtype == torch.bfloat16
    from sdkiln.runtime import W8A8DynamicLinear
    from sdkiln.runtime.lora import LoraRunner

    no_bias = W8A8DynamicLinear.from_linear(torch.nn.Linear(16, 8, bias=False))  # nothing float to read
    holder = torch.nn.Module()
    holder.proj = no_bias
    runner = LoraRunner(pipe, holder, compiled=False, folded={}, dtype=torch.bfloat16)
    runner.load_lora_weights(
        {
            "transformer.proj.lora_A.weight": torch.ones(2, 16),
            "transformer.proj.lora_B.weight": torch.ones(8, 2),
        }
    )
    assert no_bias.lora_a.dtype == torch.bfloat16


def test_a_package_with_folded_smoothing_reads_s_when_the_first_lora_loads(tmp_path):
    """SmoothQuant folded 1/s into flux-tiny's modulations: the package's layers see x / s. Loading
    does not read the calibration stats; the first LoRA does, and its branch then matches the float
    model's LoRA as closely as the package matches the float model."""
    from sdkiln.configs import RecipeConfig, SmoothQuantConfig, W8A8DynamicConfig

    recipe = RecipeConfig("sq", [SmoothQuantConfig(calib_samples=1), W8A8DynamicConfig()])
    package = sdkiln.optimize("flux-tiny", recipe, tmp_path / "pkg", eval_samples=0, progress=False).package
    pipe = sdkiln.load(package, device="cpu")
    assert callable(pipe.sdkiln_lora.folded)  # not read yet
    spec = get_spec("flux-tiny")
    float_transformer = spec.build().transformer
    args, kwargs = transformer_inputs(spec, pipe)
    state = _random_lora(float_transformer, 1)

    def out(model):
        with torch.no_grad():
            return model(*args, **{**kwargs, "return_dict": False})[0]

    plain = sqnr_db(out(float_transformer), out(pipe.transformer))
    pipe.load_lora_weights(state)
    folded = pipe.sdkiln_lora.folded
    assert folded and set(folded) & set(pipe.sdkiln_lora.hooks)  # the LoRA hits folded layers
    assert sqnr_db(out(_merged(float_transformer, state)), out(pipe.transformer)) > plain - SLACK_DB
