"""The parallel runtime on CPU: gloo, forked processes, several layouts per launch.

Every case loads a package with a ``ParallelConfig`` in each of the ranks and generates the final
latents of one prompt and seed; rank 0's are compared with one process's plain ``sdkiln.load`` run,
and every rank's with rank 0's (the latents must stay identical on all ranks). Two tolerances,
stated once: layouts that are exact by construction (CFG parallel; Ulysses with the text
replicated) must be bit-identical (``torch.equal``); the others (ring attention, split text, padded
sequences) must stay within a relative error of 1e-6 in fp32, as an SQNR of at least 120 dB over the
final latents (``sdkiln.metrics.sqnr_db``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import sdkiln
from sdkiln.configs import (
    AttentionQuantConfig,
    CacheAutoConfig,
    CompileConfig,
    Deployment,
    ParallelConfig,
    RecipeConfig,
    SparseAttentionConfig,
    W8A8DynamicConfig,
)
from sdkiln.errors import ParallelError
from sdkiln.runtime.parallel import layouts

sys.path.insert(0, str(Path(__file__).parent))
from parallel_harness import CLOSE_DB, EXACT, HANG_S, check, free_port, generate, launch  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "schema1_flux_tiny" / "package"


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict[str, Path]:
    """Float packages of the four families, a quantized + cached package with a guard, and the
    schema-1 fixture (every scheme and a cache schedule)."""
    root = tmp_path_factory.mktemp("parallel")
    out = {"fixture": FIXTURE}
    for name in ("fmnist-flux", "flux-tiny", "wan-tiny", "sd3-tiny"):
        sdkiln.optimize(name, "none", root / name, eval_samples=0)
        out[name] = root / name
    sdkiln.optimize("flux-tiny", "w8a8-dynamic+cache-safe", root / "guarded", eval_samples=0)
    out["guarded"] = root / "guarded"
    cache = CacheAutoConfig(
        psnr_floor_db=20.0, psnr_p5_floor_db=15.0, calib_samples=1, eval_samples=1, budgets=2, refine=0
    )
    sparse = [W8A8DynamicConfig(), SparseAttentionConfig(sparsity=0.6, dense_steps=1, calib_samples=1), cache]
    recipe = RecipeConfig("sparse", sparse, Deployment(num_inference_steps=8))
    with pytest.warns(UserWarning, match="no plan reached"):  # a fixed plan, whatever its quality
        sdkiln.optimize("fmnist-flux", recipe, root / "sparse", eval_samples=0)
    out["sparse"] = root / "sparse"
    # quantized attention: on FLUX's joint attention (replicated text), and with a sparse plan on Wan
    # (whose attn2 attends the text: context keys, computed on each rank's own queries)
    steps4 = Deployment(num_inference_steps=4)
    attn = AttentionQuantConfig(calib_samples=1, sqnr_floor_db=20.0)
    recipe = RecipeConfig("attn", [W8A8DynamicConfig(), attn], steps4)
    sdkiln.optimize("flux-tiny", recipe, root / "attn", eval_samples=0)
    sparse_attn = [attn, SparseAttentionConfig(sparsity=0.5, dense_steps=1, calib_samples=1)]
    sdkiln.optimize(
        "wan-tiny", RecipeConfig("attn-sparse", sparse_attn, steps4), root / "attn-wan", eval_samples=0
    )
    mindie = AttentionQuantConfig(qk="fp8", pv="fp8", layout="mindie", calib_samples=1, sqnr_floor_db=20.0)
    sdkiln.optimize(
        "flux-tiny", RecipeConfig("attn-mindie", [mindie], steps4), root / "attn-mindie", eval_samples=0
    )
    out["attn"], out["attn-wan"], out["attn-mindie"] = root / "attn", root / "attn-wan", root / "attn-mindie"
    out["lora"] = _flux_tiny_lora(root / "lora.safetensors")
    return out


def _flux_tiny_lora(path: Path) -> Path:
    """A LoRA on flux-tiny's attention projections, its single blocks' MLP, its modulations and the
    output projection, where Ulysses gathers the sequence."""
    from safetensors.torch import save_file

    from sdkiln.model_zoo import get_spec

    g, state = torch.Generator().manual_seed(0), {}
    for name, module in get_spec("flux-tiny").build().transformer.named_modules():
        if name.endswith(("attn.to_q", "attn.to_out.0", "proj_mlp", "norm1.linear")) or name == "proj_out":
            k, n = module.in_features, module.out_features
            state[f"transformer.{name}.lora_A.weight"] = torch.randn(4, k, generator=g) / k**0.5
            state[f"transformer.{name}.lora_B.weight"] = torch.randn(n, 4, generator=g)
    save_file(state, path)
    return path


def test_two_ranks_cfg_ulysses_ring_and_split_text_match_one_device(packages):
    """CFG parallel and replicated-text Ulysses bit for bit, on FLUX, Wan, the embedded model and a
    quantized + cached package (with a guard; also with its blocks compiled: dynamo's eager backend
    checks that the hooks and CFG parallel's exchange run right around compiled code); ring, split
    text and padded sequences (81 FLUX tokens, 18 Wan tokens over 2 ranks) within 1e-6."""
    cfg, uly, ring = ParallelConfig(cfg=2), ParallelConfig(ulysses=2), ParallelConfig(ring=2)
    odd_flux, odd_wan = {"height": 36, "width": 36}, {"height": 48, "width": 48}
    check(
        2,
        [
            (packages["fmnist-flux"], cfg, None, EXACT),
            (packages["fmnist-flux"], uly, None, EXACT),
            (packages["fmnist-flux"], ring, None, CLOSE_DB),
            (packages["flux-tiny"], cfg, None, EXACT),
            (packages["flux-tiny"], uly, None, EXACT),
            (packages["flux-tiny"], ring, None, CLOSE_DB),
            (packages["flux-tiny"], ParallelConfig(ulysses=2, split_text=True), None, CLOSE_DB),
            (packages["flux-tiny"], uly, odd_flux, CLOSE_DB),
            (packages["wan-tiny"], cfg, None, EXACT),
            (packages["sd3-tiny"], cfg, None, CLOSE_DB),  # SD3 batches both branches: the batch is halved
            (packages["wan-tiny"], uly, None, EXACT),
            (packages["wan-tiny"], ring, odd_wan, CLOSE_DB),
            (packages["fixture"], uly, None, EXACT),
            (packages["fixture"], cfg, None, EXACT),
            (packages["guarded"], uly, None, EXACT),
            (packages["guarded"], cfg, None, EXACT),
            (packages["guarded"], cfg, None, EXACT, CompileConfig(backend="eager", regional=True)),
            (packages["sparse"], uly, None, EXACT),  # block-sparse attention: each rank its heads' plan
            (packages["sparse"], cfg, None, EXACT),
            (packages["attn"], uly, None, EXACT),  # quantized attention: each rank its heads, every key
            (packages["attn"], cfg, None, EXACT),
            (packages["attn-wan"], uly, None, EXACT),  # with a sparse plan; attn2 on local queries
            (packages["attn-wan"], uly, odd_wan, EXACT),  # padded: on the real queries only
            (packages["attn-mindie"], uly, None, EXACT),  # MindIE SD's FP8 blocks of 128 queries
            (packages["attn-mindie"], uly, odd_flux, EXACT),
        ],
    )


def test_a_lora_runs_under_cfg_parallel_and_ulysses_as_on_one_device(packages):
    """The branch (``runtime.lora``) on a quantized + cached package, output projection included
    (where Ulysses gathers the sequence: the branch must run on this rank's tokens, inside the gather)."""
    lora = {"_lora": packages["lora"]}
    with_lora, _ = generate(packages["guarded"], None, lora)
    assert not np.array_equal(with_lora, generate(packages["guarded"], None)[0])  # the LoRA shows
    check(
        2,
        [
            (packages["guarded"], ParallelConfig(cfg=2), lora, EXACT),
            (packages["guarded"], ParallelConfig(ulysses=2), lora, EXACT),
        ],
    )


def test_residency_plans_run_under_cfg_parallel_and_ulysses_as_in_one_process(packages):
    """Memory plans (``runtime.memory``) on each rank: the text encoders and the VAE visiting and the
    blocks streamed, on a quantized + cached package with a LoRA, as one process with the same plan
    (which equals the resident run: ``test_memory.py``, and here)."""
    streamed, _ = generate(packages["guarded"], None, {"_memory": "blocks:1"})
    assert np.array_equal(streamed, generate(packages["guarded"], None)[0])
    check(
        2,
        [
            (
                packages["guarded"],
                ParallelConfig(cfg=2),
                {"_memory": "blocks:2", "_lora": packages["lora"]},
                EXACT,
            ),
            (packages["guarded"], ParallelConfig(ulysses=2), {"_memory": "blocks:1"}, EXACT),
        ],
    )


def test_four_ranks_compose_cfg_with_ulysses_and_ulysses_with_ring(packages):
    check(
        4,
        [
            (packages["flux-tiny"], ParallelConfig(cfg=2, ulysses=2), None, EXACT),
            (packages["guarded"], ParallelConfig(cfg=2, ulysses=2), None, EXACT),
            (packages["flux-tiny"], ParallelConfig(ulysses=2, ring=2), {"height": 36, "width": 36}, CLOSE_DB),
            (packages["wan-tiny"], ParallelConfig(ulysses=2, ring=2), {"height": 48, "width": 48}, CLOSE_DB),
            (packages["fmnist-flux"], ParallelConfig(cfg=2, ring=2), None, CLOSE_DB),
            (packages["sparse"], ParallelConfig(cfg=2, ulysses=2), None, EXACT),
        ],
    )


@pytest.mark.parametrize(("how", "timeout_s", "within_s"), [("exit", 30.0, 12.0), ("hang", 3.0, 12.0)])
def test_a_rank_that_dies_or_hangs_makes_the_others_fail_with_one_error(packages, how, timeout_s, within_s):
    """Rank 1 exits, or stops answering, at denoising step 1; rank 0 raises one ParallelError: at
    once for a peer that is gone (well before the 30 s timeout), after the 3 s timeout for one that
    hangs (well before the hanging rank comes back after HANG_S and exits), and never waits forever."""
    start = time.monotonic()
    config = ParallelConfig(ulysses=2, timeout_s=timeout_s)
    results = launch(2, [(packages["flux-tiny"], config, None, (how, 1), None)], timeout=90.0)
    assert list(results) == [0]
    [(status, (message, when))] = results[0]
    assert status == "ParallelError", message
    assert message.startswith("rank 0: a collective with the other ranks failed")
    assert when - start < min(within_s, timeout_s if how == "exit" else HANG_S)


def test_layouts_that_do_not_fit_the_launch_or_the_model_are_refused_clearly(packages):
    with pytest.raises(ParallelError, match="not launched by torchrun: launch torchrun --nproc-per-node 2"):
        sdkiln.load(packages["flux-tiny"], device="cpu", parallel=ParallelConfig(cfg=2))
    with pytest.raises(
        ParallelError,
        match="ulysses 3 does not divide the 4 attention heads.*allowed Ulysses degrees: 1, 2, 4",
    ):
        sdkiln.load(packages["flux-tiny"], device="cpu", parallel=ParallelConfig(ulysses=3))
    with pytest.raises(ParallelError, match="compile with ulysses 2 x ring 1 is not supported yet"):
        sdkiln.load(
            packages["flux-tiny"], device="cpu", parallel=ParallelConfig(ulysses=2), compile=CompileConfig()
        )
    with pytest.raises(
        ParallelError, match="block-sparse attention, which runs under Ulysses.*not under ring"
    ):
        sdkiln.load(packages["sparse"], device="cpu", parallel=ParallelConfig(ring=2))
    with pytest.raises(ParallelError, match="quantized attention, which runs under Ulysses.*not under ring"):
        sdkiln.load(packages["attn"], device="cpu", parallel=ParallelConfig(ring=2))
    with pytest.raises(ParallelError, match="quantized attention.*drop --split-text"):
        sdkiln.load(packages["attn"], device="cpu", parallel=ParallelConfig(ulysses=2, split_text=True))
    assert layouts(4) == [
        "--ring 4", "--ulysses 2 --ring 2", "--ulysses 4", "--cfg-parallel --ring 2", "--cfg-parallel --ulysses 2",
    ]  # fmt: skip


def test_world_size_one_runs_the_same_hooks_and_matches_plain_loading(packages):
    pipe = sdkiln.load(packages["flux-tiny"], device="cpu", parallel=ParallelConfig())
    assert pipe.transformer._diffusers_hook.get_hook("sdkiln_parallel") is not None
    assert not torch.distributed.is_initialized()
    got, _ = generate(packages["flux-tiny"], ParallelConfig())
    want, _ = generate(packages["flux-tiny"], None)
    assert np.array_equal(got, want)


def _sdkiln(*args: str, nproc: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nproc is None:
        cmd = [sys.executable, "-m", "sdkiln", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-port",
               str(free_port()), "-m", "sdkiln", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)


TORCHRUN = [
    ("fmnist-flux", ["--cfg-parallel"], "cfg 2 x ulysses 1 x ring 1", EXACT),
    ("flux-tiny", ["--ulysses", "2"], "cfg 1 x ulysses 2 x ring 1", EXACT),
    ("wan-tiny", ["--ulysses", "2"], "cfg 1 x ulysses 2 x ring 1", EXACT),
    ("flux-tiny", ["--ring", "2"], "cfg 1 x ulysses 1 x ring 2", CLOSE_DB),
]


@pytest.mark.parametrize(
    "model, flags, layout, tolerance",
    # the CFG layout on the embedded model is make test's fast twin; the others run under make test-all
    [
        pytest.param(*case, id=f"{case[0]}{''.join(case[1])}", marks=[pytest.mark.slow] * (i > 0))
        for i, case in enumerate(TORCHRUN)
    ],
)
def test_torchrun_writes_the_single_process_image(packages, tmp_path, model, flags, layout, tolerance):
    """The acceptance commands: ``torchrun --nproc-per-node 2 -m sdkiln run PKG ...`` writes one image
    (rank 0), byte-identical to the single-process one (``cmp``) for CFG parallel on the embedded
    model and Ulysses on FLUX and Wan; for ring, whose latents agree within 1e-6, the 8-bit pixels
    may differ by at most one level where a value sits on a rounding boundary."""
    from PIL import Image

    pkg, one, two = str(packages[model]), tmp_path / "one.png", tmp_path / "two.png"
    single = _sdkiln("run", pkg, "--prompt", "a shirt", "--steps", "6", "--out", str(one))
    assert single.returncode == 0, single.stderr[-2000:]
    launched = _sdkiln("run", pkg, "--prompt", "a shirt", "--steps", "6", *flags, "--out", str(two), nproc=2)
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert f"2 ranks: {layout}" in launched.stdout and launched.stdout.count(".png") == 1, launched.stdout
    if tolerance == EXACT:
        assert one.read_bytes() == two.read_bytes(), f"{model} {flags}: the images differ"
    else:
        a, b = (np.asarray(Image.open(p), dtype=np.int16) for p in (one, two))
        assert np.abs(a - b).max() <= 1, f"{model} {flags}: pixels differ by {np.abs(a - b).max()}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.png", "two.png"]  # rank 1 wrote nothing
    shutil.rmtree(tmp_path)


def test_sdkiln_run_refuses_a_layout_larger_than_its_ranks(packages):
    wrong = _sdkiln("run", str(packages["flux-tiny"]), "--prompt", "a shirt", "--ulysses", "2")
    assert wrong.returncode == 2
    assert (
        wrong.stderr.strip().splitlines()[-1].startswith("sdkiln: error: cfg 1 x ulysses 2 x ring 1 needs 2")
    )


def test_family_plans_are_diffusers_cp_plans_with_the_text_kept_whole():
    """The specs' plans track diffusers': FLUX's is its ``_cp_plan`` without the text splits, Wan's
    is its ``_cp_plan`` (whose text is cross-attention keys only)."""
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    from sdkiln.model_zoo import get_spec
    from sdkiln.runtime.parallel.sharding import to_diffusers_plan

    def plain(plan):
        return {
            module: {k: (v.split_dim, v.expected_dims, v.split_output) for k, v in entry.items()}
            if isinstance(entry, dict)
            else (entry.gather_dim, entry.expected_dims)
            for module, entry in plan.items()
        }

    flux = plain(FluxTransformer2DModel._cp_plan)
    for text in ("encoder_hidden_states", "txt_ids"):
        del flux[""][text]
    for name, want in (
        ("flux-tiny", flux),
        ("fmnist-flux", flux),
        ("wan-tiny", plain(WanTransformer3DModel._cp_plan)),
    ):
        assert plain(to_diffusers_plan(get_spec(name).parallel_plan)[0]) == want, name
