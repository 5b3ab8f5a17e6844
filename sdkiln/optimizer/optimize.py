"""``sdkiln.optimize``: apply a recipe to a model, measure it against the original, write a package."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sdkiln import kernels
from sdkiln.configs import Deployment, RecipeConfig
from sdkiln.export import ascend, write_package
from sdkiln.export.ascend import AscendExport
from sdkiln.export.atomic import target_lock
from sdkiln.export.package_writer import check_replaceable
from sdkiln.model_zoo import ModelSpec, load_model, spec_for_pipeline
from sdkiln.model_zoo.fingerprint import fingerprint
from sdkiln.optimizer.evaluate import compare
from sdkiln.optimizer.recipes import resolve_recipe
from sdkiln.optimizer.registry import TransformContext, apply_transform
from sdkiln.runtime.restore import CORE_FIELDS

DEFAULT_EVAL_SAMPLES = 20


@dataclass
class OptimizeResult:
    pipeline: Any
    """The optimized pipeline, in memory (shares every component but the transformer with the base)."""
    base: Any
    spec: ModelSpec
    manifest: dict[str, Any]
    quality: dict[str, Any] | None
    package: Path | None
    files: dict[str, Any]
    """Extra package files the steps produced (calibration statistics, schedules)."""
    ascend: AscendExport | None = None
    """With ``format="ascend"``: the MindIE SD files written beside the package."""


def _dtype_name(module: torch.nn.Module) -> str:
    floats = [p.dtype for p in module.parameters() if p.is_floating_point()]
    return str(floats[0] if floats else torch.float32).removeprefix("torch.")


def _class_path(cls: type) -> str:
    """``module:Class``, with diffusers classes named from the top-level package as the runtime resolves them."""
    module = "diffusers" if cls.__module__.startswith("diffusers.") else cls.__module__
    return f"{module}:{cls.__name__}"


def _merge_files(files: dict[str, Any], new: dict[str, Any], kind: str) -> None:
    """Add a recipe step's package files. Steps may share a file (``calibration/stats.safetensors``)
    as long as their entries (tensor names, top-level JSON keys) are distinct."""
    for rel, content in new.items():
        if rel not in files:
            files[rel] = content
            continue
        clash = sorted(set(files[rel]) & set(content))
        if clash:
            raise ValueError(
                f"recipe step {kind!r} writes {clash[0]!r} of {rel}, which an earlier step wrote"
            )
        files[rel] = {**files[rel], **content}


def _merge_sections(sections: dict[str, Any], new: dict[str, Any], kind: str) -> None:
    for name, entry in new.items():
        if name in CORE_FIELDS or name == "modules":
            raise ValueError(
                f"recipe step {kind!r} returns a manifest section named {name!r}, a field of every package"
            )
        if name in sections:
            raise ValueError(
                f"recipe step {kind!r} writes the manifest section {name!r} an earlier step wrote"
            )
        sections[name] = entry


def optimize(
    model: Any = None,
    recipe: str | RecipeConfig = "default",
    out_dir: str | os.PathLike | None = None,
    forward_loop: Callable[[Any], None] | None = None,
    *,
    force: bool = False,
    eval_samples: int = DEFAULT_EVAL_SAMPLES,
    deployment: Deployment | None = None,
    base_id: str | None = None,
    format: str = "package",
    ascend_dtype: str | None = None,
    dtype: torch.dtype | None = None,
) -> OptimizeResult:
    """Optimize ``model`` (a pipeline, a zoo name, a local diffusers directory, or None for the
    embedded model) with ``recipe`` and, if ``out_dir`` is given, write the package there.

    The recipe's deployment (denoising steps, guidance, resolution; ``deployment`` adds settings to
    it, and one that contradicts the recipe is refused) is what every recipe step calibrates,
    searches and measures at, what the quality report measures, and what the manifest records.
    ``forward_loop(pipeline)`` runs calibration data through the model for steps that calibrate;
    steps that need none ignore it. ``eval_samples=0`` skips the quality report. ``base_id`` names
    the base model in the manifest (a zoo name or a directory ``sdkiln eval`` can rebuild it from);
    for a pipeline object it defaults to the directory it was loaded from, else the family's name.

    ``out_dir`` is checked (``force`` replaces only a package or an empty directory) and locked
    against other sdkiln writers before anything is loaded, so a wrong ``--out`` fails at once, not
    after minutes of calibration, and stays reserved until the package is written.

    ``dtype`` is the dtype a model given by name or directory is loaded and optimized in (every
    component in it; default: the dtype its transformer is stored in). A pipeline object is
    optimized in the dtypes it has.

    ``format="ascend"`` also writes MindIE SD's files to ``<out_dir>-ascend`` (``export_ascend``,
    ``ascend_dtype`` its ``dtype``) and makes the package for it: the recipe is checked before any
    calibration (``sdkiln.export.ascend.ascend_recipe``) and SmoothQuant keeps input multipliers.
    """
    if format not in ("package", "ascend"):
        raise ValueError(f"format must be 'package' or 'ascend', got {format!r}")
    if format == "ascend" and out_dir is None:
        raise ValueError("format='ascend' writes beside the package: give out_dir")
    if format != "ascend" and ascend_dtype is not None:
        raise ValueError("ascend_dtype is the dtype of the Ascend files: it needs format='ascend'")
    if dtype is not None and not (isinstance(model, str | os.PathLike) or model is None):
        raise ValueError("dtype sets the dtype a model is loaded in: give the model by name or directory")
    with contextlib.ExitStack() as reserved:
        if out_dir is not None:
            reserved.enter_context(target_lock(Path(out_dir)))
            check_replaceable(Path(out_dir), force)
        if format == "ascend":
            ascend_dir = Path(f"{out_dir}-ascend")
            reserved.enter_context(target_lock(ascend_dir))
            ascend.check_replaceable(ascend_dir, force)
        asked = recipe
        recipe = resolve_recipe(asked)  # an unknown name fails before the model loads
        if isinstance(model, str | os.PathLike) or model is None:
            base, spec, base_id = load_model(None if model is None else str(model), dtype)
        else:
            base, spec = model, spec_for_pipeline(model)
            base_id = base_id or getattr(model, "name_or_path", None) or spec.name
        recipe = resolve_recipe(asked, spec)  # "default" is the family's
        if deployment is not None:
            recipe = dataclasses.replace(
                recipe, deployment=recipe.deployment.merged(deployment, "the optimize call")
            )
        attr = spec.transformer_attr
        base_transformer = getattr(base, attr)
        # Calibration, the cache search and the quality report run the quantized model many times:
        # on the device's kernels, as the runtime will (on a CPU, the int8 product it runs fast).
        kernels.load_device_kernels(next(base_transformer.parameters()).device.type)
        if format == "ascend":
            recipe = ascend.ascend_recipe(recipe, _dtype_name(base_transformer), ascend_dtype)
        optimized = type(base)(**{**base.components, attr: copy.deepcopy(base_transformer)})
        ctx = TransformContext(pipeline=optimized, spec=spec, forward_loop=forward_loop, recipe=recipe)
        ctx.check_deployment()
        steps, modules, files, sections = [], {}, {}, {}
        for config in recipe.steps:
            result = apply_transform(ctx, config)
            modules.update(result.modules)
            _merge_files(files, result.files, config.kind)
            _merge_sections(sections, result.sections, config.kind)
            steps.append({"config": config.to_dict(), "result": result.record})
        manifest = {
            "model": {
                "family": spec.name,
                "base_id": base_id,
                **fingerprint(base_transformer),
                "pipeline_class": _class_path(type(base)),
                "transformer_attr": attr,
                "transformer_class": type(base_transformer).__name__,
                "dtype": _dtype_name(base_transformer),
            },
            "call": {"guidance_arg": spec.guidance_arg, "defaults": ctx.call_kwargs()},
            "recipe": {
                "name": recipe.name,
                "version": recipe.version,
                "deployment": recipe.deployment.to_dict(),
                "steps": steps,
            },
            "modules": modules,
            **sections,
        }
        quality = None
        if eval_samples > 0:
            quality, _, _ = compare(base, optimized, spec, eval_samples, ctx.call_kwargs())
        package = None
        if out_dir is not None:
            package = write_package(
                out_dir,
                optimized,
                manifest,
                quality or {"skipped": "optimize ran with eval_samples=0"},
                attr,
                force=force,
                extra_files=files,
            )
        result = OptimizeResult(optimized, base, spec, manifest, quality, package, files)
        if format == "ascend":
            result.ascend = ascend.export_ascend(package, ascend_dir, dtype=ascend_dtype, force=force)
        return result
