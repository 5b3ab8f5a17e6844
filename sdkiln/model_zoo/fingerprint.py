"""A model's identity: a hash of its transformer config and one of its weights.

Packages record the base model's fingerprint so that ``sdkiln eval`` (and later, cache schedules)
can refuse a base model that is not the one the package was made from.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn


def config_hash(config: dict[str, Any]) -> str:
    public = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    return hashlib.sha256(json.dumps(public, sort_keys=True, default=str).encode()).hexdigest()


def weights_hash(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def fingerprint(transformer: nn.Module) -> dict[str, str]:
    return {"config_hash": config_hash(transformer.config), "weights_hash": weights_hash(transformer)}
