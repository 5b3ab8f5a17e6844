"""The family suite (STYLE.md habit 13): every family the zoo knows, put through every capability of
``model_zoo.spec.CAPABILITIES`` at its tiny size on CPU, and every capability a family refuses
(``ModelSpec.refusals``) asserted to be refused with its one-line reason, losing nothing.

Each test is named ``test_<capability>[<zoo name>...]``: tools/families_table.py reads the names from
pytest's JUnit XML and writes docs/families.md. One package per family per module (W8A8 dynamic with a
searched cache schedule) serves the load, cache, compile, Ascend, ONNX, parallel and refusal cases.
flux-tiny, sd3-tiny and wan-tiny have these capabilities tested in depth under tests/runtime and
tests/export, so their suite cases run under ``make test-all`` (``--run-slow``); every other family
runs its fast cases in ``make test``.

Tolerances, stated once:
* a loaded package against the in-memory optimized pipeline, one CPU thread: bit-identical
  (``assert_same_outputs``);
* the compiled float transformer against eager: ``FLOAT_VS_EAGER_MAX_ABS`` (the fused ops compute
  in fp32; tests/runtime/test_compile_backend.py);
* ONNX: the exporter's own bound for a quantized graph (``export.onnx.QUANT_REL``);
* several ranks against one process: bit-identical for CFG parallel (a family whose pipeline makes
  one call per branch) and Ulysses with the text replicated; within 1e-6 (120 dB) where the pipeline
  batches both branches (tests/runtime/parallel_harness.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import sdkiln
from sdkiln.configs import CacheAutoConfig, CompileConfig, ParallelConfig, RecipeConfig, W8A8DynamicConfig
from sdkiln.errors import ModelError
from sdkiln.model_zoo import get_spec, spec_names
from sdkiln.model_zoo.spec import CAPABILITIES
from sdkiln.runtime.cache import cache_runner
from sdkiln.runtime.compile import compile_transformer, repeated_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "export"))
from ascend_rules import read_ascend_dir  # noqa: E402
from compile_helpers import per_block, transformer_inputs  # noqa: E402
from parallel_harness import CLOSE_DB, EXACT, check  # noqa: E402

FLOAT_VS_EAGER_MAX_ABS = 1e-5
COVERED_ELSEWHERE = {"flux-tiny", "sd3-tiny", "wan-tiny"}
"""Families whose capabilities tests/runtime and tests/export test in depth in ``make test``."""
FAMILIES = [name for name in spec_names() if name != "fmnist-flux"]
"""Every zoo family but the embedded model (tests/model_zoo/test_fmnist.py and the benches cover it)."""

# The fused patterns (runtime.compile) each family's blocks contain, every block of every block list.
EXPECTED_PATTERNS = {
    "flux-tiny": {"rms_norm", "adaln", "rope", "gelu_tanh", "gate_add"},
    "flux-kontext-tiny": {"rms_norm", "adaln", "rope", "gelu_tanh", "gate_add"},
    "sd3-tiny": {"adaln", "gelu_tanh", "gate_add"},
    "wan-tiny": {"rms_norm", "adaln", "rope", "gelu_tanh", "gate_add"},
    "wan-i2v-tiny": {"rms_norm", "adaln", "rope", "gelu_tanh", "gate_add"},
    "wan2.2-a14b-tiny": {"rms_norm", "adaln", "rope", "gelu_tanh", "gate_add"},
    "wan2.2-a14b-i2v-tiny": {"rms_norm", "adaln", "rope", "gelu_tanh", "gate_add"},
    # Qwen-Image computes RoPE in complex numbers, which no pattern matches
    "qwen-image-tiny": {"rms_norm", "adaln", "gelu_tanh", "gate_add"},
    "qwen-image-edit-tiny": {"rms_norm", "adaln", "gelu_tanh", "gate_add"},
    # the single blocks add their residual last: "gate * x + residual", a gate_add form of its own
    "hunyuan-video-tiny": {"rms_norm", "adaln", "rope", "gelu_tanh", "gate_add"},
    # FLUX.2's modulation is shared and applied as (1 + scale) * LN(x) + shift outside the adaln pattern
    "flux2-tiny": {"rms_norm", "rope", "gate_add"},
    # compiled block by block (compile_regional): the patterns of its one dual-stream block graph
    "hunyuan-video-1.5-tiny": {"rms_norm", "adaln", "rope", "gelu_tanh", "gate_add"},
}


def families(*, fast_everywhere: bool = False, where=lambda spec: True, slow: set[str] = frozenset()) -> list:
    """The suite's parameters: each family whose spec passes ``where``; those covered elsewhere and
    those in ``slow`` run under --run-slow, unless ``fast_everywhere``."""
    params = []
    for name in FAMILIES:
        if not where(get_spec(name)):
            continue
        is_slow = (name in COVERED_ELSEWHERE or name in slow) and not fast_everywhere
        params.append(pytest.param(name, marks=pytest.mark.slow) if is_slow else name)
    return params


def having(capability: str):
    return lambda spec: capability not in spec.refusals


def refusals() -> list:
    return [
        pytest.param(name, capability, id=f"{name}-{capability}")
        for name in FAMILIES
        for capability in get_spec(name).refusals
    ]


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """``packages(name)``: the family's W8A8-dynamic package with a searched cache schedule where the
    family caches (made once)."""
    root = tmp_path_factory.mktemp("families")
    made = {}

    def get(name: str):
        if name not in made:
            cache = CacheAutoConfig(
                calib_samples=1, eval_samples=1, budgets=2, refine=0, psnr_floor_db=0.0, psnr_p5_floor_db=0.0
            )
            steps = [W8A8DynamicConfig()] + ([cache] if "cache" not in get_spec(name).refusals else [])
            recipe = RecipeConfig("suite", steps)
            made[name] = sdkiln.optimize(name, recipe, root / name, eval_samples=0, progress=False)
        return made[name]

    return get


def _call(pipe, spec, **overrides):
    call = {**pipe.sdkiln_manifest["call"]["defaults"], **overrides}
    return call, spec.condition(call)


@pytest.mark.parametrize("name", families(where=having("quant")))
def test_quant(name, packages, assert_same_outputs):
    """The package loads, swaps every quantized layer the manifest lists, and generates the in-memory
    optimized pipeline's latents and images bit for bit."""
    result = packages(name)
    loaded = sdkiln.load(result.package, device="cpu")
    for attr, modules in _modules_by_transformer(result).items():  # Wan2.2-A14B: each expert its own
        transformer = getattr(loaded, attr)
        swapped = [n for n, m in transformer.named_modules() if n in modules]
        assert len(swapped) == len(modules) > 0, attr
        assert all(type(m) is not torch.nn.Linear for n, m in transformer.named_modules() if n in swapped)
    assert_same_outputs(result, loaded)


