"""Issue 31's offline job at real scale, checked at tiny size: the plan ``optimize`` prints counts the
forwards it runs, one model in memory (in place, no copy at export), streaming steps (GPTQ one
Hessian group at a time, quant-auto one layer's candidates at a time, weight-only modules swapped as
they are built), and a quality report in bounded batches.

Memory is checked as what is alive (tensors, modules), never as time.
"""

from __future__ import annotations

import json
import weakref

import pytest
import torch

import sdkiln
from sdkiln.calibrate import hessian
from sdkiln.configs import (
    Deployment,
    QuantAutoConfig,
    RecipeConfig,
    SmoothQuantConfig,
    Sparse24Config,
    W8A8DynamicConfig,
    W8A8StaticConfig,
    W8A8TimestepConfig,
)
from sdkiln.export.package_writer import transformer_tensors
from sdkiln.model_zoo import get_spec
from sdkiln.optimizer import evaluate
from sdkiln.optimizer.plan import OPTIMIZE_LOG
from sdkiln.optimizer.quant import quant_auto
from sdkiln.runtime.quant.w8a8_dynamic import W8A8DynamicLinear

STEPS = 2


def _log(package) -> dict:
    return json.loads((package / OPTIMIZE_LOG).read_text())


PLANNED = {
    "quant-auto": [QuantAutoConfig(calib_samples=1, sensitivity_samples=1)],
    "gptq in groups": [W8A8DynamicConfig(weight_rounding="gptq", calib_samples=1, max_hessian_mb=1)],
    "smoothquant+w8a8-static": [SmoothQuantConfig(calib_samples=1), W8A8StaticConfig(calib_samples=1)],
    "w8a8-timestep": [W8A8TimestepConfig(calib_samples=1)],
    "sparse-2-4": [Sparse24Config()],
}


@pytest.mark.parametrize("name", list(PLANNED))
def test_the_plan_counts_the_forwards_each_phase_runs(name, tmp_path, capfd):
    recipe = RecipeConfig(name, PLANNED[name], Deployment(num_inference_steps=STEPS))
    result = sdkiln.optimize("flux-tiny", recipe, tmp_path / "pkg", eval_samples=3)
    log = _log(result.package)
    planned = {p["name"]: p for p in log["plan"]["phases"]}
    assert all(p["bound"] == "exact" for p in planned.values())
    for ran in log["phases"]:
        assert ran["forwards"] == ran["planned_forwards"], ran
        expected = sum(
            p["forwards"] for n, p in planned.items() if n == ran["name"] or n.startswith(ran["name"] + ":")
        )
        assert ran["planned_forwards"] == expected
    assert [r["name"] for r in log["phases"]][0] == "report: original model"
    assert log["phases"][0]["forwards"] == 2 * STEPS  # one batch of 3, true CFG: two calls a step
    if name == "gptq in groups":
        (gptq,) = [n for n in planned if "gptq hessians" in n]
        groups = int(gptq.split(", ")[1].split()[0])
        assert groups > 1 and planned[gptq]["forwards"] == groups * STEPS * 2  # one pass of 1 sample a group
    err = capfd.readouterr().err
    assert err.index("plan on cpu") < err.index("report: original model: ")  # said before any forward
    assert "estimated peak" in err


def test_a_searched_phase_stays_within_its_bound(tmp_path):
    result = sdkiln.optimize(
        "flux-tiny",
        "cache-auto",
        tmp_path / "pkg",
        eval_samples=0,
        deployment=Deployment(num_inference_steps=4),
    )
    log = _log(result.package)
    (ran,) = log["phases"]
    bounds = {p["bound"] for p in log["plan"]["phases"]}
    assert bounds == {"exact", "at most"}
    exact = sum(p["forwards"] for p in log["plan"]["phases"] if p["bound"] == "exact")
    assert exact < ran["forwards"] <= ran["planned_forwards"]


