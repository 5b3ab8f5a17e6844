"""The attention seam: each supported family's attention routed through ``sdkiln::attention`` by its
spec's data, with the text tokens where the spec says, removable, composing with diffusers'
parallel config, and compile-clean."""

import dataclasses
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
from sdkiln.runtime.attention import TokenSpan, register_backend, route_attention, unroute_attention
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


def calls_per_module(family: str, spec=None) -> tuple[object, dict[str, list]]:
    """One denoising step (guidance 1: one transformer call) of the family's tiny pipeline routed
    through the recording backend: the pipeline and each module's routed calls, in order."""
    spec = spec or get_spec(family)
    pipe = spec.build()
    call = spec.call_kwargs(num_inference_steps=1, guidance=1.0)
    route_attention(pipe.transformer, spec, "test-recording")
    CALLS.clear()
    generate(pipe, call, ["a photo of a cat"], [0], inputs=spec.condition(call))
    calls: dict[str, list] = {}
    for c in CALLS:
        calls.setdefault(c.name, []).append(c)
    return pipe, calls


def test_wan_i2v_attn2_attends_the_image_context_then_the_text():
    """Wan2.1 image-to-video's ``attn2`` makes two attention calls with the same queries: the seam labels
    the first one's keys an image context (the CLIP image tokens, no text) and the second one's text;
    both are context, which no backend splits or sparsifies. Wan text-to-video's ``attn2`` makes one
    call, over text."""
    pipe, calls = calls_per_module("wan-i2v-tiny")
    vision = pipe.image_encoder.config
    image_tokens = (vision.image_size // vision.patch_size) ** 2 + 1  # the patches and CLIP's class token
    assert image_tokens == 17
    attn2 = {n: c for n, c in calls.items() if n.endswith(".attn2")}
    assert len(attn2) == len(pipe.transformer.blocks)
    for image, text in attn2.values():
        assert (image.key_call, image.key_kind, text.key_call, text.key_kind) == (0, "image", 1, "text")
        assert image.key.shape[1] == image_tokens and text.key.shape[1] == 512
        assert image.key_text.stop == image.key_text.start and text.key_text == TokenSpan(0, 512, 512)
        assert image.query is text.query
        assert image.context_keys and text.context_keys
    assert all([c.key_kind for c in calls[n]] == ["text"] and not calls[n][0].context_keys
               for n in calls if n.endswith(".attn1"))  # fmt: skip
    _, t2v = calls_per_module("wan-tiny")
    assert t2v and all(len(c) == 1 and c[0].key_kind == "text" for c in t2v.values())
    assert all(c[0].context_keys == n.endswith(".attn2") for n, c in t2v.items())


def test_a_site_naming_fewer_or_more_attention_calls_is_refused():
    """A site's ``key_calls`` is checked against the calls its processor makes: Wan text-to-video's
    sites (one call per ``attn2``) do not route image-to-video's two, and two calls named where one is
    made are refused too, rather than labelled wrong."""
    i2v, t2v = get_spec("wan-i2v-tiny"), get_spec("wan-tiny")
    with pytest.raises(
        SdkilnError, match=r"blocks.0.attn2: its WanAttnProcessor makes more than the 1 attention"
    ):
        calls_per_module("wan-i2v-tiny", dataclasses.replace(i2v, attention=t2v.attention))
    with pytest.raises(
        SdkilnError, match=r"blocks.0.attn2: its WanAttnProcessor makes fewer than the 2 attention"
    ):
        calls_per_module("wan-tiny", dataclasses.replace(t2v, attention=i2v.attention))
    with pytest.raises(ValueError, match="key_calls is a non-empty tuple of"):
        dataclasses.replace(i2v.attention[1], key_calls=("image", "video"))


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


@pytest.mark.parametrize("family", ["flux-tiny", "wan-i2v-tiny"])
def test_routed_attention_compiles_without_graph_breaks(family):
    """One graph, every routed call in it as ``sdkiln::attention``: Wan2.1 image-to-video's ``attn2``
    numbers its two calls (image context, text) while Dynamo traces it."""
    spec = get_spec(family)
    pipe = spec.build()
    route = route_attention(pipe.transformer, spec)
    transformer = pipe.transformer
    call = spec.call_kwargs()
    try:
        graphs = []
        torch._dynamo.reset()
        counters.clear()
        pipe.transformer = torch.compile(transformer, backend=lambda gm, ex: graphs.append(gm) or gm.forward)
        generate(pipe, call, ["a photo of a cat"], [0], inputs=spec.condition(call))
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        assert len(graphs) == 1
        calls = sum(len(spec.attention_site(name).key_calls) for name in route.routed)
        assert sum("sdkiln.attention" in str(n.target) for n in graphs[0].graph.nodes) == calls
    finally:
        pipe.transformer = transformer
        unroute_attention(transformer)
