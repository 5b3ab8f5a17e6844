"""The flux-tiny call the LoRA tests run (tests/runtime/test_lora*.py): 2 steps at 32x32, seed 0."""

from __future__ import annotations

import numpy as np
import torch


def tiny_call() -> dict:
    return dict(
        prompt="a cat",
        num_inference_steps=2,
        height=32,
        width=32,
        max_sequence_length=16,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    )


def tiny_images(pipe) -> np.ndarray:
    return pipe(**tiny_call()).images