def _modules_by_transformer(result) -> dict:
    """Each transformer's quantized layers: the package's ``modules``, an expert's under ``experts``."""
    m = result.manifest
    return {m["model"]["transformer_attr"]: m["modules"]} | {
        attr: entry["modules"] for attr, entry in m.get("experts", {}).items()
    }


@pytest.mark.parametrize("name", families(where=having("cache")))
def test_cache(name, packages):
    """cache-auto searched a schedule that reuses blocks, and the loaded package reuses them."""
    result = packages(name)
    loaded = sdkiln.load(result.package, device="cpu")
    spec = result.spec
    runners = {attr: cache_runner(getattr(loaded, attr)) for attr in spec.transformer_attrs}
    assert None not in runners.values(), runners
    call, inputs = _call(loaded, spec, output_type="latent")
    for runner in runners.values():
        runner.reset_counters()
    loaded(prompt=spec.eval_prompts[0], generator=torch.Generator().manual_seed(0), **call, **inputs)
    blocks = sum(len(getattr(loaded.transformer, bl.attr)) for bl in spec.block_lists)
    for attr, runner in runners.items():  # every transformer (each expert) reuses blocks
        assert 0 < runner.block_evaluations < runner.transformer_calls * blocks, attr


@pytest.mark.slow
@pytest.mark.parametrize("name", families(fast_everywhere=True, where=having("sparse")))
def test_sparse(name, tmp_path):
    """Calibrated block-sparse attention: the plan is searched, packaged and restored."""
    result = sdkiln.optimize(name, "sparse-attn", tmp_path / "pkg", eval_samples=0, progress=False)
    assert "sparse_attention" in result.manifest
    loaded = sdkiln.load(result.package, device="cpu")
    call, inputs = _call(loaded, result.spec, output_type="latent")
    loaded(prompt=result.spec.eval_prompts[0], generator=torch.Generator().manual_seed(0), **call, **inputs)


