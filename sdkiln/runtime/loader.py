"""``sdkiln.load``: a verified package -> a ready diffusers pipeline, in one documented order.

1. **verify**: the manifest, the directory and every small file against the manifest
   (``runtime.package``), and every manifest section known to this sdkiln (``runtime.restore``);
2. **build on meta**: the transformer from its config, on the meta device (no float copy of the
   weights is ever materialized: gpt-fast's convert-for-runtime pattern);
3. **swap modules**: each section's ``build`` handler (the quantized layers the manifest names);
4. **load weights**: each safetensors file (or shard) read once, hashed as it is read, each tensor
   into storage of its own, handed over once the file's sha256 matched, then set with
   ``assign=True``; bound for an accelerator (and no mesh), each shard goes to the device before
   the next is read, so the host holds one shard at a time;
5. **assemble**: the other components, built and filled the same way (each model, on meta, first
   given each section's ``component`` handler: a quantized text encoder's modules), into the
   pipeline class the manifest names (from diffusers or sdkiln's model zoo, nowhere else);
6. **restore sections**: each section's ``attach`` handler (step tracker, cache schedule, ...);
7. **parallel**: the device mesh of ``parallel`` (``ParallelConfig``): the process group, the
   sequence split of the family's plan, the attention route, CFG parallel (``runtime.parallel``);
8. **device**: the device's kernels (``kernels.load_device_kernels``), then the pipeline moves there
   (on the CPU, 16-bit components whose dtype this CPU computes slowly run in fp32:
   ``runtime.cpu_dtype``, recorded as ``pipe.sdkiln_widened``; not under ``compile``);
9. **compile**: the transformer, or its repeated blocks, compiled (``CompileConfig``; sdkiln's
   backend fuses diffusers' subgraphs into sdkiln ops, ``runtime.compile``) for the device it is
   on, with the compiled code cached for the next process (``runtime.compile.cache``); the
   runtime's hooks decide outside the compiled region (``runtime.cache.hooks``), so the graphs see
   tensors only.

Each phase's seconds, and the first transformer call's, are ``pipe.sdkiln_cold_start`` (``ColdStart``).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sdkiln import kernels
from sdkiln.configs.runtime import CompileConfig, MemoryConfig, ParallelConfig
from sdkiln.errors import PackageError, ParallelError, SdkilnError, third_party
from sdkiln.runtime import lora, restore
from sdkiln.runtime.attention.quantized import NAME as ATTENTION_QUANT
from sdkiln.runtime.components import (
    BUDGET_MARGIN,
    assemble,
    bounded_build,
    check_config_types,
    component_tensors,
    fill_weights,
    resolve_class,
    stored_size,
)
from sdkiln.runtime.cpu_dtype import widen_slow_dtypes
from sdkiln.runtime.manifest_schema import expect_dict, short
from sdkiln.runtime.package import Package, open_package
from sdkiln.runtime.sparse import restore as sparse_restore

log = logging.getLogger("sdkiln.load")


def _attention_plans(manifest: dict, sections: list) -> set[str]:
    """The attention-plan sections (block-sparse, quantized) of the package's transformer and of every
    expert's view: compile refuses them wherever they are."""
    from sdkiln.runtime.experts import NAME as EXPERTS
    from sdkiln.runtime.experts import expert_views

    names = {s.name for s in sections}
    if EXPERTS in manifest:
        for view in expert_views(manifest).values():
            names |= {s.name for s in restore.sections_of(view)}
    return names & {sparse_restore.NAME, ATTENTION_QUANT}


def build_transformer(pkg: Package, info: dict | None = None) -> nn.Module:
    """The package's transformer class from its config, on the meta device, within the allocation
    budget its stored tensors allow (``runtime.components``). ``info``: the model fields of the
    transformer to build (an expert's, ``runtime.experts``); default the package's."""
    from diffusers import ModelMixin

    info = info or pkg.manifest["model"]
    where = f"{info['transformer_attr']}/config.json"
    config = expect_dict(pkg.read_json(where), where)
    if config.get("_class_name") != info["transformer_class"]:
        raise PackageError(
            f"{where}: _class_name {config.get('_class_name')!r} but the manifest names {info['transformer_class']}"
        )
    cls = resolve_class(f"diffusers:{info['transformer_class']}", ModelMixin, "transformer class")
    check_config_types(cls, config, where)
    with (
        third_party(where, f"building {cls.__name__}"),
        bounded_build(stored_size(pkg, info["transformer_attr"]), where),
    ):
        model = cls.from_config(config)
    # tensors a module computes from the config and keeps as plain attributes, neither parameters nor
    # buffers (Qwen-Image's complex RoPE tables), stay on meta: built again for real when small
    plain = sum(
        v.numel()
        for m in model.modules()
        for v in vars(m).values()
        if isinstance(v, torch.Tensor) and v.is_meta
    )
    if plain > BUDGET_MARGIN:
        raise PackageError(f"{where}: {plain:,} elements of tensors computed from the config")
    if plain:
        from accelerate import init_empty_weights

        with (
            third_party(where, f"building {cls.__name__}'s tables"),
            init_empty_weights(include_buffers=False),
        ):
            model = cls.from_config(config)
    return model


