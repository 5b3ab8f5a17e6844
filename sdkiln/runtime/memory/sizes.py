"""What the planner needs from a pipeline: bytes per component and per transformer block, and the
activation estimates of a call at the deployment's size.

The activation estimates are rough, and stated as such in every plan: a transformer call keeps
about 8 tensors of the model's width (its most common linear input) and 2 of its widest layer's
input alive for every token of both CFG rows, in the model's dtype; a VAE decode keeps about two 128-channel
float32 feature maps at full resolution for up to 4 frames at once (the causal video VAEs decode a
few frames at a time). A text encoder's activations are small next to its weights and counted as
1/8 of them.
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


def decode_activation_bytes(call: dict[str, Any]) -> int:
    frames = min(int(call.get("num_frames") or 1), 4)
    return int(call.get("height", 0)) * int(call.get("width", 0)) * frames * 128 * 4 * 2


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
    hidden = widths.most_common(1)[0][0] if widths else 0
    encoders = tuple(n for n in nbytes if n.startswith(ENCODER_PREFIXES))
    return Sizes(
        components=nbytes,
        encoders=encoders,
        vae=tuple(n for n in nbytes if n in VAE_NAMES),
        transformers=tuple(transformer_attrs),
        blocks=blocks,
        activations=call_activation_bytes(2, tokens(spec, call), hidden, max(widths, default=0), dtype_size),
        encode_activations=max((nbytes[n] // 8 for n in encoders), default=0),
        decode_activations=decode_activation_bytes(call),
    )
