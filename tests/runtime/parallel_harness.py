"""Running packages on several forked CPU ranks (gloo) and comparing them with one process: the
harness of tests/runtime/test_parallel.py and the family suite (tests/families).

Two tolerances, stated once: layouts that are exact by construction (CFG parallel; Ulysses with the
text replicated) must be bit-identical (``torch.equal``); the others (ring attention, split text,
padded sequences) must stay within a relative error of 1e-6 in fp32, as an SQNR of at least 120 dB
over the final latents (``sdkiln.metrics.sqnr_db``).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
import traceback
from pathlib import Path

import numpy as np
import torch

import sdkiln
from sdkiln.calibrate.steps import on_step_end
from sdkiln.configs import MemoryConfig, ParallelConfig
from sdkiln.errors import ParallelError
from sdkiln.metrics import sqnr_db
from sdkiln.model_zoo import get_spec
from sdkiln.runtime.cache import cache_runner

EXACT = "equal"
CLOSE_DB = 120.0
"""A relative error of 1e-6: 20 log10(1e6) dB."""
PROMPT, SEED = "a photo of a cat", 3
HANG_S = 15.0
"""How long a hanging rank stops answering: longer than the others may take to give up on it."""


def generate(
    package: Path, parallel: ParallelConfig | None, call: dict | None = None, stop=None, compile=None
):
    """Final latents of PROMPT at SEED, and the cache guard's counters (None without a guard).
    ``stop=("exit" | "hang", step)``: this process exits there, or stops answering for HANG_S
    seconds and then exits."""
    call = dict(call or {})
    memory = MemoryConfig(plan=call.pop("_memory")) if "_memory" in call else None  # a residency plan
    pipe = sdkiln.load(package, device="cpu", parallel=parallel, compile=compile, memory=memory)
    if "_lora" in call:  # a LoRA file run as the branch (``pipe.load_lora_weights``), not a call argument
        pipe.load_lora_weights(call.pop("_lora"))
    kwargs = {**pipe.sdkiln_manifest["call"]["defaults"], **call, "output_type": "latent"}
    model = pipe.sdkiln_manifest["model"]
    kwargs.update(get_spec(model["family"], model.get("variant")).condition(kwargs))

    def die(_pipe, step, _t, tensors):
        if stop is not None and step == stop[1]:
            if stop[0] == "hang":
                time.sleep(HANG_S)
            os._exit(17)  # a rank that dies mid-run, without a word to the others
        return tensors

    with on_step_end(pipe, die) as extra:  # HunyuanVideo-1.5's pipeline has no callback_on_step_end
        out = pipe(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(SEED), **extra, **kwargs)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, cases: list, timeout: float = 150.0) -> dict[int, list]:
    """Run ``cases`` (package, ParallelConfig, call overrides, how and where rank 1 stops) in ``world`` forked ranks;
    each rank's results, in case order (ranks that died report nothing)."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
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