def load_weights(
    pkg: Package, model: nn.Module, device: torch.device | None = None, info: dict | None = None
) -> nn.Module:
    """The transformer's tensors, read from its files (one, or shards) once each, verified, and on
    ``device`` when given (shard by shard); the non-persistent buffers the writer stored beside them
    are set as buffers (they are not in the state dict). ``info`` as in ``build_transformer``."""
    info = info or pkg.manifest["model"]
    tensors = component_tensors(pkg, info["transformer_attr"], device)
    where = f"{info['transformer_attr']}/"
    extra = {}
    for name in info.get("nonpersistent_buffers", []):
        owner, _, leaf = name.rpartition(".")
        try:
            module = model.get_submodule(owner)
        except AttributeError:
            raise PackageError(f"manifest.json: buffer {name!r} is not in the transformer") from None
        if name not in tensors or leaf not in module._buffers:
            raise PackageError(f"{where}: non-persistent buffer {name!r} is not stored or not the model's")
        extra[name] = (module, leaf, tensors.pop(name))
    for name, (module, leaf, value) in extra.items():
        if tuple(value.shape) != tuple(module._buffers[leaf].shape):
            raise PackageError(
                f"{where}: buffer {name!r} has shape {list(value.shape)}, the model's is "
                f"{list(module._buffers[leaf].shape)}"
            )
        module._buffers[leaf] = value
    return fill_weights(model, tensors, where)


def _assemble(
    pkg: Package,
    transformers: dict[str, nn.Module],
    device: torch.device | None,
    prepare: Callable[[str, nn.Module], None] | None = None,
):
    from diffusers import DiffusionPipeline

    info = pkg.manifest["model"]
    pipeline_cls = resolve_class(info["pipeline_class"], DiffusionPipeline, "pipeline class")
    call = pkg.manifest["call"]
    takes = inspect.signature(pipeline_cls.__call__).parameters
    for key in [call["guidance_arg"], *call["defaults"]]:
        if key is not None and key not in takes:
            raise PackageError(f"manifest.json: call: {pipeline_cls.__name__} takes no argument {key!r}")
    pipe = assemble(pkg, pipeline_cls, transformers, device, prepare)
    pipe.set_progress_bar_config(disable=True)
    pipe.sdkiln_manifest = pkg.manifest
    pipe.sdkiln_digest = pkg.digest
    return pipe


def _parallel(
    ctx: restore.RestoreContext, parallel: ParallelConfig | None, target: torch.device
) -> torch.device:
    """The device mesh (``runtime.parallel``); returns this rank's device (``cuda`` -> ``cuda:LOCAL_RANK``)."""
    if parallel is None:
        return target
    from sdkiln.model_zoo import get_spec
    from sdkiln.runtime.parallel import enable_parallel

    info = ctx.package.manifest["model"]
    spec = get_spec(info["family"], info.get("variant"))
    return enable_parallel(ctx.pipeline, ctx.transformer, spec, parallel, target).mesh.device


def _check_refusals(manifest: dict, parallel: ParallelConfig | None, compile: CompileConfig | None) -> None:
    """The family's one-line refusal (``ModelSpec.refusals``) of a layout it cannot run, before any work."""
    if parallel is None and compile is None:
        return
    from sdkiln.model_zoo import get_spec

    info = manifest["model"]
    spec = get_spec(info["family"], info.get("variant"))
    asked = {"compile": compile is not None}
    if parallel is not None:
        asked.update(
            {"cfg-parallel": parallel.cfg > 1, "ulysses": parallel.ulysses > 1, "ring": parallel.ring > 1}
        )
    for capability, used in asked.items():
        if used:
            spec.refuse(capability)


def _check_memory(
    memory: MemoryConfig | None, parallel: ParallelConfig | None, compile: CompileConfig | None
) -> None:
    if memory is None:
        return
    if compile is not None and compile.cuda_graphs:
        raise SdkilnError(
            "a memory budget with CUDA graphs is refused: a graph replays fixed device addresses, and a plan "
            "moves weights between calls"
        )


