"""What MindIE SD computes from our Ascend export is what our runtime computed: the emulated MindIE
layers (``mindie_emulation``) against our runtime's layers on the embedded model's activations, per
scheme and deployment dtype, and the embedded pipeline end to end."""

import copy
import re
import sys
import types
from pathlib import Path

import pytest
import torch

import sdkiln
from sdkiln.configs import (
    Deployment,
    RecipeConfig,
    SmoothQuantConfig,
    W8A8DynamicConfig,
    W8A8StaticConfig,
    W8A8TimestepConfig,
    W8A16Config,
)
from sdkiln.export import export_ascend
from sdkiln.metrics import psnr
from sdkiln.model_zoo import get_spec
from sdkiln.runtime.package import open_package
from sdkiln.runtime.quant import QuantLinear
from sdkiln.runtime.quant.smooth import MulScale

from . import mindie_emulation as mindie

# Tolerances, stated once. A MindIE layer against our runtime's on the same input (relative L2 error
# of the output), by deployment dtype: both compute with the same scales, so what is left is where
# each rounds its output.
LAYER_REL_ERR = {torch.float16: 3e-4, torch.bfloat16: 3e-3}
# The embedded pipeline with MindIE's layers against ours, each by PSNR against the float pipeline:
PIPELINE_PSNR_MARGIN_DB = 1.0
PIPELINE_SAMPLES = 8
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
STEPS, DYNAMIC_STEPS = 8, 3  # a short deployment keeps the embedded model's runs fast
CAPTURED_STEPS = (0, DYNAMIC_STEPS, STEPS - 1)

RECIPES = {
    "w8a8-dynamic": [W8A8DynamicConfig()],
    "w8a8": [W8A8StaticConfig(calib_samples=1)],
    "w8a8-timestep": [W8A8TimestepConfig(calib_samples=1, dynamic_steps=(DYNAMIC_STEPS,))],
    "w8a16": [W8A16Config()],
    "smoothquant+w8a8": [SmoothQuantConfig(calib_samples=1), W8A8StaticConfig(calib_samples=1)],
    "smoothquant+w8a8-dynamic": [SmoothQuantConfig(calib_samples=1), W8A8DynamicConfig()],
    "mixed": [
        W8A8StaticConfig(calib_samples=1, exclude=("*.ff.*", "*.ff_context.*")),
        W8A8DynamicConfig(exclude=("*.ff_context.*",)),
        W8A16Config(),
    ],
}
FAST = ("w8a8-timestep", "smoothquant+w8a8", "mixed")  # together they cover every scheme
SLOW = [pytest.param(n, marks=pytest.mark.slow) if n not in FAST else n for n in RECIPES]


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """name -> (package, {dtype name: its Ascend export}), made lazily with format="ascend"."""
    root, made = tmp_path_factory.mktemp("mindie"), {}

    def get(name):
        if name not in made:
            recipe = RecipeConfig(name, RECIPES[name], deployment=Deployment(num_inference_steps=STEPS))
            out = root / name
            result = sdkiln.optimize(
                None, recipe, out, eval_samples=0, format="ascend", ascend_dtype="bfloat16"
            )
            fp16 = export_ascend(out, root / f"{name}-fp16", dtype="float16")
            made[name] = (out, {"bfloat16": result.ascend.root, "float16": fp16.root})
        return made[name]

    return get


def _policy(manifest):
    policy = mindie.TimestepPolicyConfig()
    steps = {(m["num_steps"], m["dynamic_steps"]) for m in manifest["modules"].values() if "num_steps" in m}
    for t, k in steps:
        policy.register(list(range(k, t)), "static", target="w8a8_static_linear")  # docs/ascend.md
    return policy


def _captured_inputs(pipe, layers):
    """(layer, denoising step, input) of every quantized layer at CAPTURED_STEPS, from one run."""
    captured, step = [], {"i": 0}
    hooks = [
        pipe.transformer.get_submodule(n).register_forward_pre_hook(
            lambda m, args, n=n: (
                captured.append((n, step["i"], args[0].detach().clone()))
                if step["i"] in CAPTURED_STEPS
                else None
            )
        )
        for n in layers
    ]

    def next_step(p, i, t, kwargs):
        step["i"] = i + 1
        return kwargs

    pipe(["a sneaker"], num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0),
         callback_on_step_end=next_step)  # fmt: skip
    for h in hooks:
        h.remove()
    return captured


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", SLOW)
def test_mindie_layer_matches_our_runtime_layer_on_embedded_activations(packages, name, dtype):
    package, exports = packages(name)
    dt = DTYPES[dtype]
    pipe = sdkiln.load(package)
    manifest = open_package(package).manifest
    layers = list(manifest["modules"])
    captured = _captured_inputs(pipe, layers)
    assert {n for n, _, _ in captured} == set(layers)
    float_model = copy.deepcopy(get_spec("fmnist-flux").build().transformer)
    emulated = mindie.quantize(float_model, exports[dtype], dt, _policy(manifest))
    assert set(emulated) == set(layers)
    worst = 0.0
    for layer, step, x in captured:
        ours_module = pipe.transformer.get_submodule(layer)
        inner = getattr(ours_module, "linear", ours_module)
        if hasattr(inner, "set_step"):
            inner.set_step(step, STEPS)
        mindie.TimestepManager.set_timestep_idx(step)
        ours = ours_module(x.to(dt)).double()
        theirs = emulated[layer](x).double()
        worst = max(worst, float((theirs - ours).norm() / ours.norm()))
    print(f"{name} {dtype}: worst layer relative error {worst:.2e} over {len(captured)} inputs")
    assert worst <= LAYER_REL_ERR[dt]


