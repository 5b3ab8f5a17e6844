"""The residency planner on real models' sizes: FLUX.1-dev, Wan2.1-T2V-14B and HunyuanVideo, from their
published configs built on the meta device (``tools/random_model.py``), nothing allocated.

Sizes as a package holds them: every floating tensor in bf16; for the W8A8 package, every ``nn.Linear``
weight inside the transformer's block lists in int8 plus one fp32 scale per output channel; with
``te-w8a16`` too, every ``nn.Linear`` weight of the text encoders the same way. The expected plans are
the table in ``docs/memory.md``: a change of the planner's arithmetic or of the activation estimate
shows here first."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import random_model as rm  # noqa: E402

from sdkiln.errors import SdkilnError  # noqa: E402
from sdkiln.model_zoo import get_spec  # noqa: E402
from sdkiln.runtime.memory import plan  # noqa: E402
from sdkiln.runtime.memory.sizes import block_lists, sizes_from  # noqa: E402

GIB = 2**30
BUDGETS = (8, 16, 24, 48, 80)
MODELS = {  # variant: (family, deployment call)
    "flux-dev": ("flux", {"height": 1024, "width": 1024, "max_sequence_length": 512}),
    "wan2.1-t2v-14b": ("wan", {"height": 480, "width": 832, "num_frames": 81, "max_sequence_length": 512}),
    "hunyuan-video": (
        "hunyuan-video",
        {"height": 720, "width": 1280, "num_frames": 129, "max_sequence_length": 256},
    ),
}
MODES = ("bf16", "W8A8", "W8A8+te-w8a16")
EXPECTED = {  # (variant, mode): the plan per budget, None where refused
    ("flux-dev", "bf16"): [None, "blocks:4", "blocks:4", "resident", "resident"],
    ("flux-dev", "W8A8"): [None, "blocks:4", "encoders", "resident", "resident"],
    ("flux-dev", "W8A8+te-w8a16"): ["blocks:4", "blocks:4", "resident", "resident", "resident"],
    ("wan2.1-t2v-14b", "bf16"): [None, "blocks:4", "blocks:4", "encoders", "resident"],
    ("wan2.1-t2v-14b", "W8A8"): [None, "blocks:4", "blocks:4", "resident", "resident"],
    ("wan2.1-t2v-14b", "W8A8+te-w8a16"): [None, "blocks:4", "encoders+vae+tiled", "resident", "resident"],
    ("hunyuan-video", "bf16"): [None, None, "blocks:4", "encoders+vae+tiled", "resident"],
    ("hunyuan-video", "W8A8"): [None, None, "blocks:4", "encoders", "resident"],
    ("hunyuan-video", "W8A8+te-w8a16"): [None, "blocks:2+tiled", "blocks:4", "resident", "resident"],
}
ORDER = [
    "resident", "encoders", "encoders+vae", "encoders+vae+tiled", "blocks:4", "blocks:2", "blocks:1",
    "blocks:4+tiled", "blocks:2+tiled", "blocks:1+tiled", None,
]  # fmt: skip


def _bytes(int8_linears: set[int]):
    def count(module: nn.Module) -> int:
        total, seen = 0, set()
        for sub in module.modules():
            for name, t in [*sub._parameters.items(), *sub._buffers.items()]:
                if t is None or id(t) in seen:  # a tied weight once
                    continue
                seen.add(id(t))
                if name == "weight" and id(sub) in int8_linears:
                    total += t.numel() + 4 * t.shape[0]
                else:
                    total += t.numel() * (2 if t.is_floating_point() else t.element_size())
        return total

    return count


@pytest.fixture(scope="module")
def built() -> dict[str, dict[str, nn.Module]]:
    out = {}
    for variant in MODELS:
        out[variant] = {
            name: rm.empty_model(library, cls, config, buffers=False)
            for name, (library, cls, config) in rm.component_configs(variant).items()
            if name != "scheduler"
        }
    return out


@pytest.mark.parametrize("variant, mode", list(EXPECTED))
def test_plans_at_real_sizes(built, variant, mode):
    family, call = MODELS[variant]
    components = built[variant]
    int8 = set()
    if mode != "bf16":
        int8 = {
            id(m)
            for _, blocks in block_lists(components["transformer"])
            for m in blocks.modules()
            if isinstance(m, nn.Linear)
        }
    if mode.endswith("te-w8a16"):
        int8 |= {
            id(m)
            for name, c in components.items()
            if name.startswith("text_encoder")
            for m in c.modules()
            if isinstance(m, nn.Linear)
        }
    spec = get_spec(family)
    sizes = sizes_from(components, spec, ("transformer",), spec.call_kwargs(**call), bytes_of=_bytes(int8))
    got = []
    for budget in BUDGETS:
        try:
            got.append(plan(sizes, budget * GIB).name)
        except SdkilnError as exc:
            assert "needs about" in str(exc)
            got.append(None)
    print(variant, mode, {k: round(v / GIB, 2) for k, v in sizes.components.items()},
          "activations", round(sizes.activations / GIB, 2), "decode", round(sizes.decode_activations / GIB, 2),
          "tiled", round(sizes.decode_tiled_activations / GIB, 2), got)  # fmt: skip
    assert got == EXPECTED[(variant, mode)]
    ranks = [ORDER.index(g) for g in got]  # a larger budget never picks a slower plan
    assert ranks == sorted(ranks, reverse=True)
    assert torch.device("meta") == next(components["transformer"].parameters()).device