def _residency(
    ctx: restore.RestoreContext, memory: MemoryConfig, target: torch.device, compiled: bool
) -> Any:
    """Plan (``runtime.memory``) from the package's memory table for its deployment, and carry the
    plan out; one log line."""
    from sdkiln.runtime.memory import apply, plan
    from sdkiln.runtime.memory.table import deployment_sizes

    sizes, _ = deployment_sizes(ctx.package)
    chosen = plan(sizes, memory.device_budget, memory.plan, memory.prefetch)
    if chosen.blocks_per_group and compiled:
        raise SdkilnError(
            f"memory plan {chosen.name} streams the transformer's blocks, which compile does not take yet; "
            "load without compile, or with a budget that keeps the transformer resident"
        )
    log.info("%s", chosen.describe(sizes))
    return apply(ctx.pipeline, chosen, target, (ctx.transformer_attr, *ctx.transformers), sizes)


def _check_parallel_compile(parallel: ParallelConfig | None, compile: CompileConfig | None) -> None:
    """The parallel layouts ``compile`` is verified with, checked before any work: CFG parallel
    (its exchange runs in the outermost hook, outside the compiled region) but not yet sequence
    parallelism, whose attention backend breaks the compiled graph inside the routed diffusers
    processors (which compiles and runs on one process since the seam shares one routed class,
    but has not been verified across ranks: docs/parallel.md), nor CUDA graphs across ranks,
    which no GPU has verified."""
    if parallel is None or compile is None:
        return
    if parallel.sequence > 1:
        raise ParallelError(
            f"compile with ulysses {parallel.ulysses} x ring {parallel.ring} is not supported yet: the "
            "sequence-parallel attention breaks the compiled graph inside the routed attention processors, "
            "which is not verified across ranks; run sequence parallelism without compile, or compile with "
            "CFG parallel alone"
        )
    if compile.cuda_graphs and parallel.world_size > 1:
        raise ParallelError(
            "CompileConfig(cuda_graphs=True) on several ranks is not verified yet; turn cuda_graphs off"
        )


def _compile(ctx: restore.RestoreContext, compile: CompileConfig | None, device: torch.device) -> None:
    if compile is not None:
        from sdkiln.model_zoo import get_spec
        from sdkiln.runtime.compile import compile_transformer, use_compile_cache

        info = ctx.package.manifest["model"]
        spec = get_spec(info["family"], info.get("variant"))
        lists = tuple(bl.attr for bl in spec.block_lists)
        if spec.compile_regional and not compile.regional:
            log.warning("compiling %s's blocks regionally: %s", spec.family, spec.compile_regional)
            compile = dataclasses.replace(compile, regional=True)
        ctx.pipeline.sdkiln_compile_cache = use_compile_cache(compile, ctx.package.digest, device)
        for attr, transformer in {ctx.transformer_attr: ctx.transformer, **ctx.transformers}.items():
            setattr(ctx.pipeline, attr, compile_transformer(transformer, compile, lists))


FOLD_STATS = "calibration/stats.safetensors"


def _folded_smoothing(pkg: Package) -> dict[str, torch.Tensor]:
    """SmoothQuant's s of each transformer layer whose 1/s it folded into the float modulation before
    it (the recipe's ``folded`` list; s in the calibration stats): the layer's input is x / s, which
    a LoRA branch must undo (``runtime.lora``). Read when the first LoRA loads, and only from a
    package that folded something (the stats file is verified against the manifest as it is read)."""
    folded = []
    for step in pkg.manifest["recipe"].get("steps", []):
        record = step.get("result") if isinstance(step, dict) else None
        layers = record.get("folded") if isinstance(record, dict) else None
        folded += layers if isinstance(layers, list) else []
    if not folded:
        return {}
    if FOLD_STATS not in pkg.files:
        raise PackageError(
            f"manifest.json: SmoothQuant folded {len(folded)} layers, but {FOLD_STATS} is missing"
        )
    stats = pkg.tensors(FOLD_STATS)
    out = {}
    for layer in folded:
        s = stats.get(f"smoothquant/{layer}.smooth_scale")
        if s is None or s.dim() != 1 or not bool((s > 0).all()):
            raise PackageError(
                f"{FOLD_STATS}: no positive smooth_scale vector for the folded layer {short(layer)}"
            )
        out[layer] = s
    return out


