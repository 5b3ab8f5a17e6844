"""Put a block-sparse attention plan on a pipeline's transformer, and take it off."""

from __future__ import annotations

from typing import Any

from sdkiln.errors import SdkilnError
from sdkiln.runtime.attention import attention_route, route_attention, unroute_attention
from sdkiln.runtime.denoising import attach_step_tracker
from sdkiln.runtime.sparse.attention import SparseAttention
from sdkiln.runtime.sparse.plan import SparseAttentionPlan


def attach_sparse_attention(
    pipeline: Any, spec, plan: SparseAttentionPlan, runner=SparseAttention
) -> SparseAttention:
    """Route ``pipeline``'s transformer (family ``spec``) to the ``"sparse"`` backend under ``plan``.
    ValueError when the plan names a layer that is not one of the family's attention modules.
    ``runner`` is the class that runs the plan (calibration measures with its own).
    ``detach_sparse_attention`` undoes it."""
    if spec.token_grid is None:
        raise SdkilnError(f"model family {spec.name!r} has no token grid: it has no block-sparse attention")
    transformer = getattr(pipeline, spec.transformer_attr)
    transformer = getattr(transformer, "_orig_mod", transformer)
    route = attention_route(transformer)
    joined = route is not None and route.quantized is not None  # quantized attention takes the dense calls
    route = route if joined else route_attention(transformer, spec, "sparse")

    def refuse(message: str):
        if not joined:
            unroute_attention(transformer)
        raise ValueError(message)

    unknown = sorted(set(plan.layers) - set(route.routed))
    if unknown:
        refuse(f"the plan names {unknown[0]!r}, which is not a routed attention module of {spec.name}")
    heads = {name: int(getattr(module, "heads", 0)) for name, (module, _) in route.routed.items()}
    bad = sorted(n for n in plan.layers if heads[n] % plan.head_groups)
    if bad:
        refuse(f"{bad[0]}: {plan.head_groups} head groups do not divide its {heads[bad[0]]} heads")
    tracker = attach_step_tracker(pipeline, spec.transformer_attr)
    route.sparse = runner(plan, spec.token_grid, transformer, heads, tracker)
    if route.backend_name != "parallel":  # under the parallel runtime its backend calls the plan
        route.use("sparse")
    return route.sparse


def sparse_attention_of(transformer) -> SparseAttention | None:
    route = attention_route(transformer)
    return None if route is None else route.sparse


def detach_sparse_attention(transformer) -> None:
    """Remove the plan and the route, unless an attention-quantization plan still uses it (the step
    tracker stays: other modules may follow it)."""
    sparse = sparse_attention_of(transformer)
    if sparse is not None:
        sparse.remove()
        route = attention_route(transformer)
        route.sparse = None
        if route.backend_name == "parallel":  # the parallel runtime keeps its route
            return
        if route.quantized is not None:  # the attention-quantization plan keeps the route
            route.use("quantized")
        else:
            unroute_attention(transformer)
