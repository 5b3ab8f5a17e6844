"""``sdkiln.load``: a verified package -> a ready diffusers pipeline, in one documented order.

1. **verify**: every file against the manifest (``runtime.package``), and every manifest section
   known to this sdkiln (``runtime.restore``);
2. **build on meta**: the transformer from its config, on the meta device (no float copy of the
   weights is ever materialized: gpt-fast's convert-for-runtime pattern);
3. **swap modules**: each section's ``build`` handler (the quantized layers the manifest names);
4. **load weights**: the safetensors, with ``assign=True``;
5. **assemble**: the other components with their own ``from_pretrained``, into the pipeline class
   the manifest names (from diffusers or sdkiln's model zoo, nowhere else);
6. **restore sections**: each section's ``attach`` handler (step tracker, cache schedule, ...);
7. **parallel**: the device mesh of ``parallel`` (``ParallelConfig``);
8. **compile**: ``torch.compile`` of the transformer (``CompileConfig``); the runtime's hooks decide
   outside the compiled region (``runtime.cache.hooks``), so the compiled graph sees tensors only;
9. **device**: the device's kernels (``kernels.load_device_kernels``), then the pipeline moves there.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from sdkiln import kernels
from sdkiln.configs.runtime import CompileConfig, ParallelConfig
from sdkiln.errors import PackageError, SdkilnError
from sdkiln.runtime import restore
from sdkiln.runtime.package import TRANSFORMER_WEIGHTS, Package, open_package

# Pipelines come from diffusers or from sdkiln's own model zoo, nowhere else.
_PIPELINE_MODULES = ("diffusers", "sdkiln.model_zoo.")


def resolve_class(path: str, base: type, what: str) -> type:
    """``module:Class`` from the allow-list, and a subclass of ``base``."""
    module, _, name = path.partition(":")
    if not name or not (module == "diffusers" or module.startswith(_PIPELINE_MODULES[1])):
        raise PackageError(
            f"manifest.json: {what} {path!r} is not from diffusers or sdkiln.model_zoo; refusing it"
        )
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise PackageError(f"manifest.json: cannot import {what} {path!r} ({exc})") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise PackageError(f"manifest.json: {what} {path!r} is not a {base.__name__}")
    return cls


def build_transformer(pkg: Package) -> nn.Module:
    """The package's transformer class from its config, on the meta device."""
    from diffusers import ModelMixin

    config = pkg.read_json(f"{pkg.manifest['model']['transformer_attr']}/config.json")
    cls = resolve_class(f"diffusers:{config.get('_class_name')}", ModelMixin, "transformer class")
    with torch.device("meta"):
        return cls.from_config(config)


def load_weights(pkg: Package, model: nn.Module) -> nn.Module:
    info = pkg.manifest["model"]
    weights_path = pkg.path(f"{info['transformer_attr']}/{TRANSFORMER_WEIGHTS}")
    tensors = load_file(weights_path)
    extra = {n: tensors.pop(n) for n in info.get("nonpersistent_buffers", [])}
    try:
        model.load_state_dict(tensors, strict=True, assign=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0:3]
        raise PackageError(f"{weights_path}: does not match the transformer ({' '.join(first)})") from None
    for name, value in extra.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = value
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftover:
        raise PackageError(f"{weights_path}: tensors missing for {leftover[:3]}")
    return model.eval()


def _assemble(pkg: Package, transformer: nn.Module):
    from diffusers import DiffusionPipeline

    info = pkg.manifest["model"]
    pipeline_cls = resolve_class(info["pipeline_class"], DiffusionPipeline, "pipeline class")
    dtype = getattr(torch, info.get("dtype", "float32"))
    pipe = pipeline_cls.from_pretrained(
        str(pkg.root), **{info["transformer_attr"]: transformer}, dtype=dtype, use_safetensors=True
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.sdkiln_manifest = pkg.manifest
    return pipe


def _parallel(ctx: restore.RestoreContext, parallel: ParallelConfig | None) -> None:
    if parallel is not None and parallel.world_size > 1:
        raise SdkilnError(
            f"parallel={parallel}: this sdkiln runs a package on one device; the parallel runtime "
            "(CFG, Ulysses and ring attention over torch.distributed) is not part of it yet"
        )


def _compile(ctx: restore.RestoreContext, compile: CompileConfig | None) -> None:
    if compile is not None:
        setattr(ctx.pipeline, ctx.transformer_attr, torch.compile(ctx.transformer, **compile.kwargs()))


def load(
    path: str | os.PathLike,
    device: str | torch.device = "auto",
    *,
    parallel: ParallelConfig | None = None,
    compile: CompileConfig | None = None,
) -> Any:
    """Load a package into a diffusers ``DiffusionPipeline`` on ``device`` ("auto", "cpu", "cuda:0", ...).

    Every file is verified against the manifest first (sizes, sha256, no links, no stray files),
    and every manifest section must be one this sdkiln restores. ``parallel`` runs it on a device
    mesh, ``compile`` compiles its transformer (``sdkiln.configs.runtime``). The manifest is kept on
    the pipeline as ``pipe.sdkiln_manifest``; the order of the work is the module docstring's.
    """
    pkg = open_package(path)
    sections = restore.sections_of(pkg.manifest)
    target = kernels.resolve_device(device)
    ctx = restore.RestoreContext(pkg, build_transformer(pkg))
    restore.run_stage("build", sections, ctx)
    load_weights(pkg, ctx.transformer)
    ctx.pipeline = _assemble(pkg, ctx.transformer)
    restore.run_stage("attach", sections, ctx)
    _parallel(ctx, parallel)
    _compile(ctx, compile)
    kernels.load_device_kernels(target.type)
    return ctx.pipeline.to(target)
