"""Which Linear layers a quantization step touches, and swapping them in place.

Every weight quantization step quantizes the same set: the ``nn.Linear`` layers inside the spec's
transformer blocks, minus the family's float list and the step's ``exclude`` patterns.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

from torch import nn

from sdkiln.optimizer.registry import StepContext


def block_linears(ctx: StepContext, exclude: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """Names of the ``nn.Linear`` layers inside the spec's blocks: (to quantize, kept in float)."""
    prefixes = ctx.spec.block_prefixes()
    chosen, kept = [], []
    for name, module in ctx.transformer.named_modules():
        if not isinstance(module, nn.Linear) or not name.startswith(prefixes):
            continue
        if ctx.spec.is_float_layer(name) or any(fnmatch.fnmatchcase(name, p) for p in exclude):
            kept.append(name)
        else:
            chosen.append(name)
    return chosen, kept


def replace_linears(
    model: nn.Module, names: list[str], build: Callable[[nn.Linear], nn.Module]
) -> dict[str, dict[str, Any]]:
    """Replace each named ``nn.Linear`` of ``model`` by the runtime module ``build(linear)``.

    Returns the manifest's ``modules`` entries: ``{name: {"scheme": ..., **module.params()}}``, all
    the runtime needs to rebuild each module before loading its tensors.
    """
    entries = {}
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = build(getattr(parent, leaf))
        setattr(parent, leaf, module)
        entries[name] = {"scheme": module.scheme, **module.params()}
    return entries
