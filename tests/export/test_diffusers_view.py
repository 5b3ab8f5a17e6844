"""``sdkiln export-diffusers``: a W8A8_DYNAMIC and a W8A16 package of flux-tiny as directories plain
diffusers loads, with exactly the package's layers quantized, its int8 values and scales carried bit
for bit, and outputs matching sdkiln's runtime.

The tolerance is the exporter's own, ``VIEW_REL`` (its docstring says why).
"""

import json

import pytest
import torch

import sdkiln
from sdkiln.cli import main
from sdkiln.errors import PackageError, SdkilnError
from sdkiln.export.diffusers_view import REPORT_FILE, VIEW_REL, _check_package, export_diffusers
from sdkiln.export.onnx import capture_inputs

pytest.importorskip("torchao", reason="the [diffusers-view] extra (make test installs it)")


@pytest.mark.parametrize("recipe", ["w8a8-dynamic", "w8a16"])
def test_plain_diffusers_loads_the_view_and_matches_the_runtime(tmp_path, recipe):
    from diffusers import FluxPipeline
    from torchao.quantization import Int8Tensor

    result = sdkiln.optimize("flux-tiny", recipe, tmp_path / "pkg", eval_samples=0)
    out = tmp_path / "view"
    assert main(["export-diffusers", str(result.package), "--out", str(out)]) == 0
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["max_rel_error"] <= VIEW_REL
    pipe = FluxPipeline.from_pretrained(out, torch_dtype=torch.float32)  # plain diffusers
    ours = sdkiln.load(result.package, "cpu")
    quantized = set(result.manifest["modules"])
    for name, module in pipe.transformer.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert isinstance(module.weight, Int8Tensor) == (name in quantized), name
    for name in quantized:
        theirs, mine = pipe.transformer.get_submodule(name).weight, ours.transformer.get_submodule(name)
        assert torch.equal(theirs.qdata, mine.weight)
        assert torch.equal(theirs.scale.reshape(-1), mine.weight_scale.reshape(-1))
    inputs = capture_inputs(ours, None, None)
    with torch.inference_mode():
        want = ours.transformer(**inputs, return_dict=False)[0]
        got = pipe.transformer(**inputs, return_dict=False)[0]
    assert float((got - want).abs().max() / want.abs().max()) <= VIEW_REL
    image = pipe("a cat", num_inference_steps=2, height=32, width=32, output_type="np").images
    assert image.shape == (1, 32, 32, 3) and bool((image >= 0).all() and (image <= 1).all())


def test_schemes_without_a_torchao_form_are_refused(tmp_path):
    with pytest.raises(SdkilnError, match="a is W8A8$"):
        _check_package({"modules": {"a": {"scheme": "W8A8"}}})
    with pytest.raises(SdkilnError, match="smooth"):
        _check_package({"modules": {"a": {"scheme": "W8A8_DYNAMIC", "smooth": True}}})
    with pytest.raises(SdkilnError, match="block-sparse"):
        _check_package({"sparse_attention": {}, "modules": {}})
    result = sdkiln.optimize("flux-tiny", "w8a8-static", tmp_path / "pkg", eval_samples=0)
    with pytest.raises(SdkilnError, match="to_q is W8A8$"):
        export_diffusers(result.package, tmp_path / "view")
    assert not (tmp_path / "view").exists()
    (tmp_path / "mine").mkdir()
    with pytest.raises(PackageError, match="already exists"):
        export_diffusers(result.package, tmp_path / "mine")
