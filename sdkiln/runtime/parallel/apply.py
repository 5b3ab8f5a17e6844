"""Put a loaded pipeline on a device mesh: ``enable_parallel`` (the loader's parallel stage).

In this order: the mesh (``mesh.py``); with a sequence degree > 1, the split and gather hooks of the
family's plan (``sharding.py``) and the attention route to the ``"parallel"`` backend
(``attention.py``); last, the outermost ``ParallelHook`` (``cfg.py``), which runs CFG parallel and
turns a failed collective into one error. The cache hooks, attached before, stay inside: they see
the calls this rank computes, sharded. ``ParallelRuntime`` is kept on the transformer so that the
cache guard can reach it (``parallel_runtime``): its decision is taken on the whole sequence
(gathered) and agreed among the ranks that run the call, so every rank takes it alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks import HookRegistry
from torch import nn

from sdkiln.configs.runtime import ParallelConfig
from sdkiln.errors import ParallelError
from sdkiln.runtime.attention import attention_route, route_attention, unroute_attention
from sdkiln.runtime.parallel import attention as _backend  # noqa: F401  (registers "parallel")
from sdkiln.runtime.parallel.cfg import HOOK, ParallelHook
from sdkiln.runtime.parallel.mesh import Mesh, init_mesh
from sdkiln.runtime.parallel.sharding import (
    SequenceLayout,
    apply_plan,
    gather_sequence,
    named_cp_plan,
    to_diffusers_plan,
)

ATTRIBUTE = "_sdkiln_parallel"


@dataclass
class ParallelRuntime:
    mesh: Mesh
    layout: SequenceLayout | None
    hook: ParallelHook

    @property
    def call_group(self):
        """The ranks that run the current transformer call (``cfg.ParallelHook.call_group``)."""
        return self.hook.call_group

    def whole_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The image stream ``x`` [B, S, ...] gathered from the sequence ranks (itself without
        sequence parallelism)."""
        if self.layout is None:
            return x
        return gather_sequence(x, 1, self.layout.lengths[self.layout.image], self.layout)


def parallel_runtime(transformer: nn.Module) -> ParallelRuntime | None:
    return getattr(getattr(transformer, "_orig_mod", transformer), ATTRIBUTE, None)


def _give_back(transformer: nn.Module, route) -> None:
    """Undo the parallel runtime's route: back to the sparse or quantized backend, or unrouted."""
    if route.sparse is not None:
        route.use("sparse")
    elif route.quantized is not None:
        route.use("quantized")
    else:
        unroute_attention(transformer)


def enable_parallel(
    pipeline: Any, transformer: nn.Module, spec, config: ParallelConfig, device: torch.device
) -> ParallelRuntime:
    """Make ``transformer`` (of ``pipeline``, family ``spec``) run on the mesh of ``config``."""
    plan = route = None
    if config.sequence > 1:
        if spec.parallel_plan is None or not spec.attention:
            raise ParallelError(
                f"model family {spec.name!r} has no sequence-parallel plan; it runs with --cfg-parallel only"
            )
        if config.split_text:
            cp_plan = getattr(type(transformer), "_cp_plan", None)
            if cp_plan is None:
                raise ParallelError(
                    f"{type(transformer).__name__} has no diffusers _cp_plan to split its text by"
                )
            plan, lengths = named_cp_plan(cp_plan, spec.parallel_plan.image)
        else:
            plan, lengths = to_diffusers_plan(spec.parallel_plan)
        route = attention_route(transformer)
        if route is not None and route.quantized is not None and config.split_text:
            raise ParallelError(
                "this package runs quantized attention, whose key blocks must follow one device's token order; "
                "with the text split across ranks the keys arrive in another order: drop --split-text"
            )
        if route is not None and route.quantized is not None and config.ring > 1:
            raise ParallelError(
                "this package runs quantized attention, which runs under Ulysses (each rank quantizes whole "
                "heads over every key, as one device does) but not under ring attention (a rank's key blocks "
                "would be smoothed and scaled apart from the others); use --ulysses alone"
            )
        if route is not None and route.sparse is not None and config.ring > 1:
            raise ParallelError(
                "this package runs block-sparse attention, which runs under Ulysses (each rank holds whole "
                "heads) but not under ring attention (a rank holds a part of the key blocks its queries "
                "choose from); use --ulysses alone"
            )
        if route is None:
            route = route_attention(transformer, spec, "parallel")
        else:  # a sparse or quantized attention plan: Ulysses computes each rank's heads under it
            route.use("parallel")
        heads = {getattr(module, "heads", None) for module, _ in route.routed.values()} - {None}
        bad = sorted(h for h in heads if h % config.ulysses)
        if bad:
            _give_back(transformer, route)
            allowed = [d for d in range(1, min(heads) + 1) if all(h % d == 0 for h in heads)]
            raise ParallelError(
                f"ulysses {config.ulysses} does not divide the {bad[0]} attention heads of "
                f"{type(transformer).__name__}; allowed Ulysses degrees: {', '.join(map(str, allowed))}"
            )
    try:
        mesh = init_mesh(config, device)
    except BaseException:
        if route is not None:
            _give_back(transformer, route)
        raise
    layout = None
    if route is not None:
        layout = SequenceLayout(mesh, config.split_text, spec.parallel_plan.image, spec.text_arg)
        route.sequence = layout
        apply_plan(transformer, plan, lengths, layout)
    hook = ParallelHook(mesh)
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    registry.register_hook(hook, HOOK)
    if hasattr(registry, "invalidate_child_registries_cache"):  # so cache_context reaches the hook
        registry.invalidate_child_registries_cache()
    runtime = ParallelRuntime(mesh, layout, hook)
    setattr(transformer, ATTRIBUTE, runtime)
    pipeline.sdkiln_parallel = runtime
    return runtime