class ColdStart:
    """Seconds from the call to ``load`` to the end of the first transformer call, by phase:
    ``verify`` (manifest, directory, small files), ``build`` (the models on meta, modules swapped),
    ``read`` (the weights read, verified and placed), ``assemble`` (the other components, the
    sections attached), ``device`` (kernels, the move, the mesh), ``compile`` (wrapping the
    transformer: Dynamo and Inductor run in the first step), and ``first_step``, the first
    transformer call (with compile, the compile itself), set when it returns. ``pipe.sdkiln_cold_start``."""

    def __init__(self):
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now

    def watch_first_step(self, transformer: nn.Module) -> None:
        handles = []

        def before(module, args, kwargs):
            self._last = time.perf_counter()

        def after(module, args, kwargs, output):
            self.mark("first_step")
            for handle in handles:
                handle.remove()

        handles.append(transformer.register_forward_pre_hook(before, with_kwargs=True, prepend=True))
        handles.append(transformer.register_forward_hook(after, with_kwargs=True, always_call=True))

    @property
    def total(self) -> float:
        return sum(self.phases.values())


def load(
    path: str | os.PathLike,
    device: str | torch.device = "auto",
    *,
    parallel: ParallelConfig | None = None,
    compile: CompileConfig | None = None,
    memory: MemoryConfig | None = None,
    digest: str | None = None,
) -> Any:
    """Load a package into a diffusers ``DiffusionPipeline`` on ``device`` ("auto", "cpu", "cuda:0", ...).

    Every file is verified against the manifest (sizes, sha256, no links, no stray files) before it
    is used, and every manifest section must be one this sdkiln restores. Each weights file is read
    once, straight into its tensors' own storage (on an accelerator, shard by shard to the device),
    so the host holds at most the package once (one shard for an accelerator) and nothing after.
    ``parallel`` runs it on a device mesh, ``memory`` within a device budget (the plan as
    ``pipe.sdkiln_memory``, ``sdkiln.runtime.memory``), ``compile`` compiles its transformer
    (``sdkiln.configs.runtime``; compiled code is cached per package digest, device and torch
    version, ``runtime.compile.cache``). The manifest is kept on the pipeline as
    ``pipe.sdkiln_manifest``, its digest as ``pipe.sdkiln_digest`` and the time each phase took as
    ``pipe.sdkiln_cold_start`` (``ColdStart``); with ``digest="sha256:..."`` a package whose digest
    differs is refused before anything is read (``sdkiln inspect`` prints it). The order of the
    work is the module docstring's.
    """
    clock = ColdStart()
    _check_parallel_compile(parallel, compile)
    _check_memory(memory, parallel, compile)
    target = kernels.resolve_device(device)
    pkg = open_package(path, digest=digest)
    _check_refusals(pkg.manifest, parallel, compile)
    sections = restore.sections_of(pkg.manifest)
    planned = _attention_plans(pkg.manifest, sections) if compile is not None else set()
    if sparse_restore.NAME in planned:
        raise SdkilnError(
            "compile with block-sparse attention is not supported yet: the sparse backend breaks the compiled "
            "graph inside the routed attention processors and reads each layer's own plan, so every block "
            "would compile its own graph (docs/sparsity.md); load this package without compile"
        )
    if ATTENTION_QUANT in planned:
        raise SdkilnError(
            "compile with quantized attention is not supported yet: its backend reads each layer's own plan and "
            "the denoising step, so every block would compile its own graph per step (docs/attention-quantization.md); load "
            "this package without compile"
        )
    clock.mark("verify")
    # straight to the accelerator, shard by shard; a mesh picks each rank's device after assembly
    placed = target if target.type != "cpu" and parallel is None and memory is None else None
    if placed is not None:
        kernels.load_device_kernels(target.type)
    ctx = restore.RestoreContext(pkg, build_transformer(pkg), device=placed)
    restore.run_stage("build", sections, ctx)
    clock.mark("build")
    load_weights(pkg, ctx.transformer, placed)
    clock.mark("read")
    ctx.pipeline = _assemble(
        pkg,
        {ctx.transformer_attr: ctx.transformer, **ctx.transformers},
        placed,
        lambda name, model: restore.run_component(sections, ctx, name, model),
    )
    restore.run_stage("attach", sections, ctx)
    clock.mark("assemble")
    target = _parallel(ctx, parallel, target)
    kernels.load_device_kernels(target.type)
    if memory is None:
        ctx.pipeline.to(target)
    ctx.pipeline.sdkiln_widened = {}
    if target.type == "cpu" and compile is None:
        ctx.pipeline.sdkiln_widened = widen_slow_dtypes(ctx.pipeline)
    ctx.pipeline.sdkiln_memory = (
        None if memory is None else _residency(ctx, memory, target, compile is not None)
    )
    clock.mark("device")
    _compile(ctx, compile, target)
    lora.attach(
        ctx.pipeline, ctx.transformer, compiled=compile is not None, folded=lambda: _folded_smoothing(pkg)
    )
    clock.mark("compile")
    clock.watch_first_step(getattr(ctx.pipeline, ctx.transformer_attr))
    ctx.pipeline.sdkiln_cold_start = clock
    return ctx.pipeline
