"""The text-encoder quantization step (``TextEncoderQuantConfig``): its gate, its package section,
and the loaded encoders.

What is checked: on flux-tiny (CLIP and T5) the step quantizes both encoders, the manifest, the
record and the quality report say so, the loaded package's encoders run the scheme's kernel and give
the in-memory optimized pipeline's images bit for bit, and the SQNRs the gate read (of the
transformer's conditioning) and recorded (of the encoders' outputs) equal the loaded package's
against the float pipeline (the trial modules are the modules). Every family's encoders quantize
and load, FLUX.2's tied lm_head left float. Below its floor an encoder stays float, with a warning and the measurement. At T5-XXL's
width (cut to one layer) every scheme quantizes and keeps the scheme's bound; its fast twin runs a
narrow T5.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

import sdkiln
from sdkiln import kernels as K
from sdkiln.configs import RECIPE_STEPS, RecipeConfig, TextEncoderQuantConfig
from sdkiln.configs.quant import TEXT_ENCODER_SCHEMES
from sdkiln.errors import PackageError, RecipeError, SdkilnError
from sdkiln.model_zoo import get_spec, spec_names
from sdkiln.optimizer.quant.encoders import (
    _outputs,
    _sqnr,
    _swap,
    _trial,
    applicable,
    chosen_linears,
    conditioning_sqnr,
    measure_encoder,
    run_to_transformer,
)
from sdkiln.optimizer.recipes import resolve_recipe
from sdkiln.optimizer.registry import TransformContext
from sdkiln.runtime.quant import QuantLinear, by_recipe_kind

SCHEME_BOUND_DB = {"w8a16": 35.0, "w8a8_dynamic": 30.0, "fp8_dynamic": 25.0, "w4a16": 15.0}
"""Each scheme's bound on a random-weight encoder's output SQNR against float: int8 per channel on
Gaussian weights alone gives about 40 dB, e4m3's three mantissa bits about 28 dB, int4 in groups of
128 about 20 dB less than int8 (measured at T5-XXL width, one layer: W8A16 40.7, W8A8 dynamic 34.3,
FP8 29.5 and W4A16 19.6 dB, the last two with T5's float32 ``wo`` left float)."""


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    out = tmp_path_factory.mktemp("te") / "pkg"
    result = sdkiln.optimize("flux-tiny", "te-w8a16", out, eval_samples=2, progress=False)
    return result, out


def _image(pipe) -> torch.Tensor:
    call = get_spec("flux-tiny").call_kwargs(num_inference_steps=3) | {"output_type": "np"}
    with torch.inference_mode():
        out = pipe(prompt="a red bus", generator=torch.Generator().manual_seed(1), **call)
    return torch.as_tensor(out[0])


def test_the_step_quantizes_both_encoders_and_the_package_carries_them(flux):
    result, out = flux
    [step] = result.manifest["recipe"]["steps"]
    record = step["result"]
    assert record["scheme"] == "W8A16" and record["sqnr_floor_db"] == 30.0
    section = result.manifest["text_encoders"]
    assert sorted(section) == sorted(record["encoders"]) == ["text_encoder", "text_encoder_2"]
    for name, entry in record["encoders"].items():
        encoder = getattr(get_spec("flux-tiny").build(), name)
        linears = [n for n, m in encoder.named_modules() if isinstance(m, nn.Linear)]
        assert entry["decision"] == "quantized" and entry["quantized"] == len(linears) == len(
            section[name]["modules"]
        )
        assert entry["sqnr_db"] == min(entry["conditioning_sqnr_db"].values()) >= 30.0
        assert set(entry["output_sqnr_db"]) == (
            {"last_hidden_state", "pooler_output"} if name == "text_encoder" else {"last_hidden_state"}
        )
        assert entry["calls"] == 8  # 4 prompts, each with the negative prompt of FLUX's true CFG
        assert result.quality["text_encoders"][name] == {
            "sqnr_db": entry["sqnr_db"], "decision": "quantized", "scheme": "W8A16"
        }  # fmt: skip
    assert all(
        isinstance(m, nn.Linear) for m in result.pipeline.transformer.modules() if type(m) is nn.Linear
    )
    loaded = sdkiln.load(out, device="cpu")
    for name in section:
        modules = [m for m in getattr(loaded, name).modules() if isinstance(m, QuantLinear)]
        assert len(modules) == len(section[name]["modules"]) and {m.scheme for m in modules} == {"W8A16"}
        assert not any(type(m) is nn.Linear for m in getattr(loaded, name).modules())
    K.reset_kernel_counts()
    image = _image(loaded)
    assert (
        sum(n for (op, dev, _), n in K.kernel_counts().items() if (op, dev) == ("weight_only_linear", "cpu"))
        >= 24
    )
    assert torch.equal(image, _image(result.pipeline))


def test_the_gate_read_what_the_loaded_encoders_give(flux):
    """The SQNRs recorded from the trial modules equal the loaded package's against the float
    pipeline on the same prompts and seeds: each encoder's outputs, and the transformer's
    conditioning from both encoders together (the trial modules are the modules)."""
    result, out = flux
    base = get_spec("flux-tiny").build()
    loaded = sdkiln.load(out, device="cpu")
    names = ["text_encoder", "text_encoder_2"]
    record = result.manifest["recipe"]["steps"][0]["result"]
    spec = get_spec("flux-tiny")
    calls, reference = run_to_transformer(TransformContext(base, spec, None), 4, names)
    _, given = run_to_transformer(TransformContext(loaded, spec, None), 4)
    together = conditioning_sqnr(reference, given)
    assert set(together) == {"encoder_hidden_states", "pooled_projections"}
    assert together == pytest.approx(record["conditioning_sqnr_db"], abs=1e-9)
    for name in names:

        def pairs(name=name):
            with torch.inference_mode():
                for args, kwargs in calls[name]:
                    yield (
                        dict(_outputs(getattr(base, name)(*args, **kwargs))),
                        dict(_outputs(getattr(loaded, name)(*args, **kwargs))),
                    )

        assert _sqnr(pairs()) == pytest.approx(record["encoders"][name]["output_sqnr_db"], abs=1e-9)


def test_below_its_floor_an_encoder_stays_float_with_a_warning(tmp_path, capsys):
    recipe = RecipeConfig("te", [TextEncoderQuantConfig(encoders=("text_encoder_2",), sqnr_floor_db=90.0)])
    with pytest.warns(
        UserWarning,
        match=r"text_encoder_2 stays float: the transformer's conditioning keeps .* below the floor 90 dB",
    ):
        result = sdkiln.optimize("flux-tiny", recipe, tmp_path / "pkg", eval_samples=0, progress=False)
    entry = result.manifest["recipe"]["steps"][0]["result"]["encoders"]["text_encoder_2"]
    assert entry["decision"].startswith("float") and 30 < entry["sqnr_db"] < 90
    assert "text_encoders" not in result.manifest and list(
        result.manifest["recipe"]["steps"][0]["result"]["encoders"]
    ) == ["text_encoder_2"]
    assert not any(isinstance(m, QuantLinear) for m in result.pipeline.text_encoder_2.modules())
    assert isinstance(sdkiln.load(tmp_path / "pkg", device="cpu").text_encoder_2.shared, nn.Embedding)
    from sdkiln.cli import main

    assert main(["inspect", str(tmp_path / "pkg")]) == 0
    assert (
        "text encoder text_encoder_2: float (the transformer's conditioning keeps" in capsys.readouterr().out
    )


def test_a_pipeline_object_keeps_its_float_encoders():
    base = get_spec("flux-tiny").build()
    result = sdkiln.optimize(base, "te-w8a16", eval_samples=0, progress=False)
    assert result.pipeline.text_encoder_2 is not base.text_encoder_2
    assert not any(isinstance(m, QuantLinear) for m in base.text_encoder_2.modules())
    assert any(isinstance(m, QuantLinear) for m in result.pipeline.text_encoder_2.modules())


def test_configs_and_recipes():
    assert [s.kind for s in resolve_recipe("te-w4a16+w8a8-dynamic").steps] == [
        "text_encoder_quant",
        "w8a8_dynamic",
    ]
    assert resolve_recipe("te-w4a16").steps[0].scheme == "w4a16"
    assert resolve_recipe("default", get_spec("flux-tiny")).steps[0] == TextEncoderQuantConfig()
    assert (
        TextEncoderQuantConfig.from_dict(TextEncoderQuantConfig(scheme="fp8_dynamic").to_dict()).scheme
        == "fp8_dynamic"
    )
    for bad, match in [
        (dict(scheme="w8a8_static"), "built from the weight alone"),
        (dict(encoders=("vae",)), "component names"),
        (dict(sqnr_floor_db=math.nan), "finite"),
        (dict(calib_samples=0), "calib_samples"),
    ]:
        with pytest.raises(ValueError, match=match):
            TextEncoderQuantConfig(**bad)
    with pytest.raises(RecipeError, match="same recipe step twice"):
        resolve_recipe("te-w8a16+te-w4a16")
    with pytest.raises(ValueError, match="no text encoder 'text_encoder_3'"):
        sdkiln.optimize(
            "flux-tiny", RecipeConfig("x", [TextEncoderQuantConfig(encoders=("text_encoder_3",))]), eval_samples=0, progress=False
        )  # fmt: skip


def test_a_damaged_section_is_one_error_and_the_diffusers_view_refuses(flux, tmp_path):
    import shutil

    from sdkiln.export.diffusers_view import export_diffusers

    _, out = flux
    with pytest.raises(SdkilnError, match="quantized text_encoder"):
        export_diffusers(out, tmp_path / "view")
    for change, match in [
        (lambda m: m["text_encoders"].update(vae=m["text_encoders"]["text_encoder"]), "'vae', which is not a text encoder"),
        (lambda m: m["text_encoders"].update(text_encoder_3={"modules": {}}), "'text_encoder_3', which is not a model component"),
        (lambda m: m["text_encoders"]["text_encoder"]["modules"].update({"nope.q": {"scheme": "W8A16"}}), "'nope.q' does not exist in text_encoder"),
        (lambda m: m["text_encoders"].update(text_encoder=[]), "text_encoders.text_encoder: must be an object"),
    ]:  # fmt: skip
        pkg = tmp_path / "edited"
        shutil.rmtree(pkg, ignore_errors=True)
        shutil.copytree(out, pkg)
        manifest = json.loads((pkg / "manifest.json").read_text())
        change(manifest)
        (pkg / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(PackageError, match=match):
            sdkiln.load(pkg, device="cpu")


def _t5(width: int, ff: int, heads: int):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=1000, d_model=width, d_ff=ff, d_kv=64, num_heads=heads, num_layers=1,
        feed_forward_proj="gated-gelu", dense_act_fn="gelu_new", is_gated_act=True,
    )  # fmt: skip
    return T5EncoderModel(config).eval()


def _every_scheme_keeps_its_bound(encoder) -> dict[str, float]:
    ids = torch.randint(2, 1000, (2, 64), generator=torch.Generator().manual_seed(0))
    calls = [((), {"input_ids": ids[:1]}), ((), {"input_ids": ids[1:]})]
    layers, _ = chosen_linears(encoder, ())
    got = {}
    for scheme in TEXT_ENCODER_SCHEMES:
        cls, params = by_recipe_kind()[scheme], RECIPE_STEPS[scheme]().module_params()
        taken, not_applicable = applicable(encoder, layers, cls, params)
        if scheme in ("w8a16", "w8a8_dynamic"):  # int8 weights: T5's float32 'wo' too
            assert taken == layers and not not_applicable
        else:
            assert list(not_applicable) == ["encoder.block.0.layer.1.DenseReluDense.wo"], not_applicable
            assert "keeps 'wo' in float32" in not_applicable["encoder.block.0.layer.1.DenseReluDense.wo"]
        got[scheme] = measure_encoder(encoder, calls, taken, cls, params)["last_hidden_state"]
        assert got[scheme] >= SCHEME_BOUND_DB[scheme], (scheme, got[scheme])
        with torch.inference_mode(), _trial(encoder, taken, cls, params):
            trial = encoder(**calls[0][1]).last_hidden_state
    quantized = encoder  # the last scheme, swapped in for real: the trial's output exactly
    _swap(quantized, taken, cls, params)
    with torch.inference_mode():
        assert torch.equal(quantized(**calls[0][1]).last_hidden_state, trial)
    return got


def test_every_scheme_on_a_narrow_t5():
    _every_scheme_keeps_its_bound(_t5(512, 1280, 8))


@pytest.mark.slow
def test_every_scheme_at_t5_xxl_width():
    """T5-XXL's width (d_model 4096, d_ff 10240, 64 heads), one layer of its 24."""
    _every_scheme_keeps_its_bound(_t5(4096, 10240, 64))


@pytest.mark.parametrize(
    "family",
    # the embedded model's MiniLM: test_memory's packages and bench/te_quant.py
    [n for n in spec_names() if n != "fmnist-flux"],
)
def test_every_family_quantizes_its_encoders_and_loads_them(family, tmp_path):
    spec = get_spec(family)
    recipe = RecipeConfig("te", [TextEncoderQuantConfig(sqnr_floor_db=0.0)])
    result = sdkiln.optimize(family, recipe, tmp_path / "pkg", eval_samples=0, progress=False)
    encoders = result.manifest["recipe"]["steps"][0]["result"]["encoders"]
    assert encoders and all(e["decision"] == "quantized" for e in encoders.values())
    for entry in encoders.values():  # FLUX.2's Mistral ties its lm_head to its embedding
        assert all("tied" in why for why in entry["not_applicable"].values()), entry["not_applicable"]
    loaded = sdkiln.load(tmp_path / "pkg", device="cpu")
    for name, entry in result.manifest["text_encoders"].items():
        swapped = [n for n, m in getattr(loaded, name).named_modules() if isinstance(m, QuantLinear)]
        assert sorted(swapped) == sorted(entry["modules"])
    call = spec.call_kwargs(num_inference_steps=2) | {"output_type": "np"}
    outs = []
    for pipe in (loaded, result.pipeline):
        with torch.inference_mode():
            outs.append(
                pipe(
                    prompt="a cat", generator=torch.Generator().manual_seed(0), **call, **spec.condition(call)
                )[0]
            )
    assert np.array_equal(np.asarray(outs[0]), np.asarray(outs[1]))


def test_inspect_and_the_model_card_name_the_quantized_encoders(flux, capsys):
    from sdkiln.cli import main
    from sdkiln.export.publish import model_card
    from sdkiln.runtime.package import open_package

    _, out = flux
    assert main(["inspect", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "sections: text_encoders\n" in printed  # te-w8a16 alone: no transformer layer quantized
    assert "text encoder text_encoder_2: 12 layers W8A16 (conditioning SQNR" in printed
    card = model_card(open_package(out), "org/flux-tiny", "apache-2.0")
    assert "- Text encoder `text_encoder_2`: 12 layers W8A16 (quantized)." in card
