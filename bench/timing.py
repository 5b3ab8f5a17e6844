"""How bench/kernels.py and bench/e2e.py measure and report: the device and software a figure was
measured on, timed calls (CUDA events on a GPU, ``time.perf_counter`` elsewhere) and their median,
inputs that rotate past the cache, the device's matmul and copy peaks, and the JSON report with its
table. Needs only torch and sdkiln (no diffusers), so the kernel bench runs on a bare GPU machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sdkiln import kernels
from sdkiln.kernels.platform import current_platform
from sdkiln.metrics import sqnr_db

RESULTS = Path(__file__).resolve().parent / "results"
PACKAGES = ("torch", "triton", "diffusers", "torchao", "transformers", "sdkiln")
ROTATE_BYTES = 256 * 2**20
MAX_SETS = 32
SQNR_CAP_DB = 100.0


# ---------------------------------------------------------------------------------------------
# The device and the software


def device_kind(device: torch.device) -> str:
    """The device's short name for the result file: "cpu", or the GPU's model ("h100", "h200")."""
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device).lower().replace("nvidia", "")
    found = re.search(r"[a-z]+\d+[a-z]*", name)
    return found.group(0) if found else re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo. (bench/harness.py's ``machine`` says the same, but
    importing it imports diffusers, which the GPU machines lack unless brought; the kernel bench
    needs only torch.)"""
    info = Path("/proc/cpuinfo")
    lines = (
        [ln for ln in info.read_text().splitlines() if ln.startswith("model name")] if info.is_file() else []
    )
    return lines[0].split(":", 1)[1].strip() if lines else platform.processor() or "unknown"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def device_info(device: torch.device) -> dict[str, Any]:
    """What ran the numbers: the device and its driver, the software versions, the threads, the tree."""
    cpu = _cpu_model()
    info: dict[str, Any] = {"type": device.type, "kind": device_kind(device), "name": cpu, "driver": None}
    info |= {"cpu": cpu, "cores": os.cpu_count()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "name": torch.cuda.get_device_name(device),
            "capability": list(torch.cuda.get_device_capability(device)),
            "memory_bytes": props.total_memory,
            "sm_count": props.multi_processor_count,
            "cuda": torch.version.cuda,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        }
        if shutil.which("nvidia-smi"):
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            done = subprocess.run(query, capture_output=True, text=True, check=False)
            if done.returncode == 0 and done.stdout.strip():
                info["driver"] = done.stdout.strip().splitlines()[0]
    return info | {
        "versions": {p: _version(p) for p in PACKAGES} | {"torch_runtime": torch.__version__},
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "git": _git_state(),
    }


def _git_state() -> dict[str, Any] | None:
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists() or not shutil.which("git"):
        return None
    run = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True, check=False)  # noqa: E731
    return {
        "commit": run("rev-parse", "HEAD").stdout.strip(),
        "dirty": bool(run("status", "--porcelain").stdout.strip()),
    }


def announce(device: torch.device, dtype: torch.dtype, note: str | None) -> dict[str, Any]:
    """``device_info``, printed with the run's dtype and ``note`` (what the figures are not), if any."""
    info = device_info(device)
    print(
        f"device: {info['name']} ({info['kind']}), {dtype}, threads {info['torch_threads']}", file=sys.stderr
    )
    if note:
        print(note, file=sys.stderr)
    return info


def load_kernels(device: torch.device) -> dict[str, Any]:
    """Register the device's kernels; a failure is recorded (the references still run)."""
    try:
        return {"modules": kernels.load_device_kernels(device.type)}
    except Exception as exc:
        return {"error": error_text(exc)}


def error_text(exc: BaseException) -> str:
    """An exception as a row records it: its type and message, cut at 600 characters."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 600 else text[:600] + " ..."


def capped_sqnr(reference: Tensor, values: Tensor) -> float:
    """``sdkiln.metrics.sqnr_db`` capped at ``SQNR_CAP_DB`` (identical outputs: the cap, not infinity)."""
    return min(SQNR_CAP_DB, sqnr_db(reference, values))


# ---------------------------------------------------------------------------------------------
# Timing


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        current_platform().synchronize()


def release(device: torch.device) -> None:
    """Hand the allocator's cached blocks back, so the next measurement starts with the memory free."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, Any]:
    """The GPU allocator's peak since ``reset_peak_memory``; elsewhere the platform's peak, which on
    CPU is the process's resident peak so far (it only grows)."""
    if device.type == "cuda":
        return {"peak_memory_bytes": torch.cuda.max_memory_allocated(device)}
    return {
        "peak_memory_bytes": current_platform().memory_stats()["peak_allocated_bytes"],
        "memory_scope": "process",
    }


