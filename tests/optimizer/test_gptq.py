"""GPTQ rounding: the algorithm against nearest rounding on known inputs, the
streaming second moments, and flux-tiny packages of each scheme that takes it (W8A8_DYNAMIC, W8A16,
W4A16): exact round trips, the nearest-rounding scales kept, the integers changed."""

import json

import pytest
import torch

import sdkiln
from sdkiln.calibrate.hessian import HessianAccumulator, collect_hessians, hessian_groups
from sdkiln.calibrate.loop import PromptLoop
from sdkiln.configs import Deployment, RecipeConfig, W4A16Config, W8A8DynamicConfig, W8A16Config
from sdkiln.errors import RecipeError
from sdkiln.export.summary import summarize
from sdkiln.kernels.int4 import unpack_int4
from sdkiln.model_zoo import get_spec
from sdkiln.optimizer.quant.gptq import expand_scale, gptq_round, output_error
from sdkiln.optimizer.recipes import resolve_recipe
from sdkiln.runtime.package import open_package
from sdkiln.runtime.quant.w8a8_dynamic import W8A8DynamicLinear, int8_weight
from sdkiln.runtime.quant.weight_only import W4A16Linear, W8A16Linear

# Tolerances, stated once. Integer results and package round trips are exact (torch.equal). The
# streamed second moment is an fp32 running mean against a float64 product: within 1e-5 of the
# matrix's largest entry.
MOMENT_TOL = 1e-5


def correlated_inputs(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Inputs whose channels share a few strong directions, as activations do."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(4, k, generator=g, dtype=torch.float64)
    return torch.randn(rows, 4, generator=g, dtype=torch.float64) @ basis + 0.05 * torch.randn(
        rows, k, generator=g, dtype=torch.float64
    )


def test_with_a_diagonal_hessian_gptq_is_nearest_rounding():
    w = torch.randn(16, 40, generator=torch.Generator().manual_seed(1))
    _, scale = int8_weight(w)
    h = torch.diag(torch.rand(40, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.5)
    # nearest in float64, as GPTQ rounds (int8_weight divides in fp32, which can round a quotient
    # of -127.499997 to -127.5 and then to -128)
    nearest = torch.round(w.double() / scale.double()).clamp(-128, 127)
    assert torch.equal(gptq_round(w, h, scale, -128, 127), nearest)


def test_gptq_lowers_the_output_error_on_correlated_inputs_and_stays_on_the_grid():
    x, x2 = correlated_inputs(4000, 96).split(2000)  # calibration rows, held-out rows
    h = x.T @ x / x.shape[0]
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(3))
    nearest, scale = int8_weight(w)
    q = gptq_round(w, h, scale, -128, 127)
    assert torch.equal(q, q.round()) and q.min() >= -128 and q.max() <= 127
    e_near = output_error(w, nearest.double() * scale.double(), h)
    e_gptq = output_error(w, q * scale.double(), h)
    assert e_gptq < 0.5 * e_near
    # the same ordering on held-out inputs from the same distribution, measured directly
    out = x2 @ w.double().T
    err_near = (x2 @ (nearest.double() * scale.double()).T - out).pow(2).mean()
    err_gptq = (x2 @ (q * scale.double()).T - out).pow(2).mean()
    assert err_gptq < 0.5 * err_near


def test_the_blocked_form_matches_one_block():
    x = correlated_inputs(500, 70, seed=4)
    h = x.T @ x / x.shape[0]
    w = torch.randn(8, 70, generator=torch.Generator().manual_seed(5))
    _, scale = int8_weight(w)
    assert torch.equal(
        gptq_round(w, h, scale, -128, 127, block=16), gptq_round(w, h, scale, -128, 127, block=128)
    )


def test_group_wise_scales_stay_on_each_groups_grid_and_lower_the_error():
    x, _ = correlated_inputs(4000, 128, seed=6).split(2000)
    h = x.T @ x / x.shape[0]
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(7))
    scale = w.abs().reshape(16, 2, 64).amax(-1) / 7  # [N, 2]: two groups of 64 inputs
    q = gptq_round(w, h, scale, -7, 7)
    assert q.min() >= -7 and q.max() <= 7
    s = expand_scale(scale, 128)
    assert torch.equal(s[:, :64], scale[:, :1].expand(16, 64)) and torch.equal(
        s[:, 64:], scale[:, 1:].expand(16, 64)
    )
    nearest = torch.round(w.double() / s.double()).clamp(-7, 7)
    assert output_error(w, q * s.double(), h) < 0.5 * output_error(w, nearest * s.double(), h)


def test_gptq_rejects_mismatched_shapes():
    w = torch.randn(4, 8)
    _, scale = int8_weight(w)
    with pytest.raises(ValueError, match="input channels"):
        gptq_round(w, torch.eye(7), scale, -128, 127)
    with pytest.raises(ValueError, match=r"must be \[4, 1\] or \[4, groups\]"):
        gptq_round(w, torch.eye(8), scale.reshape(1, 4), -128, 127)
    with pytest.raises(ValueError, match="3 scale groups do not divide 8"):
        gptq_round(w, torch.eye(8), torch.ones(4, 3), -128, 127)


