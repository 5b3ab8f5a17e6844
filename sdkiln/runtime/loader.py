"""``sdkiln.load``: a verified package -> a ready diffusers pipeline.

The transformer is built on the meta device from its config, the manifest's quantized layers are
swapped in, and the safetensors are loaded with ``assign=True`` (gpt-fast's convert-for-runtime
pattern): no float copy of the weights is ever materialized. Other components load with their own
``from_pretrained`` from the package's safetensors/JSON files. A package with a cache schedule
(``schedules/cache_schedule.json``) gets it attached after its fingerprint matched the loaded
transformer's.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from sdkiln.errors import PackageError
from sdkiln.kernels.platform import resolve_device
from sdkiln.model_zoo.fingerprint import fingerprint
from sdkiln.runtime.cache import SCHEDULE_FILE, CacheSchedule, attach_cache
from sdkiln.runtime.package import TRANSFORMER_WEIGHTS, Package, open_package
from sdkiln.runtime.quant import SCHEME_MODULES, quant_module
from sdkiln.runtime.quant.smooth import SmoothedLinear

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


def _swap_modules(model: nn.Module, modules: dict[str, Any]) -> None:
    for name, info in modules.items():
        params = dict(info) if isinstance(info, dict) else {}
        scheme = params.pop("scheme", None)
        if scheme not in SCHEME_MODULES:
            raise PackageError(
                f"manifest.json: layer {name!r} has unknown scheme {scheme!r}; this sdkiln runs {sorted(SCHEME_MODULES)}"
            )
        parent_name, _, leaf = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
            linear = getattr(parent, leaf)
        except AttributeError:
            raise PackageError(f"manifest.json: layer {name!r} does not exist in the transformer") from None
        if not isinstance(linear, nn.Linear):
            raise PackageError(f"manifest.json: layer {name!r} is a {type(linear).__name__}, not a Linear")
        smooth = params.pop("smooth", False)
        if not isinstance(smooth, bool):
            raise PackageError(f"manifest.json: layer {name!r} has a non-boolean 'smooth' ({smooth!r})")
        try:
            module = quant_module(scheme)(
                linear.in_features,
                linear.out_features,
                linear.bias is not None,
                linear.weight.dtype,
                "meta",
                **params,
            )
        except (TypeError, ValueError) as exc:
            raise PackageError(
                f"manifest.json: layer {name!r} cannot be built as {scheme} with {params}: {exc}"
            ) from None
        setattr(parent, leaf, SmoothedLinear(module, linear.in_features, "meta") if smooth else module)


def load_transformer(pkg: Package) -> nn.Module:
    from diffusers import ModelMixin

    info = pkg.manifest["model"]
    attr = info["transformer_attr"]
    config = pkg.read_json(f"{attr}/config.json")
    cls = resolve_class(f"diffusers:{config.get('_class_name')}", ModelMixin, "transformer class")
    with torch.device("meta"):
        model = cls.from_config(config)
    _swap_modules(model, pkg.manifest["modules"])
    weights_path = pkg.path(f"{attr}/{TRANSFORMER_WEIGHTS}")
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


def load(path: str | os.PathLike, device: str | torch.device = "auto"):
    """Load a package into a diffusers ``DiffusionPipeline`` on ``device`` ("auto", "cpu", "cuda:0", ...).

    Every file is verified against the manifest first (sizes, sha256, no links, no stray files).
    The manifest is kept on the pipeline as ``pipe.sdkiln_manifest``.
    """
    from diffusers import DiffusionPipeline

    from sdkiln.runtime.steps import attach_step_tracker, needs_step_tracker

    pkg = open_package(path)
    info = pkg.manifest["model"]
    pipeline_cls = resolve_class(info["pipeline_class"], DiffusionPipeline, "pipeline class")
    transformer = load_transformer(pkg)
    dtype = getattr(torch, info.get("dtype", "float32"))
    pipe = pipeline_cls.from_pretrained(
        str(pkg.root), **{info["transformer_attr"]: transformer}, dtype=dtype, use_safetensors=True
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.sdkiln_manifest = pkg.manifest
    if needs_step_tracker(transformer):
        attach_step_tracker(pipe, info["transformer_attr"])
    if SCHEDULE_FILE in pkg.manifest["files"]:
        schedule = CacheSchedule.from_dict(pkg.read_json(SCHEDULE_FILE))
        schedule.check_fingerprint(fingerprint(transformer))
        attach_cache(pipe, schedule, info["transformer_attr"])
    return pipe.to(resolve_device(device))
