"""quant_auto on flux-tiny: the plan falls back exactly where a layer's SQNR is under the floor, the
recorded SQNRs are those of the layer's real inputs, the sensitivity pass keeps no activations, and
mixed packages round-trip bit-identically with their plan in the manifest and in ``sdkiln inspect``."""

import functools
import gc
import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sdkiln
from sdkiln.calibrate.loop import PromptLoop
from sdkiln.calibrate.observers import observing
from sdkiln.cli import main
from sdkiln.configs import QuantAutoConfig, RecipeConfig, quant_auto_schemes
from sdkiln.errors import RecipeError
from sdkiln.metrics import sqnr_db
from sdkiln.model_zoo import get_spec
from sdkiln.optimizer.quant.quant_auto import (
    FLOAT,
    LayerSensitivity,
    build_candidate,
    candidate_modules,
    sensitivity_pass,
)
from sdkiln.optimizer.recipes import resolve_recipe
from sdkiln.optimizer.registry import TransformContext, apply_transform
from sdkiln.runtime.package import open_package
from sdkiln.runtime.quant import Ranges, by_recipe_kind
from sdkiln.runtime.quant.w8a8_dynamic import W8A8DynamicLinear
from sdkiln.runtime.quant.w8a8_static import W8A8StaticLinear

# int8's usual layer floor; flux-tiny's random-weight layers measure 36-42 dB static and 37-44 dB
# dynamic, so the default floor (40 dB) would split them by chance rather than by the spike below.
FLOOR_DB = 25.0
ONE_SAMPLE = dict(calib_samples=1, sensitivity_samples=1, sqnr_floor_db=FLOOR_DB)
# The step sums fp32 squared errors per call in fp64; the test recomputes them over all calls at once.
SQNR_TOL_DB = 1e-4
# One massive activation (one channel of one token, every call) in a K=128 layer whose inputs are
# O(1): a per-tensor static range must stretch to hold it (static SQNR about 20 dB on flux-tiny)
# while per-token quantization confines the damage to that token (dynamic about 33 dB). Every
# other flux-tiny layer measures 36-42 dB static.
SPIKED = "transformer_blocks.0.attn.to_out.0"
SPIKE = 50.0
SCHEME = {"w8a8_static": "W8A8", "w8a8_timestep": "W8A8_TIMESTEP", "w8a8_dynamic": "W8A8_DYNAMIC"}


@pytest.fixture(scope="module")
def spec():
    return get_spec("flux-tiny")


def spiked_pipeline(spec):
    pipe = spec.build()

    def spike(module, args):
        x = args[0].clone()
        x[..., 0, 0] = SPIKE
        return (x,)

    pipe.transformer.get_submodule(SPIKED).register_forward_pre_hook(spike)
    return pipe


def run_step(spec, config):
    pipe = spiked_pipeline(spec)
    return pipe, apply_transform(TransformContext(pipeline=pipe, spec=spec, forward_loop=None), config)


@pytest.fixture(scope="module")
def default_plan(spec):
    return run_step(spec, QuantAutoConfig(**ONE_SAMPLE))


def test_the_spiked_layer_falls_back_to_dynamic_and_every_other_layer_stays_static(default_plan):
    pipe, result = default_plan
    plan = result.record["plan"]
    spiked = plan[SPIKED]["sqnr_db"]
    assert spiked["w8a8_static"] < FLOOR_DB <= spiked["w8a8_dynamic"]
    for layer, entry in plan.items():
        first = next((s for s in ("w8a8_static", "w8a8_dynamic") if entry["sqnr_db"][s] >= FLOOR_DB), FLOAT)
        assert entry["choice"] == first, layer
        assert entry["choice"] == ("w8a8_dynamic" if layer == SPIKED else "w8a8_static"), layer
        expected = W8A8DynamicLinear if layer == SPIKED else W8A8StaticLinear
        assert type(pipe.transformer.get_submodule(layer)) is expected
        assert result.modules[layer] == {"scheme": SCHEME[entry["choice"]]}
    n = len(plan)
    assert result.record["counts"] == {"w8a8_static": n - 1, "w8a8_dynamic": 1, FLOAT: 0}
    assert result.record["below_floor"] == [] and result.record["calibration"]["seeds"] == [0]
    assert result.record["sensitivity_data"]["seeds"] == [1], "SQNRs are measured on held-out samples"


