"""The parallel runtime's cost and gain: a denoising run (the package's call, latents out) loaded
plainly, through the parallel hooks at world size 1, and in 2-rank layouts, side by side.

* **Overhead at world size 1**: ``sdkiln.load(pkg)`` against ``sdkiln.load(pkg,
  parallel=ParallelConfig())``, which puts the parallel hook on the transformer and, under torchrun,
  joins a process group of one (``torchrun --nproc-per-node 1 bench/parallel.py --device cuda`` is
  the nccl smoke run on one GPU). Per step: the run's median time over its step count, the median
  of ``--rounds`` measurements of each, taken in alternating order; and the hook alone, per call,
  on a module that returns its input (``hook_us_per_call``).
* **Layouts** (CPU only: forked processes over gloo, one torch thread each, so two ranks use two
  cores where the plain run uses one): CFG parallel, Ulysses and ring on 2 ranks; speedup is the
  plain run's time over rank 0's. A tiny model's step is milliseconds, so these figures show the
  runtime's fixed costs (hooks, collectives), not what a FLUX- or Wan-size model gains.

Every package is a float package of the zoo model (recipe ``none``), made in a temporary directory.
The JSON goes to bench/results/parallel_<device kind>.json.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import Clock, Settings, align, announce, report_arguments, run_or_show_table  # noqa: E402

import sdkiln  # noqa: E402
from sdkiln.configs import ParallelConfig  # noqa: E402

LAYOUTS = {"cfg2": {"cfg": 2}, "ulysses2": {"ulysses": 2}, "ring2": {"ring": 2}}


def _runner(package: Path, device: str, parallel: ParallelConfig | None):
    pipe = sdkiln.load(package, device=device, parallel=parallel)
    call = {**pipe.sdkiln_manifest["call"]["defaults"], "output_type": "latent"}

    def run():
        return pipe(prompt="a photo of a cat", generator=torch.Generator("cpu").manual_seed(0), **call)

    return run, call["num_inference_steps"]


def _rank(rank: int, port: int, package: Path, layout: dict, repeats: int, queue) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    try:
        run, _ = _runner(package, "cpu", ParallelConfig(**layout))
        run()  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) * 1e3)
        queue.put((rank, statistics.median(times), None))
    except Exception as exc:  # recorded in the report; the other rank fails with it
        queue.put((rank, None, f"{type(exc).__name__}: {exc}"))


def _two_ranks(package: Path, layout: dict, repeats: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, port, package, layout, repeats, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, ms, error = queue.get(timeout=600)
        results[rank] = (ms, error)
    for p in procs:
        p.join(60)
    ms, error = results[0]
    return {"error": error} if error else {"ms": ms}


class _Identity(torch.nn.Module):
    def forward(self, hidden_states, return_dict=False):
        return (hidden_states,)


def _hook_us(device: torch.device, calls: int = 20_000, rounds: int = 5) -> dict[str, float]:
    """Microseconds per call of a module that returns its input, bare and under the parallel
    hook at world size 1: what the hook itself costs per transformer call (the end-to-end runs of
    tiny models vary by more than that from run to run). Medians of ``rounds`` alternating rounds."""
    from diffusers.hooks import HookRegistry

    from sdkiln.runtime.parallel.cfg import HOOK, ParallelHook
    from sdkiln.runtime.parallel.mesh import init_mesh

    bare, hooked = _Identity(), _Identity()
    mesh = init_mesh(ParallelConfig(), device)
    HookRegistry.check_if_exists_or_initialize(hooked).register_hook(ParallelHook(mesh), HOOK)
    x = torch.zeros(1, device=device)
    times: dict[str, list[float]] = {"bare": [], "hooked": []}
    for i in range(rounds):
        order = (("bare", bare), ("hooked", hooked))
        for name, module in order if i % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            for _ in range(calls):
                module(hidden_states=x)
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    us = {name: statistics.median(values) for name, values in times.items()}
    return us | {"overhead": us["hooked"] - us["bare"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    info = announce(device, torch.float32, "tiny models: fixed costs of the runtime, not large-model gains")
    clock = Clock(device, Settings(warmup=1, repeats=args.repeats, budget_s=20.0))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            package = Path(tmp) / model
            sdkiln.optimize(model, "none", package, eval_samples=0)
            plain, steps = _runner(package, args.device, None)
            wrapped, _ = _runner(package, args.device, ParallelConfig())
            times: dict[str, list[float]] = {"plain": [], "world1": []}
            for i in range(args.rounds):  # alternating order: neither run always goes first
                order = (("plain", plain), ("world1", wrapped))
                for name, fn in order if i % 2 == 0 else order[::-1]:
                    times[name].append(clock.measure(fn, [()])[0]["ms"])
            base_ms, world1_ms = (statistics.median(times[k]) for k in ("plain", "world1"))
            row = {
                "model": model,
                "steps": steps,
                "plain_ms_per_step": base_ms / steps,
                "world1_ms_per_step": world1_ms / steps,
                "world1_overhead": world1_ms / base_ms - 1.0,
                "rounds_ms": times,
                "layouts": {},
            }
            if device.type == "cpu" and "WORLD_SIZE" not in os.environ:
                for name in args.layouts:
                    got = _two_ranks(package, LAYOUTS[name], args.repeats)
                    if "ms" in got:
                        got = {"ms_per_step": got["ms"] / steps, "speedup": base_ms / got["ms"]}
                    row["layouts"][name] = got
            rows.append(row)
            print(f"{model}: done", file=sys.stderr)
    return {
        "benchmark": "parallel runtime: world-size-1 overhead and 2-rank layouts (bench/parallel.py)",
        "device": info,
        "method": clock.describe() | {"layouts": "2 forked ranks over gloo, 1 warm-up + median of repeats"},
        "hook_us_per_call": _hook_us(device),
        "rows": rows,
    }


def table(report: dict[str, Any]) -> str:
    layouts = sorted({name for row in report["rows"] for name in row["layouts"]})
    lines = [
        ["model", "steps", "plain ms/step", "world-1 ms/step", "overhead", *[f"{n} speedup" for n in layouts]]
    ]
    for row in report["rows"]:
        cells = [
            row["model"],
            row["steps"],
            f"{row['plain_ms_per_step']:.2f}",
            f"{row['world1_ms_per_step']:.2f}",
            f"{100 * row['world1_overhead']:+.1f}%",
        ]
        for name in layouts:
            got = row["layouts"].get(name, {})
            cells.append(f"{got['speedup']:.2f}x" if "speedup" in got else got.get("error", "-"))
        lines.append(cells)
    hook = report["hook_us_per_call"]["overhead"]
    return "\n".join(
        [*align(lines), f"the parallel hook alone, world size 1: {hook:.2f} us per transformer call"]
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", nargs="+", default=["fmnist-flux", "flux-tiny", "wan-tiny"])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--rounds", type=int, default=4, help="plain and world-1 measurements, alternating which goes first"
    )
    parser.add_argument("--quick", action="store_true", help="one model, 3 repeats")
    report_arguments(parser, "parallel")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.repeats, args.rounds = args.models[:1], 3, 2
    return run_or_show_table(args, argv, "parallel", lambda: run(args), table)


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    main()
