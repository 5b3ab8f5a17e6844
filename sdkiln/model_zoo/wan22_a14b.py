"""Wan2.2-T2V-A14B: Wan's DiT twice, two experts of one width switched at a timestep boundary.

``WanPipeline`` holds two ``WanTransformer3DModel``s of Wan2.1-14B's width (40 heads of 128, FFN 13824):
``transformer``, the high-noise expert, runs every step whose timestep is at least ``boundary_ratio``
times the scheduler's ``num_train_timesteps`` (0.875 for text-to-video), and ``transformer_2``, the
low-noise expert, runs the steps below it, with guidance ``guidance_scale_2``. A directory of this
family sets both ``transformer_2`` and ``boundary_ratio`` in its model_index.json (``layout``); a
``WanPipeline`` that sets neither is Wan's (``wan.py``).

Each expert is its own model (``ModelSpec.experts``): every recipe step runs on ``transformer``, then
on ``transformer_2``, each seeing only the steps its pipeline calls it on, so calibration statistics,
the quant-auto mix and the cache schedule of an expert come from the steps it runs (per-step scales,
W8A8_TIMESTEP, need every step of the run and are refused on an expert). The package holds both
(``transformer/`` and ``transformer_2/``, the second's sections under ``experts`` in the manifest:
docs/package-format.md) and ``sdkiln.load`` restores both.

The blocks, attention sites, token grid and sequence-parallel plan are Wan's (the same class).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from sdkiln.model_zoo.spec import Variant
from sdkiln.model_zoo.wan import SPEC as WAN_SPEC
from sdkiln.model_zoo.wan import tiny as wan_tiny

if TYPE_CHECKING:
    import torch
    from diffusers import WanPipeline

_SEED_2 = 1
TINY_BOUNDARY = 0.75
"""At the tiny builds' 8 steps (timesteps 1000, 948, 883, 801, 694, 548, 338, 9) each expert runs four."""


def second_expert(transformer: torch.nn.Module) -> torch.nn.Module:
    """A copy of the test build's ``transformer`` with other random weights (each parameter plus
    noise of std 0.02, seeded), for the low-noise expert: the same size, its own quantization scales
    and cache schedule."""
    import copy

    import torch

    expert = copy.deepcopy(transformer)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(_SEED_2)
        for param in expert.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return expert


def tiny() -> WanPipeline:
    """Wan's test build (``wan.tiny``) with a second expert of the same size and other random weights,
    switched at ``boundary_ratio`` 0.75: ``transformer`` runs steps 0-3 of 8, ``transformer_2`` steps 4-7."""
    base = wan_tiny()
    return type(base)(
        **{k: v for k, v in base.components.items() if k != "transformer_2"},
        transformer_2=second_expert(base.transformer),
        boundary_ratio=TINY_BOUNDARY,
    )


_PARALLEL = (
    "the parallel runtime places one transformer on the device mesh; the low-noise expert would run on "
    "one device (run Wan2.2-A14B on one device)"
)
_EXPORT = "the {} export writes one transformer, and Wan2.2-A14B has two"

WAN22_A14B_VARIANTS = (
    Variant(
        "Wan2.2-T2V-A14B",
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers, 720p (two experts of Wan2.1-14B's width, boundary 0.875)",
        match={
            "in_channels": 16,
            "attention_head_dim": 128,
            "text_dim": 4096,
            "num_attention_heads": 40,
            "ffn_dim": 13824,
        },
        call_defaults={
            "num_inference_steps": 40,
            "guidance_scale": 4.0,
            "guidance_scale_2": 3.0,
            "height": 720,
            "width": 1280,
            "num_frames": 81,
            "max_sequence_length": 512,
            "output_type": "np",
        },
        sparse_block_size=128,
    ),
    Variant(
        "tiny",
        "the test build (tiny() above): Wan's, twice, boundary 0.75, 8 steps (4 per expert)",
        match=dict(next(v for v in WAN_SPEC.variants if v.name == "tiny").match),
        call_defaults={**WAN_SPEC.call_defaults, "num_inference_steps": 8, "guidance_scale_2": 4.0},
        sparse_block_size=16,
    ),
)

SPEC = dataclasses.replace(
    WAN_SPEC,
    name="wan2.2-a14b-tiny",
    family="wan2.2-a14b",
    description="Wan2.2-A14B text-to-video (two experts) at test size with random weights",
    build=tiny,
    variants=WAN22_A14B_VARIANTS,
    unsupported_layout={},
    experts=("transformer_2",),
    layout=("transformer_2", "boundary_ratio"),
    refusals={
        "cfg-parallel": _PARALLEL,
        "ulysses": _PARALLEL,
        "ring": _PARALLEL,
        "ascend": _EXPORT.format("Ascend (MindIE SD)"),
        "onnx": _EXPORT.format("ONNX"),
    },
).resolve("tiny")
