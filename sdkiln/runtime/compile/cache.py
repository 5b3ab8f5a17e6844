"""Where compiled code is kept between processes: one directory per package digest, device and
torch version, never inside the package.

A compiled transformer's cold start is mostly Inductor (code generation, C++ and Triton builds);
Inductor's FX-graph cache and AOTAutograd cache, and Triton's kernel cache, keep what it built
under ``TORCHINDUCTOR_CACHE_DIR``. ``use_compile_cache`` points that directory at
``ROOT/<digest>-<device>-torch<version>``, so a second process loading the same package on the same
kind of device with the same torch compiles from the cache (Dynamo still traces; Inductor serves
each graph from disk: ``torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]``). ``ROOT``
is ``CompileConfig.cache_dir``, else ``$SDKILN_CACHE_DIR/compile``, else
``$XDG_CACHE_HOME/sdkiln/compile`` (``~/.cache/sdkiln/compile``). The setting is the process's:
compiled code runs lazily, at the first call, so it stays set after ``load`` returns.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from sdkiln.configs.runtime import CompileConfig


def cache_root(config: CompileConfig) -> Path:
    if config.cache_dir is not None:
        return Path(config.cache_dir)
    if os.environ.get("SDKILN_CACHE_DIR"):
        return Path(os.environ["SDKILN_CACHE_DIR"]) / "compile"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sdkiln" / "compile"


def cache_key(digest: str, device: torch.device) -> str:
    """``<first 16 hex digits of the digest>-<device kind and name>-torch<version>``."""
    kind = device.type
    if kind == "cuda":
        kind = "cuda-" + torch.cuda.get_device_name(device).replace(" ", "_")
    version = torch.__version__.replace("+", "_")
    return f"{digest.removeprefix('sha256:')[:16]}-{kind}-torch{version}"


def use_compile_cache(config: CompileConfig, digest: str, device: torch.device) -> Path:
    """Make Inductor (and Triton) keep and find compiled code in this package's cache directory;
    returns it."""
    from torch._inductor.utils import clear_caches

    path = cache_root(config) / cache_key(digest, device)
    path.mkdir(parents=True, exist_ok=True)
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") != str(path):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
        os.environ.pop("TRITON_CACHE_DIR", None)  # Triton's cache follows Inductor's (its triton/ folder)
        clear_caches()  # the in-memory caches of the previous directory
    return path