def test_a_model_given_by_name_is_optimized_in_place_and_a_pipeline_object_is_kept(tmp_path):
    by_name = sdkiln.optimize("flux-tiny", "w8a8-dynamic", None, eval_samples=1, progress=False)
    assert by_name.base is None
    pipe = get_spec("flux-tiny").build()
    before = pipe.transformer.transformer_blocks[0].attn.to_q
    kept = sdkiln.optimize(pipe, "w8a8-dynamic", None, eval_samples=0, progress=False)
    assert kept.base is pipe and pipe.transformer.transformer_blocks[0].attn.to_q is before
    inplace = sdkiln.optimize(pipe, "w8a8-dynamic", None, eval_samples=0, in_place=True, progress=False)
    assert inplace.base is None and inplace.pipeline is pipe
    assert isinstance(pipe.transformer.transformer_blocks[0].attn.to_q, W8A8DynamicLinear)
    # the report made before the in-place change measures the same as against a kept original
    assert by_name.quality["psnr"] == pytest.approx(
        sdkiln.optimize(get_spec("flux-tiny").build(), "w8a8-dynamic", None, eval_samples=1).quality["psnr"]
    )


def test_export_writes_the_model_s_own_memory():
    pipe = get_spec("flux-tiny").build()
    model = pipe.transformer
    planned, _ = transformer_tensors(model)
    params = dict(model.named_parameters())
    shared = [t.name for t in planned if t.name in params and t.get().data_ptr() == params[t.name].data_ptr()]
    assert len(shared) == len(params)