COMPILE_SLOW = {
    "flux-kontext-tiny",
    "flux2-tiny",
    "hunyuan-video-tiny",
    "hunyuan-video-1.5-tiny",
    "qwen-image-tiny",
    "qwen-image-edit-tiny",
    "wan-i2v-tiny",
    "wan2.2-a14b-tiny",
    "wan2.2-a14b-i2v-tiny",
}
"""Families whose compile takes over 10 s on 2 cores: under --run-slow (CI budget). HunyuanVideo-1.5's
regional compile has its fast twin in test_load_compiles_a_regional_family_by_block_and_says_so.
Wan2.2-A14B's experts (text- and image-to-video) are wan-tiny's transformer class, compiled in tests/runtime."""


@pytest.mark.parametrize("name", families(where=having("compile"), slow=COMPILE_SLOW))
def test_compile(name):
    """The float transformer compiled with sdkiln's backend: no graph break, the family's fused patterns
    in every block, the output equal to eager. Whole, or, for a family whose forward does not trace in
    one graph (``compile_regional``), block by block as ``sdkiln.load`` compiles it: every block runs the
    one block graph. Inductor's cache is off: a graph served from it skips the passes and would log no
    matches."""
    assert name in EXPECTED_PATTERNS, f"{name}: add its fused patterns to EXPECTED_PATTERNS"
    spec = get_spec(name)
    pipe = spec.build()
    pipe.set_progress_bar_config(disable=True)
    args, kwargs = transformer_inputs(spec, pipe)
    transformer = getattr(pipe, spec.transformer_attr).eval()
    torch._dynamo.reset()
    counters.clear()
    config = CompileConfig(regional=bool(spec.compile_regional))
    lists = tuple(bl.attr for bl in spec.block_lists)
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        eager = transformer(*args, **kwargs)[0]
        compiled = compile_transformer(transformer, config, lists)(*args, **kwargs)[0]
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    backend = transformer._sdkiln_backend
    if config.regional:
        blocks = repeated_blocks(transformer, lists)  # diffusers' _repeated_blocks, else the block lists
        assert {b for attr in lists for b in getattr(transformer, attr)} <= set(blocks)
        assert all(block._compiled_call_impl is not None for block in blocks)
        assert backend.graphs == len({type(b) for b in blocks}), backend.graphs  # one graph per block kind
        assert counters["frames"]["total"] == counters["frames"]["ok"], dict(counters["frames"])
        assert EXPECTED_PATTERNS[name] <= {m.pattern for m in backend.matches}
    else:
        matched = per_block(backend, spec)
        assert len(matched) == sum(len(getattr(transformer, bl.attr)) for bl in spec.block_lists), sorted(
            matched
        )
        for block, patterns in matched.items():
            assert EXPECTED_PATTERNS[name] <= patterns, (block, patterns)
    assert float((compiled - eager).abs().max()) <= FLOAT_VS_EAGER_MAX_ABS


@pytest.mark.parametrize("name", families(where=lambda spec: bool(spec.compile_regional)))
def test_load_compiles_a_regional_family_by_block_and_says_so(name, packages, caplog):
    """``sdkiln.load(compile=...)`` on a family whose forward does not trace whole compiles its blocks
    (each block's own compiled call) and logs why, rather than breaking the graph silently."""
    spec = get_spec(name)
    with caplog.at_level("WARNING", logger="sdkiln.load"):
        pipe = sdkiln.load(packages(name).package, device="cpu", compile=CompileConfig(backend="eager"))
    assert f"compiling {spec.family}'s blocks regionally" in caplog.text
    transformer = getattr(pipe, spec.transformer_attr)
    blocks = repeated_blocks(transformer, tuple(bl.attr for bl in spec.block_lists))
    assert blocks and all(block._compiled_call_impl is not None for block in blocks)
    assert not isinstance(transformer, torch._dynamo.eval_frame.OptimizedModule)


