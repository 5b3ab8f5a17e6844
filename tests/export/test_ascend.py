"""The Ascend export, re-parsed with MindIE SD's loading rules (``ascend_rules``, written apart from
the writer): names, types, dtypes, shapes, modes; values bit-identical to the package's; and the
exported tensors, run through MindIE SD's layer math, compute the original float layer."""

import json
import os
import shutil
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import sdkiln
from sdkiln.cli import main
from sdkiln.configs import (
    Deployment,
    RecipeConfig,
    SmoothQuantConfig,
    W8A8DynamicConfig,
    W8A8StaticConfig,
    W8A8TimestepConfig,
    W8A16Config,
)
from sdkiln.errors import PackageError
from sdkiln.export import ascend
from sdkiln.export.ascend import ascend_files, export_ascend
from sdkiln.metrics import sqnr_db
from sdkiln.model_zoo import get_spec
from sdkiln.runtime.package import TRANSFORMER_WEIGHTS, open_package

from .ascend_rules import AscendFormatError, deq_scale_as_fp32, mindie_linear, read_ascend_dir

# Tolerances, stated once. Exact paths (values, bytes) use torch.equal. MindIE SD's math on the
# exported tensors against the float layer, SQNR in dB, by weight precision:
VS_FLOAT_MIN_SQNR_DB = {"int8": 20.0, "int4": 15.0}
# ... and against our runtime module on the same input (the same integers, fp32 vs float64 scaling):
VS_RUNTIME_MIN_SQNR_DB = 50.0