@dataclass
class Settings:
    """How many calls ``Clock.measure`` makes: up to ``warmup`` untimed calls, then up to ``repeats``
    timed ones, as many as fit ``budget_s`` by the estimate of one call."""

    warmup: int
    repeats: int
    budget_s: float
    """time one measurement's timed calls may take, beyond which fewer than ``repeats`` run"""
    min_repeats: int = 3
    slow_first_is_estimate: bool = False
    """a first call that took half the budget is its own estimate (no second untimed call, no
    warm-up): for calls of many seconds, such as a model forward on the reference ops at full size"""


class Clock:
    """Times calls on one device: CUDA events on a GPU, ``time.perf_counter`` elsewhere."""

    def __init__(self, device: torch.device, settings: Settings):
        self.device, self.settings = device, settings
        self.cuda = device.type == "cuda"

    def describe(self) -> dict[str, Any]:
        """The settings and the method, for the report."""
        return asdict(self.settings) | {"method": "cuda events" if self.cuda else "time.perf_counter"}

    def first_call(self, fn: Callable, args: tuple) -> tuple[float, Any]:
        """Seconds of one call, synchronized (for a compiled function: the compile and the call), and
        its output."""
        sync(self.device)
        start = time.perf_counter()
        out = fn(*args)
        sync(self.device)
        return time.perf_counter() - start, out

    def measure(self, fn: Callable, sets: list[tuple]) -> tuple[dict[str, Any], Any]:
        """First-call seconds, then warm-up, then the median over the timed calls, inputs rotating;
        and the last call's output.

        The second call estimates a call's time, which sets how many warm-up and timed calls fit
        the budget (``Settings.slow_first_is_estimate``: a slow first call is its own estimate);
        ``warmup_calls`` counts every untimed call, the first included. On a GPU the timed calls'
        events are recorded back to back and read after one synchronization."""
        st = self.settings
        first, out = self.first_call(fn, sets[0])
        untimed, warmup, estimate = 1, 0, first
        if not (st.slow_first_is_estimate and first >= st.budget_s / 2):
            estimate, out = self.first_call(fn, sets[1 % len(sets)])
            untimed += 1
            warmup = max(0, min(st.warmup, int(st.budget_s / 4 / max(estimate, 1e-6))) - 1)
        repeats = max(st.min_repeats, min(st.repeats, int(st.budget_s / max(estimate, 1e-6))))
        for i in range(warmup):
            out = fn(*sets[i % len(sets)])
        sync(self.device)
        times = []
        if self.cuda:
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(repeats)
            ]
            for i, (start, end) in enumerate(events):
                args = sets[i % len(sets)]
                start.record()
                out = fn(*args)
                end.record()
            sync(self.device)
            times = [start.elapsed_time(end) for start, end in events]
        else:
            for i in range(repeats):
                args = sets[i % len(sets)]
                start = time.perf_counter()
                out = fn(*args)
                sync(self.device)
                times.append((time.perf_counter() - start) * 1e3)
        result = {
            "ms": statistics.median(times),
            "min_ms": min(times),
            "max_ms": max(times),
            "calls": repeats,
            "warmup_calls": warmup + untimed,
            "first_call_s": first,
        }
        return result, out


def start_compiler(device: torch.device) -> float:
    """Seconds to compile and run a one-line function: Inductor's one-time start in this process
    (imports, worker pools, the device's compiler), which would otherwise land on the first
    compiled row's figure alone."""
    x = torch.ones(8, device=device)
    start = time.perf_counter()
    torch.compile(lambda t: t * 2 + 1)(x)
    sync(device)
    seconds = time.perf_counter() - start
    torch._dynamo.reset()
    return seconds


# ---------------------------------------------------------------------------------------------
# Inputs and peaks


