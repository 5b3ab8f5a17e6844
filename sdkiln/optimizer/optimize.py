"""``sdkiln.optimize``: apply a recipe to a model, measure it against the original, write a package."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from sdkiln import kernels
from sdkiln.configs import Deployment, LoraFile, RecipeConfig, TextEncoderQuantConfig
from sdkiln.export import ascend, write_package
from sdkiln.export.ascend import AscendExport
from sdkiln.export.atomic import target_lock
from sdkiln.export.package_writer import check_replaceable
from sdkiln.model_zoo import ModelSpec, load_model, spec_for_pipeline
from sdkiln.model_zoo.fingerprint import fingerprint
from sdkiln.optimizer.evaluate import default_eval_batch, measure, reference
from sdkiln.optimizer.lora import fuse_loras
from sdkiln.optimizer.match import DEFAULT_SLACK_DB, QualityTarget
from sdkiln.optimizer.plan import OPTIMIZE_LOG, PhaseMeter, make_plan, peak_host_bytes
from sdkiln.optimizer.recipes import resolve_recipe
from sdkiln.optimizer.registry import TransformContext, apply_transform, refuse_steps
from sdkiln.runtime.restore import CORE_FIELDS

DEFAULT_EVAL_SAMPLES = 20


@dataclass
class OptimizeResult:
    pipeline: Any
    """The optimized pipeline, in memory (a copied pipeline object shares every component but the
    transformer with ``base``)."""
    base: Any
    """The pipeline object given, as it was; None when the model was optimized in place (given by
    name or directory, or ``in_place=True``)."""
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


EXPERTS_DIR = "experts"
"""Package files of a pipeline's other transformers' steps sit under ``experts/<attr>/``."""


def _expert_result(result: Any, attr: str) -> Any:
    """A recipe step's result on the expert ``attr``, its files moved under ``experts/<attr>/`` and
    the section entries that name them (``{"file": ...}``) following."""
    moved = {rel: f"{EXPERTS_DIR}/{attr}/{rel}" for rel in result.files}

    def follow(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: follow(v) for k, v in value.items()}
        if isinstance(value, list):
            return [follow(v) for v in value]
        return moved.get(value, value) if isinstance(value, str) else value

    return dataclasses.replace(
        result,
        files={moved[rel]: content for rel, content in result.files.items()},
        sections=follow(result.sections),
    )


def _model_fields(transformer: torch.nn.Module) -> dict[str, Any]:
    """What the manifest records of one transformer: its fingerprint, class and dtype."""
    return {
        **fingerprint(transformer),
        "transformer_class": type(transformer).__name__,
        "dtype": _dtype_name(transformer),
    }


def _encoder_quality(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """What the text-encoder step measured, per encoder: the quality report's part on them (the
    images it measures were made with them)."""
    return {
        name: {k: entry[k] for k in ("sqnr_db", "decision")} | {"scheme": step["result"]["scheme"]}
        for step in steps
        if step["config"]["kind"] == TextEncoderQuantConfig.kind
        for name, entry in step["result"]["encoders"].items()
    }


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
    device: str | torch.device | None = None,
    eval_batch: int | None = None,
    in_place: bool = False,
    progress: bool = True,
    lora: list[LoraFile] | tuple[LoraFile, ...] = (),
    match_quality: str | os.PathLike | None = None,
    match_slack_db: float = DEFAULT_SLACK_DB,
) -> OptimizeResult:
    """Optimize ``model`` (a pipeline, a zoo name, a local diffusers directory, or None for the
    embedded model) with ``recipe`` and, if ``out_dir`` is given, write the package there.

    The recipe's deployment (denoising steps, guidance, resolution; ``deployment`` adds settings to
    it, and one that contradicts the recipe is refused) is what every recipe step calibrates,
    searches and measures at, what the quality report measures, and what the manifest records.
    ``forward_loop(pipeline)`` runs calibration data through the model for steps that calibrate;
    steps that need none ignore it. ``eval_samples=0`` skips the quality report, which otherwise
    generates ``eval_batch`` samples at a time (default: what the deployment's size allows,
    ``evaluate.default_eval_batch``). ``base_id`` names the base model in the manifest (a zoo name or
    a directory ``sdkiln eval`` can rebuild it from); for a pipeline object it defaults to the
    directory it was loaded from, else the family's name.

    One model in memory: a model given by name or directory is loaded (every component in
    ``dtype``, default the dtype its transformer is stored in) onto ``device`` ("auto": the
    accelerator if there is one; default: the CPU), the quality report's original samples are
    generated first, and the recipe steps then change the transformer in place; ``result.base`` is
    None. A pipeline object stays as it was (its transformer is copied, and ``result.base`` is it)
    unless ``in_place=True``; it is optimized on the device it is on (``device``, which moves it,
    needs ``in_place=True``).
    Calibration, scoring, the cache search and the report run on that device with its kernels loaded.

    Before the first forward the plan is printed (``progress``): the transformer forwards of every
    phase and the peak-memory estimate; each phase then shows a progress bar. The package keeps the
    plan and what each phase measured (forwards, seconds, memory high-water mark) in
    ``report/optimize.json``.

    ``out_dir`` is checked (``force`` replaces only a package or an empty directory) and locked
    against other sdkiln writers before anything is loaded, so a wrong ``--out`` fails at once, not
    after minutes of calibration, and stays reserved until the package is written.

    ``lora`` (``LoraFile``: a .safetensors file and a strength) fuses LoRAs into the float transformer
    right after loading (``optimizer.lora``): every step and the quality report's originals see the
    LoRA'd model, and the manifest records them (``model.fused_loras``). A pipeline object takes them
    only with ``in_place=True``.

    ``match_quality`` (a package directory of the same model family and deployment) makes the cache
    search match that package's: its floors rise to the package's held-out result less
    ``match_slack_db``, and its front is confirmed beside the search's own candidates
    (``optimizer.match``; the manifest records it as ``recipe.quality_target``). Meant for variants of a
    package: a LoRA fused (``lora``), a fine-tune, another quantization.

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
    by_name = isinstance(model, str | os.PathLike) or model is None
    if dtype is not None and not by_name:
        raise ValueError("dtype sets the dtype a model is loaded in: give the model by name or directory")
    if eval_batch is not None and eval_batch < 1:
        raise ValueError(f"eval_batch must be >= 1, got {eval_batch}")
    if device is not None and not (by_name or in_place):
        raise ValueError(
            "device moves the model, and a pipeline object optimize is given stays as it was: move it "
            "first (pipe.to(device)) or pass in_place=True"
        )
    if lora and not (by_name or in_place):
        raise ValueError(
            "lora changes the model's weights: give the model by name or directory, or in_place=True"
        )
    lora = [LoraFile.parse(x) if isinstance(x, str) else x for x in lora]
    target = kernels.resolve_device(device) if device is not None else None
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
        quality_target = None if match_quality is None else QualityTarget.read(match_quality, match_slack_db)
        if by_name:
            base, spec, base_id = load_model(None if model is None else str(model), dtype, target)
        else:
            base, spec = model, spec_for_pipeline(model)
            base_id = base_id or getattr(model, "name_or_path", None) or spec.name
        if target is not None:
            base.to(target)
        recipe = resolve_recipe(asked, spec)  # "default" is the family's
        refuse_steps(spec, recipe.steps)
        if format == "ascend":
            spec.refuse("ascend")
        if deployment is not None:
            recipe = dataclasses.replace(
                recipe, deployment=recipe.deployment.merged(deployment, "the optimize call")
            )
        if quality_target is not None:
            recipe = quality_target.apply(recipe)
        attr, attrs = spec.transformer_attr, spec.transformer_attrs
        fused_loras = fuse_loras(base, attr, list(lora)) if lora else []
        base_transformer = getattr(base, attr)
        run_device = next(base_transformer.parameters()).device
        # Calibration, the cache search and the quality report run the quantized model many times:
        # on the device's kernels, as the runtime will (on a CPU, the int8 product it runs fast).
        kernels.load_device_kernels(run_device.type)
        if format == "ascend":
            recipe = ascend.ascend_recipe(recipe, _dtype_name(base_transformer), ascend_dtype)
        model_fields = {
            "family": spec.family,
            "variant": spec.variant,
            "base_id": base_id,
            "pipeline_class": _class_path(type(base)),
            "transformer_attr": attr,
            **_model_fields(base_transformer),
            **({"fused_loras": fused_loras} if fused_loras else {}),
        }
        experts = {a: {"model": _model_fields(getattr(base, a))} for a in spec.experts}
        encoders_changed = any(isinstance(s, TextEncoderQuantConfig) for s in recipe.steps)
        if by_name or in_place:
            optimized, kept_base = base, None
        else:
            # the pipeline's registered settings go along (Wan2.2 TI2V-5B's expand_timesteps); not
            # from_pipe, which casts every component to one dtype (float32 by default)
            params = inspect.signature(type(base).__init__).parameters
            settings = {k: v for k, v in base.config.items() if k in params and k not in base.components}
            # the transformers, and the text encoders where a recipe step changes them, are the copy's own
            encoders = (
                [n for n in base.components if n.startswith("text_encoder")] if encoders_changed else []
            )
            copies = {
                a: copy.deepcopy(getattr(base, a))
                for a in [*attrs, *encoders]
                if getattr(base, a) is not None
            }
            optimized = type(base)(**{**base.components, **settings, **copies})
            kept_base = base
        ctx = TransformContext(pipeline=optimized, spec=spec, forward_loop=forward_loop, recipe=recipe)
        ctx.check_deployment()
        call = ctx.call_kwargs()
        if quality_target is not None:
            quality_target.check(spec, call)
            if progress:
                tqdm.write(quality_target.describe(recipe), file=sys.stderr)
        batch = eval_batch or default_eval_batch(call)
        plan = make_plan(ctx, list(recipe.steps), eval_samples, batch, run_device)
        if progress:
            tqdm.write("\n".join(plan.lines()), file=sys.stderr)
        meter = PhaseMeter([getattr(optimized, a) for a in attrs], run_device, show=progress)
        try:
            ref = None
            if eval_samples > 0:  # the original's samples, before the transformer changes
                ref = meter.run(
                    "report: original model",
                    plan.phases[0].forwards,
                    lambda: reference(optimized, spec, eval_samples, call, batch_size=batch),
                )
            steps, modules, files, sections = [], {}, {}, {}
            for config in recipe.steps:
                for a in ctx.transformers_of(config):  # each on the steps it runs
                    label = ctx.step_label(config, a)
                    counts = [p.forwards for p in plan.phases if p.name.split(":")[0] == label]
                    result = meter.run(
                        label,
                        None if None in counts else sum(counts),
                        functools.partial(apply_transform, ctx.for_transformer(a), config),
                    )
                    if a != attr:
                        result = _expert_result(result, a)
                        expert = experts[a]
                        expert.setdefault("modules", {}).update(result.modules)
                        _merge_sections(expert, result.sections, label)
                        expert.setdefault("steps", []).append(result.record)
                    else:
                        modules.update(result.modules)
                        _merge_sections(sections, result.sections, label)
                        steps.append({"config": config.to_dict(), "result": result.record})
                    _merge_files(files, result.files, label)
            quality = None
            if ref is not None:
                quality, _ = meter.run(
                    "report: optimized model",
                    plan.phases[-1].forwards,
                    lambda: measure(optimized, spec, ref, batch),
                )
                encoders = _encoder_quality(steps)
                if encoders:
                    quality["text_encoders"] = encoders
        finally:
            meter.close()
        manifest = {
            "model": model_fields,
            "call": {"guidance_arg": spec.guidance_arg, "defaults": call},
            "recipe": {
                "name": recipe.name,
                "version": recipe.version,
                "deployment": recipe.deployment.to_dict(),
                "steps": steps,
                **({"quality_target": quality_target.record()} if quality_target is not None else {}),
            },
            "modules": modules,
            **sections,
            **({"experts": experts} if experts else {}),
        }
        log = {
            "plan": plan.to_dict(),
            "phases": meter.records,
            "peak_host_bytes": peak_host_bytes(),
            "peak_device_bytes": max((r.get("peak_device_bytes", 0) for r in meter.records), default=None)
            if run_device.type == "cuda"
            else None,
            "device": str(run_device),
            "dtype": model_fields["dtype"],
            "eval_batch": batch if eval_samples else None,
        }
        _merge_files(files, {OPTIMIZE_LOG: log}, "optimize")
        package = None
        if out_dir is not None:
            package = write_package(
                out_dir,
                optimized,
                manifest,
                quality or {"skipped": "optimize ran with eval_samples=0"},
                attrs,
                force=force,
                extra_files=files,
            )
        result = OptimizeResult(optimized, kept_base, spec, manifest, quality, package, files)
        if format == "ascend":
            result.ascend = ascend.export_ascend(package, ascend_dir, dtype=ascend_dtype, force=force)
        return result
