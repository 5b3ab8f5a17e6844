"""Sequence-parallel attention: the ``"parallel"`` attention backend (Ulysses, ring, both).

Each routed attention call arrives with this rank's shard of the sequence. Its local tokens are
segments: the image (or video) stream, always sharded, and for a joint-attention family the text,
replicated on every rank (exact) or sharded with the image (``split_text``). From the site's text
places (``AttentionSite``) and the split's recorded lengths the backend knows which is which and
which positions are padding.

* **Ulysses** (degree U): one all-to-all per q, k, v turns the sharded segments from sequence-split
  into head-split (each rank then holds every token of H/U heads); a replicated text segment needs
  no transfer, each rank takes its heads. With the ring degree 1, attention over the whole sequence
  then runs as the unrouted diffusers processor runs it (``AttentionCall.native``), on keys in the
  single-device order, so replicated text is bit-for-bit one device's result. With a block-sparse
  attention plan (``AttentionCall.sparse``) the plan computes it instead, on the real tokens, told
  the rank's first global head; with an attention-quantization plan (``AttentionRoute.quantized``)
  the plan computes it on the real tokens (the keys are whole, in one device's order, so each head's
  quantization is one device's), as it does a context-keys call on the local queries (exact for the
  ``sage`` layout, which quantizes Q per token; the ``mindie`` layout's Q blocks of 128 start at each
  rank's first token, so there it is one device's only where a rank's share is a multiple of 128).
  The output goes back
  by one all-to-all; the text rows by one all-gather of heads.
* **Ring** (degree R): the K/V blocks travel around the ring with ``batch_isend_irecv``, two
  buffers, so a block's transfer overlaps the attention over the previous one (``sdkiln::attention``,
  which returns the log-sum-exp on every device); partial outputs are merged by log-sum-exp in fp32.
  Replicated text K/V are attended once, as their own block; text queries merge their partials in
  one fixed order, so the replicated text stays identical on every rank.
* **Both**: Ulysses inside, ring across (USP): the ring passes Ulysses-gathered blocks.

Cross-attention whose keys are context only (``AttentionCall.context_keys``: all text, as Wan's
``attn2``, or an image context, as the first call of Wan2.1 image-to-video's ``attn2``) needs no
communication: the context is whole on every rank, which attends its queries to it. Padded keys are
left out by index; a block with no real token is skipped. Attention masks are refused: no family in
the zoo passes one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from sdkiln import kernels
from sdkiln.errors import ParallelError
from sdkiln.runtime.attention.backends import AttentionCall, TokenSpan, register_backend
from sdkiln.runtime.parallel.mesh import all_gather
from sdkiln.runtime.parallel.sharding import SequenceLayout


@dataclass(frozen=True)
class Segment:
    replicated: bool
    local: int
    """Tokens of this segment on this rank."""
    total: int
    """Real tokens of the whole segment across the sequence ranks (padding excluded)."""


def segments(place: str, length: int, layout: SequenceLayout) -> list[Segment]:
    """The segments of a local sequence of ``length`` tokens whose text is at ``place``."""
    if place == "all":
        return [Segment(True, length, length)]
    total = layout.lengths[layout.image]
    image = Segment(False, layout.shard(total), total)
    if place == "none":
        if length != image.local:
            raise ParallelError(f"an attention call has {length} local tokens, the image shard {image.local}")
        return [image]
    text_local = length - image.local
    if layout.split_text:
        text = Segment(False, text_local, layout.lengths[layout.text])
    else:
        text = Segment(True, text_local, text_local)
    return [text, image] if place == "first" else [image, text]


def _seq_to_heads(x: Tensor, group, degree: int) -> Tensor:
    """[B, L, H, D] sequence shard -> [B, degree * L, H / degree, D] head shard."""
    b, s, h, d = x.shape
    send = x.reshape(b, s, degree, h // degree, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, degree * s, h // degree, d)


def _heads_to_seq(x: Tensor, group, degree: int) -> Tensor:
    """[B, degree * L, H / degree, D] -> [B, L, H, D]; the inverse of ``_seq_to_heads``."""
    b, s, hl, d = x.shape
    send = x.reshape(b, degree, s // degree, hl, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // degree, degree * hl, d)


def _gather_heads(x: Tensor, group, degree: int) -> Tensor:
    """[B, T, H / degree, D] on every Ulysses rank -> [B, T, H, D]."""
    return all_gather(x, group, degree).permute(1, 2, 0, 3, 4).flatten(2, 3)


def _valid(shards: list[Segment], shard_index: int, ulysses: int) -> Tensor | None:
    """Positions of real tokens in the Ulysses-gathered block of ring rank ``shard_index``; None: all."""
    width = sum(s.local for s in shards)
    index, complete = [], True
    for u in range(ulysses):
        offset = u * width
        for seg in shards:
            shard = shard_index * ulysses + u
            count = max(0, min(seg.local, seg.total - shard * seg.local))
            complete &= count == seg.local
            index.append(torch.arange(offset, offset + count))
            offset += seg.local
    return None if complete else torch.cat(index)


def _merge(out: Tensor | None, lse: Tensor | None, o: Tensor, o_lse: Tensor) -> tuple[Tensor, Tensor]:
    o = o.float()
    if out is None:
        return o, o_lse
    new = torch.logaddexp(lse, o_lse)
    return out * torch.exp(lse - new).unsqueeze(-1) + o * torch.exp(o_lse - new).unsqueeze(-1), new


def _select(x: Tensor, index: Tensor | None) -> Tensor:
    return x if index is None else x.index_select(1, index.to(x.device))


class _Ring:
    """The K/V blocks of one ring pass, double-buffered: ``blocks()`` yields (source ring rank,
    stacked k and v) while the next block is in flight."""

    def __init__(self, k: Tensor, v: Tensor, layout: SequenceLayout):
        mesh = layout.mesh
        self.mesh, self.degree = mesh, mesh.config.ring
        self.current = torch.stack([k, v]).contiguous()
        self.spare = torch.empty_like(self.current)

    def blocks(self):
        mesh, r = self.mesh, self.mesh.ring_rank
        after = mesh.ring_ranks[(r + 1) % self.degree]
        before = mesh.ring_ranks[(r - 1) % self.degree]
        for step in range(self.degree):
            requests = []
            if step < self.degree - 1:
                requests = dist.batch_isend_irecv([
                    dist.P2POp(dist.isend, self.current, after, mesh.ring_group),
                    dist.P2POp(dist.irecv, self.spare, before, mesh.ring_group),
                ])  # fmt: skip
            yield (r - step) % self.degree, self.current
            for request in requests:
                request.wait()
            if requests:
                self.current, self.spare = self.spare, self.current


@register_backend("parallel")
@torch.compiler.disable
def parallel_attention(call: AttentionCall) -> Tensor:
    """A routed attention call on this rank's shard of the sequence (module docstring)."""
    layout: SequenceLayout | None = call.sequence
    if layout is None:
        out, _ = kernels.attention(call.query, call.key, call.value, call.mask, call.scale)
        return out
    if call.mask is not None:
        raise ParallelError(f"{call.name}: attention masks are not supported under sequence parallelism")
    mesh, config = layout.mesh, layout.mesh.config
    q_segs = segments(call.site.query_text, call.query.shape[1], layout)
    quantized = call.processor._sdkiln_route.quantized
    if call.context_keys:  # keys are context (all text, or an image context), whole on every rank
        if quantized is not None:  # queries per token, keys whole: one device's quantization
            return quantized(dataclasses.replace(call, sequence=None))
        return call.native(call.query, call.key, call.value, scale=call.scale)
    k_segs = segments(call.site.key_text, call.key.shape[1], layout)
    if q_segs != k_segs:
        raise ParallelError(f"{call.name}: queries and keys are split differently ({q_segs} vs {k_segs})")
    u, heads = config.ulysses, call.query.shape[2]
    if heads % u:
        raise ParallelError(f"{call.name}: ulysses {u} does not divide its {heads} heads")
    head0, head_count = mesh.ulysses_rank * (heads // u), heads // u

    def parts(x: Tensor) -> tuple[Tensor | None, Tensor]:
        pieces = x.split([s.local for s in q_segs], dim=1)
        rep = [
            p[:, :, head0 : head0 + head_count] for p, s in zip(pieces, q_segs, strict=True) if s.replicated
        ]
        shard = torch.cat([p for p, s in zip(pieces, q_segs, strict=True) if not s.replicated], dim=1)
        if u > 1:
            shard = _seq_to_heads(shard, mesh.ulysses_group, u)
        return (rep[0] if rep else None), shard

    (q_rep, q_x), (k_rep, k_x), (v_rep, v_x) = parts(call.query), parts(call.key), parts(call.value)
    rep_first = q_segs[0].replicated
    shards = [s for s in q_segs if not s.replicated]

    def joined(rep: Tensor | None, x: Tensor) -> Tensor:
        return x if rep is None else torch.cat([rep, x] if rep_first else [x, rep], dim=1)

    q = joined(q_rep, q_x)
    if config.ring == 1:
        valid = _valid(shards, 0, u)
        k, v = joined(k_rep, _select(k_x, valid)), joined(v_rep, _select(v_x, valid))
        if call.sparse is not None:  # its dense calls go to a quantization plan, if any
            out = _sparse(call, q_rep, q_x, k, v, valid, rep_first, head0)
        elif quantized is not None:  # on the real queries: block layouts quantize them as one device does
            out = _on_real_queries(
                q_rep, q_x, valid, rep_first,
                lambda q: quantized(dataclasses.replace(call, query=q, key=k, value=v, sequence=None)),
            )  # fmt: skip
        else:
            out = call.native(q, k, v, scale=call.scale)
    else:
        out = _ring_attention(q, k_rep, v_rep, k_x, v_x, shards, layout, call.scale, rep_first)
    text = 0 if q_rep is None else q_rep.shape[1]
    out_rep = out[:, :text] if rep_first else out[:, out.shape[1] - text :]
    out_x = out[:, text:] if rep_first else out[:, : out.shape[1] - text]
    if u > 1:
        out_x = _heads_to_seq(out_x.contiguous(), mesh.ulysses_group, u)
        out_rep = _gather_heads(out_rep, mesh.ulysses_group, u) if text else out_rep
    pieces = list(out_x.split([s.local for s in shards], dim=1))
    ordered = [out_rep if s.replicated else pieces.pop(0) for s in q_segs]
    return torch.cat(ordered, dim=1)


def _sparse(call: AttentionCall, q_rep, q_x, k, v, valid, rep_first: bool, head0: int) -> Tensor:
    """The whole sequence of this rank's heads under the block-sparse plan (``call.sparse``), on the
    real tokens in the single-device order; padded query rows come back as zeros."""
    text = 0 if q_rep is None else q_rep.shape[1]

    def run(q: Tensor) -> Tensor:
        length = q.shape[1]
        span = TokenSpan(0, text, length) if rep_first else TokenSpan(length - text, length, length)
        whole = dataclasses.replace(
            call, query=q, key=k, value=v, query_text=span, key_text=span, sequence=None
        )
        return call.sparse(whole, head_offset=head0)

    return _on_real_queries(q_rep, q_x, valid, rep_first, run)


def _on_real_queries(q_rep, q_x, valid, rep_first: bool, run) -> Tensor:
    """``run(q)`` on the real query tokens in the single-device order (a plan that quantizes queries per
    block, or keeps blocks, sees no padding); padded query rows come back as zeros."""
    q = _select(q_x, valid)
    text = 0 if q_rep is None else q_rep.shape[1]
    out = run(q if q_rep is None else torch.cat([q_rep, q] if rep_first else [q, q_rep], dim=1))
    if valid is None:
        return out
    length = out.shape[1]
    out_rep, out_x = (
        (out[:, :text], out[:, text:]) if rep_first else (out[:, length - text :], out[:, : length - text])
    )
    padded = out_x.new_zeros(out_x.shape[0], q_x.shape[1], *out_x.shape[2:]).index_copy_(1, valid, out_x)
    return torch.cat([out_rep, padded] if rep_first else [padded, out_rep], dim=1)


def _ring_attention(q, k_rep, v_rep, k_x, v_x, shards, layout, scale, rep_first) -> Tensor:
    """Ring attention of all local queries over the replicated text block (once) and every rank's
    sharded block; text query rows merged in a fixed order (text, ring rank 0, 1, ...)."""
    u = layout.mesh.config.ulysses
    text = 0 if k_rep is None else k_rep.shape[1]
    rows = slice(0, text) if rep_first else slice(q.shape[1] - text, q.shape[1])
    out = lse = None
    text_parts: dict[int, tuple[Tensor, Tensor]] = {}
    if text:
        o, o_lse = kernels.attention(q, k_rep, v_rep, None, scale)
        out, lse = _merge(None, None, o, o_lse)
        text_parts[-1] = (out[:, rows], lse[:, rows])
    for source, kv in _Ring(k_x, v_x, layout).blocks():
        valid = _valid(shards, source, u)
        if valid is not None and valid.numel() == 0:
            continue
        o, o_lse = kernels.attention(q, _select(kv[0], valid), _select(kv[1], valid), None, scale)
        if text:
            text_parts[source] = (o[:, rows].float(), o_lse[:, rows])
        out, lse = _merge(out, lse, o, o_lse)
    if text:
        t_out = t_lse = None
        for source in sorted(text_parts):
            t_out, t_lse = _merge(t_out, t_lse, *text_parts[source])
        out[:, rows] = t_out
    return out.to(q.dtype)
