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

import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

import sdkiln
from sdkiln.configs import (
    CacheAutoConfig,
    CompileConfig,
    Deployment,
    ParallelConfig,
    RecipeConfig,
    SparseAttentionConfig,
    W8A8DynamicConfig,
)
from sdkiln.errors import ParallelError
from sdkiln.metrics import sqnr_db
from sdkiln.runtime.cache import cache_runner
from sdkiln.runtime.parallel import layouts

EXACT = "equal"
CLOSE_DB = 120.0
"""A relative error of 1e-6: 20 log10(1e6) dB."""
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "schema1_flux_tiny" / "package"
PROMPT, SEED = "a photo of a cat", 3
HANG_S = 15.0
"""How long a hanging rank stops answering: longer than the others may take to give up on it."""


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
    return out


def generate(
    package: Path, parallel: ParallelConfig | None, call: dict | None = None, stop=None, compile=None
):
    """Final latents of PROMPT at SEED, and the cache guard's counters (None without a guard).
    ``stop=("exit" | "hang", step)``: this process exits there, or stops answering for HANG_S
    seconds and then exits."""
    pipe = sdkiln.load(package, device="cpu", parallel=parallel, compile=compile)
    kwargs = {**pipe.sdkiln_manifest["call"]["defaults"], **(call or {}), "output_type": "latent"}

    def die(_pipe, step, _t, tensors):
        if stop is not None and step == stop[1]:
            if stop[0] == "hang":
                time.sleep(HANG_S)
            os._exit(17)  # a rank that dies mid-run, without a word to the others
        return tensors

    out = pipe(
        prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(SEED), callback_on_step_end=die, **kwargs
    )
    latents = out.images if hasattr(out, "images") else out.frames
    runner = cache_runner(pipe.transformer)
    guard = None if runner is None or runner.guard is None else (runner.guard_checks, runner.guard_forced)
    return latents.numpy(), guard


def _worker(rank: int, world: int, port: int, cases: list, queue) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    results = []
    try:
        for package, config, call, stop, compile in cases:
            try:
                results.append(("ok", generate(package, config, call, stop if rank == 1 else None, compile)))
            except ParallelError as exc:
                results.append(("ParallelError", (str(exc), time.monotonic())))
    except BaseException:
        queue.put((rank, "crash", traceback.format_exc()))
        raise
    queue.put((rank, "done", results))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, cases: list, timeout: float = 150.0) -> dict[int, list]:
    """Run ``cases`` (package, ParallelConfig, call overrides, how and where rank 1 stops) in ``world`` forked ranks;
    each rank's results, in case order (ranks that died report nothing)."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, cases, queue)) for r in range(world)]
    for p in procs:
        p.start()
    deadline, results = time.monotonic() + timeout, {}
    # read while the ranks run: a rank's results fill the pipe, and it exits only once they are read
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, status, payload = queue.get(timeout=0.5)
        except Exception:  # queue.Empty: nothing yet
            if not any(p.is_alive() for p in procs) and queue.empty():
                break
            continue
        assert status == "done", f"rank {rank} crashed:\n{payload}"
        results[rank] = payload
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"{len(alive)} rank(s) still running after {timeout} s: a hang"
    return results


def check(world: int, cases: list[tuple]) -> None:
    """``cases``: (package, ParallelConfig, call overrides, tolerance[, CompileConfig]) -> one launch,
    then compare with one process's uncompiled run."""
    cases = [(*case, None)[:5] for case in cases]
    references = [generate(package, None, call) for package, _, call, _, _ in cases]
    results = launch(
        world, [(package, config, call, None, compile) for package, config, call, _, compile in cases]
    )
    assert sorted(results) == list(range(world))
    for i, ((package, config, call, tolerance, compile), (ref, ref_guard)) in enumerate(
        zip(cases, references, strict=True)
    ):
        where = f"{package.name} {config} {call or ''} {compile or ''}"
        outputs = [results[r][i] for r in range(world)]
        assert all(status == "ok" for status, _ in outputs), f"{where}: {outputs}"
        latents, guard = outputs[0][1]
        for _, (other, other_guard) in outputs[1:]:
            assert np.array_equal(other, latents), f"{where}: the ranks' latents differ"
            assert other_guard == guard, f"{where}: the ranks' cache guards decided differently"
        got, want = torch.from_numpy(latents), torch.from_numpy(ref)
        if tolerance == EXACT:
            assert torch.equal(got, want), f"{where}: not bit-identical (SQNR {sqnr_db(want, got):.1f} dB)"
        else:
            assert sqnr_db(want, got) >= CLOSE_DB, f"{where}: SQNR {sqnr_db(want, got):.1f} dB"
        if config.cfg == 1:  # every rank ran both branches: the guard's counts are one device's
            assert guard == ref_guard, f"{where}: guard {guard} vs one device's {ref_guard}"


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
               str(_free_port()), "-m", "sdkiln", *args]  # fmt: skip
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
