"""Test-wide settings: one torch thread (2-core CI), markers, --run-slow."""

import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
# compiled code a test's load(compile=...) caches goes to a directory of this run, not ~/.cache
os.environ.setdefault("SDKILN_CACHE_DIR", tempfile.mkdtemp(prefix="sdkiln-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
# Without a GPU, Triton kernels run in Triton's interpreter; it must be on before any kernel module
# is imported (tests/kernels/test_triton_kernels.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow (make test-all)")


def pytest_configure(config):
    for marker, text in [
        ("slow", "too slow for the 15-minute CI budget; runs under make test-all"),
        ("gpu", "needs a CUDA device"),
        ("npu", "needs an Ascend NPU"),
    ]:
        config.addinivalue_line("markers", f"{marker}: {text}")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with make test-all (--run-slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def flux_tiny():
    """``(spec, pipeline)`` of the tiny random-weight FluxPipeline, progress bars off; one per module."""
    from sdkiln.model_zoo import get_spec

    spec = get_spec("flux-tiny")
    pipe = spec.build()
    pipe.set_progress_bar_config(disable=True)
    return spec, pipe


@pytest.fixture(scope="session")
def assert_same_outputs():
    """``check(result, loaded)``: the loaded package generates latents and images bit-identical to
    the in-memory optimized pipeline of ``result`` (two eval prompts, seeds 3 and 4)."""
    import numpy as np

    from sdkiln.optimizer.evaluate import generate

    def check(result, loaded) -> None:
        call = result.spec.call_kwargs()
        prompts, seeds = list(result.spec.eval_prompts[:2]), [3, 4]
        inputs = result.spec.condition(call, len(prompts))
        img_mem, lat_mem = generate(result.pipeline, call, prompts, seeds, inputs=inputs)
        img_pkg, lat_pkg = generate(loaded, call, prompts, seeds, inputs=inputs)
        assert torch.equal(lat_mem, lat_pkg)
        assert np.array_equal(img_mem, img_pkg)

    return check


@pytest.fixture(scope="session")
def rehash():
    """``rehash(package, rel)``: re-sign one changed file in the package's manifest, as a writer would,
    so a test's tampering leaves only that file's content wrong."""
    import hashlib
    import json

    def sign(package, rel: str) -> None:
        manifest = json.loads((package / "manifest.json").read_text())
        data = (package / rel).read_bytes()
        entry = manifest["files"][rel]
        entry["sha256"], entry["size"] = hashlib.sha256(data).hexdigest(), len(data)
        (package / "manifest.json").write_text(json.dumps(manifest))

    return sign
