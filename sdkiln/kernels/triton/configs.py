"""Launch configurations: autotuned on a GPU, one fixed configuration under Triton's interpreter.

Under ``TRITON_INTERPRET=1`` (CI without a GPU) each program instance runs in numpy, autotuning
with several configurations fails, and arithmetic directly on bfloat16 values is wrong; so there
the GEMMs and attention launch one small fixed configuration and every kernel converts its inputs
to fp32 right after loading them (``FP32_DOT``). On a GPU the GEMMs autotune over the
configurations of the device's generation: Hopper (sm90) and Ampere/Ada (sm80, sm89) differ in
shared memory and in the pipeline depth that pays off. These lists are starting points; tuning them
is measured work on the GPU (docs/performance.md).
"""

from __future__ import annotations

import functools
import os

import torch
import triton

KERNEL_NAME = "triton"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Read once, at import: Triton itself reads the variable when its decorators run."""

MAX_ROW = 16384
"""The widest row a row kernel holds in registers (one program per row)."""


@functools.cache
def capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def _configs(rows: list[tuple[int, int, int, int, int]]) -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=s, num_warps=w)
        for m, n, k, s, w in rows
    ]


# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
HOPPER_INT8 = [
    (128, 256, 128, 3, 8),
    (256, 128, 128, 3, 8),
    (128, 128, 128, 4, 8),
    (128, 128, 64, 4, 4),
    (64, 128, 128, 4, 4),
    (64, 64, 128, 4, 4),
]
AMPERE_INT8 = [
    (128, 256, 64, 3, 8),
    (256, 128, 64, 3, 8),
    (128, 128, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 64, 64, 4, 4),
]
HOPPER_HALF = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (64, 128, 64, 4, 4), (16, 128, 128, 4, 4)]
AMPERE_HALF = [(128, 128, 32, 4, 4), (64, 128, 32, 4, 4), (16, 128, 64, 4, 4)]


def gemm_configs(kind: str) -> list[triton.Config]:
    """The autotune list of ``kind`` ("int8" for int8/fp8 operands, "half" for weight-only) on this
    GPU; one fixed config under the interpreter."""
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 1})]
    # without a GPU (importing the module to list its kernels) the Ampere list stands in
    hopper = capability() >= (9, 0)
    table = {
        "int8": HOPPER_INT8 if hopper else AMPERE_INT8,
        "half": HOPPER_HALF if hopper else AMPERE_HALF,
    }
    return _configs(table[kind])


def attention_config(head_dim: int, block: int | None = None) -> dict:
    """Tiles, warps and pipeline depth of the attention kernel for a head dim (<= 128) on this GPU;
    ``block`` fixes both tiles (block-sparse attention: the plan's block). Shared memory holds a
    query tile and ``num_stages`` key and value tiles: Hopper (227 KB) keeps three stages of 128x64
    tiles at d=128, Ampere/Ada (about 100 KB usable) two of 64x64."""
    if INTERPRET:
        tile = block or 16
        return {"BLOCK_M": tile, "BLOCK_N": tile, "num_warps": 1, "num_stages": 1}
    hopper = capability() >= (9, 0)
    if hopper:
        m, n, stages = 128, 64, 3
    else:
        m, n, stages = (128, 64, 2) if head_dim <= 64 else (64, 64, 2)
    if block is not None:
        m = n = block
        stages = 2 if block * head_dim >= 128 * 128 or not hopper else stages
    return {"BLOCK_M": m, "BLOCK_N": n, "num_warps": 4 if head_dim <= 64 else 8, "num_stages": stages}


def row_warps(block: int) -> int:
    """Warps for a one-row-per-program kernel over ``block`` columns."""
    if INTERPRET:
        return 1
    return 4 if block <= 1024 else 8 if block <= 4096 else 16
