"""The attention seam: one named, removable way to route a family's attention through an
attention backend (``route``), and the backends (``backends``: the dense ``sdkiln::attention``).
Parallel (Ulysses, ring) and block-sparse attention plug in here as backends."""

from sdkiln.runtime.attention.backends import AttentionCall, TokenSpan, backend, register_backend
from sdkiln.runtime.attention.route import AttentionRoute, attention_route, route_attention, unroute_attention

__all__ = [
    "AttentionCall",
    "AttentionRoute",
    "TokenSpan",
    "attention_route",
    "backend",
    "register_backend",
    "route_attention",
    "unroute_attention",
]
