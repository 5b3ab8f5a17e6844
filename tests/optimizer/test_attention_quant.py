"""The ``attention_quant`` recipe step, its package section and the ``"quantized"`` attention backend.

Packages are compared with the in-memory optimized model bit for bit (``assert_same_outputs``): the
loaded plan runs the same kernel on the same inputs. The decisions are checked on a probe whose
measurements the test sets."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import sdkiln
from sdkiln import kernels as K
from sdkiln.configs import (
    AttentionQuantConfig,
    CacheAutoConfig,
    CompileConfig,
    Deployment,
    RecipeConfig,
    SparseAttentionConfig,
    W8A8DynamicConfig,
)
from sdkiln.errors import PackageError, SdkilnError
from sdkiln.optimizer.quant.attention import decide, per_sample_sqnr
from sdkiln.optimizer.recipes import resolve_recipe
from sdkiln.runtime.attention.quantized import PLAN_FILE, AttentionQuantPlan, attention_quant_of
from sdkiln.runtime.sparse import sparse_attention_of

STEPS = 4


def _recipe(*steps) -> RecipeConfig:
    return RecipeConfig("attn", list(steps), Deployment(num_inference_steps=STEPS))


@pytest.fixture(scope="module")
def flux_package(tmp_path_factory):
    out = tmp_path_factory.mktemp("attn") / "pkg"
    # the tiny random model's attention keeps 30.6-31.9 dB (INT8/FP8): a floor of 25 decides the same way
    # on every machine's rounding
    result = sdkiln.optimize(
        "flux-tiny",
        _recipe(W8A8DynamicConfig(), AttentionQuantConfig(sqnr_floor_db=25.0)),
        out,
        eval_samples=0,
    )
    return result, out


def test_a_flux_tiny_package_runs_quantized_attention_as_optimized(flux_package, assert_same_outputs):
    result, path = flux_package
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["attention_quant"] == {"file": PLAN_FILE}
    record = next(
        s["result"] for s in manifest["recipe"]["steps"] if s["config"]["kind"] == "attention_quant"
    )
    layers = {n for n, m in result.pipeline.transformer.named_modules() if n.endswith(".attn")}
    # every layer's per-step decision and the SQNR it was made on are in the manifest
    assert set(record["layers"]) == layers
    for entry in record["layers"].values():
        assert len(entry["steps"]) == len(entry["sqnr_db"]) == STEPS
        assert entry["steps"] == [x >= record["sqnr_floor_db"] for x in entry["sqnr_db"]]
    assert record["floor_met"] and record["tries"][-1]["psnr_mean"] >= 38.0
    plan = AttentionQuantPlan.from_dict(json.loads((path / PLAN_FILE).read_text()))
    assert (plan.qk, plan.pv, plan.num_steps) == ("int8", "fp8", STEPS) and plan.layers
    loaded = sdkiln.load(path, device="cpu")
    K.reset_kernel_counts()
    assert_same_outputs(result, loaded)
    runner = attention_quant_of(loaded.transformer)
    assert runner.stats["quantized_calls"] > 0
    assert K.kernel_counts()[("quantized_attention", "cpu", "reference")] > 0


def test_quantized_attention_composes_with_sparse_attention_and_a_cache_on_wan_tiny(
    tmp_path, assert_same_outputs
):
    """One route: the sparse backend runs its sparse calls and hands the dense ones (its dense step,
    cross-attention to the text) to the quantization plan."""
    cache = CacheAutoConfig(
        psnr_floor_db=20.0, psnr_p5_floor_db=15.0, calib_samples=1, eval_samples=1, budgets=2, refine=0
    )
    recipe = _recipe(
        AttentionQuantConfig(calib_samples=1, sqnr_floor_db=20.0),
        SparseAttentionConfig(sparsity=0.5, dense_steps=1, calib_samples=1),
        cache,
    )
    result = sdkiln.optimize("wan-tiny", recipe, tmp_path / "pkg", eval_samples=0)
    manifest = json.loads((tmp_path / "pkg" / "manifest.json").read_text())
    assert {"attention_quant", "sparse_attention", "cache_schedule"} <= set(manifest)
    loaded = sdkiln.load(tmp_path / "pkg", device="cpu")
    assert_same_outputs(result, loaded)
    quantized, sparse = attention_quant_of(loaded.transformer), sparse_attention_of(loaded.transformer)
    assert quantized.stats["quantized_calls"] > 0 and sparse.stats["sparse_calls"] > 0
    assert quantized.stats["quantized_calls"] + quantized.stats["float_calls"] == sparse.stats["dense_calls"]
    # the step tracker stays while the plans follow it, whoever attached it first (the cache did)
    from sdkiln.runtime.cache import detach_cache
    from sdkiln.runtime.denoising import step_tracker

    detach_cache(loaded.transformer)
    assert step_tracker(loaded.transformer) is not None


@pytest.mark.parametrize("family", ["flux-tiny", pytest.param("wan-tiny", marks=pytest.mark.slow)])
def test_the_default_recipe_with_attn_int8_loads_and_matches(family, tmp_path, assert_same_outputs):
    """``default+attn-int8`` (wan-tiny's default has block-sparse attention too): about 10 s each."""
    result = sdkiln.optimize(family, "default+attn-int8", tmp_path / "pkg", eval_samples=0)
    kinds = [s["config"]["kind"] for s in result.manifest["recipe"]["steps"]]
    assert kinds[kinds.index("quant_auto") + 1] == "attention_quant"
    loaded = sdkiln.load(tmp_path / "pkg", device="cpu")
    assert_same_outputs(result, loaded)
    runner = attention_quant_of(loaded.transformer)
    assert (runner is not None) == ("attention_quant" in result.manifest)
    if runner is not None:
        assert runner.stats["quantized_calls"] > 0


def test_compile_and_a_bad_plan_are_refused(flux_package, tmp_path, rehash):
    _, path = flux_package
    with pytest.raises(SdkilnError, match="compile with quantized attention is not supported"):
        sdkiln.load(path, device="cpu", compile=CompileConfig(backend="eager"))
    plan = json.loads((path / PLAN_FILE).read_text())
    name = next(iter(plan["layers"]))
    for i, (change, match) in enumerate(
        [
            ({"config_hash": "0" * 64}, "another transformer config"),
            (
                {"layers": {"transformer_blocks.9.attn": {"rotate": False, "steps": [True] * STEPS}}},
                "not a routed",
            ),
            ({"layers": {name: {"rotate": False, "steps": [True]}}}, f"steps {STEPS} booleans"),
            ({"qk": "int4"}, "qk is one of"),
            ({"extra": 1}, "unknown field 'extra'"),
        ]
    ):
        bad = tmp_path / f"bad{i}"
        shutil.copytree(path, bad)
        (bad / PLAN_FILE).write_text(json.dumps(plan | change))
        rehash(bad, PLAN_FILE)
        with pytest.raises(PackageError, match=match):
            sdkiln.load(bad, device="cpu")


def test_inspect_the_model_card_and_the_exports_say_what_they_do_with_it(flux_package, capsys):
    from sdkiln.cli import main
    from sdkiln.export import diffusers_view, onnx
    from sdkiln.export.publish import model_card
    from sdkiln.runtime.package import open_package

    _, path = flux_package
    assert main(["inspect", str(path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("quantized attention:"))
    plan = AttentionQuantPlan.from_dict(json.loads((path / PLAN_FILE).read_text()))
    assert (
        line.startswith(f"quantized attention: int8 QK, fp8 PV on {len(plan.layers)} layers")
        and PLAN_FILE in line
    )
    card = model_card(open_package(path), "me/pkg", "apache-2.0")
    share = f"{plan.record['quantized_fraction']:.0%}"
    assert (
        f"- Quantized attention (INT8 QK, FP8 PV): {share} of the attention layers' denoising steps" in card
    )
    manifest = json.loads((path / "manifest.json").read_text())
    for module in (diffusers_view, onnx):
        with pytest.raises(SdkilnError, match="quantized attention"):
            module._check_package(manifest)


class _Probe:
    rotations = (False, True)

    def __init__(self, sqnr):
        self.sqnr = sqnr


def test_decisions_per_layer_and_step():
    """The rotation of higher mean SQNR, steps at or above the floor, unseen steps float, a layer with no
    quantized step left out of the plan but kept in the record."""
    sqnr = {}
    for s, (plain, rotated) in enumerate([(28.0, 33.0), (31.0, 36.0), (35.0, 29.0)]):
        sqnr["a", s, False], sqnr["a", s, True] = plain, rotated
    for s in range(2):  # layer b: seen at steps 0 and 1 only (an expert's window), always low
        sqnr["b", s, False] = sqnr["b", s, True] = 10.0
    plan, record = decide(_Probe(sqnr), ["a", "b", "c"], 3, 30.0, None)
    assert plan == {"a": {"rotate": True, "steps": [True, True, False]}}
    assert record["b"] == {"rotate": False, "steps": [False, False, False], "sqnr_db": [10.0, 10.0, None]}
    assert "c" not in record
    assert decide(_Probe(sqnr), ["a"], 3, 30.0, False)[0] == {
        "a": {"rotate": False, "steps": [False, True, True]}
    }
    # a layer measured without the rotation only (a head dim that is no power of two)
    plan, _ = decide(_Probe({("d", 0, False): 40.0}), ["d"], 1, 30.0, None)
    assert plan == {"d": {"rotate": False, "steps": [True]}}


def test_a_run_at_another_step_count_follows_the_plan_by_position():
    plan = AttentionQuantPlan("int8", "fp8", 4, {"x": {"rotate": False, "steps": [False, True, True, False]}})
    assert [plan.quantized("x", i, 8) is not None for i in range(8)] == [False] * 2 + [True] * 4 + [False] * 2
    assert plan.quantized("y", 0, 4) is None


def test_per_sample_sqnr():
    ref = torch.randn(3, 5, 2, 4)
    noisy = ref.clone()
    noisy[1] += 0.01 * torch.randn(5, 2, 4)
    db = per_sample_sqnr(ref, noisy)
    assert db[0] == db[2] == 200.0 and 30 < db[1] < 60


def test_a_floor_nothing_reaches_leaves_no_section(tmp_path):
    result = sdkiln.optimize(
        "flux-tiny", _recipe(AttentionQuantConfig(sqnr_floor_db=150.0, retries=0, calib_samples=1)), tmp_path / "p",
        eval_samples=0,
    )  # fmt: skip
    manifest = json.loads((tmp_path / "p" / "manifest.json").read_text())
    assert "attention_quant" not in manifest and PLAN_FILE not in manifest["files"]
    record = manifest["recipe"]["steps"][0]["result"]
    assert record["quantized_fraction"] == 0.0 and record["tries"] == [
        {"sqnr_floor_db": 150.0, "quantized_fraction": 0.0, "psnr_mean": None}
    ]
    assert attention_quant_of(result.pipeline.transformer) is None


def test_a_mindie_layout_package_runs_fp8_block_attention_as_optimized(tmp_path, assert_same_outputs):
    """``attn-fp8-ascend``: decided on ``sdkiln::fp8_block_attention`` (MindIE SD's blocks), which the
    loaded package runs; the plan says its layout, and a plan of another layout is refused at read."""
    config = AttentionQuantConfig(qk="fp8", pv="fp8", layout="mindie", sqnr_floor_db=20.0, calib_samples=1)
    result = sdkiln.optimize(
        "flux-tiny", _recipe(W8A8DynamicConfig(), config), tmp_path / "pkg", eval_samples=0
    )
    data = json.loads((tmp_path / "pkg" / PLAN_FILE).read_text())
    assert data["layout"] == "mindie" and data["layers"]
    loaded = sdkiln.load(tmp_path / "pkg", device="cpu")
    K.reset_kernel_counts()
    assert_same_outputs(result, loaded)
    counts = K.kernel_counts()
    assert counts[("fp8_block_attention", "cpu", "reference")] > 0
    assert not any(op == "quantized_attention" for op, *_ in counts)
    with pytest.raises(PackageError, match="layout is one of"):
        AttentionQuantPlan.from_dict(data | {"layout": "flash"})


def test_recipe_names_and_config_checks():
    (attn_int8,) = resolve_recipe("attn-int8").steps
    (attn_fp8,) = resolve_recipe("attn-fp8").steps
    (ascend,) = resolve_recipe("attn-fp8-ascend").steps
    assert (attn_int8.qk, attn_int8.pv, attn_fp8.qk, attn_fp8.pv) == ("int8", "fp8", "fp8", "fp8")
    assert (ascend.qk, ascend.pv, ascend.layout, attn_fp8.layout) == ("fp8", "fp8", "mindie", "sage")
    assert [s.kind for s in resolve_recipe("attn-int8+w8a8-dynamic+cache-auto").steps] == [
        "w8a8_dynamic", "attention_quant", "cache_auto",
    ]  # fmt: skip
    for bad, match in [({"qk": "int4"}, "qk is one of"), ({"rotate": "yes"}, "rotate is one of"),
                       ({"retries": -1}, "retries"), ({"floor_step_db": 0}, "floor_step_db"),
                       ({"layout": "flash"}, "layout is one of"),
                       ({"layout": "mindie", "qk": "int8"}, "FP8 throughout")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            AttentionQuantConfig(**bad)
