"""2:4 weight sparsity: of each 4 consecutive input weights of a row, the 2 of smallest magnitude
become zero (magnitude pruning, per Linear, no retraining).

It is the pattern NVIDIA's sparse tensor cores run at up to twice the dense rate
(``torch.sparse.to_sparse_semi_structured``); this step only makes the weights 2:4 and records it:
the package stores them as ordinary (float or quantized) weights, and a 2:4 kernel is a runtime
matter. Quantization steps after it (its order is first) quantize the pruned weights, whose zeros
stay zero on every grid. The quality cost is what the package's quality report measures.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from sdkiln.configs.sparse import Sparse24Config
from sdkiln.optimizer.plan import Phase, register_plan
from sdkiln.optimizer.registry import TransformContext, TransformResult, register_transform


def prune_2_4(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] (in divisible by 4) with the 2 smallest-magnitude of every 4 consecutive
    input weights of a row set to zero (among equal magnitudes the earlier is dropped first)."""
    groups = weight.reshape(weight.shape[0], -1, 4)
    drop = groups.abs().argsort(dim=-1, stable=True)[..., :2]
    return groups.scatter(-1, drop, 0.0).reshape(weight.shape)


@register_transform(Sparse24Config)
@torch.no_grad()
def apply_sparse_2_4(ctx: TransformContext, config: Sparse24Config) -> TransformResult:
    prefixes = ctx.spec.block_prefixes()
    pruned, skipped, error = [], {}, {}
    for name, module in ctx.transformer.named_modules():
        if not isinstance(module, nn.Linear) or not name.startswith(prefixes):
            continue
        if ctx.spec.is_float_layer(name) or any(fnmatch.fnmatchcase(name, p) for p in config.exclude):
            skipped[name] = "float layer or excluded"
            continue
        if module.in_features % 4:
            skipped[name] = f"{module.in_features} input features are not a multiple of 4"
            continue
        weight = module.weight.data
        sparse = prune_2_4(weight.float()).to(weight.dtype)
        error[name] = round(float((sparse.float() - weight.float()).norm() / weight.float().norm()), 5)
        module.weight.data = sparse
        pruned.append(name)
    if not pruned:
        raise ValueError("sparse_2_4 found no Linear inside the transformer blocks to prune")
    return TransformResult(
        modules={},
        record={
            "pattern": "2:4 along input features, magnitude",
            "layers": pruned,
            "skipped": skipped,
            "weight_rel_l2": error,
            "mean_weight_rel_l2": round(sum(error.values()) / len(error), 5),
        },
    )


@register_plan(Sparse24Config)
def plan_sparse_2_4(ctx: TransformContext, config: Sparse24Config) -> list[Phase]:
    return []  # pruning reads the weights only