def test_without_a_fallback_or_under_an_impossible_floor_layers_stay_float(spec):
    pipe, result = run_step(spec, QuantAutoConfig(**ONE_SAMPLE, fallbacks=()))
    assert result.record["below_floor"] == [SPIKED] and SPIKED in result.record["float"]
    assert SPIKED not in result.modules and type(pipe.transformer.get_submodule(SPIKED)) is nn.Linear
    assert {e["scheme"] for e in result.modules.values()} == {"W8A8"}

    with pytest.warns(UserWarning, match="no layer reached 1000.0 dB"):
        pipe, result = run_step(spec, QuantAutoConfig(**{**ONE_SAMPLE, "sqnr_floor_db": 1000.0}))
    assert result.modules == {} and result.record["counts"][FLOAT] == len(result.record["plan"])
    assert not any(type(m) in (W8A8DynamicLinear, W8A8StaticLinear) for m in pipe.transformer.modules())


def test_recorded_sqnr_is_the_sqnr_of_the_layer_on_its_held_out_inputs(spec, default_plan):
    _, result = default_plan
    stats = result.files["calibration/stats.safetensors"]
    layers = [SPIKED, "single_transformer_blocks.1.proj_out"]
    pipe = spiked_pipeline(spec)
    stored = {name: [] for name in layers}
    with observing(
        pipe, "transformer", {n: (lambda x, s, t, n=n: stored[n].append(x.clone())) for n in layers}
    ):
        PromptLoop(spec, 1, first=1)(pipe)
    for name in layers:
        linear = pipe.transformer.get_submodule(name)
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in stored[name]])
        lo, hi = float(stats[f"quant_auto/{name}.min"]), float(stats[f"quant_auto/{name}.max"])
        measured = result.record["plan"][name]["sqnr_db"]
        with torch.no_grad():
            ref = F.linear(x, linear.weight, linear.bias)
            static = W8A8StaticLinear.from_linear(linear, Ranges(lo, hi))(x)
            dynamic = W8A8DynamicLinear.from_linear(linear)(x)
        assert abs(measured["w8a8_static"] - sqnr_db(ref, static)) < SQNR_TOL_DB
        assert abs(measured["w8a8_dynamic"] - sqnr_db(ref, dynamic)) < SQNR_TOL_DB


def test_a_user_loop_runs_once_per_pass_and_is_recorded(spec):
    runs = []
    call = {**spec.call_kwargs(), "num_inference_steps": 3, "output_type": "latent"}

    def forward_loop(pipe):
        runs.append(pipe)
        with torch.inference_mode():
            pipe(prompt="a lighthouse in a storm", generator=torch.Generator().manual_seed(9), **call)

    for config, passes in [(QuantAutoConfig(), 2), (QuantAutoConfig(scheme="w8a16", fallbacks=()), 1)]:
        pipe, runs[:] = spec.build(), []
        result = apply_transform(
            TransformContext(pipeline=pipe, spec=spec, forward_loop=forward_loop), config
        )
        assert runs == [pipe] * passes
        assert result.record["sensitivity_data"] == {"loop": "user", "steps": 3}
        assert result.record["calibration"] == ({"loop": "user", "steps": 3} if passes == 2 else None)
        assert bool(result.files) == (passes == 2)


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_the_sensitivity_pass_keeps_no_activations(spec):
    pipe = spec.build()
    names = [n for n, m in pipe.transformer.named_modules() if isinstance(m, nn.Linear) and "blocks." in n]

    def sensitivities():
        return {
            n: LayerSensitivity(
                pipe.transformer.get_submodule(n),
                functools.partial(
                    lambda m: {"w8a8_dynamic": W8A8DynamicLinear.from_linear(m)},
                    pipe.transformer.get_submodule(n),
                ),
                ["w8a8_dynamic"],
            )
            for n in names
        }

    def state(layers):
        return [
            (k, type(v).__name__, len(v) if isinstance(v, dict | list) else None)
            for s in layers.values()
            for k, v in vars(s).items()
        ]

    small = sensitivities()
    sensitivity_pass(pipe, "transformer", small, PromptLoop(spec, samples=1))
    gc.collect()
    before = rss_bytes()
    seen = [0]

    def count(x, step, num_steps):
        seen[0] += x.numel() * x.element_size()

    many = sensitivities()
    with observing(pipe, "transformer", dict.fromkeys(names, count)):
        sensitivity_pass(pipe, "transformer", many, PromptLoop(spec, samples=6))
    gc.collect()
    growth = rss_bytes() - before
    assert state(many) == state(small)
    assert all(isinstance(v, float) for s in many.values() for v in [s.signal, *s.noise.values()])
    # Storing the inputs would take seen[0] (about 70 MB); the pass adds two floats per candidate.
    assert growth < 0.1 * seen[0], (growth, seen[0])


