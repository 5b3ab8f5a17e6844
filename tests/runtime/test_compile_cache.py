"""Cold start: ``sdkiln.load(..., compile=...)`` keeps Inductor's compiled code in a cache directory
keyed by the package digest, the device and the torch version, outside the package, and a second
process compiles from it; the load records its phases."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import sdkiln
from sdkiln.configs import CompileConfig
from sdkiln.runtime.compile.cache import cache_key, cache_root
from sdkiln.runtime.package import open_package

PROBE = """
import json, sys
import torch
import sdkiln
from sdkiln.configs import CompileConfig
from torch._dynamo.utils import counters
pipe = sdkiln.load(sys.argv[1], device="cpu", compile=CompileConfig(regional=True, cache_dir=sys.argv[2]))
pipe("a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="latent")
print(json.dumps({"inductor": dict(counters["inductor"]), "phases": pipe.sdkiln_cold_start.phases,
                  "cache": str(pipe.sdkiln_compile_cache)}))
"""


def _run(package: Path, cache: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(package), str(cache)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_compiles_from_the_cache(tmp_path):
    """A float flux-tiny package: three block graphs to compile, the fewest a FLUX has."""
    package = sdkiln.optimize("flux-tiny", "none", tmp_path / "pkg", eval_samples=0, progress=False).package
    before = {p: p.stat().st_mtime_ns for p in package.rglob("*")}
    first, second = _run(package, tmp_path / "cache"), _run(package, tmp_path / "cache")
    digest = open_package(package).digest
    expected = tmp_path / "cache" / cache_key(digest, torch.device("cpu"))
    assert first["cache"] == second["cache"] == str(expected) and expected.is_dir()
    assert first["inductor"].get("fxgraph_cache_miss", 0) > 0
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0, second["inductor"]
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= first["inductor"]["fxgraph_cache_miss"]
    assert {p: p.stat().st_mtime_ns for p in package.rglob("*")} == before  # nothing written into the package
    phases = ["verify", "build", "read", "assemble", "device", "compile", "first_step"]
    assert list(second["phases"]) == phases and all(v >= 0 for v in second["phases"].values())


def test_the_cache_key_and_root(monkeypatch, tmp_path):
    key = cache_key("sha256:" + "ab" * 32, torch.device("cpu"))
    assert key == f"{'ab' * 8}-cpu-torch{torch.__version__.replace('+', '_')}"
    assert cache_root(CompileConfig(cache_dir=str(tmp_path))) == tmp_path
    monkeypatch.setenv("SDKILN_CACHE_DIR", str(tmp_path / "s"))
    assert cache_root(CompileConfig()) == tmp_path / "s" / "compile"
    monkeypatch.delenv("SDKILN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_root(CompileConfig()) == tmp_path / "x" / "sdkiln" / "compile"
