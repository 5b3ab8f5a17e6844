"""The attention seam: each supported family's attention routed through ``sdkiln::attention`` by its
spec's data, with the text tokens where the spec says, removable, composing with diffusers'
parallel config, and compile-clean."""

import gc
import inspect
import weakref

import numpy as np
import pytest
import torch
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from torch._dynamo.utils import counters

from sdkiln import metrics
from sdkiln.errors import SdkilnError
from sdkiln.model_zoo import get_spec
from sdkiln.optimizer.evaluate import generate
from sdkiln.runtime.attention import register_backend, route_attention, unroute_attention
from sdkiln.runtime.attention.backends import dense

# Routed against unrouted: the reference op computes attention in fp32 like SDPA, so the images
# differ by float rounding only.
ROUTED_VS_UNROUTED_MIN_PSNR_DB = 60.0

CALLS = []


@register_backend("test-recording")
def recording(call):
    """The dense backend, recording what every call saw."""
    CALLS.append(call)
    return dense(call)


def text_tokens_seen(transformer, spec) -> list[int]:
    """A hook recording the length of the transformer's text argument at every call."""
    seen = []
    transformer.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs[spec.text_arg].shape[1]), with_kwargs=True
    )
    return seen


@pytest.mark.parametrize("family", ["flux-tiny", "sd3-tiny", "wan-tiny"])
def test_every_site_routes_with_its_text_tokens_and_unroutes(family):
    spec = get_spec(family)
    pipe = spec.build()
    call = spec.call_kwargs()
    before, before_latents = generate(pipe, call, ["a photo of a cat"], [0])
    processors = {n: m.processor for n, m in pipe.transformer.named_modules() if hasattr(m, "processor")}
    route = route_attention(pipe.transformer, spec, "test-recording")
    text = text_tokens_seen(pipe.transformer, spec)
    CALLS.clear()
    routed, _ = generate(pipe, call, ["a photo of a cat"], [0])
    assert {c.name for c in CALLS} == set(route.routed) and route.routed
    assert len(CALLS) == len(route.routed) * len(text)  # every site, every transformer call
    for c in CALLS:
        assert c.query.dim() == 4 and c.query.shape[2] == c.key.shape[2]  # [B, S, H, D]
        for span, place, length in ((c.query_text, c.site.query_text, c.query.shape[1]),
                                    (c.key_text, c.site.key_text, c.key.shape[1])):  # fmt: skip
            expected = {"none": 0, "all": length, "first": text[0], "last": text[0]}[place]
            assert span.length == length and span.stop - span.start == expected
            assert span.start == (length - expected if place == "last" else 0)
    assert metrics.psnr(before, routed).min() >= ROUTED_VS_UNROUTED_MIN_PSNR_DB
    unroute_attention(pipe.transformer)
    assert {
        n: m.processor for n, m in pipe.transformer.named_modules() if hasattr(m, "processor")
    } == processors
    _, after_latents = generate(pipe, call, ["a photo of a cat"], [0])
    assert torch.equal(after_latents, before_latents)


def test_every_module_of_a_processor_class_shares_one_routed_class(flux_tiny):
    """One routed class (one code object, one namespace) per processor class and call kind, for every
    module and every route: torch.compile sees the same processor in every block
    (tests/runtime/test_compile_depth.py). It keeps diffusers' signature, which diffusers reads to
    pick the keyword arguments it passes."""
    spec, pipe = flux_tiny
    originals = {n: m.processor for n, m in pipe.transformer.named_modules() if hasattr(m, "processor")}
    classes = []
    for _ in range(2):
        route = route_attention(pipe.transformer, spec)
        try:
            classes.append({type(module.processor) for module, _ in route.routed.values()})
            for module, processor in route.routed.values():
                assert inspect.signature(module.processor.__call__) == inspect.signature(processor.__call__)
        finally:
            unroute_attention(pipe.transformer)
    assert classes[0] == classes[1] and len(classes[0]) == 1
    (routed,) = classes[0]
    assert routed.__name__ == "RoutedFluxAttnProcessor" and routed.__bases__ == (FluxAttnProcessor,)
    after = {n: m.processor for n, m in pipe.transformer.named_modules() if hasattr(m, "processor")}
    assert after == originals


