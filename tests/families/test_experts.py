"""A pipeline with two transformers (Wan2.2-A14B: ``transformer`` above the boundary timestep,
``transformer_2`` below it): each expert is calibrated, quantized and cache-searched on the steps it
runs, packaged with its own sections, and restored, compiled and checked as its own model.

The package is the family suite's (tests/families/test_capabilities.py: W8A8 dynamic with a searched
cache schedule), made once per family here with the same recipe. The experts checks run on both
two-expert families (text- and image-to-video, ``NAMES``), the checks of the package format on
text-to-video's. Outputs: a loaded package against the in-memory optimized pipeline is bit-identical
(``assert_same_outputs``, one CPU thread).
"""

from __future__ import annotations

import json

import pytest
import torch

import sdkiln
from sdkiln.configs import CacheAutoConfig, CompileConfig, RecipeConfig, W8A8DynamicConfig
from sdkiln.errors import ModelError, PackageError
from sdkiln.model_zoo import detect, get_spec
from sdkiln.runtime.cache import cache_runner
from sdkiln.runtime.quant.w8a8_dynamic import W8A8DynamicLinear

NAME = "wan2.2-a14b-tiny"
NAMES = (NAME, "wan2.2-a14b-i2v-tiny")
EXPERT = "transformer_2"


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """``packages(name)``: the family's package, made once."""
    made = {}

    def get(name: str):
        if name not in made:
            cache = CacheAutoConfig(
                calib_samples=1, eval_samples=1, budgets=2, refine=0, psnr_floor_db=0.0, psnr_p5_floor_db=0.0
            )
            recipe = RecipeConfig("suite", [W8A8DynamicConfig(), cache])
            out = tmp_path_factory.mktemp("a14b") / "pkg"
            made[name] = sdkiln.optimize(name, recipe, out, eval_samples=0, progress=False)
        return made[name]

    return get


@pytest.fixture
def a14b(packages):
    return packages(NAME)


def _steps_run(pipe, spec) -> dict[str, set[int]]:
    """The denoising steps each transformer computed in one call of ``pipe`` (with the spec's
    conditioning picture for image-to-video)."""
    seen: dict[str, set[int]] = {"transformer": set(), EXPERT: set()}
    handles = [
        getattr(pipe, attr).register_forward_pre_hook(
            lambda *_, attr=attr: seen[attr].add(pipe.scheduler.step_index or 0)
        )
        for attr in seen
    ]
    call = {**pipe.sdkiln_manifest["call"]["defaults"], "output_type": "latent"}
    try:
        pipe(
            prompt="a boat on a lake",
            generator=torch.Generator().manual_seed(0),
            **call,
            **spec.condition(call),
        )
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("name", NAMES)
def test_manifest_holds_both_experts(name, packages):
    """Both experts are quantized and cache-searched, each on its own steps, and the manifest, the
    schedules and the files say so."""
    a14b = packages(name)
    m = a14b.manifest
    expert = m["experts"][EXPERT]
    assert set(expert) == {"model", "modules", "steps", "cache_schedule"}
    assert set(expert["modules"]) == set(m["modules"]) and m["modules"]
    assert expert["model"]["weights_hash"] != m["model"]["weights_hash"]
    files = json.loads((a14b.package / "manifest.json").read_text())["files"]
    assert f"{EXPERT}/diffusion_pytorch_model.safetensors" in files
    schedules = {
        "transformer": json.loads((a14b.package / m["cache_schedule"]["file"]).read_text()),
        EXPERT: json.loads((a14b.package / expert["cache_schedule"]["file"]).read_text()),
    }
    assert expert["cache_schedule"]["file"].startswith(f"experts/{EXPERT}/")
    # the tiny build's boundary gives each expert four of the eight steps
    assert schedules["transformer"]["search"]["steps"] == [0, 3]
    assert schedules[EXPERT]["search"]["steps"] == [4, 7]
    # the steps the other expert runs stay full in each schedule: the hooks never see them
    assert all(a == "full" for a in schedules["transformer"]["actions"]["batched"][4:])
    assert all(a == "full" for a in schedules[EXPERT]["actions"]["batched"][:4])


@pytest.mark.parametrize("name", NAMES)
def test_each_expert_runs_its_quantized_modules_on_its_steps(name, packages, assert_same_outputs):
    """The loaded package: each expert's layers are the quantized ones, each expert computes the steps
    its side of the boundary and reuses blocks by its own schedule, and the outputs equal the
    in-memory pipeline's."""
    a14b = packages(name)
    loaded = sdkiln.load(a14b.package, device="cpu")
    for attr in ("transformer", EXPERT):
        assert isinstance(getattr(loaded, attr).blocks[0].ffn.net[2], W8A8DynamicLinear), attr
    runners = {attr: cache_runner(getattr(loaded, attr)) for attr in ("transformer", EXPERT)}
    for runner in runners.values():
        runner.reset_counters()
    assert _steps_run(loaded, a14b.spec) == {"transformer": {0, 1, 2, 3}, EXPERT: {4, 5, 6, 7}}
    blocks = len(loaded.transformer.blocks)
    for attr, runner in runners.items():
        assert runner.transformer_calls == 8, attr  # 4 steps x 2 guidance branches
        assert 0 < runner.block_evaluations < runner.transformer_calls * blocks, attr
    assert_same_outputs(a14b, loaded)


