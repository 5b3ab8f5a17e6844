"""FP8_DYNAMIC, W8A16 and W4A16 packages of flux-tiny: exact round trips, the stored tensors, the
bytes ``sdkiln inspect`` reports, and a manifest whose module parameters do not fit."""

import json
import shutil

import pytest
from safetensors import safe_open

import sdkiln
from sdkiln.cli import main
from sdkiln.errors import PackageError
from sdkiln.runtime.quant.fp8_dynamic import FP8DynamicLinear
from sdkiln.runtime.quant.weight_only import W4A16Linear, W8A16Linear

RECIPES = {"fp8-dynamic": FP8DynamicLinear, "w8a16": W8A16Linear, "w4a16": W4A16Linear}
WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("schemes")
    return {name: sdkiln.optimize("flux-tiny", name, root / name, eval_samples=0) for name in RECIPES}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_save_load_is_bit_identical(results, recipe, assert_same_outputs):
    result = results[recipe]
    loaded = sdkiln.load(result.package, device="cpu")
    swapped = [m for m in loaded.transformer.modules() if type(m) is RECIPES[recipe]]
    assert len(swapped) == len(result.manifest["modules"]) > 0
    assert_same_outputs(result, loaded)


def test_stored_tensors_are_fp8_int8_and_packed_int4(results):
    expected = {"fp8-dynamic": "F8_E4M3", "w8a16": "I8", "w4a16": "U8"}
    for recipe, dtype in expected.items():
        result = results[recipe]
        model = result.pipeline.transformer
        with safe_open(result.package / WEIGHTS, framework="pt") as fh:
            for layer in result.manifest["modules"]:
                weight = fh.get_slice(f"{layer}.weight")
                k = model.get_submodule(layer).in_features
                assert weight.get_dtype() == dtype
                assert weight.get_shape()[1] == (k // 2 if recipe == "w4a16" else k)
    assert all(
        e == {"scheme": "W4A16", "group_size": 128} for e in results["w4a16"].manifest["modules"].values()
    )


def expected_bytes(result, recipe) -> tuple[int, int]:
    """What the quantized layers store (values, scales, offsets) and what their weights weigh in fp32."""
    qbytes = fbytes = 0
    for layer in result.manifest["modules"]:
        m = result.pipeline.transformer.get_submodule(layer)
        n, k = m.out_features, m.in_features
        fbytes += 4 * n * k
        qbytes += {
            "fp8-dynamic": n * k + 4 * n,
            "w8a16": n * k + 2 * 4 * n,
            "w4a16": n * k // 2 + 2 * 4 * n * (k // 128),
        }[recipe]
    return qbytes, fbytes


def test_inspect_json_counts_the_stored_bytes(results, capsys):
    ratios = {}
    for recipe, result in results.items():
        capsys.readouterr()
        assert main(["inspect", str(result.package), "--json"]) == 0
        summary = json.loads(capsys.readouterr().out)["summary"]
        qbytes, fbytes = expected_bytes(result, recipe)
        assert (summary["quantized_bytes"], summary["quantized_float_bytes"]) == (qbytes, fbytes)
        ratios[recipe] = summary["quantized_ratio"]
    # flux-tiny's K is 128 to 640: about 0.25 + 2/K for int8, 1/8 + 1/64 for int4 in groups of 128.
    assert ratios["w4a16"] < 0.6 * ratios["w8a16"]
    assert ratios["w8a16"] < 0.27 and ratios["fp8-dynamic"] < 0.26


def test_a_group_size_that_does_not_fit_is_a_package_error(results, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(results["w4a16"].package, root)
    manifest = json.loads((root / "manifest.json").read_text())
    layer = next(iter(manifest["modules"]))
    manifest["modules"][layer]["group_size"] = 48
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageError, match=f"layer '{layer}' cannot be built as W4A16 .* group_size must be"):
        sdkiln.load(root, device="cpu")