RECIPES = {
    "w8a8-dynamic": "w8a8-dynamic",
    "w8a16": "w8a16",
    "w4a16": "w4a16",
    "w8a8": RecipeConfig("w8a8", [W8A8StaticConfig(calib_samples=1)]),
    "w8a8-timestep": RecipeConfig("w8a8-timestep", [W8A8TimestepConfig(calib_samples=1, dynamic_steps=(1,))]),
    "smoothquant+w8a8": RecipeConfig(
        "smoothquant+w8a8",
        [SmoothQuantConfig(calib_samples=1, fold=False), W8A8StaticConfig(calib_samples=1)],
    ),
    "smoothquant+w8a8-dynamic": RecipeConfig(
        "smoothquant+w8a8-dynamic", [SmoothQuantConfig(calib_samples=1, fold=False), W8A8DynamicConfig()]
    ),
    "smoothquant-folded": RecipeConfig(
        "smoothquant-folded", [SmoothQuantConfig(calib_samples=1), W8A8DynamicConfig()]
    ),
    "w8a8-dynamic-gptq": RecipeConfig(
        "w8a8-dynamic-gptq", [W8A8DynamicConfig(weight_rounding="gptq", calib_samples=1)]
    ),
    "mixed": RecipeConfig(
        "mixed",
        [
            W8A8DynamicConfig(exclude=("*.attn.*",)),
            W8A16Config(exclude=("*.to_q", "*.to_k")),
            W8A8StaticConfig(calib_samples=1),
        ],
    ),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("ascend")
    return {  # pipeline objects: optimize keeps them as they were, the float reference of these tests
        name: sdkiln.optimize(get_spec("flux-tiny").build(), r, root / name, eval_samples=0)
        for name, r in RECIPES.items()
    }


def _package_tensors(pkg_root):
    pkg = open_package(pkg_root)
    return pkg.manifest, load_file(pkg.root / "transformer" / TRANSFORMER_WEIGHTS)


EXPORTABLE = [n for n in RECIPES if n not in ("w4a16", "smoothquant-folded")]


@pytest.mark.parametrize("name", EXPORTABLE)
def test_export_follows_mindie_rules_and_keeps_every_value(results, name, tmp_path):
    export = export_ascend(results[name].package, tmp_path / "ascend", dtype="bfloat16")
    view = read_ascend_dir(export.root)
    manifest, tensors = _package_tensors(results[name].package)
    modules = manifest["modules"]
    assert {layer: v.scheme for layer, v in view.layers.items()} == {
        n: m["scheme"] for n, m in modules.items()
    }
    buffers = set(manifest["model"]["nonpersistent_buffers"])
    layer_keys = {k for k in tensors if k.rsplit(".", 1)[0] in modules or k.rsplit(".", 2)[0] in modules}
    assert view.float_keys == set(tensors) - layer_keys - buffers
    for key in view.float_keys:
        assert torch.equal(view.weights[key], tensors[key]), key
    for layer, v in view.layers.items():
        smooth = modules[layer].get("smooth", False)
        assert v.prefix == (f"{layer}.linear" if smooth else layer)
        if smooth:
            assert torch.equal(v.mul_scale, tensors[f"{layer}.div.mul_scale"])
        stored = {k.rsplit(".", 1)[1]: t for k, t in tensors.items() if k.rsplit(".", 1)[0] == v.prefix}
        assert set(v.tensors) == set(stored), layer
        for suffix, t in stored.items():
            got = v.tensors[suffix]
            if suffix == "bias":
                t = t.float()
            assert torch.equal(got, t), f"{layer}.{suffix}"
    assert export.model_quant_type == view.model_quant_type


@pytest.mark.parametrize(
    "name",
    [
        "w8a8-dynamic",
        "w8a16",
        "w8a8",
        "w8a8-timestep",
        "smoothquant+w8a8",
        "smoothquant+w8a8-dynamic",
        "w8a8-dynamic-gptq",
    ],
)
def test_exported_layers_under_mindie_math_compute_the_float_layer(results, name, tmp_path):
    result = results[name]
    view = read_ascend_dir(export_ascend(result.package, tmp_path / "a", dtype="float16").root)
    float_model, quant_model = result.base.transformer, result.pipeline.transformer
    floor = VS_FLOAT_MIN_SQNR_DB["int8"]
    torch.manual_seed(0)
    smoothed = [n for n, v in view.layers.items() if v.mul_scale is not None]
    assert bool(smoothed) == name.startswith("smoothquant")
    for layer in (smoothed or list(view.layers))[:6]:
        v, linear = view.layers[layer], float_model.get_submodule(layer)
        module = quant_model.get_submodule(layer)
        step = 2 if name == "w8a8-timestep" else None  # a static step of the 4-step calibration
        if step is not None:
            module.set_step(step, 4)
        if "input_scale" in v.tensors:  # static: inputs inside the calibrated range (after smoothing)
            row = slice(None) if step is None else step
            s, o = v.tensors["input_scale"][row].item(), v.tensors["input_offset"][row].item()
            x = torch.empty(64, linear.in_features).uniform_((-128 - o) * s, (127 - o) * s)
            if v.mul_scale is not None:
                x = x / v.mul_scale
        else:
            x = torch.randn(64, linear.in_features)
        expected = F.linear(x.double(), linear.weight.double(), linear.bias.double())
        got = mindie_linear(v, x, step)
        assert sqnr_db(expected, got) > floor, layer
        assert sqnr_db(module(x).double(), got) > VS_RUNTIME_MIN_SQNR_DB, layer


@pytest.mark.parametrize("name", ["w8a8", "w8a8-timestep"])
def test_deq_scale_form_follows_the_deployment_dtype(results, name, tmp_path):
    package = results[name].package
    _, tensors = _package_tensors(package)
    layer = "transformer_blocks.0.attn.to_q"
    stored = tensors[f"{layer}.deq_scale"]
    bf16 = read_ascend_dir(export_ascend(package, tmp_path / "bf16", dtype="bfloat16").root)
    fp16 = read_ascend_dir(export_ascend(package, tmp_path / "fp16", dtype="float16").root)
    assert torch.equal(bf16.layers[layer].tensors["deq_scale"], stored)
    packed = fp16.layers[layer].tensors["deq_scale"]
    assert packed.dtype == torch.int64 and packed.shape == stored.shape
    assert torch.equal(packed, stored.view(torch.int32).to(torch.int64))  # msModelSlim's deqscale2int64
    assert torch.equal(deq_scale_as_fp32(packed), stored)
    with pytest.raises(PackageError, match="deq_scale's form depends on the dtype"):
        export_ascend(package, tmp_path / "none")  # a float32 package, no --dtype


def test_timestep_policy_is_reported_not_written(results, tmp_path, capsys):
    package = results["w8a8-timestep"].package
    assert main(["export-ascend", str(package), "--out", str(tmp_path / "a"), "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert 'policy.register(list(range(1, 4)), "static", target="w8a8_static_linear")' in out
    assert "run exactly 4 steps" in out
    view = read_ascend_dir(tmp_path / "a")
    assert view.model_quant_type == "W8A8_TIMESTEP"
    assert {k for k, v in view.description.items() if not isinstance(v, str)} == set()
    assert main(["export-ascend", str(package), "--out", str(tmp_path / "b")]) == 2  # float32, no --dtype
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "export-ascend --dtype" in err and not (tmp_path / "b").exists()


def test_mixed_precision_is_tagged_per_tensor_and_named_for_the_lowest_bit_scheme(results, tmp_path):
    view = read_ascend_dir(export_ascend(results["mixed"].package, tmp_path / "a", dtype="float16").root)
    assert {v.scheme for v in view.layers.values()} == {"W8A8_DYNAMIC", "W8A16", "W8A8"}
    assert view.model_quant_type == "W8A8"  # msModelSlim's AscendV1 ranking: W8A16 < W8A8_DYNAMIC < W8A8
    assert view.group_size is None
    assert sorted(os.listdir(tmp_path / "a")) == [
        "quant_model_description_w8a8.json",
        "quant_model_weight_w8a8.safetensors",
    ]


def test_cli_export_matches_optimize_format_ascend_byte_for_byte(tmp_path, capsys):
    pkg = tmp_path / "pkg"
    args = ["optimize", "flux-tiny", "--recipe", "w8a16", "--out", str(pkg), "--eval-samples", "0"]
    assert main([*args, "--format", "ascend", "--ascend-dtype", "float16"]) == 0
    assert main(["export-ascend", str(pkg), "--out", str(tmp_path / "again"), "--dtype", "float16"]) == 0
    layers = len(json.loads((pkg / "manifest.json").read_text())["modules"])  # the adaLN modulations too
    assert f"ascend (W8A16; {layers} W8A16)" in capsys.readouterr().out
    first, again = tmp_path / "pkg-ascend", tmp_path / "again"
    assert sorted(os.listdir(first)) == sorted(os.listdir(again))
    for name in os.listdir(first):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    read_ascend_dir(first)


def test_existing_target_needs_force_and_an_interrupted_export_leaves_nothing(results, tmp_path, monkeypatch):
    package, target = results["w8a16"].package, tmp_path / "a"
    export_ascend(package, target, dtype="bfloat16")
    with pytest.raises(PackageError, match="already exists"):
        export_ascend(package, target, dtype="bfloat16")
    with pytest.raises(PackageError, match="is not an Ascend export"):
        export_ascend(package, package, dtype="bfloat16", force=True)  # --force replaces only an export
    open_package(package)

    def die(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ascend, "save_file", die)
    with pytest.raises(KeyboardInterrupt):
        export_ascend(package, tmp_path / "fresh", dtype="bfloat16")
    with pytest.raises(KeyboardInterrupt):
        export_ascend(package, target, dtype="bfloat16", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    read_ascend_dir(target)


def test_fp8_and_float_packages_are_refused_with_the_reason(tmp_path):
    fp8 = sdkiln.optimize("flux-tiny", "fp8-dynamic", tmp_path / "fp8", eval_samples=0).package
    with pytest.raises(PackageError, match="FP8_DYNAMIC cannot be exported for Ascend: MindIE SD has no FP8"):
        export_ascend(fp8, tmp_path / "out")
    float_pkg = sdkiln.optimize("flux-tiny", "none", tmp_path / "float", eval_samples=0).package
    with pytest.raises(PackageError, match="quantizes no layer"):
        export_ascend(float_pkg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_tensors_that_do_not_fit_the_scheme_are_refused_by_name(results, tmp_path):
    root = tmp_path / "p"
    shutil.copytree(results["w4a16"].package, root)
    manifest = json.loads((root / "manifest.json").read_text())
    # first, so it is the layer the export reaches before any group-wise W4A16 layer it refuses
    to_q = "transformer_blocks.0.attn.to_q"
    manifest["modules"] = {to_q: {"scheme": "W8A16"}} | {
        k: v for k, v in manifest["modules"].items() if k != to_q
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageError, match=r"to_q.weight: expected torch.int8 .*, got torch.uint8"):
        export_ascend(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_smoothed_layers_keep_mindie_names(results):
    """Our runtime keeps a smoothed layer as ``L.div.mul_scale`` + ``L.linear.*``; so does MindIE SD."""
    manifest, tensors = _package_tensors(results["w8a8-dynamic"].package)
    layer = "transformer_blocks.0.attn.to_q"
    for suffix in ("weight", "weight_scale", "weight_offset", "bias"):
        tensors[f"{layer}.linear.{suffix}"] = tensors.pop(f"{layer}.{suffix}")
    tensors[f"{layer}.div.mul_scale"] = torch.rand(tensors[f"{layer}.linear.weight"].shape[1]) + 0.5
    with pytest.raises(PackageError, match="manifest smooth=False but .*div.mul_scale is present"):
        ascend_files(manifest, dict(tensors), None)
    manifest["modules"][layer]["smooth"] = True
    files = ascend_files(manifest, tensors, None)
    desc = files.description
    assert desc[f"{layer}.div.mul_scale"] == "FLOAT" and desc[f"{layer}.linear.weight"] == "W8A8_DYNAMIC"
    assert desc[f"{layer}.linear.bias"] == "FLOAT" and f"{layer}.weight" not in desc
    for suffix in ("linear.weight", "linear.weight_scale", "div.mul_scale"):
        assert torch.equal(files.weights[f"{layer}.{suffix}"], tensors[f"{layer}.{suffix}"])


def test_reader_rejects_what_mindie_would_reject(results, tmp_path):
    root = export_ascend(results["w8a16"].package, tmp_path / "a", dtype="bfloat16").root
    desc_path = root / "quant_model_description_w8a16.json"
    os.chmod(desc_path, 0o644)
    with pytest.raises(AscendFormatError, match="exceeds 0o640"):
        read_ascend_dir(root)
    os.chmod(desc_path, 0o640)
    desc = json.loads(desc_path.read_text())
    desc["transformer_blocks.0.attn.to_q.bias"] = "W8A16"
    desc_path.write_text(json.dumps(desc))
    with pytest.raises(AscendFormatError, match="to_q.bias: tagged W8A16, expected FLOAT"):
        read_ascend_dir(root)


def test_folded_smoothquant_and_groupwise_w4a16_are_refused_naming_the_alternative(results, tmp_path):
    with pytest.raises(
        PackageError, match=r"folded .* MindIE SD never loads; .*--format ascend.*fold: false"
    ):
        export_ascend(results["smoothquant-folded"].package, tmp_path / "a", dtype="bfloat16")
    with pytest.raises(
        PackageError, match="W4A16 cannot be exported for Ascend: .*antiquant_group_size.*w8a16"
    ):
        export_ascend(results["w4a16"].package, tmp_path / "a", dtype="bfloat16")
    assert not (tmp_path / "a").exists()


def test_weight_only_bias_is_what_cann_takes_for_the_deployment_dtype(results, tmp_path):
    package = results["w8a16"].package
    for dtype, expected in [("float16", torch.float16), ("bfloat16", torch.float32)]:
        view = read_ascend_dir(export_ascend(package, tmp_path / dtype, dtype=dtype).root)
        assert {v.tensors["bias"].dtype for v in view.layers.values()} == {expected}
    view = read_ascend_dir(
        export_ascend(results["w8a8-dynamic"].package, tmp_path / "d", dtype="float16").root
    )
    assert {v.tensors["bias"].dtype for v in view.layers.values()} == {torch.float32}  # MindIE SD casts it


def test_static_scales_on_the_deployment_grid_and_old_packages_regridded(results):
    """A package from this sdkiln exports its W8A8 scales unchanged; one from before the grids has
    input_scale rounded to bfloat16 (bf16) or deq_scale to fp19 (fp16), quant_bias recomputed."""
    manifest, tensors = _package_tensors(results["w8a8"].package)
    layer = "transformer_blocks.0.attn.to_q"
    for dt in (torch.bfloat16, torch.float16):
        files = ascend_files(manifest, dict(tensors), dt)
        assert files.regridded == 0
        assert torch.equal(files.weights[f"{layer}.quant_bias"], tensors[f"{layer}.quant_bias"])
    old = dict(tensors)
    s, deq = old[f"{layer}.input_scale"], old[f"{layer}.deq_scale"]
    old[f"{layer}.input_scale"] = s * (1 + 2**-12)  # off both grids, as an fp32 scale was
    old[f"{layer}.deq_scale"] = deq * (1 + 2**-12)
    bf16 = ascend_files(manifest, dict(old), torch.bfloat16)
    fp16 = ascend_files(manifest, dict(old), torch.float16)
    assert bf16.regridded == fp16.regridded == 1
    new_scale = bf16.weights[f"{layer}.input_scale"]
    assert torch.equal(new_scale, new_scale.to(torch.bfloat16).float())
    fp19 = deq_scale_as_fp32(fp16.weights[f"{layer}.deq_scale"])
    assert bool(((fp19.view(torch.int32) & 0x1FFF) == 0).all())
    w, bias, offset = old[f"{layer}.weight"], old[f"{layer}.bias"], old[f"{layer}.input_offset"]
    for files, deq in [(bf16, bf16.weights[f"{layer}.deq_scale"]), (fp16, fp19)]:
        expected = torch.round(bias.double() / deq.double() - offset.double() * w.long().sum(1).double())
        assert torch.equal(files.weights[f"{layer}.quant_bias"], expected.to(torch.int32))
    assert torch.allclose(bf16.weights[f"{layer}.deq_scale"], deq * new_scale / s, rtol=1e-6)


def test_format_ascend_refuses_a_recipe_it_cannot_export_before_calibrating(tmp_path, capsys):
    """The embedded model is float32: W8A8's files depend on the deployment dtype, so without
    --ascend-dtype optimize stops at once, with one line, writing nothing."""
    out = tmp_path / "pkg"
    cases = [
        (["--recipe", "w8a8-timestep"], "pass --ascend-dtype"),
        (["--recipe", "w4a16", "--ascend-dtype", "bfloat16"], "W4A16, which cannot be exported"),
        (["--recipe", "fp8-dynamic", "--ascend-dtype", "bfloat16"], "FP8_DYNAMIC, which cannot be exported"),
        (["--recipe", "w8a8-dynamic", "--ascend-dtype", "float16", "--format", "package"], "needs --format"),
    ]
    for extra, message in cases:
        t0 = time.perf_counter()
        code = main(["optimize", "--out", str(out), "--format", "ascend", "--eval-samples", "0", *extra])
        elapsed = time.perf_counter() - t0
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and message in err, err
        assert elapsed < 10.0, f"{extra}: {elapsed:.1f} s"
    assert not out.exists() and not (tmp_path / "pkg-ascend").exists()


def test_all_dynamic_timestep_policy_needs_nothing_registered(tmp_path, capsys):
    recipe = RecipeConfig("ts", [W8A8TimestepConfig(calib_samples=1, dynamic_steps=(4,))])
    result = sdkiln.optimize("flux-tiny", recipe, tmp_path / "p", eval_samples=0, format="ascend",
                             ascend_dtype="bfloat16", deployment=Deployment(num_inference_steps=4))  # fmt: skip
    assert result.ascend.timestep_policy == {"num_steps": 4, "dynamic_steps": 4}
    assert (
        main(["export-ascend", str(result.package), "--out", str(tmp_path / "b"), "--dtype", "float16"]) == 0
    )
    out = capsys.readouterr().out
    assert "all 4 steps run dynamic" in out and "register" not in out