@pytest.mark.parametrize("name", families(where=having("ascend")))
def test_ascend(name, packages, tmp_path):
    """The W8A8-dynamic package exports to MindIE SD's files, every quantized layer under its rules."""
    from sdkiln.export.ascend import export_ascend

    result = packages(name)
    export = export_ascend(result.package, tmp_path / "ascend", dtype="bfloat16")
    view = read_ascend_dir(export.root)
    assert view.model_quant_type == "W8A8_DYNAMIC"
    assert len(view.layers) == len(result.manifest["modules"])


@pytest.mark.slow
@pytest.mark.parametrize("name", families(fast_everywhere=True, where=having("onnx")))
def test_onnx(name, packages, tmp_path):
    """The transformer exports to ONNX and onnxruntime matches the runtime (export-onnx's own check)."""
    from sdkiln.export.onnx import QUANT_REL, export_onnx

    report = export_onnx(packages(name).package, tmp_path / "onnx")
    assert report.max_rel_error <= QUANT_REL and report.max_rel_error_batch1 <= QUANT_REL, report


def _parallel_cases(name: str, packages) -> list:
    spec = get_spec(name)
    package = packages(name).package
    cases = []
    if "cfg-parallel" not in spec.refusals:
        # a call that runs both guidance branches: a second transformer call per step where the
        # pipeline makes one (bit-identical), else a batch that CFG parallel halves (within 1e-6)
        guided = (
            {spec.cfg_calls[0]: 2.0, **{arg: "" for arg in spec.cfg_calls[1:]}} if spec.cfg_calls else None
        )
        # (a guider component, guidance_arg None, calls once per branch at its saved scale: 6.0)
        per_branch = bool(spec.cfg_calls) or spec.guidance_arg is None
        cases.append((package, ParallelConfig(cfg=2), guided, EXACT if per_branch else CLOSE_DB))
    if "ulysses" not in spec.refusals:
        cases.append((package, ParallelConfig(ulysses=2), None, EXACT))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", families(fast_everywhere=True, where=lambda s: not {"cfg-parallel", "ulysses"} <= set(s.refusals))
)
def test_parallel(name, packages):
    """CFG parallel and Ulysses on two gloo ranks against one process (tests/runtime/parallel_harness.py)."""
    check(2, _parallel_cases(name, packages))


@pytest.mark.parametrize("name,capability", refusals())
def test_refused(name, capability, packages, tmp_path):
    """A capability the family refuses is one line naming the reason, before anything is written."""
    from sdkiln.export.ascend import export_ascend
    from sdkiln.export.onnx import export_onnx

    spec = get_spec(name)
    assert capability in CAPABILITIES
    out = tmp_path / "out"
    with pytest.raises(ModelError) as caught:
        if capability in ("quant", "cache", "sparse"):
            recipe = {"quant": "w8a8-dynamic", "cache": "cache-auto", "sparse": "sparse-attn"}[capability]
            sdkiln.optimize(name, recipe, out, eval_samples=0, progress=False)
        elif capability == "compile":
            sdkiln.load(packages(name).package, device="cpu", compile=CompileConfig())
        elif capability in ("cfg-parallel", "ulysses", "ring"):
            layout = {"cfg-parallel": {"cfg": 2}, "ulysses": {"ulysses": 2}, "ring": {"ring": 2}}[capability]
            sdkiln.load(packages(name).package, device="cpu", parallel=ParallelConfig(**layout))
        elif capability == "ascend":
            export_ascend(packages(name).package, out)
        else:
            export_onnx(packages(name).package, out)
    message = str(caught.value)
    assert "\n" not in message and spec.refusals[capability] in message and capability in message
    assert not out.exists()