def test_a_scheme_that_cannot_take_a_layer_is_recorded_and_skipped():
    modules, reasons = candidate_modules(nn.Linear(96, 8), ("w4a16", "w8a16"), None)
    assert list(modules) == ["w8a16"] and "not a multiple of group_size 128" in reasons["w4a16"]


def test_config_validation_and_the_default_recipe():
    layer = nn.Linear(128, 16)
    ranges = Ranges(-1.0, 1.0, torch.full((4,), -1.0), torch.ones(4))
    for kind, cls in by_recipe_kind().items():  # every runtime scheme is a candidate, built from its class
        assert kind in quant_auto_schemes() and type(build_candidate(kind, layer, ranges)) is cls
    for bad, match in [
        (dict(scheme="int3"), "cannot use 'int3'"),
        (dict(fallbacks=("w8a8_static",)), "each scheme once"),
        (dict(sqnr_floor_db=float("nan")), "finite"),
        (dict(sqnr_floor_db="25"), "number of dB"),
        (dict(sensitivity_samples=0), "sensitivity_samples must be >= 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            QuantAutoConfig(**bad)
    with pytest.raises(RecipeError, match="sqnr_floor_db must be finite"):
        QuantAutoConfig.from_dict({"kind": "quant_auto", "sqnr_floor_db": float("inf")})
    assert resolve_recipe("default").steps[1] == QuantAutoConfig()  # after the text encoders' step


PACKAGES = {
    "static": QuantAutoConfig(**ONE_SAMPLE),
    "timestep": QuantAutoConfig(**ONE_SAMPLE, scheme="w8a8_timestep"),
}


@pytest.fixture(scope="module")
def packages(spec, tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_auto")
    return {
        name: sdkiln.optimize(
            spiked_pipeline(spec), RecipeConfig("quant-auto", [cfg]), root / name, eval_samples=0
        )
        for name, cfg in PACKAGES.items()
    }


@pytest.mark.parametrize("name", list(PACKAGES))
def test_a_mixed_package_round_trips_bit_identically(packages, name, assert_same_outputs):
    result = packages[name]
    loaded = sdkiln.load(result.package, device="cpu")
    schemes = {type(m).scheme for m in loaded.transformer.modules() if hasattr(m, "scheme")}
    assert schemes == {SCHEME[PACKAGES[name].scheme], "W8A8_DYNAMIC"}
    assert_same_outputs(result, loaded)


def test_the_manifest_records_the_plan_and_inspect_counts_the_schemes(packages, capsys):
    result = packages["static"]
    manifest = open_package(result.package).manifest
    step = manifest["recipe"]["steps"][0]
    assert step["config"] == PACKAGES["static"].to_dict()
    assert step["result"]["plan"] == json.loads(
        json.dumps(result.manifest["recipe"]["steps"][0]["result"]["plan"])
    )
    assert {
        layer: e["choice"] for layer, e in step["result"]["plan"].items() if e["choice"] == "w8a8_dynamic"
    } == {SPIKED: "w8a8_dynamic"}
    config = json.loads((result.package / "calibration/config.json").read_text())
    assert set(config) == {"quant_auto"} and config["quant_auto"]["seeds"] == [0]
    n = len(manifest["modules"])
    counts = {"W8A8": n - 1, "W8A8_DYNAMIC": 1}
    assert main(["inspect", str(result.package), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["schemes"] == counts
    assert main(["inspect", str(result.package)]) == 0
    assert f"layers: {n} quantized {counts}" in capsys.readouterr().out
