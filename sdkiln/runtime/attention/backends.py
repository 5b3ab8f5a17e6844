"""Attention backends: what a routed attention call runs. One function per backend, registered by name.

A backend takes an ``AttentionCall`` (q, k, v in diffusers' dispatch layout [B, S, H, D], the
mask and scale, where the text tokens are, whether the keys are an image context, which site it is,
and diffusers' ``parallel_config`` when context parallelism is on) and returns the attention output
[B, Sq, H, Dv]. ``"sdkiln"`` is the dense ``sdkiln::attention`` op, which runs on whatever kernel the
device has registered for it (``sdkiln.kernels``). A new backend (block-sparse attention, say) is one
module with a registered function; the route names it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sdkiln import kernels
from sdkiln.errors import SdkilnError


@dataclass(frozen=True)
class TokenSpan:
    """Where the text tokens are in a sequence of ``length`` tokens: ``[start, stop)``, empty for none."""

    start: int
    stop: int
    length: int

    @property
    def text(self) -> slice:
        return slice(self.start, self.stop)


@dataclass
class AttentionCall:
    site: Any
    """The ``AttentionSite`` of the module this call comes from."""
    processor: Any
    """The module's routed processor, which knows the module's name (``name``)."""
    query: Tensor
    key: Tensor
    value: Tensor
    mask: Tensor | None
    """Broadcasts to [B, H, Sq, Sk]: boolean True attends, a float mask adds to the logits."""
    scale: float | None
    query_text: TokenSpan
    key_text: TokenSpan
    parallel_config: Any = None
    """diffusers' ``ParallelConfig`` when its context parallelism sharded this call's sequence."""
    native: Callable[..., Tensor] | None = None
    """``native(q, k, v, attn_mask=None, scale=None)``: attention as the unrouted diffusers processor
    computes it ([B, S, H, D]), so a backend can compute (part of) the call exactly as one device does."""
    sequence: Any = None
    """sdkiln's sequence-parallel layout (``sdkiln.runtime.parallel``) when the parallel runtime
    sharded this call's sequence."""
    sparse: Callable[..., Tensor] | None = None
    """The transformer's block-sparse attention plan (``sdkiln.runtime.sparse``) when one is attached:
    ``sparse(call, head_offset=0)`` computes a whole-sequence call under it."""
    key_call: int = 0
    """Which of the processor's attention calls this is, per module call: its number in the site's
    ``AttentionSite.key_calls``, which says what its keys are (``key_kind``)."""

    @property
    def key_kind(self) -> str:
        """``"text"``: the keys ``key_text`` places the text in (the sequence's own tokens, or all text);
        ``"image"``: an image context's tokens only, and ``key_text`` holds none."""
        return self.site.key_calls[self.key_call]

    @property
    def context_keys(self) -> bool:
        """Whether the keys are context only (all text, or an image context), not the transformer's own
        tokens. A backend treats an image context as it treats text keys: whole on every rank, never
        split with the sequence nor made sparse."""
        return self.site.context_keys(self.key_call)

    @property
    def name(self) -> str:
        """The attention module's name. A backend reads it only where it needs it (an error message, a
        per-layer plan): every block of a kind compiles to one graph only while its name is not read."""
        return self.processor._sdkiln_name


Backend = Callable[[AttentionCall], Tensor]
_BACKENDS: dict[str, Backend] = {}


def register_backend(name: str) -> Callable[[Backend], Backend]:
    def wrap(fn: Backend) -> Backend:
        if name in _BACKENDS:
            raise ValueError(f"attention backend {name!r} is registered twice")
        _BACKENDS[name] = fn
        return fn

    return wrap


def backend(name: str) -> Backend:
    if name not in _BACKENDS:
        raise SdkilnError(f"unknown attention backend {name!r}; known: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]


@register_backend("sdkiln")
def dense(call: AttentionCall) -> torch.Tensor:
    """``sdkiln::attention`` over the whole sequence on one device."""
    if call.parallel_config is not None or call.sequence is not None:
        raise SdkilnError(
            f"{call.name}: this call's sequence is sharded across devices (diffusers' enable_parallelism or "
            "sdkiln's parallel runtime), and the 'sdkiln' attention backend attends over one device's "
            "tokens; load with sdkiln.load(..., parallel=ParallelConfig(...)) instead (docs/parallel.md)"
        )
    out, _ = kernels.attention(call.query, call.key, call.value, call.mask, call.scale)
    return out
