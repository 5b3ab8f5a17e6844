"""Order image tokens tile by tile, so that each block of consecutive tokens is spatially local.

Block-sparse attention keeps or drops whole blocks of ``block_size`` consecutive tokens; in the
row-major order a transformer sees, 64 consecutive tokens of a 64-wide latent are one thin row,
and a query block's neighbours are spread over many key blocks. Reordering the image tokens into
tiles (RainFusion 2.0, Sliding Tile Attention) makes a block a compact 2-D (image) or 3-D (video)
region, whose attention concentrates on few key blocks. A video's first frame is tiled on its own
and ordered first, so its tokens fill their own blocks, which stay dense.

Everything here is a permutation of integer positions: applying it and then its inverse gives the
input back exactly (``tests/runtime/test_sparse.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sdkiln.errors import SdkilnError


def token_coords(grid, value: Tensor) -> Tensor:
    """Each image token's (frame, row, column) [N, 3] int64, from the transformer argument the family's
    ``TokenGrid`` names (``grid``), in sequence order."""
    if grid.layout == "ids":
        ids = value[0] if value.dim() == 3 else value
        if ids.dim() != 2 or ids.shape[-1] < 3:
            raise SdkilnError(
                f"{grid.arg}: position ids must be [S, 3] (frame, row, column), got {tuple(value.shape)}"
            )
        return ids[:, :3].round().long().cpu()
    shape = tuple(value.shape[2:])
    if len(shape) == 2:
        shape = (1, *shape)
    if len(shape) != 3:
        raise SdkilnError(f"{grid.arg}: latents must be [B, C, (F,) H, W], got {tuple(value.shape)}")
    f, h, w = (n // p for n, p in zip(shape, grid.patch, strict=True))
    frames, rows, cols = torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([frames, rows, cols], dim=-1).reshape(-1, 3)


@dataclass(frozen=True)
class Tiling:
    order: Tensor
    """Image token ``order[i]`` goes to tiled position ``i`` (int64 [N])."""
    inverse: Tensor
    """The inverse permutation: tiled position ``inverse[j]`` holds image token ``j``."""
    first_frame: int
    """How many tokens at the front of the tiled order are the first frame's (0: not kept dense)."""


def tile_order(coords: Tensor, tile: tuple[int, int, int], first_frame_dense: bool) -> Tiling:
    """The tiled order of tokens at ``coords`` [N, 3]: tile by tile (frames, then rows, then columns
    of tiles), and within a tile frame, row, column. With ``first_frame_dense`` and more than one
    frame, the first frame comes first, tiled by the tile's rows and columns."""
    coords = coords - coords.min(dim=0).values
    frame, row, col = coords.unbind(-1)
    tf, th, tw = tile
    first = (frame == 0) & bool(first_frame_dense) & bool((frame > 0).any())
    group = (~first).long()
    f = torch.where(first, 0, frame - int(bool(first.any())))  # later frames' tiles start at frame 1
    parts = [group, f // tf, row // th, col // tw, f % tf, row % th, col % tw]
    key = torch.zeros_like(frame)
    for part in parts:
        key = key * (int(part.max()) + 1) + part
    order = torch.sort(key, stable=True).indices
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    return Tiling(order, inverse, int(first.sum()))


def default_tile(block_size: int, frames: int) -> tuple[int, int, int]:
    """A tile of ``block_size`` tokens: square-ish in rows and columns for an image, and for a video
    up to 4 frames deep (64 tokens: 4x4x4; 128: 4x4x8), powers of two as block sizes are."""
    depth = 1
    while frames > 1 and depth < 4 and block_size % (depth * 2 * 4) == 0 and block_size // (depth * 2) >= 16:
        depth *= 2
    area = block_size // depth
    rows = 1
    while rows * rows < area and area % (rows * 2) == 0:
        rows *= 2
    return depth, rows, area // rows