def test_compile_wraps_both_experts(a14b):
    """``compile`` compiles every transformer of the pipeline (Dynamo runs at the first call)."""
    loaded = sdkiln.load(a14b.package, device="cpu", compile=CompileConfig())
    for attr in ("transformer", EXPERT):
        assert isinstance(getattr(loaded, attr), torch._dynamo.eval_frame.OptimizedModule), attr


@pytest.mark.parametrize(
    "name,family,half",
    [
        (NAME, "wan2.2-a14b", "neither Wan's one transformer nor"),
        (NAMES[1], "wan2.2-a14b-i2v", "neither Wan2.1-I2V's one transformer nor"),
    ],
    ids=["t2v", "i2v"],
)
def test_directory_is_detected(name, family, half, tmp_path):
    """A saved directory with both experts is its two-expert family; one with half the layout is
    refused by the one-transformer family of its pipeline class."""
    pipe = get_spec(name).build()
    pipe.save_pretrained(tmp_path / "a14b")
    spec = detect(tmp_path / "a14b")
    assert (spec.family, spec.variant, spec.transformer_attrs) == (family, "tiny", ("transformer", EXPERT))
    index = json.loads((tmp_path / "a14b" / "model_index.json").read_text())
    index["boundary_ratio"] = None
    (tmp_path / "a14b" / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ModelError, match=f"sets transformer_2 or boundary_ratio but not both: {half}"):
        detect(tmp_path / "a14b")


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda m: m["experts"][EXPERT].pop("model"), "missing 'model'"),
        (lambda m: m["experts"][EXPERT]["model"].update(dtype="int8"), "dtype: must be one of"),
        (lambda m: m["experts"][EXPERT].update(recipe={}), "an expert carries sections"),
        (lambda m: m["experts"][EXPERT].update(unknown={}), "unknown section 'unknown'"),
        (lambda m: m["experts"][EXPERT].update(modules=[]), "modules: must be an object"),
        (
            lambda m: m["experts"][EXPERT]["model"].update(transformer_class="AutoencoderKLWan"),
            "transformer_class: must be WanTransformer3DModel",
        ),
        (lambda m: m.pop("experts"), r"the package's experts are \[\], but wan2.2-a14b pipelines have"),
        (lambda m: m["experts"].update(vae=m["experts"][EXPERT]), "the package's experts are"),
    ],
    ids=["no-model", "dtype", "core-field", "unknown-section", "modules", "class", "dropped", "vae"],
)
def test_bad_expert_entry_is_refused(a14b, tmp_path, change, message):
    """A tampered ``experts`` entry is one PackageError naming it (the manifest re-signed: the check is
    the schema's, not the digest's)."""
    import shutil

    pkg = tmp_path / "pkg"
    shutil.copytree(a14b.package, pkg)
    manifest = json.loads((pkg / "manifest.json").read_text())
    change(manifest)
    (pkg / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageError, match=message):
        sdkiln.load(pkg, device="cpu")


def test_diffusers_view_refuses_experts(a14b, tmp_path):
    """The diffusers view writes one transformer: a package with experts is one line, nothing written."""
    from sdkiln.errors import SdkilnError
    from sdkiln.export.diffusers_view import export_diffusers

    with pytest.raises(SdkilnError, match="writes one transformer, and this package has others too"):
        export_diffusers(a14b.package, tmp_path / "view")
    assert not (tmp_path / "view").exists()


@pytest.mark.parametrize("steps", [5, 6, 7])
def test_another_step_count_runs_each_expert_from_a_full_step(a14b, steps):
    """At another step count each schedule is mapped by sigma; the low-noise expert's first call may map
    onto a reuse step of its schedule and computes every block (counted in ``forced``), never an error."""
    loaded = sdkiln.load(a14b.package, device="cpu")
    runners = {attr: cache_runner(getattr(loaded, attr)) for attr in ("transformer", EXPERT)}
    call = {
        **loaded.sdkiln_manifest["call"]["defaults"],
        "num_inference_steps": steps,
        "output_type": "latent",
    }
    out = loaded(prompt="a boat on a lake", generator=torch.Generator().manual_seed(0), **call).frames
    assert torch.as_tensor(out).isfinite().all()
    assert all(r.transformer_calls > 0 for r in runners.values())
    if steps in (5, 7):  # the expert's first call maps onto a reuse step of its schedule: run full
        assert runners[EXPERT].forced == 2 and runners["transformer"].forced == 0  # both CFG branches


