"""The sdkiln ``torch.compile`` backend: fusion patterns, then Inductor, optionally CUDA graphs.

``Backend(config)`` is a torch.compile backend (``torch.compile(m, backend=Backend(config))``). It
hands the graph to Inductor with the fusion patterns (``patterns.py``) installed as Inductor's
post-grad custom pass, so they rewrite the functional aten graph Inductor compiles; the sdkiln ops
they produce run their registered device kernels (Triton on CUDA, torch_npu on Ascend, the
reference on CPU). Every match is kept in ``Backend.matches`` (pattern, module path) for tests and
``sdkiln.compile`` DEBUG logs; a graph Inductor serves from its cache (a warm start) runs no passes
and so logs none (``torch._inductor.config.force_disable_caches`` to see them again).

CUDA graphs (``CompileConfig.cuda_graphs``, or ``mode="reduce-overhead"``) are Inductor's CUDA-graph
trees: one capture per input shape, replayed while shapes hold; a new shape (another resolution or
batch) compiles and captures anew, which ``Backend`` logs at INFO, naming the shapes.

``compile_transformer(transformer, config)`` is what ``sdkiln.load(..., compile=...)`` does:
regional compilation of the transformer's repeated blocks (diffusers' ``_repeated_blocks``, the
idea of its ``compile_repeated_blocks``), so a cold start compiles one graph per block kind rather
than the whole model; or the whole transformer with ``regional=False``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from sdkiln.configs.runtime import CompileConfig
from sdkiln.errors import SdkilnError
from sdkiln.runtime.cache.hooks import cache_runner
from sdkiln.runtime.compile import patterns

log = logging.getLogger("sdkiln.compile")


class FusionPass(CustomGraphPass):
    """Inductor's post-grad custom pass: dedupe quantizations, float patterns, norm->quantize."""

    def __init__(self, enabled: tuple[str, ...], record: list):
        self.enabled = enabled
        self.record = record

    def __call__(self, graph: torch.fx.Graph) -> None:
        first, second = patterns.matcher_passes(self.enabled)
        with patterns.recording(self.record):
            first.apply(graph)
            if "norm_quantize" in self.enabled:
                patterns.dedupe_quantize(graph)
                second.apply(graph)
        graph.eliminate_dead_code()

    def uuid(self) -> Any:
        """Inductor's FX-graph cache key for this pass: the source of the pass and its patterns, and
        which patterns are on (a cached graph is reused only if the pass would rewrite it the same)."""
        return (get_hash_for_files((patterns.__file__, __file__)), self.enabled)


class Backend:
    """``torch.compile`` backend: the enabled fusion patterns, then Inductor (``compile_fx``)."""

    def __init__(self, config: CompileConfig | None = None):
        self.config = config or CompileConfig()
        self.matches: list[patterns.MatchRecord] = []
        self.graphs = 0

    def inductor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "post_grad_custom_pre_pass": FusionPass(self.config.fusions, self.matches),
        }
        mode = self.config.mode or "default"
        if self.config.cuda_graphs or mode in ("reduce-overhead", "max-autotune"):
            options["triton.cudagraphs"] = True
        if mode.startswith("max-autotune"):
            options["max_autotune"] = True
        return options

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        shapes = [tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)][:4]
        log.info("sdkiln.compile: compiling graph %d (input shapes %s, ...)", self.graphs, shapes)
        return compile_fx(gm, example_inputs, config_patches=self.inductor_options())


def _check_cuda_graphs(transformer: nn.Module, config: CompileConfig) -> None:
    if not config.cuda_graphs:
        return
    if cache_runner(transformer) is not None:
        raise SdkilnError(
            "CompileConfig(cuda_graphs=True) with a cache schedule is not verified yet: the cached residuals "
            "are outputs of the captured graphs, which a later replay may overwrite; compile without "
            "cuda_graphs, or use a package without a cache schedule"
        )
    device = next((p.device for p in transformer.parameters()), torch.device("cpu"))
    if device.type != "cuda":
        raise SdkilnError(
            f"CompileConfig(cuda_graphs=True) captures CUDA graphs, but the transformer is on {device.type}; "
            "turn cuda_graphs off there (NPU graph capture is not part of this sdkiln)"
        )


def repeated_blocks(transformer: nn.Module, block_lists: tuple[str, ...] = ()) -> list[nn.Module]:
    """The transformer's repeated blocks: instances of the classes diffusers lists in
    ``_repeated_blocks``, or, for a class that lists none (SD3 in diffusers 0.42), the modules of
    its block lists named by the family's spec (``block_lists``, ``ModelSpec.block_lists``' attrs)."""
    kinds = set(getattr(transformer, "_repeated_blocks", None) or ())
    if kinds:
        return [m for m in transformer.modules() if type(m).__name__ in kinds]
    return [block for attr in block_lists for block in getattr(transformer, attr, ())]


def compile_transformer(
    transformer: nn.Module, config: CompileConfig, block_lists: tuple[str, ...] = ()
) -> nn.Module:
    """Compile ``transformer`` as ``config`` says; returns the module to call (the same module,
    its blocks compiled in place, when regional: ``repeated_blocks``, with the family's
    ``block_lists`` where diffusers names none). The backend is ``transformer._sdkiln_backend``
    (its match log) when it is sdkiln's."""
    _check_cuda_graphs(transformer, config)
    backend = Backend(config) if config.backend == "sdkiln" else config.backend
    kwargs: dict[str, Any] = {"backend": backend, "fullgraph": config.fullgraph, "dynamic": config.dynamic}
    if config.backend != "sdkiln":
        kwargs["mode"] = config.mode
    if config.regional:
        blocks = repeated_blocks(transformer, block_lists)
        if not blocks:
            raise SdkilnError(
                f"{type(transformer).__name__} names no repeated blocks (_repeated_blocks, or the family's "
                "block lists) to compile regionally; use CompileConfig(regional=False)"
            )
        for block in blocks:
            block.compile(**kwargs)
        compiled = transformer
    else:
        compiled = torch.compile(transformer, **kwargs)
    if isinstance(backend, Backend):
        transformer._sdkiln_backend = backend
    return compiled
