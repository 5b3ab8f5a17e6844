"""Route a transformer's attention through an attention backend: one named, removable route per
transformer, decided by the family's ``ModelSpec.attention`` data.

Each routed attention module gets a copy of its diffusers processor whose class's ``__call__`` is
diffusers' own code, rebound so that the calls it makes to compute attention
(``dispatch_attention_fn`` or ``F.scaled_dot_product_attention``, the site's ``call``) reach the
route instead. Nothing of the processor is rewritten: projections, norms, RoPE and output layers stay
diffusers'. The route builds an ``AttentionCall`` in diffusers' dispatch layout [B, S, H, D] (an SDPA
call's [B, H, S, D] tensors are transposed views of it) with where the text tokens are and what the
keys are, and hands it to the backend (``backends.py``). A processor may make several attention
calls per module call (Wan2.1 image-to-video's ``attn2``: the image context, then the text); the
route numbers them in each ``__call__`` and labels each by the site's ``key_calls``, and refuses a
processor that makes more or fewer calls than the site names. The processor's ``_parallel_config``,
which diffusers' ``enable_parallelism`` sets, still reaches the backend, so the route composes with
diffusers' context parallelism rather than replacing it; a diffusers attention backend chosen with
``set_attention_backend`` is overridden while the route is on.

There is one routed class, with one rebound function and namespace, per processor class and call kind,
shared by every module and every route. Its ``__call__`` records which processor is calling (per
thread) and counts that processor's attention calls on it (``_sdkiln_calls``); the rebound attention
call reads the module's route and site from that processor. So
``torch.compile`` sees the same code and the same globals in every block of a kind and compiles one
graph for them all; the module's name, which differs per block, is read only by a backend that needs
it (``AttentionCall.name``). A code object runs with one namespace only, so the functions Dynamo
installs in it (compiled graphs, resume functions after a graph break) are found again.

The text token count comes from the transformer's text argument (``ModelSpec.text_arg``), read by
a forward pre-hook under ``torch.compiler.disable``. ``unroute_attention`` restores the original
processors and removes the hook; the route lives on the transformer as ``_sdkiln_attention``.
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
import threading
import types
from typing import Any

import torch
import torch.nn.functional
from torch import nn

from sdkiln.errors import SdkilnError
from sdkiln.runtime.attention.backends import AttentionCall, TokenSpan, backend

ATTRIBUTE = "_sdkiln_attention"


def _span(place: str, length: int, text: int) -> TokenSpan:
    if place == "none":
        return TokenSpan(0, 0, length)
    if place == "all":
        return TokenSpan(0, length, length)
    return TokenSpan(0, text, length) if place == "first" else TokenSpan(length - text, length, length)


def _refuse_training_options(processor, dropout_p: float, is_causal: bool, enable_gqa: bool) -> None:
    if dropout_p or is_causal or enable_gqa:
        raise SdkilnError(
            f"{processor._sdkiln_name}: the sdkiln attention route runs inference attention; dropout, "
            "causal masks and grouped-query attention are not routed"
        )


class AttentionRoute:
    """The route of one transformer: its backend, its routed modules and the call's text length."""

    def __init__(self, transformer: nn.Module, backend_name: str, text_arg: str):
        self.backend_name = backend_name
        self.backend = backend(backend_name)
        self.text_arg = text_arg
        params = list(inspect.signature(transformer.forward).parameters)
        self._text_position = params.index(text_arg) if text_arg in params else None
        self.text_tokens = 0
        self.sequence: Any = None
        """The parallel runtime's sequence layout when the transformer runs sequence-parallel
        (``sdkiln.runtime.parallel``); the backend reads it from the call."""
        self.sparse: Any = None
        """The block-sparse attention plan at run time (``sdkiln.runtime.sparse``), when one is attached."""
        self.quantized: Any = None
        """The attention-quantization plan at run time (``runtime.attention.quantized``), when one is attached."""
        self.originals: dict[str, Any] = {}
        """Site call kind -> what the unrouted processor calls (diffusers' ``dispatch_attention_fn``,
        ``torch.nn.functional``), for a backend that computes part of a call as diffusers would."""
        self.routed: dict[str, tuple[nn.Module, Any]] = {}
        """Module name -> (the attention module, its original processor)."""
        self._handle = None

    def use(self, backend_name: str) -> None:
        """Run the routed calls on another backend (the parallel runtime takes over a sparse route)."""
        self.backend, self.backend_name = backend(backend_name), backend_name

    @torch.compiler.disable
    def before_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        text = kwargs.get(self.text_arg)
        if text is None and self._text_position is not None and self._text_position < len(args):
            text = args[self._text_position]
        self.text_tokens = 0 if text is None else int(text.shape[1])

    def dispatch(self, processor, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                 scale=None, enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):  # fmt: skip
        """diffusers' ``dispatch_attention_fn`` signature, [B, S, H, D] tensors, called by ``processor``."""
        _refuse_training_options(processor, dropout_p, is_causal, enable_gqa)
        if attn_mask is not None and attn_mask.ndim == 2:  # [B, Sk]: keys to attend, as diffusers reads it
            attn_mask = attn_mask[:, None, None, :]
        site, text = processor._sdkiln_site, self.text_tokens
        number = processor._sdkiln_calls
        processor._sdkiln_calls = number + 1
        if number >= len(site.key_calls):
            raise SdkilnError(_miscounted(processor, "more than"))
        if site.call == "dispatch":
            native = functools.partial(self.originals["dispatch"], backend=backend)
        else:
            native = functools.partial(_native_sdpa, self.originals["sdpa"])
        key_place = site.key_text if site.key_calls[number] == "text" else "none"  # image context: no text
        call = AttentionCall(
            site, processor, query, key, value, attn_mask, scale,
            _span(site.query_text, query.shape[1], text), _span(key_place, key.shape[1], text),
            parallel_config, native, self.sequence, self.sparse, number,
        )  # fmt: skip
        return self.backend(call)

    def sdpa(self, processor, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
             scale=None, enable_gqa=False):  # fmt: skip
        """``F.scaled_dot_product_attention``'s signature, [B, H, S, D] tensors, called by ``processor``."""
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # views in the dispatch layout
        return self.dispatch(
            processor, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa
        ).transpose(1, 2)