def test_streamed_second_moment_is_the_mean_of_x_xt_and_its_size_is_fixed():
    acc = HessianAccumulator()
    chunks = [correlated_inputs(n, 24, seed=n).float().reshape(-1, 3, 24) for n in (30, 90, 60)]
    for c in chunks:
        acc.update(c, 0, 1)
        assert acc.matrix.shape == (24, 24)
    x = torch.cat([c.reshape(-1, 24) for c in chunks]).double()
    expected = x.T @ x / x.shape[0]
    tol = MOMENT_TOL * float(expected.abs().max())
    torch.testing.assert_close(acc.matrix.double(), expected, rtol=0, atol=tol)
    assert acc.rows == x.shape[0]


def test_hessian_groups_fit_the_budget_in_order():
    widths = {"a": 10, "b": 10, "c": 20, "d": 5}  # 400, 400, 1600, 100 bytes
    assert hessian_groups(widths, 900) == [["a", "b"], ["c"], ["d"]]
    assert hessian_groups(widths, 10**6) == [["a", "b", "c", "d"]]


def test_one_pass_or_several_collect_the_same_moments(flux_tiny):
    spec, pipe = flux_tiny
    names = ["transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.proj_mlp"]
    loop = PromptLoop(spec, 1, spec.call_kwargs(num_inference_steps=2))
    one = collect_hessians(pipe, spec.transformer_attr, names, loop, 2**30)
    per_layer = collect_hessians(pipe, spec.transformer_attr, names, loop, 1)
    for name in names:
        assert torch.equal(one[name].matrix, per_layer[name].matrix)


def test_config_and_recipe_names():
    assert resolve_recipe("w8a8-dynamic-gptq").steps == [W8A8DynamicConfig(weight_rounding="gptq")]
    assert resolve_recipe("w8a16-gptq").steps == [W8A16Config(weight_rounding="gptq")]
    assert resolve_recipe("w4a16-gptq").steps == [W4A16Config(weight_rounding="gptq")]
    with pytest.raises(RecipeError, match="weight_rounding must be one of nearest, gptq"):
        RecipeConfig.from_dict({"name": "x", "steps": [{"kind": "w8a8_dynamic", "weight_rounding": "awq"}]})
    with pytest.raises(ValueError, match="gptq_damp"):
        W8A8DynamicConfig(gptq_damp=0)


SCHEMES = {
    "w8a8-dynamic": (W8A8DynamicConfig, W8A8DynamicLinear),
    "w8a16": (W8A16Config, W8A16Linear),
    "w4a16": (W4A16Config, W4A16Linear),
}


@pytest.fixture(scope="module")
def gptq_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq")
    out = {}
    for name, (config, _) in SCHEMES.items():
        extra = {"group_size": 64} if config is W4A16Config else {}
        recipe = RecipeConfig(
            name,
            [config(weight_rounding="gptq", calib_samples=1, **extra)],
            Deployment(num_inference_steps=2),
        )
        out[name] = sdkiln.optimize(get_spec("flux-tiny").build(), recipe, root / name, eval_samples=0)
    return out


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_gptq_package_round_trips_bit_identically_and_records_its_calibration(
    gptq_results, scheme, assert_same_outputs
):
    result = gptq_results[scheme]
    kind = SCHEMES[scheme][0].kind
    record = result.manifest["recipe"]["steps"][0]["result"]
    assert record["weight_rounding"] == "gptq"
    assert set(record["gptq_error_ratio"]) == set(result.manifest["modules"])
    assert record["gptq_error_ratio_median"] < 1.0
    assert summarize(open_package(result.package))["gptq"] == {kind: record["gptq_error_ratio_median"]}
    config = json.loads((result.package / "calibration/config.json").read_text())
    assert config[kind]["steps"] == 2 and config[kind]["seeds"] == [0]
    loaded = sdkiln.load(result.package, device="cpu")
    swapped = [m for m in loaded.transformer.modules() if isinstance(m, SCHEMES[scheme][1])]
    assert len(swapped) == len(result.manifest["modules"]) > 0
    assert_same_outputs(result, loaded)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_gptq_keeps_the_nearest_rounding_scales_and_changes_some_integers(gptq_results, scheme):
    result = gptq_results[scheme]
    config, module_cls = SCHEMES[scheme]
    base, quant = result.base.transformer, result.pipeline.transformer
    changed = 0
    for layer in result.manifest["modules"]:
        linear = base.get_submodule(layer)
        nearest = module_cls.from_linear(linear, **({"group_size": 64} if config is W4A16Config else {}))
        module = quant.get_submodule(layer)
        assert torch.equal(module.weight_scale, nearest.weight_scale)
        if config is W4A16Config:
            changed += int((unpack_int4(module.weight) != unpack_int4(nearest.weight)).sum())
        else:
            changed += int((module.weight != nearest.weight).sum())
    assert changed > 0