def test_a_removed_route_keeps_nothing_alive():
    """The routed classes are shared and the calling processor is recorded per call: after a call and
    ``unroute_attention``, nothing of the route holds the transformer or its attention modules."""
    spec = get_spec("flux-tiny")
    pipe = spec.build()
    route = route_attention(pipe.transformer, spec)
    generate(pipe, spec.call_kwargs(), ["a photo of a cat"], [0])
    unroute_attention(pipe.transformer)
    refs = [weakref.ref(pipe.transformer)] + [weakref.ref(module) for module, _ in route.routed.values()]
    del pipe, route
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_the_embedded_model_routed_matches_unrouted():
    spec = get_spec("fmnist-flux")
    pipe = spec.build()
    call, prompts, seeds = spec.call_kwargs(), list(spec.eval_prompts[:4]), [0, 1, 2, 3]
    unrouted, _ = generate(pipe, call, prompts, seeds)
    route_attention(pipe.transformer, spec)
    routed, _ = generate(pipe, call, prompts, seeds)
    psnr = metrics.psnr(unrouted, routed)
    assert np.all(psnr >= ROUTED_VS_UNROUTED_MIN_PSNR_DB), psnr


def test_diffusers_parallel_config_reaches_the_backend(flux_tiny):
    """diffusers' enable_parallelism sets ``_parallel_config`` on each processor: the routed ones
    pass it on, and the dense backend refuses what it cannot do."""
    spec, pipe = flux_tiny
    route = route_attention(pipe.transformer, spec)
    try:
        marker = object()
        for module, _ in route.routed.values():
            module.processor._parallel_config = marker
        with pytest.raises(SdkilnError, match="sequence is sharded across devices"):
            generate(pipe, spec.call_kwargs(), ["a photo of a cat"], [0])
    finally:
        unroute_attention(pipe.transformer)


def test_refusals(flux_tiny):
    spec, pipe = flux_tiny
    route_attention(pipe.transformer, spec)
    try:
        with pytest.raises(SdkilnError, match="already routed"):
            route_attention(pipe.transformer, spec)
    finally:
        unroute_attention(pipe.transformer)
    with pytest.raises(SdkilnError, match="unknown attention backend 'flash'"):
        route_attention(pipe.transformer, spec, "flash")
    wan = get_spec("wan-tiny")
    with pytest.raises(SdkilnError, match="no attention module matches 'blocks.*.attn1'"):
        route_attention(pipe.transformer, wan)
    sd3 = get_spec("sd3-tiny")
    with pytest.raises(
        SdkilnError, match="processor is FluxAttnProcessor, the family's spec routes JointAttn"
    ):
        route_attention(pipe.transformer, type(sd3)(**{**sd3.__dict__, "attention": (
            type(sd3.attention[0])("transformer_blocks.*.attn", "JointAttnProcessor2_0", "sdpa", "last", "last"),
        )}))  # fmt: skip
    assert not hasattr(pipe.transformer, "_sdkiln_attention")


def test_routed_attention_compiles_without_graph_breaks(flux_tiny):
    spec, pipe = flux_tiny
    route_attention(pipe.transformer, spec)
    transformer = pipe.transformer
    try:
        graphs = []
        torch._dynamo.reset()
        counters.clear()
        pipe.transformer = torch.compile(transformer, backend=lambda gm, ex: graphs.append(gm) or gm.forward)
        generate(pipe, spec.call_kwargs(), ["a photo of a cat"], [0])
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        assert len(graphs) == 1
        assert any("sdkiln.attention" in str(n.target) for g in graphs for n in g.graph.nodes)
    finally:
        pipe.transformer = transformer
        unroute_attention(transformer)
