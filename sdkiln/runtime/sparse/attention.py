"""The ``"sparse"`` attention backend: a routed attention call runs as block-sparse attention.

``SparseAttention`` runs one transformer's plan (``plan.py``). A forward pre-hook on the transformer
reads where its image tokens sit (the family's ``TokenGrid``) and tiles them (``tiling.py``) once
per grid. Each routed call of a layer the plan lists, from its ``dense_steps``-th denoising step
on, then:

1. reorders the image tokens of q, k and v into tiles (text tokens stay where they are);
2. selects each query block's key blocks (``selection.py``) from the layer's per-head-group value,
   text blocks and a video's first frame dense, or reuses the selection made at most ``mask_reuse``
   - 1 denoising steps earlier for the same layer and the same call of the step (so CFG's two
   branches keep their own selections);
3. runs ``sdkiln::block_sparse_attention`` on the kept blocks (on the CPU: the gather + flash kernel
   of ``sdkiln.kernels.cpu``; on a GPU: Triton's; on Ascend: ``npu_block_sparse_attention``);
4. puts the output rows back in the sequence order.

Every other call (a layer the plan leaves dense, cross-attention whose keys are context only, all
text or an image context, the dense steps) runs as the unrouted diffusers processor would
(``AttentionCall.native``), or through the transformer's attention-quantization plan where it has
one (``runtime.attention.quantized``). Under Ulysses the parallel backend calls ``SparseAttention`` on its
whole-sequence, head-split call with the call's first global head, so the per-head plan applies
unchanged; ring attention is refused (``sdkiln.runtime.parallel.apply``).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from sdkiln import kernels
from sdkiln.errors import SdkilnError
from sdkiln.runtime.attention.backends import AttentionCall, register_backend
from sdkiln.runtime.sparse.plan import SparseAttentionPlan
from sdkiln.runtime.sparse.selection import kept_fraction, select_blocks
from sdkiln.runtime.sparse.tiling import Tiling, tile_order, token_coords


class SparseAttention:
    """The plan of one transformer at run time, and what it computed (``stats``)."""

    def __init__(
        self, plan: SparseAttentionPlan, grid, transformer: nn.Module, heads: dict[str, int], tracker
    ):
        self.plan = plan
        self.grid = grid
        self.heads = heads
        """Module name -> its attention heads (all of them, across Ulysses ranks)."""
        self.tracker = tracker
        self.tiling: Tiling | None = None
        self._coords_key: Any = None
        self._coords: Tensor | None = None
        self._held: Tensor | None = None
        self._layouts: dict[tuple, CallLayout] = {}
        """(sequence length, text span, device) -> the call layout, for the current tiling."""
        self._kept: dict[tuple[str, int], tuple[int, Tensor, float]] = {}
        """(layer, call of the step) -> (the step it was selected at, the kept blocks, their fraction)."""
        self._calls: dict[str, tuple[int, int]] = {}
        self.stats = {"sparse_calls": 0, "dense_calls": 0, "selections": 0, "self_attention_calls": 0,
                      "computed_block_pairs": 0.0}  # fmt: skip
        """Counters: routed calls run sparse and dense, selections made, self-attention calls (sparse
        or not), and their summed fraction of block pairs computed (1 for a dense one):
        ``computed_fraction()``."""
        params = list(inspect.signature(transformer.forward).parameters)
        self._position = params.index(grid.arg) if grid.arg in params else None
        self._handle = transformer.register_forward_pre_hook(self.before_call, with_kwargs=True)

    def remove(self) -> None:
        self._handle.remove()

    @torch.compiler.disable
    def before_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        value = kwargs.get(self.grid.arg)
        if value is None and self._position is not None and self._position < len(args):
            value = args[self._position]
        if value is None:
            raise SdkilnError(
                f"sparse attention reads the image token grid from {self.grid.arg!r}; this call has none"
            )
        # The latents' grid is their shape; ids are read (one copy to the host) only when another
        # tensor, or a changed one, is passed: pipelines pass the same ids at every step.
        key = (tuple(value.shape), value.device)
        if self.grid.layout == "ids":  # an inference tensor keeps no version: it is not changed in place
            key += (value.data_ptr(), 0 if value.is_inference() else value._version)
        if key == self._coords_key:
            return
        self._coords_key, self._held = key, value  # held: its memory cannot be reused by another tensor
        coords = token_coords(self.grid, value)
        if self.tiling is not None and torch.equal(coords, self._coords):
            return
        self._coords = coords
        self.tiling = tile_order(coords, self.plan.tile, self.plan.first_frame_dense)
        self._layouts.clear()
        self._kept.clear()

    def _ordinal(self, name: str, step: int) -> int:
        last_step, count = self._calls.get(name, (-1, 0))
        count = count + 1 if last_step == step else 0
        self._calls[name] = (step, count)
        return count

    def __call__(self, call: AttentionCall, head_offset: int = 0) -> Tensor:
        """The call's attention under the plan; ``head_offset`` is the global index of the call's first
        head (Ulysses gives each rank a slice of the heads)."""
        values = self.plan.layers.get(call.name)
        step = self.step()
        self_attention = self.sparse_site(call)
        self.stats["self_attention_calls"] += self_attention
        if values is None or not self_attention or step < self.plan.dense_steps:
            self.stats["dense_calls"] += 1
            self.stats["computed_block_pairs"] += float(self_attention)
            quantized = call.processor._sdkiln_route.quantized  # an attention-quantization plan takes these
            if quantized is not None:
                return quantized(call)
            return call.native(call.query, call.key, call.value, attn_mask=call.mask, scale=call.scale)
        layout = self.layout(call)
        key = (call.name, self._ordinal(call.name, step))
        cached = self._kept.get(key)
        reuse = (
            cached is not None
            and 0 <= step - cached[0] < self.plan.mask_reuse
            and cached[1].shape[:2] == (call.query.shape[0], call.query.shape[2])
        )
        if reuse:
            out, _ = self.compute(call, layout, None, cached[1])
        else:
            out, kept = self.compute(call, layout, self.head_values(call, values, head_offset))
            # select_blocks has synchronized with the device already: counting here costs no more
            cached = self._kept[key] = (step, kept, kept_fraction(kept, layout.blocks))
            self.stats["selections"] += 1
        self.stats["sparse_calls"] += 1
        self.stats["computed_block_pairs"] += cached[2]
        return out

    def computed_fraction(self) -> float:
        """The fraction of self-attention block pairs computed so far, dense layers and steps included:
        what attention cost relative to dense attention, up to the selection."""
        return self.stats["computed_block_pairs"] / max(self.stats["self_attention_calls"], 1)

    def step(self) -> int:
        if self.tracker.step is None:
            raise SdkilnError(
                "sparse attention follows the denoising step; run the transformer through its pipeline"
            )
        return self.tracker.step

    @staticmethod
    def sparse_site(call: AttentionCall) -> bool:
        """Self-attention over image tokens: what a plan can make sparse (not keys that are context
        only: all text, or an image context, which stay dense as text does)."""
        return not call.context_keys

    def head_values(self, call: AttentionCall, values: list[float], head_offset: int) -> Tensor:
        """The plan's value for each of the call's heads [H]: head group ``g`` holds global heads
        ``[g * H / G, (g + 1) * H / G)``."""
        total = self.heads.get(call.name) or call.query.shape[2]
        heads = (torch.arange(call.query.shape[2]) + head_offset) * len(values) // total
        return torch.tensor(values, dtype=torch.float32)[heads]

    def layout(self, call: AttentionCall) -> CallLayout:
        """Where the call's tokens go in the tiled order, and which blocks stay dense: made once per
        sequence length, text span and device for the current tiling."""
        if call.mask is not None:
            raise SdkilnError(f"{call.name}: sparse attention takes no attention mask")
        if call.query.shape[1] != call.key.shape[1] or call.query_text != call.key_text:
            raise SdkilnError(
                f"{call.name}: sparse attention runs self-attention (queries and keys the same tokens)"
            )
        key = (call.query.shape[1], call.query_text, call.query.device)
        if key not in self._layouts:
            self._layouts[key] = self._new_layout(call)
        return self._layouts[key]

    def _new_layout(self, call: AttentionCall) -> CallLayout:
        q = call.query
        tiling, bs, s, text = self.tiling, self.plan.block_size, q.shape[1], call.query_text
        image = torch.cat([torch.arange(0, text.start), torch.arange(text.stop, s)])
        if len(image) != len(tiling.order):
            raise SdkilnError(
                f"{call.name}: {len(image)} image tokens in the call, {len(tiling.order)} in the grid of {self.grid.arg!r}"
            )
        perm = torch.arange(s)
        perm[image] = image[tiling.order]
        n = math.ceil(s / bs)
        dense = torch.zeros(n, dtype=torch.bool)
        if text.stop > text.start:
            dense[text.start // bs : (text.stop - 1) // bs + 1] = True
        dense[image[: tiling.first_frame] // bs] = True
        return CallLayout(perm.to(q.device), torch.argsort(perm).to(q.device), dense.to(q.device), n)

    def compute(
        self, call: AttentionCall, layout: CallLayout, values: Tensor | None, kept: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(block-sparse attention output in sequence order, the kept blocks): the blocks selected
        for the heads' ``values`` [H], or ``kept`` when given."""
        perm = layout.order
        qp, kp, vp = call.query[:, perm], call.key[:, perm], call.value[:, perm]
        bs = self.plan.block_size
        if kept is None:
            kept = select_blocks(
                qp, kp, values, bs, self.plan.selection, layout.dense, layout.dense, call.scale
            )
        out, _ = kernels.block_sparse_attention(qp, kp, vp, kept, bs, call.scale)
        return out[:, layout.inverse], kept


@dataclass(frozen=True)
class CallLayout:
    order: Tensor
    """Sequence position ``order[i]`` goes to tiled position ``i`` (text positions map to themselves)."""
    inverse: Tensor
    dense: Tensor
    """Blocks (of the tiled order) that attend and are attended densely: text and a video's first frame."""
    blocks: int


@register_backend("sparse")
@torch.compiler.disable
def sparse_attention(call: AttentionCall) -> Tensor:
    """A routed call on one device under the transformer's block-sparse plan (module docstring)."""
    if call.sparse is None:
        raise SdkilnError(
            f"{call.name}: the 'sparse' attention backend runs a sparse-attention plan; none is attached"
        )
    if call.parallel_config is not None:
        raise SdkilnError(
            f"{call.name}: sparse attention under diffusers' enable_parallelism is not supported; load with "
            "sdkiln.load(..., parallel=ParallelConfig(ulysses=N)) instead"
        )
    return call.sparse(call)