def _float_parts_to(model, dt):
    """Our runtime's transformer in ``dt`` as MindIE SD runs the model: every float layer cast, the
    quantized layers' scales left as they are (our kernels take them in float32)."""
    for module in model.modules():
        if isinstance(module, QuantLinear | MulScale):
            continue
        for _, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if t.is_floating_point():
                t.data = t.data.to(dt)


def _images(pipe, prompts, on_step=None):
    return pipe(prompts, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(1), output_type="np",
                callback_on_step_end=on_step).images  # fmt: skip


def _timestep_manager(p, i, t, kwargs):
    mindie.TimestepManager.set_timestep_idx(i + 1)  # before the next step's transformer call
    return kwargs


@pytest.mark.parametrize(
    "name,dtype",
    [
        # one of each package and each dtype in make test (20-30 s each on 2 cores: the CI budget)
        pytest.param(
            name, dtype, marks=[] if (name == "mixed") == (dtype == "bfloat16") else pytest.mark.slow
        )
        for name in ("w8a8-timestep", "mixed")
        for dtype in DTYPES
    ],
)
def test_embedded_pipeline_with_mindie_layers_is_within_a_db_of_our_runtime(packages, name, dtype):
    package, exports = packages(name)
    spec = get_spec("fmnist-flux")
    prompts = list(spec.eval_prompts[:PIPELINE_SAMPLES])
    base = spec.build()
    reference = _images(base, prompts)
    ours_pipe = sdkiln.load(package)
    _float_parts_to(ours_pipe.transformer, DTYPES[dtype])
    ours = _images(ours_pipe, prompts)
    base.transformer = base.transformer.to(DTYPES[dtype])
    mindie.quantize(base.transformer, exports[dtype], DTYPES[dtype], _policy(open_package(package).manifest))
    mindie.TimestepManager.set_timestep_idx(0)
    theirs = _images(base, prompts, _timestep_manager)
    ours_db, theirs_db = float(psnr(reference, ours).mean()), float(psnr(reference, theirs).mean())
    direct = float(psnr(ours, theirs).mean())
    print(
        f"{name} {dtype}: PSNR vs float, ours {ours_db:.2f} dB, MindIE {theirs_db:.2f} dB; MindIE vs ours {direct:.2f} dB"
    )
    assert abs(ours_db - theirs_db) <= PIPELINE_PSNR_MARGIN_DB


def test_docs_timestep_example_runs_against_the_mindie_3_1_policy_api(monkeypatch):
    """docs/ascend.md's W8A8_TIMESTEP snippet, run with a ``mindiesd`` module holding the emulated
    3.1.0 policy API (whose ``register`` defaults to ``target="w4a4_linear"``)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "ascend.md").read_text(encoding="utf-8")
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "TimestepPolicyConfig" in b)
    calls = []
    fake = types.ModuleType("mindiesd")
    fake.TimestepPolicyConfig, fake.TimestepManager = mindie.TimestepPolicyConfig, mindie.TimestepManager
    fake.QuantConfig = lambda **kw: kw
    fake.quantize = lambda model, path, **kw: calls.append((model, path, kw))
    monkeypatch.setitem(sys.modules, "mindiesd", fake)
    pipe = types.SimpleNamespace(transformer="transformer")
    scope = {"k": 3, "T": 8, "pipe": pipe}
    exec(compile(snippet, "docs/ascend.md", "exec"), scope)
    ((model, path, kw),) = calls
    policy = kw["quant_config"]["timestep_config"]
    assert [policy.get_strategy(i, target="w8a8_static_linear") for i in range(8)] == ["dynamic"] * 3 + [
        "static"
    ] * 5
    with pytest.raises(ValueError, match="invalid policy type: static"):  # the call without target
        mindie.TimestepPolicyConfig().register([3], "static")
