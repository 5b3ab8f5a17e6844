"""What the planner needs from a pipeline: bytes per component and per transformer block, and the
activation estimates of a call at the deployment's size.

The activation estimates are rough, stated as such in every plan, and checked against what a resident
run measures on this machine's CPU (``bench/memory_table.py``, docs/memory.md):

* a transformer call keeps about 8 tensors of the model's width (its most common linear input) and 2
  of its widest layer's input alive for every token of every row it computes, in the model's dtype:
  one row where classifier-free guidance runs its branches as separate calls (``spec.cfg_calls``:
  FLUX, Wan) or not at all, two where one call batches both (SD3);
* a VAE decode keeps about 4 KiB per output pixel for an image VAE (four 256-channel float32 maps at
  full resolution), and about 5.5 KiB per pixel of each of up to 4 frames for a video VAE, which
  decodes a few frames at a time;
* decoding in tiles of ``VAE_TILE`` pixels, it keeps one tile's maps and about three float32 copies
  of the output (the decoded tiles before blending, the blend, the result);
* a text encoder's activations are small next to its weights and counted as 1/8 of them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from torch import nn

from sdkiln.runtime.memory.plan import Sizes

ENCODER_PREFIXES = ("text_encoder", "image_encoder")
VAE_NAMES = ("vae",)


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage once."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        key = (t.device, t.data_ptr()) if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def block_lists(transformer: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The transformer's block lists: its direct ``nn.ModuleList`` children of two or more blocks,
    in definition order (the order diffusers' transformers run them)."""
    return [(n, c) for n, c in transformer.named_children() if isinstance(c, nn.ModuleList) and len(c) >= 2]


def tokens(spec: Any, call: dict[str, Any]) -> int:
    """Image (and video) tokens plus text tokens of one transformer call at ``call``'s size."""
    size = spec.size_step
    frames = int(call.get("num_frames") or 1)
    n = (int(call.get("height", size)) // size) * (int(call.get("width", size)) // size)
    return n * ((frames - 1) // (spec.frame_step or 1) + 1) + int(call.get("max_sequence_length") or 0)


def call_activation_bytes(rows: int, n_tokens: int, hidden: int, widest: int, dtype_size: int) -> int:
    """About 8 hidden-width tensors and 2 of the widest layer's input alive per token and row."""
    return rows * n_tokens * (8 * hidden + 2 * widest) * dtype_size


def call_rows(spec: Any) -> int:
    """The rows of one transformer call: CFG's two branches in one call, unless the family runs them
    as separate calls (``cfg_calls``) or takes its guidance from a guider (separate calls too)."""
    return 1 if spec.cfg_calls or spec.guidance_arg is None else 2


IMAGE_DECODE_BYTES_PER_PIXEL = 4096
"""Measured 1.01 GB at 512x512 on FLUX.1-dev's VAE (``bench/memory_table.py``): about 3.9 KiB."""
VIDEO_DECODE_BYTES_PER_PIXEL = 5632
"""Per pixel of each of 4 frames: measured 8.65 GB at 480x832, 9 frames, on Wan2.1's VAE: 5.3 KiB."""
VAE_TILE = 256
"""A tiled decode's tile, in pixels, with tiles 192 apart (diffusers' video VAEs' default; an
``AutoencoderKL`` is set to it: ``runtime.memory.residency``)."""


def decode_activation_bytes(call: dict[str, Any]) -> int:
    per_pixel = (
        IMAGE_DECODE_BYTES_PER_PIXEL if call.get("num_frames") is None else VIDEO_DECODE_BYTES_PER_PIXEL
    )
    frames = min(int(call.get("num_frames") or 1), 4)
    return int(call.get("height", 0)) * int(call.get("width", 0)) * frames * per_pixel


def tiled_decode_bytes(call: dict[str, Any], vae_class: type | None) -> int:
    """The decode's activations in tiles of ``VAE_TILE``; 0 when the VAE cannot tile (no
    ``enable_tiling``) or the output is one tile."""
    height, width = int(call.get("height", 0)), int(call.get("width", 0))
    if vae_class is None or not hasattr(vae_class, "enable_tiling") or max(height, width) <= VAE_TILE:
        return 0
    tile = {**call, "height": min(height, VAE_TILE), "width": min(width, VAE_TILE)}
    return decode_activation_bytes(tile) + 3 * height * width * int(call.get("num_frames") or 1) * 3 * 4


def sizes_of(pipeline: Any, spec: Any, transformer_attrs: tuple[str, ...], call: dict[str, Any]) -> Sizes:
    """The planner's view of a loaded pipeline at ``call``'s size."""
    components = {n: c for n, c in pipeline.components.items() if isinstance(c, nn.Module)}
    return sizes_from(components, spec, transformer_attrs, call)


def sizes_from(
    components: dict[str, nn.Module],
    spec: Any,
    transformer_attrs: tuple[str, ...],
    call: dict[str, Any],
    bytes_of: Callable[[nn.Module], int] = module_bytes,
) -> Sizes:
    """The planner's view of ``components`` (built, or on the meta device with ``bytes_of`` giving the
    bytes they would have) at ``call``'s size."""
    nbytes = {name: bytes_of(c) for name, c in components.items()}
    blocks: dict[str, list[int]] = {}
    widths: Counter[int] = Counter()
    dtype_size = 2
    for attr in transformer_attrs:
        transformer = components[attr]
        blocks[attr] = [bytes_of(b) for _, blist in block_lists(transformer) for b in blist]
        widths.update(int(m.in_features) for m in transformer.modules() if hasattr(m, "in_features"))
        floats = [p for p in transformer.parameters() if p.is_floating_point() and p.device.type != "meta"]
        dtype_size = floats[0].element_size() if floats else 2
    return sizes_at(
        nbytes,
        spec,
        call,
        tuple(transformer_attrs),
        blocks,
        widths,
        dtype_size,
        lambda n: type(components[n]),
    )


def sizes_at(
    nbytes: dict[str, int],
    spec: Any,
    call: dict[str, Any],
    transformer_attrs: tuple[str, ...],
    blocks: dict[str, list[int]],
    widths: Counter[int],
    dtype_size: int,
    vae_class: Callable[[Any], type | None],
) -> Sizes:
    """``Sizes`` from what a pipeline or a package says of itself: each component's bytes, each
    transformer's block bytes, its linears' input widths and its float dtype's size; ``vae_class``
    maps the VAE's entry (the module, or its ``model_index.json`` entry) to its class."""
    hidden = widths.most_common(1)[0][0] if widths else 0
    encoders = tuple(n for n in nbytes if n.startswith(ENCODER_PREFIXES))
    vae = tuple(n for n in nbytes if n in VAE_NAMES)
    return Sizes(
        components=nbytes,
        encoders=encoders,
        vae=vae,
        transformers=transformer_attrs,
        blocks=blocks,
        activations=call_activation_bytes(
            call_rows(spec), tokens(spec, call), hidden, max(widths, default=0), dtype_size
        ),
        encode_activations=max((nbytes[n] // 8 for n in encoders), default=0),
        decode_activations=decode_activation_bytes(call),
        decode_tiled_activations=sum(tiled_decode_bytes(call, vae_class(n)) for n in vae),
    )
