"""The methods bench/cache.py runs: one ``Method`` per row family, each a knob sweep and a context
manager that installs one knob value on the bench's pipeline and removes it on exit. ``bench``
arguments are bench/cache.py's ``Bench`` (not imported here: cache.py imports this module)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch

from sdkiln.optimizer.cache.search import fixed_interval
from sdkiln.runtime.cache import attach_cache, detach_cache


@dataclasses.dataclass(frozen=True)
class Method:
    by: str
    """``sdkiln`` (ours), ``baseline``, ``diffusers`` or ``cache-dit``."""
    sweep: Callable[[Any], list[dict[str, Any]]]
    """The knob values at the bench's step count; ``actions`` in a knob is a schedule to run."""
    install: Callable[[Any, dict[str, Any]], contextlib.AbstractContextManager]
    """Installs one knob value; yields the pipeline to generate with; removes it on exit."""
    reuses: str = "blocks"
    """``blocks`` (a reused step skips whole blocks) or ``attention`` (only attention outputs)."""
    package: str = "diffusers"


@contextlib.contextmanager
def _schedule(bench: Any, knob: dict[str, Any]):
    attach_cache(bench.base, bench.schedule(knob["actions"]), bench.spec.transformer_attr)
    try:
        yield bench.base
    finally:
        detach_cache(bench.transformer)


def _ours(bench: Any) -> list[dict[str, Any]]:
    return [{"point": i, "actions": p["actions"]} for i, p in enumerate(bench.front())]


FIXED_INTERVALS = ((2, 2), (4, 2), (7, 3), (3, 3), (4, 4), (2, 4), (3, 6))
"""(first, every) at 28 steps: block-evaluation ratios 0.29 to 0.61; ``first`` scales with the steps."""


def _fixed(bench: Any) -> list[dict[str, Any]]:
    knobs: dict[tuple[str, ...], dict[str, Any]] = {}
    for first, every in FIXED_INTERVALS:
        first = max(1, round(first * bench.steps / 28))
        actions = [str(a) for a in fixed_interval(bench.steps, first, every)]
        knobs.setdefault(tuple(actions), {"first": first, "every": every, "actions": actions})
    return list(knobs.values())


def _diffusers(make: Callable[[Any, dict[str, Any]], Any]):
    @contextlib.contextmanager
    def install(bench: Any, knob: dict[str, Any]):
        bench.transformer.enable_cache(make(bench, knob))
        try:
            yield bench.base
        finally:
            bench.transformer.disable_cache()

    return install


def _fbc(bench, knob):
    from diffusers.hooks import FirstBlockCacheConfig

    return FirstBlockCacheConfig(**knob)


def _magcache(bench, knob):
    from diffusers.hooks import MagCacheConfig

    return MagCacheConfig(num_inference_steps=bench.steps, mag_ratios=bench.mag_ratios(), **knob)


def _taylorseer(lite: bool):
    def make(bench, knob):
        from diffusers.hooks import TaylorSeerCacheConfig

        # float32 factors: the model runs in float32 (the default stores them in bfloat16)
        return TaylorSeerCacheConfig(taylor_factors_dtype=torch.float32, use_lite_mode=lite, **knob)

    return make


def _pab(bench, knob):
    from diffusers.hooks import PyramidAttentionBroadcastConfig

    return PyramidAttentionBroadcastConfig(current_timestep_callback=bench.current_timestep, **knob)


def _fastercache(attention_only: bool):
    def make(bench, knob):
        from diffusers.hooks import FasterCacheConfig

        # is_guidance_distilled turns off the unconditional-branch approximation, leaving the
        # attention reuse; the default keeps both.
        return FasterCacheConfig(
            current_timestep_callback=bench.current_timestep, is_guidance_distilled=attention_only, **knob
        )

    return make


def _seacache(bench, knob):
    from diffusers.hooks import SeaCacheConfig

    return SeaCacheConfig(**knob)


@contextlib.contextmanager
def _cache_dit(bench: Any, knob: dict[str, Any]):
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "error")  # it logs to stdout, which has the table
    import cache_dit
    from cache_dit import BlockAdapter, DBCacheConfig, ForwardPattern
    from cache_dit.caching.patch_functors import FluxPatchFunctor

    pipe = bench.cache_dit_pipe()
    transformer = getattr(pipe, bench.spec.transformer_attr)
    # cache-dit's own adapter for FluxPipeline (``flux_adapter``), which it does not apply to a
    # pipeline class it does not know: one stack of both block lists, the single blocks as dummies.
    adapter = BlockAdapter(
        pipe=pipe,
        transformer=transformer,
        blocks=transformer.transformer_blocks + transformer.single_transformer_blocks,
        blocks_name="transformer_blocks",
        dummy_blocks_names=["single_transformer_blocks"],
        patch_functor=FluxPatchFunctor(),
        forward_pattern=ForwardPattern.Pattern_1,
    )
    config = DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=0, num_inference_steps=bench.steps, **knob)
    cache_dit.enable_cache(adapter, cache_config=config)
    try:
        yield pipe
    finally:
        cache_dit.disable_cache(pipe)


METHODS: dict[str, Method] = {
    "sdkiln-cache-auto": Method("sdkiln", _ours, _schedule, package="sdkiln"),
    "fixed-interval": Method("baseline", _fixed, _schedule, package="sdkiln"),
    "diffusers-fbc": Method(
        "diffusers", lambda b: [{"threshold": t} for t in (0.05, 0.1, 0.2, 0.3, 0.5)], _diffusers(_fbc)
    ),
    "diffusers-magcache": Method(
        "diffusers",
        lambda b: (
            [{"threshold": t} for t in (0.02, 0.06, 0.12, 0.25)]
            + [{"threshold": 0.3, "max_skip_steps": 5, "retention_ratio": 0.1}]
        ),
        _diffusers(_magcache),
    ),
    "diffusers-taylorseer-lite": Method(
        "diffusers", lambda b: [{"cache_interval": k} for k in (2, 3, 4, 5, 6)], _diffusers(_taylorseer(True))
    ),
    "diffusers-taylorseer": Method(
        "diffusers",
        lambda b: [{"cache_interval": 3}],
        _diffusers(_taylorseer(False)),
        reuses="attention",
    ),
    "diffusers-pab": Method(
        "diffusers",
        lambda b: [{"spatial_attention_block_skip_range": k} for k in (2, 4)],
        _diffusers(_pab),
        reuses="attention",
    ),
    "diffusers-fastercache": Method(
        "diffusers",
        lambda b: [{"spatial_attention_block_skip_range": 2}],
        _diffusers(_fastercache(False)),
        reuses="attention",
    ),
    "diffusers-fastercache-attention": Method(
        "diffusers",
        lambda b: [{"spatial_attention_block_skip_range": 2}],
        _diffusers(_fastercache(True)),
        reuses="attention",
    ),
    "diffusers-seacache": Method("diffusers", lambda b: [{"threshold": 0.25}], _diffusers(_seacache)),
    "cache-dit-dbcache": Method(
        "cache-dit",
        lambda b: (
            [{"residual_diff_threshold": t} for t in (0.08, 0.15, 0.25, 0.4)]
            + [{"residual_diff_threshold": t, "max_warmup_steps": 4} for t in (0.25, 0.4, 0.6)]
        ),
        _cache_dit,
        package="cache-dit",
    ),
}
