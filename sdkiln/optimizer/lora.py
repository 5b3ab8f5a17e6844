"""``optimize --lora FILE[:STRENGTH]``: LoRAs fused into the float transformer before any recipe step.

The ModelOpt way: the package is calibrated, quantized, cache-searched and measured on the model with
the LoRA in its weights, so it has the best quality a LoRA'd package can have, and no strength
control at run time (``pipe.load_lora_weights`` on a package keeps it). Each LoRA is read and
normalized as the runtime reads one (``sdkiln.runtime.lora``: diffusers' converters, safetensors
only, every key checked first) and merged into the float ``nn.Linear`` weights it targets:
``W += strength * alpha / r * B @ A``, in fp32 on the weight's device, rounded once to the weight's
dtype. The manifest records each in ``model.fused_loras`` (file name, sha256, strength, layers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdkiln.configs.runtime import LoraFile
from sdkiln.errors import SdkilnError
from sdkiln.runtime.lora import converter_for, lora_layers, read_lora
from sdkiln.runtime.package import sha256_file


def fuse_loras(pipe: Any, transformer_attr: str, loras: list[LoraFile]) -> list[dict[str, Any]]:
    """Merge each LoRA into ``pipe``'s transformer (float ``nn.Linear`` layers); what the manifest
    records of them. Every LoRA is read and checked before any weight changes."""
    transformer = getattr(pipe, transformer_attr)
    converter = converter_for(type(pipe), transformer)
    read = []
    for lora in loras:
        path = Path(lora.path)
        if not path.is_file():
            raise SdkilnError(f"--lora {path}: no such file")
        state = read_lora(path, None, converter)
        read.append((lora, path, lora_layers(state, transformer, lambda name, m: isinstance(m, nn.Linear))))
    records = []
    with torch.no_grad():
        for lora, path, layers in read:
            for layer, (a, b, alpha) in layers.items():
                weight = transformer.get_submodule(layer).weight
                rank = a.shape[0]
                scale = lora.strength * (alpha if alpha is not None else rank) / rank
                delta = (b.to(weight.device, torch.float32) @ a.to(weight.device, torch.float32)) * scale
                weight.copy_((weight.float() + delta).to(weight.dtype))
            records.append(
                {
                    "file": path.name,
                    "sha256": sha256_file(path),
                    "strength": float(lora.strength),
                    "layers": len(layers),
                }
            )
    return records
