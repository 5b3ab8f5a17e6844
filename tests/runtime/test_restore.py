"""The loader restores a package section by section, refuses sections it does not know, and takes
its load-time options (parallel, compile) in the documented order."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import sdkiln
from sdkiln.configs import CompileConfig, ParallelConfig
from sdkiln.errors import PackageError, SdkilnError
from sdkiln.runtime import restore
from sdkiln.runtime.package import open_package
from sdkiln.runtime.quant import QuantLinear

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "schema1_flux_tiny" / "package"


@pytest.fixture
def package(tmp_path) -> Path:
    """A writable copy of the schema-1 fixture package (every scheme and a cache schedule)."""
    return Path(shutil.copytree(FIXTURE, tmp_path / "pkg"))


def rewrite_manifest(root: Path, edit) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    edit(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))


def test_sections_of_a_schema1_package_and_their_order():
    manifest = open_package(FIXTURE).manifest
    assert "cache_schedule" not in manifest  # written before sections were named: found by its file
    assert [s.name for s in restore.sections_of(manifest)] == ["modules", "cache_schedule"]
    assert [s.name for s in restore.sections_of(manifest | {"modules": {}})] == ["cache_schedule"]


def test_an_unknown_section_is_refused_before_anything_loads(package):
    rewrite_manifest(
        package, lambda m: m.update(weight_sparsity={"file": "weights/sparsity.json"})
    )  # a section a later sdkiln might write
    with pytest.raises(PackageError, match="unknown section 'weight_sparsity'; this sdkiln restores modules"):
        sdkiln.load(package, device="cpu")


def test_a_named_cache_section_pointing_nowhere_is_refused(package):
    rewrite_manifest(package, lambda m: m.update(cache_schedule={"file": "schedules/missing.json"}))
    with pytest.raises(PackageError, match="not listed in manifest.json"):
        sdkiln.load(package, device="cpu")
    rewrite_manifest(package, lambda m: m.update(cache_schedule="schedules/cache_schedule.json"))
    with pytest.raises(PackageError, match="cache_schedule: a package section must be an object"):
        sdkiln.load(package, device="cpu")


def test_sections_restore_in_their_stages(package):
    """build swaps modules on the meta transformer; attach hooks the assembled pipeline."""
    pipe = sdkiln.load(package, device="cpu")
    quantized = [n for n, m in pipe.transformer.named_modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == len(pipe.sdkiln_manifest["modules"])
    assert pipe.transformer._diffusers_hook.get_hook("sdkiln_cache") is not None
    assert not any(t.is_meta for t in pipe.transformer.state_dict().values())


CPU_ALIGNMENT = 64
"""Bytes: the alignment of torch's CPU allocator. BLAS kernels may take another path for an
unaligned operand: on an AMD EPYC, a batch-1 Linear over a weight 24 bytes off a 64-byte boundary
differed from the same Linear over an aligned weight in the last bit."""


def test_every_loaded_tensor_owns_aligned_storage_no_view_of_a_file(package):
    """Each tensor is read into storage of its own (``runtime.safetensors_data``): none keeps a whole
    weights file alive after load returns, and each sits at an address the CPU allocator aligned."""
    pipe = sdkiln.load(package, device="cpu")
    modules = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
    tensors = [t for c in modules for t in [*c.parameters(), *c.buffers()] if t.numel()]
    assert len(tensors) > 100
    shared = [t.shape for t in tensors if t.untyped_storage().nbytes() != t.numel() * t.element_size()]
    assert shared == [], f"tensors whose storage holds more than themselves (a view of a file): {shared[:3]}"
    assert [t.shape for t in tensors if t.data_ptr() % CPU_ALIGNMENT] == []


def test_parallel_runs_at_its_stage_after_the_sections_attach(package):
    """A mesh beyond this process needs torchrun (tests/runtime/test_parallel.py runs them); world
    size 1 puts the parallel hook outside the cache hook that attach registered."""
    with pytest.raises(SdkilnError, match="not launched by torchrun"):
        sdkiln.load(package, device="cpu", parallel=ParallelConfig(ulysses=2))
    pipe = sdkiln.load(package, device="cpu", parallel=ParallelConfig())
    order = pipe.transformer._diffusers_hook._hook_order
    assert order.index("sdkiln_cache") < order.index("sdkiln_parallel")


def test_compile_wraps_the_transformer_lazily(package):
    pipe = sdkiln.load(package, device="cpu", compile=CompileConfig(backend="eager"))
    assert isinstance(pipe.transformer, torch._dynamo.eval_frame.OptimizedModule)
    assert pipe.transformer._orig_mod._diffusers_hook.get_hook("sdkiln_cache") is not None


def test_load_time_configs_round_trip_and_validate():
    for config in (
        ParallelConfig(cfg=2, ulysses=2, split_text=True, timeout_s=30.5),
        CompileConfig(mode="max-autotune", fullgraph=True),
    ):
        again = type(config).from_dict(json.loads(json.dumps(config.to_dict())))
        assert again == config
    assert ParallelConfig(cfg=2, ulysses=2, ring=2).world_size == 8
    with pytest.raises(SdkilnError, match="cfg is 1 or 2"):
        ParallelConfig(cfg=3)
    with pytest.raises(SdkilnError, match="positive integer"):
        ParallelConfig(ring=0)
    with pytest.raises(SdkilnError, match="mode must be one of"):
        CompileConfig(mode="fast")
    with pytest.raises(SdkilnError, match="unknown fields: speed"):
        CompileConfig.from_dict({"speed": 1})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_package_loads_onto_cuda_shard_by_shard(tmp_path):
    """Bound for CUDA, the weights go to the device file by file as they are verified; the pipeline
    generates what the CPU load does within the device kernels' tolerance."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
    from reshard import reshard

    root = Path(shutil.copytree(FIXTURE, tmp_path / "pkg"))
    reshard(root, 1 << 20)
    pipe = sdkiln.load(root, device="cuda")
    modules = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
    assert all(t.device.type == "cuda" for c in modules for t in [*c.parameters(), *c.buffers()])
    assert set(pipe.sdkiln_cold_start.phases) >= {"verify", "build", "read", "assemble", "device"}
