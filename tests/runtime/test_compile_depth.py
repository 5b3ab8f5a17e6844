"""Compile at real depth: a transformer with a released model's block count, its attention routed
through the seam, compiles regionally with the sdkiln backend to one graph per block kind, as the
unrouted transformer does, with no recompile and no graph break; and a backend that breaks the graph
inside the processor still runs compiled. Every block of a kind runs the same routed class, code and
globals (``sdkiln.runtime.attention.route``), so nothing Dynamo guards on differs between blocks."""

import diffusers
import pytest
import torch
from torch._dynamo.utils import counters

from sdkiln import kernels
from sdkiln.configs.runtime import CompileConfig
from sdkiln.model_zoo import get_spec
from sdkiln.runtime.attention import register_backend, route_attention
from sdkiln.runtime.attention.backends import dense
from sdkiln.runtime.compile.backend import compile_transformer

# Exact path: fp32, the reference attention op and Inductor against diffusers' eager SDPA (measured
# at most 8e-7).
COMPILED_VS_EAGER_ATOL = 1e-5


def _inputs(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=generator) for shape in shapes]


def flux():
    """FLUX.1-dev's depth (19 double + 38 single blocks) at width 16; 16 image and 4 text tokens."""
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=19,
        num_single_layers=38,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        pooled_projection_dim=16,
        guidance_embeds=False,
        axes_dims_rope=(2, 2, 4),
    )
    image, text, pooled = _inputs((1, 16, 16), (1, 4, 16), (1, 16))
    call = {"hidden_states": image, "encoder_hidden_states": text, "pooled_projections": pooled,
            "timestep": torch.tensor([0.5]), "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(4, 3)}  # fmt: skip
    return transformer, call


def sd3():
    """SD3-medium's depth (24 joint blocks) at width 16; an 8x8 latent (16 tokens) and 4 text tokens."""
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=24,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=8,
    )
    latent, text, pooled = _inputs((1, 4, 8, 8), (1, 4, 16), (1, 16))
    call = {"hidden_states": latent, "encoder_hidden_states": text, "pooled_projections": pooled,
            "timestep": torch.tensor([500.0])}  # fmt: skip
    return transformer, call


def wan():
    """Wan2.1-14B's depth (40 blocks) at width 24; one 8x8 latent frame (16 tokens) and 4 text tokens."""
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=40,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    latent, text = _inputs((1, 4, 1, 8, 8), (1, 4, 16))
    return transformer, {
        "hidden_states": latent,
        "encoder_hidden_states": text,
        "timestep": torch.tensor([500.0]),
    }


# Graphs per family, as many as unrouted: one per block kind, and one more where diffusers itself
# recompiles: FLUX's first single block gets a contiguous image stream and the others a slice of the
# joint one (a stride guard); SD3's last block drops the text stream (context_pre_only).
GRAPHS = {"flux": 3, "sd3": 2, "wan": 1}


def compile_routed(family: str, build, backend_name: str = "sdkiln", config: CompileConfig | None = None):
    """``(transformer, call, route, eager output)``: ``build()`` routed to ``backend_name`` and
    compiled as ``config`` says; the eager output is the unrouted transformer's."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer, call = build()
    transformer.eval()
    with torch.no_grad():
        eager = transformer(**call, return_dict=False)[0]
    route = route_attention(transformer, get_spec(family), backend_name)
    # diffusers 0.42 names no repeated blocks for SD3: the family's block lists do (as sdkiln.load passes them)
    lists = tuple(bl.attr for bl in get_spec(family).block_lists)
    compile_transformer(transformer, config or CompileConfig(regional=True), lists)
    return transformer, call, route, eager


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def check_compiles_once_per_block_kind(family: str, build, graphs: int) -> None:
    transformer, call, route, eager = compile_routed(family, build)
    with torch.no_grad():
        first = transformer(**call, return_dict=False)[0]
    assert transformer._sdkiln_backend.graphs <= graphs, transformer._sdkiln_backend.graphs
    assert counters["stats"]["unique_graphs"] <= graphs, dict(counters["stats"])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    kernels.reset_kernel_counts()
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        second = transformer(**call, return_dict=False)[0]
    ran = sum(
        n for (op, device, _), n in kernels.kernel_counts().items() if (op, device) == ("attention", "cpu")
    )
    assert ran == len(route.routed)  # sdkiln::attention, once per routed module
    for out in (first, second):
        torch.testing.assert_close(out, eager, atol=COMPILED_VS_EAGER_ATOL, rtol=COMPILED_VS_EAGER_ATOL)


def test_flux_dev_depth_compiles_once_per_block_kind(fresh_dynamo):
    check_compiles_once_per_block_kind("flux", flux, GRAPHS["flux"])


@pytest.mark.slow  # the FLUX case above runs the same seam in make test (CI budget)
@pytest.mark.parametrize("family, build", [("sd3", sd3), ("wan", wan)])
def test_sd3_and_wan_depth_compile_once_per_block_kind(fresh_dynamo, family, build):
    check_compiles_once_per_block_kind(family, build, GRAPHS[family])


@register_backend("test-compile-depth-graph-break")
def breaking(call):
    """The dense backend after a graph break inside the processor."""
    torch._dynamo.graph_break()
    return dense(call)


def test_a_backend_that_breaks_the_graph_runs_compiled(fresh_dynamo):
    """Dynamo resumes in the processor after the break, in every block, with the functions it installed
    in the routed namespace (a namespace per module lost them: NameError ``__compiled_fn_...``)."""
    transformer, call, route, eager = compile_routed(
        "flux", flux, "test-compile-depth-graph-break", CompileConfig(backend="eager", regional=True)
    )
    with torch.no_grad():
        first = transformer(**call, return_dict=False)[0]
    assert sum(counters["graph_break"].values()) > 0  # precondition: it broke, and ran compiled
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        second = transformer(**call, return_dict=False)[0]
    for out in (first, second):
        torch.testing.assert_close(out, eager, atol=COMPILED_VS_EAGER_ATOL, rtol=COMPILED_VS_EAGER_ATOL)