def nbytes(tensors) -> int:
    """Bytes of the tensors among ``tensors`` (other values count nothing)."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))


def rotating_sets(make: Callable[[], tuple]) -> list[tuple]:
    """Input sets from ``make``: at least two, together at least ``ROTATE_BYTES``, at most ``MAX_SETS``."""
    first = make()
    count = max(2, min(MAX_SETS, math.ceil(ROTATE_BYTES / max(1, nbytes(first)))))
    return [first] + [make() for _ in range(count - 1)]


def matmul_peak(clock: Clock, m: int, k: int, n: int, dtype) -> dict[str, Any]:
    """``torch.mm`` of [M, K] by [K, N] in ``dtype`` (bf16 on a GPU, fp32 on CPU), rotating inputs."""
    device = clock.device

    def make():
        return torch.randn(m, k, device=device, dtype=dtype), torch.randn(n, k, device=device, dtype=dtype)

    sets = rotating_sets(make)
    result = clock.measure(lambda a, b: torch.mm(a, b.t()), sets)[0]
    del sets
    release(device)
    return {"M": m, "K": k, "N": n, "dtype": str(dtype).removeprefix("torch."), **result} | {
        "tflop_per_s": 2.0 * m * k * n / (result["ms"] / 1e3) / 1e12
    }


def copy_peak(clock: Clock, size: int) -> dict[str, Any]:
    """``dst.copy_(src)`` of ``size`` bytes: read once, written once."""
    src = torch.empty(size, dtype=torch.uint8, device=clock.device).random_(0, 255)
    dst = torch.empty_like(src)
    result = clock.measure(lambda a, b: b.copy_(a), [(src, dst), (dst, src)])[0]
    del src, dst
    release(clock.device)
    return {"bytes": size, **result} | {"gb_per_s": 2.0 * size / (result["ms"] / 1e3) / 1e9}


def device_peaks(clock: Clock, gemm: tuple[int, int, int], dtype, copy_bytes: int) -> tuple[dict, dict]:
    """The matmul peak at ``gemm`` (M, K, N) and the copy peak of ``copy_bytes``, each recording its
    error if it fails; and the two rates that ``fraction_of_peak`` divides by."""
    measured: dict[str, Any] = {}
    try:
        measured["matmul"] = matmul_peak(clock, *gemm, dtype)
    except Exception as exc:
        measured["matmul"] = {"error": error_text(exc)}
    try:
        measured["copy"] = copy_peak(clock, copy_bytes)
    except Exception as exc:
        measured["copy"] = {"error": error_text(exc)}
    rates = {
        "matmul_tflop_per_s": measured["matmul"].get("tflop_per_s"),
        "copy_gb_per_s": measured["copy"].get("gb_per_s"),
    }
    print(f"peaks: {rates}", file=sys.stderr)
    return measured, rates


# ---------------------------------------------------------------------------------------------
# The report


def align(lines: list[list | str]) -> list[str]:
    """Table rows as text, each column as wide as its widest cell; a string row (a note under the
    row above) stands as it is."""
    cells = [line for line in lines if not isinstance(line, str)]
    widths = [max(len(str(line[i])) for line in cells) for i in range(len(cells[0]))]
    return [
        line
        if isinstance(line, str)
        else "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    ]


def report_arguments(parser: argparse.ArgumentParser, script: str) -> None:
    """``--out`` and ``--table``, the arguments every bench's command line ends with."""
    parser.add_argument(
        "--out", type=Path, help=f"JSON path (default: bench/results/{script}_<device kind>.json)"
    )
    parser.add_argument("--table", type=Path, help="print the table of an existing report and exit")


def run_or_show_table(
    args: argparse.Namespace,
    argv: list[str] | None,
    script: str,
    run: Callable[[], dict[str, Any]],
    table: Callable[[dict[str, Any]], str],
) -> dict[str, Any]:
    """With ``--table``, print an existing report's table. Otherwise ``run``, record the command
    line, write the report as standard JSON (``--out``, default
    bench/results/<script>_<device kind>[_quick].json) and print its table."""
    if args.table:
        result = json.loads(args.table.read_text())
        print(table(result))
        return result
    result = run()
    result["command"] = " ".join(
        ["python", f"bench/{script}.py", *(argv if argv is not None else sys.argv[1:])]
    )
    kind = result["device"]["kind"]
    out = args.out or RESULTS / f"{script}_{kind}{'_quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    print(table(result))
    print(f"wrote {out}", file=sys.stderr)
    return result