def test_per_step_scales_on_an_expert_are_refused_in_one_line(tmp_path):
    """W8A8_TIMESTEP calibrates every step of the run; an expert runs its window only: one line."""
    from sdkiln.errors import RecipeError

    with pytest.raises(
        RecipeError, match="per-step schemes are not supported on a pipeline's experts"
    ) as err:
        sdkiln.optimize(NAME, "w8a8-timestep", tmp_path / "pkg", eval_samples=0, progress=False)
    assert "\n" not in str(err.value) and not (tmp_path / "pkg").exists()


def test_an_expert_that_runs_no_step_is_refused_in_one_line():
    """An expert the deployment never calls (every step on the other side of the boundary: Wan2.2-T2V-A14B
    at a few steps of its shift-12 schedule) has an empty profile: the cache search on it is one
    RecipeError naming it. (The tiny build's last timestep is always below its boundary.)"""
    from types import SimpleNamespace

    from sdkiln.errors import RecipeError
    from sdkiln.optimizer.cache.search import Search

    search = SimpleNamespace(ctx=SimpleNamespace(spec=SimpleNamespace(transformer_attr=EXPERT)),
                             traj=SimpleNamespace(num_steps=3))  # fmt: skip
    with pytest.raises(RecipeError, match="transformer_2 computes none of the 3 steps") as err:
        Search.own_steps(search, {"branches": {"call0": []}})
    assert "\n" not in str(err.value)


def test_the_first_expert_frees_its_cache_buffers_when_its_window_ends(a14b):
    """Past its window no step of the run reuses the high-noise expert's residuals: by the low-noise
    expert's first call its cached tensors are freed (at real size, GBs held through half the run)."""
    from sdkiln.runtime.cache.hooks import MODEL_HOOK

    loaded = sdkiln.load(a14b.package, device="cpu")
    hook = loaded.transformer._diffusers_hook.get_hook(MODEL_HOOK)
    held = []

    def states():
        return [*hook.contexts._state_cache.values(), *hook.plain.values()]

    def look(*_):
        held.append((len(states()), sum(len(s.residuals) + len(s.span_inputs) for s in states())))

    handle = loaded.transformer_2.register_forward_pre_hook(look)
    call = {**loaded.sdkiln_manifest["call"]["defaults"], "output_type": "latent"}
    try:
        loaded(prompt="a boat on a lake", generator=torch.Generator().manual_seed(0), **call)
    finally:
        handle.remove()
    states_seen, tensors = held[0]
    assert states_seen > 0 and tensors == 0, held  # the branches' states are there, their tensors freed


def test_quantized_attention_runs_on_each_expert_and_compile_is_refused(tmp_path):
    """Each expert gets its own attention-quantization plan (an expert's steps only), the package loads
    with both, and compile is refused for an expert's plan as for the main transformer's."""
    from sdkiln.configs import AttentionQuantConfig, Deployment
    from sdkiln.errors import SdkilnError
    from sdkiln.runtime.attention.quantized import attention_quant_of

    attn = AttentionQuantConfig(calib_samples=1, sqnr_floor_db=0.0, psnr_floor_db=0.0)
    recipe = RecipeConfig("attn", [attn], Deployment(num_inference_steps=4))
    result = sdkiln.optimize(NAME, recipe, tmp_path / "pkg", eval_samples=0, progress=False)
    assert "attention_quant" in result.manifest and "attention_quant" in result.manifest["experts"][EXPERT]
    loaded = sdkiln.load(tmp_path / "pkg", device="cpu")
    call = {**loaded.sdkiln_manifest["call"]["defaults"], "output_type": "latent"}
    loaded(prompt="a cat", generator=torch.Generator().manual_seed(0), **call)
    for attr in ("transformer", EXPERT):
        runner = attention_quant_of(getattr(loaded, attr))
        assert runner.stats["quantized_calls"] > 0, attr
        steps = [s for e in runner.plan.layers.values() for s, q in enumerate(e["steps"]) if q]
        assert steps and len(set(steps)) < 4  # each expert runs part of the steps only
    with pytest.raises(SdkilnError, match="compile with quantized attention"):
        sdkiln.load(tmp_path / "pkg", device="cpu", compile=CompileConfig())
    # the expert's plan alone: still refused
    manifest = json.loads((tmp_path / "pkg" / "manifest.json").read_text())
    del manifest["attention_quant"]
    (tmp_path / "pkg" / "manifest.json").write_text(json.dumps(manifest))
    assert attention_quant_of(sdkiln.load(tmp_path / "pkg", device="cpu").transformer) is None
    with pytest.raises(SdkilnError, match="compile with quantized attention"):
        sdkiln.load(tmp_path / "pkg", device="cpu", compile=CompileConfig())
