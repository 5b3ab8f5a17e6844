"""A schema-1 package written before the milestone-2 restructuring still loads and runs bit for bit.

``tests/fixtures/schema1_flux_tiny/package`` was written by sdkiln at commit 4464289 from the
flux-tiny model with ``recipe.json`` beside it: every quantization scheme (W8A8_TIMESTEP behind
SmoothQuant folds and input multipliers, W8A8, W8A8_DYNAMIC, W8A16, FP8_DYNAMIC, W4A16) and a
cache schedule with skip steps. ``expected.safetensors`` holds the images and final latents that
commit's runtime generated from it (prompts and seeds in its metadata). Regenerate neither: the
point is that today's loader reads yesterday's files.
"""

from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

import sdkiln
from sdkiln.optimizer.evaluate import generate

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "schema1_flux_tiny"


def test_schema1_package_loads_and_generates_bit_identical_images():
    with safe_open(FIXTURE / "expected.safetensors", framework="pt") as fh:
        meta = fh.metadata()
        expected = {k: fh.get_tensor(k) for k in fh.keys()}
    pipe = sdkiln.load(FIXTURE / "package", device="cpu")
    assert pipe.sdkiln_manifest["schema_version"] == 1
    schemes = {m["scheme"] for m in pipe.sdkiln_manifest["modules"].values()}
    assert schemes == {"W8A8_TIMESTEP", "W8A8", "W8A8_DYNAMIC", "W8A16", "FP8_DYNAMIC", "W4A16"}
    call = dict(pipe.sdkiln_manifest["call"]["defaults"])
    prompts, seeds = meta["prompts"].split("|"), [int(s) for s in meta["seeds"].split(",")]
    images, latents = generate(pipe, call, prompts, seeds)
    assert torch.equal(latents, expected["latents"])
    assert np.array_equal(images, expected["images"].numpy())