def _native_sdpa(functional, q, k, v, attn_mask=None, scale=None):
    """SDPA as the unrouted processor calls it, on [B, S, H, D] tensors."""
    out = functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask, scale=scale
    )
    return out.transpose(1, 2)


def _miscounted(processor, how: str) -> str:
    site = processor._sdkiln_site
    return (
        f"{processor._sdkiln_name}: its {site.processor} makes {how} the {len(site.key_calls)} attention "
        f"call(s) its site's key_calls names {site.key_calls} (update the family's AttentionSite)"
    )


class _Calling(threading.local):
    processor: Any = None
    """The routed processor whose ``__call__`` runs in this thread."""


_CALLING = _Calling()


def _dispatch_attention_fn(*args, **kwargs):
    processor = _CALLING.processor
    return processor._sdkiln_route.dispatch(processor, *args, **kwargs)


class _Functional:
    """``torch.nn.functional`` with ``scaled_dot_product_attention`` routed."""

    @staticmethod
    def scaled_dot_product_attention(*args, **kwargs):
        processor = _CALLING.processor
        return processor._sdkiln_route.sdpa(processor, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(torch.nn.functional, name)


_CALLEES = {"dispatch": ("dispatch_attention_fn", _dispatch_attention_fn), "sdpa": ("F", _Functional())}
_ROUTED_CLASSES: dict[tuple[type, str], type] = {}


def _routed_class(cls: type, kind: str, name: str) -> type:
    """The routed class of processor class ``cls`` whose attention call is of ``kind`` (``AttentionSite.call``)."""
    if (cls, kind) in _ROUTED_CLASSES:
        return _ROUTED_CLASSES[cls, kind]
    call = cls.__call__
    callee, routed_callee = _CALLEES[kind]
    if not isinstance(call, types.FunctionType) or callee not in call.__code__.co_names:
        raise SdkilnError(
            f"{name}: {cls.__name__}.__call__ does not call {callee} itself in this diffusers version; "
            "the attention seam cannot route it (update the family's AttentionSite)"
        )
    namespace = dict(call.__globals__)
    namespace[callee] = routed_callee
    # Without a module name, torch.compile guards on this namespace itself rather than on the
    # diffusers module it was copied from (whose attention function is not the one called here).
    del namespace["__name__"]
    # A code object of its own: Dynamo keeps what it compiles (and installs in the namespace) per code
    # object, and diffusers' unrouted processors run the original one in diffusers' namespace.
    rebound = types.FunctionType(
        call.__code__.replace(), namespace, call.__name__, call.__defaults__, call.__closure__
    )
    rebound.__kwdefaults__ = call.__kwdefaults__

    def __call__(self, *args, **kwargs):
        # The attention calls made so far in this call, on the processor (Dynamo replays a mutated
        # thread-local wrongly across a graph break): the next one's number in AttentionSite.key_calls.
        _CALLING.processor, self._sdkiln_calls = self, 0
        try:
            out = rebound(self, *args, **kwargs)
        finally:
            _CALLING.processor = None
        if self._sdkiln_calls != len(self._sdkiln_site.key_calls):
            raise SdkilnError(_miscounted(self, "fewer than"))
        return out

    __call__.__signature__ = inspect.signature(call)  # diffusers passes the kwargs its processor takes
    routed = type(f"Routed{cls.__name__}", (cls,), {"__call__": __call__, "__module__": __name__})
    _ROUTED_CLASSES[cls, kind] = routed
    return routed


def _routed_processor(processor: Any, site, name: str, route: AttentionRoute) -> Any:
    """A copy of ``processor`` of its routed class, calling ``route`` as module ``name`` of ``site``."""
    cls = _routed_class(type(processor), site.call, name)
    route.originals.setdefault(site.call, type(processor).__call__.__globals__[_CALLEES[site.call][0]])
    routed = object.__new__(cls)
    routed.__dict__.update(processor.__dict__)
    routed._sdkiln_route, routed._sdkiln_site, routed._sdkiln_name = route, site, name
    routed._sdkiln_calls = 0
    return routed


def _unwrapped(transformer: nn.Module) -> nn.Module:
    return getattr(transformer, "_orig_mod", transformer)


def attention_route(transformer: nn.Module) -> AttentionRoute | None:
    return getattr(_unwrapped(transformer), ATTRIBUTE, None)


def route_attention(transformer: nn.Module, spec, backend_name: str = "sdkiln") -> AttentionRoute:
    """Route every attention module the family's spec names (``spec.attention``) through the attention
    backend ``backend_name``. ``unroute_attention`` undoes it."""
    transformer = _unwrapped(transformer)
    if attention_route(transformer) is not None:
        raise SdkilnError(
            "this transformer's attention is already routed; unroute_attention(transformer) first"
        )
    if not spec.attention:
        raise SdkilnError(f"model family {spec.name!r} names no attention sites to route")
    route = AttentionRoute(transformer, backend_name, spec.text_arg)
    modules = dict(transformer.named_modules())
    for site in spec.attention:
        matched = [n for n in modules if fnmatch.fnmatchcase(n, site.modules)]
        if not matched:
            raise SdkilnError(f"model family {spec.name!r}: no attention module matches {site.modules!r}")
        for name in matched:
            module = modules[name]
            processor = getattr(module, "processor", None)
            if type(processor).__name__ != site.processor:
                raise SdkilnError(
                    f"{name}: its attention processor is {type(processor).__name__}, the family's spec routes "
                    f"{site.processor}; restore the default processor to route it"
                )
            route.routed[name] = (module, processor)
    for name, (module, processor) in route.routed.items():
        site = spec.attention_site(name)
        module.processor = _routed_processor(processor, site, name, route)
    route._handle = transformer.register_forward_pre_hook(route.before_call, with_kwargs=True)
    setattr(transformer, ATTRIBUTE, route)
    return route


def unroute_attention(transformer: nn.Module) -> None:
    """Give every routed attention module its original processor back and remove the route."""
    transformer = _unwrapped(transformer)
    route = attention_route(transformer)
    if route is None:
        return
    for module, processor in route.routed.values():
        module.processor = processor
    route._handle.remove()
    delattr(transformer, ATTRIBUTE)
