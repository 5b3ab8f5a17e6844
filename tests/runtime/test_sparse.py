"""Block-sparse attention at run time: the tiling, the block selection, the plan and its package
section, sparsity 0 against dense attention, and a quantized + cached + sparse package loaded.

Tolerances, stated once: permutations and the package round trip are exact (``torch.equal``); a
plan at sparsity 0 computes dense attention in another order of summation, so its images stay
within float rounding of the unrouted model (PSNR >= ROUNDING_MIN_PSNR_DB, as the attention seam's
routed-vs-unrouted test).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

import sdkiln
from sdkiln import metrics
from sdkiln.configs import CacheAutoConfig, CompileConfig, Deployment, RecipeConfig, SparseAttentionConfig
from sdkiln.configs.quant import W8A8DynamicConfig
from sdkiln.errors import PackageError, SdkilnError
from sdkiln.model_zoo import get_spec
from sdkiln.model_zoo.fingerprint import config_hash
from sdkiln.model_zoo.spec import TokenGrid
from sdkiln.optimizer.evaluate import generate
from sdkiln.runtime.cache import cache_runner
from sdkiln.runtime.sparse import (
    PLAN_FILE,
    SparseAttentionPlan,
    attach_sparse_attention,
    detach_sparse_attention,
    sparse_attention_of,
)
from sdkiln.runtime.sparse.selection import pool_blocks, select_blocks
from sdkiln.runtime.sparse.tiling import default_tile, tile_order, token_coords

ROUNDING_MIN_PSNR_DB = 60.0


def grid_coords(frames: int, rows: int, cols: int) -> torch.Tensor:
    f, r, c = torch.meshgrid(torch.arange(frames), torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack([f, r, c], -1).reshape(-1, 3)


@pytest.mark.parametrize(
    "shape, tile", [((1, 16, 16), (1, 4, 4)), ((5, 12, 10), (2, 4, 4)), ((3, 7, 9), (1, 8, 8))]
)
def test_the_tiling_is_a_permutation_whose_inverse_is_exact_and_whose_blocks_are_tiles(shape, tile):
    coords = grid_coords(*shape)
    shuffled = coords[torch.randperm(len(coords), generator=torch.Generator().manual_seed(0))]
    for c in (coords, shuffled):
        tiling = tile_order(c, tile, first_frame_dense=True)
        assert torch.equal(tiling.order.sort().values, torch.arange(len(c)))
        x = torch.randn(len(c), 5)
        assert torch.equal(x[tiling.order][tiling.inverse], x)
        first = shape[0] > 1
        assert tiling.first_frame == (shape[1] * shape[2] if first else 0)
        assert bool((c[tiling.order][: tiling.first_frame, 0] == 0).all())
    if shape == (1, 16, 16):  # whole tiles: each block of 16 consecutive tokens is one 4x4 square
        blocks = coords[tile_order(coords, tile, True).order].reshape(16, 16, 3)
        for block in blocks:
            assert (
                int(block[:, 1].max() - block[:, 1].min()) == 3
                and int(block[:, 2].max() - block[:, 2].min()) == 3
            )


def test_token_coordinates_from_ids_and_from_latents():
    ids = torch.zeros(6, 3)
    ids[:, 1], ids[:, 2] = torch.arange(6) // 3, torch.arange(6) % 3
    assert torch.equal(token_coords(TokenGrid("img_ids", "ids"), ids), grid_coords(1, 2, 3))
    latents = torch.zeros(1, 16, 3, 8, 12)
    assert torch.equal(
        token_coords(TokenGrid("hidden_states", "latents", (1, 2, 2)), latents), grid_coords(3, 4, 6)
    )
    with pytest.raises(SdkilnError, match="latents must be"):
        token_coords(TokenGrid("hidden_states", "latents"), torch.zeros(2, 3))
    assert (
        default_tile(64, 1) == (1, 8, 8)
        and default_tile(64, 21) == (4, 4, 4)
        and default_tile(16, 1) == (1, 4, 4)
    )


def test_selection_keeps_text_and_first_frame_dense_and_the_budget_per_head():
    torch.manual_seed(0)
    b, s, h, d, bs = 2, 100, 4, 8, 10
    q, k = torch.randn(b, s, h, d), torch.randn(b, s, h, d)
    n = 10
    dense = torch.zeros(n, dtype=torch.bool)
    dense[[0, 3]] = True  # a text block and a first-frame block
    values = torch.tensor([0.0, 0.5, 0.8, 0.9])
    kept = select_blocks(q, k, values, bs, "topk", dense, dense)
    assert kept.dtype == torch.int32 and kept.shape[:3] == (b, h, n)
    for hi, sparsity in enumerate(values.tolist()):
        budget = max(math.ceil((1 - sparsity) * n - 1e-6), 3)  # diagonal + the two dense key blocks
        for qb in range(n):
            row = set(kept[:, hi, qb].flatten().tolist()) - {-1}
            counts = (kept[:, hi, qb] >= 0).sum(-1)
            if dense[qb]:
                assert counts.tolist() == [n, n]  # a dense query block keeps every key block
            else:
                assert counts.tolist() == [budget, budget] and {0, 3, qb} <= row
    assert bool((pool_blocks(q, bs) - q.transpose(1, 2).reshape(b, h, n, bs, d).mean(3)).abs().max() < 1e-6)
    mass = select_blocks(
        q,
        k,
        torch.full((h,), 0.5),
        bs,
        "mass",
        torch.zeros(n, dtype=torch.bool),
        torch.zeros(n, dtype=torch.bool),
    )
    probs = torch.softmax(pool_blocks(q, bs) @ pool_blocks(k, bs).transpose(-1, -2) / math.sqrt(d), -1)
    got = torch.where(mass >= 0, probs.gather(-1, mass.long().clamp(min=0)), 0.0).sum(-1)
    assert bool((got >= 0.5 - 1e-5).all())  # the kept blocks reach the mass


def _plan(spec, transformer, value: float, **kw) -> SparseAttentionPlan:
    names = [n for n, m in transformer.named_modules() if n.endswith(".attn")]
    return SparseAttentionPlan(
        spec.sparse_block_size,
        (1, 4, 4),
        {n: [value] for n in names},
        config_hash=config_hash(transformer.config),
        **kw,
    )


def test_the_plan_round_trips_and_refuses_bad_data():
    plan = SparseAttentionPlan(
        64, (4, 4, 4), {"blocks.0.attn1": [0.5, 0.9]}, dense_steps=2, mask_reuse=3, config_hash="x"
    )
    again = SparseAttentionPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and again.head_groups == 2
    for bad, match in [
        ({"version": 2}, "version"),
        ({"block_size": 0}, "block_size"),
        ({"tile": [4, 4]}, "tile"),
        ({"layers": {"a": [1.0]}}, "sparsity in"),
        ({"layers": {"a": [0.5], "b": [0.5, 0.5]}}, "same number of groups"),
        ({"selection": "random"}, "selection"),
        ({"mask_reuse": 0}, "mask_reuse"),
        ({"extra": 1}, "unknown field"),
    ]:
        with pytest.raises(PackageError, match=match):
            SparseAttentionPlan.from_dict(plan.to_dict() | bad)


def test_sparsity_zero_is_dense_attention_and_high_sparsity_is_not():
    spec = get_spec("fmnist-flux")
    pipe = spec.build()
    call = spec.call_kwargs(num_inference_steps=6)
    dense, _ = generate(pipe, call, ["a red shirt"], [0])
    attach_sparse_attention(pipe, spec, _plan(spec, pipe.transformer, 0.0))
    sparse = sparse_attention_of(pipe.transformer)
    zero, _ = generate(pipe, call, ["a red shirt"], [0])
    assert sparse.stats["sparse_calls"] == 6 * 2 * 6 and sparse.computed_fraction() == 1.0
    detach_sparse_attention(pipe.transformer)
    assert sparse_attention_of(pipe.transformer) is None
    assert metrics.psnr(dense, zero).min() >= ROUNDING_MIN_PSNR_DB
    attach_sparse_attention(pipe, spec, _plan(spec, pipe.transformer, 0.8, dense_steps=2, mask_reuse=2))
    sparse = sparse_attention_of(pipe.transformer)
    eighty, _ = generate(pipe, call, ["a red shirt"], [0])
    detach_sparse_attention(pipe.transformer)
    assert sparse.stats["dense_calls"] == 2 * 2 * 6 and sparse.stats["sparse_calls"] == 4 * 2 * 6
    assert sparse.stats["selections"] == 2 * 2 * 6  # reused every other step, per layer and branch
    assert 2 / 6 < sparse.computed_fraction() < (2 + 4 * 0.45) / 6  # dense steps count whole
    assert metrics.psnr(dense, eighty).mean() < ROUNDING_MIN_PSNR_DB


def test_a_video_first_frame_stays_dense_and_cross_attention_is_not_sparse():
    spec = get_spec("wan-tiny")
    pipe = spec.build()
    call = spec.call_kwargs(num_frames=9, height=64, width=64)  # 3 latent frames of 4x4 tokens
    plan = SparseAttentionPlan(
        16, (2, 4, 4), {"blocks.0.attn1": [0.9], "blocks.1.attn1": [0.9]}, config_hash=""
    )
    sparse = attach_sparse_attention(pipe, spec, plan)
    seen = []
    compute = sparse.compute
    sparse.compute = lambda call, layout, values, kept=None: (
        seen.append(layout) or compute(call, layout, values, kept)
    )
    generate(pipe, call, ["a cat"], [0])
    detach_sparse_attention(pipe.transformer)
    assert seen and all(layout.dense.tolist() == [True, False, False] for layout in seen)  # frame 0: block 0
    assert sparse.stats["dense_calls"] == sparse.stats["sparse_calls"]  # attn2 (text keys) ran dense


@pytest.fixture(scope="module")
def sparse_package(tmp_path_factory):
    """The embedded model (256 image tokens in 16 blocks, and its text), w8a8-dynamic, uniform sparse
    attention at 0.6 from the second step, and a cache schedule searched on top of it."""
    out = tmp_path_factory.mktemp("sparse") / "pkg"
    cache = CacheAutoConfig(
        psnr_floor_db=20.0, psnr_p5_floor_db=15.0, calib_samples=1, eval_samples=1, budgets=2, refine=0
    )
    recipe = RecipeConfig(
        "w8a8-dynamic+sparse-attn+cache",
        [W8A8DynamicConfig(), SparseAttentionConfig(sparsity=0.6, dense_steps=1, calib_samples=1), cache],
        Deployment(num_inference_steps=6),
    )
    result = sdkiln.optimize("fmnist-flux", recipe, out, eval_samples=0)
    return result, out


def test_a_quantized_cached_sparse_package_round_trips(sparse_package):
    result, path = sparse_package
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["sparse_attention"] == {"file": PLAN_FILE} and "cache_schedule" in manifest
    assert {e["scheme"] for e in manifest["modules"].values()} == {"W8A8_DYNAMIC"}
    plan = SparseAttentionPlan.from_dict(json.loads((path / PLAN_FILE).read_text()))
    assert plan.dense_steps == 1 and set(plan.layers) == {
        n for n, m in result.pipeline.transformer.named_modules() if n.endswith(".attn")
    }
    pipe = sdkiln.load(path, device="cpu")
    call = {**pipe.sdkiln_manifest["call"]["defaults"], "output_type": "latent"}
    run = lambda p: p(prompt="a red shirt", generator=torch.Generator().manual_seed(3), **call).images  # noqa: E731
    made, loaded = run(result.pipeline), run(pipe)
    assert torch.equal(made, loaded)
    sparse = sparse_attention_of(pipe.transformer)
    assert sparse.stats["sparse_calls"] > 0 and sparse.stats["dense_calls"] > 0
    assert cache_runner(pipe.transformer) is not None and cache_runner(pipe.transformer).block_evaluations > 0


def test_a_bad_plan_in_a_package_is_refused_and_compile_is_refused(sparse_package, tmp_path, rehash):
    _, path = sparse_package
    with pytest.raises(SdkilnError, match="compile with block-sparse attention is not supported"):
        sdkiln.load(path, device="cpu", compile=CompileConfig(backend="eager"))
    for change, match in [
        (lambda p: p | {"config_hash": "0" * 64}, "another transformer config"),
        (lambda p: p | {"layers": {"transformer_blocks.9.attn": [0.5]}}, "not a routed attention module"),
        (
            lambda p: p | {"layers": {"transformer_blocks.0.attn": [0.5, 0.5, 0.5]}},
            "3 head groups do not divide",
        ),
    ]:
        bad = tmp_path / f"bad{len(match)}"
        shutil.copytree(path, bad)
        plan = json.loads((bad / PLAN_FILE).read_text())
        (bad / PLAN_FILE).write_text(json.dumps(change(plan)))
        rehash(bad, PLAN_FILE)
        with pytest.raises(PackageError, match=match):
            sdkiln.load(bad, device="cpu")
