"""What the compile tests read off a compiled transformer (tests/runtime/test_compile_backend.py and
the family suite, tests/families)."""

from __future__ import annotations

import collections

from sdkiln.optimizer.evaluate import generate
from sdkiln.runtime.compile import Backend


def transformer_inputs(spec, pipe) -> tuple[tuple, dict]:
    """The transformer's arguments at the first denoising step of a real pipeline call."""
    captured = []
    handle = pipe.transformer.register_forward_pre_hook(
        lambda m, args, kwargs: captured.append((args, kwargs)) if not captured else None, with_kwargs=True
    )
    call = spec.call_kwargs(num_inference_steps=1)
    generate(pipe, call, ["a photo of a cat"], [0], inputs=spec.condition(call))
    handle.remove()
    return captured[0]


def per_block(backend: Backend, spec) -> dict[str, set[str]]:
    """Block path ("transformer_blocks.0") -> the patterns that matched inside it."""
    blocks = collections.defaultdict(set)
    prefixes = spec.block_prefixes()
    for record in backend.matches:
        for prefix in prefixes:
            if record.where.startswith(prefix):
                index = record.where[len(prefix) :].split(".")[0]
                blocks[prefix + index].add(record.pattern)
    return blocks