def test_gptq_holds_one_group_of_hessians_at_a_time(monkeypatch):
    matrices: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    most = [0]
    original = hessian.HessianAccumulator.update

    def update(self, x, step, num_steps):
        original(self, x, step, num_steps)
        matrices[id(self.matrix)] = self.matrix  # freed by reference counting: no gc pass needed
        most[0] = max(most[0], sum(m.numel() * m.element_size() for m in list(matrices.values())))

    monkeypatch.setattr(hessian.HessianAccumulator, "update", update)
    pipe = get_spec("flux-tiny").build()
    widths = [m.in_features for n, m in pipe.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    budget_mb = 1  # groups of a few 128- and 512-wide layers: several passes
    recipe = RecipeConfig(
        "g",
        [W8A8DynamicConfig(weight_rounding="gptq", calib_samples=1, max_hessian_mb=budget_mb)],
        Deployment(num_inference_steps=STEPS),
    )
    result = sdkiln.optimize(pipe, recipe, None, eval_samples=0, in_place=True, progress=False)
    every = sum(4 * k * k for k in widths)
    group = max(budget_mb * 2**20, 4 * max(widths) ** 2)  # what one group may take
    assert 0 < most[0] <= group < every
    assert len(result.manifest["modules"]) > 0


def test_quant_auto_builds_one_layer_s_candidates_at_a_time_and_frees_each_float_layer(monkeypatch):
    alive: weakref.WeakSet = weakref.WeakSet()
    most, scoring = [0], [False]
    build_candidate, sensitivity_pass, replace = (
        quant_auto.build_candidate,
        quant_auto.sensitivity_pass,
        quant_auto.replace,
    )

    def build(kind, linear, ranges):
        module = build_candidate(kind, linear, ranges)
        alive.add(module)  # dropped modules leave the set by reference counting
        if scoring[0]:
            most[0] = max(most[0], len(alive))
        return module

    def score(*args):
        scoring[0] = True
        try:
            sensitivity_pass(*args)
        finally:
            scoring[0] = False

    replaced: weakref.WeakSet = weakref.WeakSet()
    floats_alive = [0]

    def swap(model, target, module):
        replaced.add(model.get_submodule(target.linear))
        replace(model, target, module)
        floats_alive[0] = max(floats_alive[0], len(replaced))  # float layers swapped out, still held

    monkeypatch.setattr(quant_auto, "build_candidate", build)
    monkeypatch.setattr(quant_auto, "sensitivity_pass", score)
    monkeypatch.setattr(quant_auto, "replace", swap)
    config = QuantAutoConfig(calib_samples=1, sensitivity_samples=1)
    order = (config.scheme, *config.fallbacks)
    recipe = RecipeConfig("qa", [config], Deployment(num_inference_steps=STEPS))
    pipe = get_spec("flux-tiny").build()
    result = sdkiln.optimize(pipe, recipe, None, eval_samples=0, in_place=True, progress=False)
    assert 0 < most[0] <= len(order)  # while scoring: one layer's candidates at a time
    assert len(result.manifest["modules"]) > 2
    assert floats_alive[0] == 0  # each float layer freed as its module came in


def test_weight_only_modules_are_swapped_as_they_are_built(monkeypatch):
    built: list = []
    original = W8A8DynamicLinear.from_linear.__func__

    def from_linear(cls, linear, **kw):
        pipe_modules = {id(m) for m in holder[0].transformer.modules()}
        assert all(id(m) in pipe_modules for m in built), "a built module was not swapped in before the next"
        module = original(cls, linear, **kw)
        built.append(module)
        return module

    holder = [get_spec("flux-tiny").build()]
    monkeypatch.setattr(W8A8DynamicLinear, "from_linear", classmethod(from_linear))
    sdkiln.optimize(holder[0], "w8a8-dynamic", None, eval_samples=0, in_place=True, progress=False)
    assert len(built) > 2


@pytest.mark.parametrize(
    ("call", "batch"),
    [
        ({"height": 32, "width": 32}, 16),
        ({"height": 1024, "width": 1024}, 4),
        ({"height": 480, "width": 832, "num_frames": 81}, 1),
    ],
)
def test_the_report_batch_follows_the_deployment_size(call, batch):
    assert evaluate.default_eval_batch(call) == batch


def test_the_report_decodes_in_slices_and_tiles_when_large_and_leaves_the_vae_as_found():
    pipe = get_spec("flux-tiny").build()
    seen = {}
    with evaluate.bounded_decode(pipe, {"height": 2048, "width": 2048}):
        seen["big"] = (pipe.vae.use_slicing, pipe.vae.use_tiling)
    with evaluate.bounded_decode(pipe, {"height": 32, "width": 32}):
        seen["small"] = (pipe.vae.use_slicing, pipe.vae.use_tiling)
    assert seen == {"big": (True, True), "small": (True, False)}
    assert (pipe.vae.use_slicing, pipe.vae.use_tiling) == (False, False)


def test_eval_batches_give_the_report_optimize_stored(tmp_path):
    from sdkiln.cli import main

    result = sdkiln.optimize(
        "flux-tiny", "w8a8-dynamic", tmp_path / "pkg", eval_samples=3, eval_batch=2, progress=False
    )
    assert _log(result.package)["eval_batch"] == 2
    out = tmp_path / "eval.json"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["eval", str(result.package), "--num-samples", "3", "--eval-batch", "2", "--json"]) == 0
    out.write_text(buf.getvalue())
    report = json.loads(out.read_text())
    # the same batches as optimize's report (a batch's size changes the float rounding a little)
    assert report["psnr_per_sample"] == pytest.approx(result.quality["psnr_per_sample"], abs=1e-3)


def test_a_device_this_machine_lacks_is_one_error_before_anything_loads(tmp_path, capsys):
    from sdkiln.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal needs a machine without it")
    assert main(["optimize", "flux-tiny", "--device", "cuda", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cuda" in err[0] and "no cuda device" in err[0]
    assert not (tmp_path / "p").exists()


def test_a_device_for_a_kept_pipeline_object_is_refused():
    pipe = get_spec("flux-tiny").build()
    with pytest.raises(ValueError, match="in_place=True"):
        sdkiln.optimize(pipe, "none", None, eval_samples=0, device="cpu")
