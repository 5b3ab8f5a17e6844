"""Fuzz the package loader: mutated copies of a good package through ``sdkiln inspect`` and
``sdkiln run``, each case in a forked process with a time and memory cap, classified by outcome.

    python tests/fuzz/fuzz_harness.py --cases 10000 --jobs 2 --json bench/results/fuzz.json

(``make fuzz CASES=10000``). Outcomes of a case:

- ``identical``: ``run`` produced the original image bit for bit (``inspect`` may have refused);
- ``refused``: ``run`` printed one clean error and exited 2;
- ``changed``: ``run`` produced another image, and the original digest refuses the package
  (``--digest`` catches it);
- and the failures: ``changed_undetected`` (another image, the digest does not catch it),
  ``traceback`` (an exception that is not an ``SdkilnError``, from ``inspect`` or ``run``), ``hang``
  (over the time cap), ``memory`` (over the memory cap), ``crash`` (the process died otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fuzz_mutate import mutate  # noqa: E402
from reshard import reshard  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SEED_PACKAGE = ROOT / "tests" / "fixtures" / "schema1_flux_tiny" / "package"
PROMPT = "a photo of a cat"
FAILURES = ("changed_undetected", "traceback", "hang", "memory", "crash")


def _vm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def _cli(args: list[str], err_path: Path) -> tuple[int | None, str]:
    """One sdkiln command in this process: (exit code or None for an exception, the error line or
    the exception's last frame)."""
    from sdkiln import cli

    with (
        open(err_path, "w") as err,
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(open(os.devnull, "w")),
    ):
        try:
            rc = cli.main(args)
        except MemoryError:
            return None, "MemoryError"
        except BaseException as exc:  # noqa: BLE001 - the harness reports every escaping exception
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            return (
                None,
                f"{type(exc).__name__} at {Path(frame.filename).name}:{frame.lineno}: {str(exc)[:200]}",
            )
    lines = err_path.read_text(errors="replace").strip().splitlines()
    return rc, lines[-1][:300] if lines else ""


def run_case(pkg: Path, work: Path, original_png: bytes | None, original_digest: str | None) -> dict:
    """What inspect and run do with ``pkg`` (in the calling process)."""
    from sdkiln.errors import PackageError
    from sdkiln.runtime.package import open_package

    rc_i, msg_i = _cli(["inspect", str(pkg)], work / "inspect.err")
    out = work / "out.png"
    rc_r, msg_r = _cli(
        ["run", str(pkg), "--prompt", PROMPT, "--out", str(out), "--device", "cpu"], work / "run.err"
    )
    result = {
        "inspect": "ok" if rc_i == 0 else "refused" if rc_i == 2 else "traceback",
        "inspect_message": msg_i,
    }
    if rc_i is None and "MemoryError" in msg_i:
        result["inspect"] = "memory"
    if rc_r is None:
        result["outcome"] = "memory" if "MemoryError" in msg_r or "allocate" in msg_r else "traceback"
        result["message"] = msg_r
    elif rc_r != 0:
        result["outcome"], result["message"] = ("refused" if rc_r == 2 else "traceback"), msg_r
    else:
        png = out.read_bytes()
        if original_png is None or png == original_png:
            result["outcome"] = "identical"
        else:
            try:
                open_package(pkg, digest=original_digest)
                result["outcome"] = "changed_undetected"
            except PackageError:
                result["outcome"] = "changed"
        result["png"] = png if original_png is None else None
    if result["inspect"] in ("traceback", "memory") and result["outcome"] not in FAILURES:
        result["outcome"], result["message"] = result["inspect"], "inspect: " + msg_i
    return result


def _child(pkg: Path, work: Path, seed: int, original_png: bytes, original_digest: str, memory: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + memory, resource.RLIM_INFINITY))
    try:
        kind, what = mutate(pkg, seed)
        result = {"seed": seed, "kind": kind, "mutation": what}
        result.update(run_case(pkg, work, original_png, original_digest))
        result.pop("png", None)
    except BaseException as exc:  # noqa: BLE001
        result = {"seed": seed, "outcome": "crash", "message": f"harness: {type(exc).__name__}: {exc}"[:300]}
    (work / "result.json").write_text(json.dumps(result))
    os._exit(0)


def fuzz(
    cases: int,
    first_seed: int = 0,
    jobs: int = 1,
    timeout: float = 10.0,
    memory_gb: float = 2.0,
    progress=None,
    shard_bytes: int | None = None,
) -> tuple[list[dict], dict]:
    """Run ``cases`` mutated packages (seeds ``first_seed``...), ``jobs`` at a time; with
    ``shard_bytes``, of the seed package with its transformer in shards of that size (``reshard``)."""
    import torch

    from sdkiln.runtime.package import open_package

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="sdkiln-fuzz-"))
    try:
        pristine = tmp / "pristine"
        shutil.copytree(SEED_PACKAGE, pristine)
        if shard_bytes is not None:
            reshard(pristine, shard_bytes)
        (tmp / "w").mkdir()
        base = run_case(pristine, tmp / "w", None, None)  # also warms every import before forking
        if base["outcome"] != "identical":
            raise RuntimeError(f"the seed package does not run: {base}")
        original_png, original_digest = base["png"], open_package(pristine).digest
        memory = int(memory_gb * (1 << 30))
        results, running, seeds = [], {}, iter(range(first_seed, first_seed + cases))
        t0 = time.perf_counter()
        while True:
            while len(running) < jobs:
                seed = next(seeds, None)
                if seed is None:
                    break
                case = tmp / f"case-{seed}"
                pkg, work = case / "package", case / "work"
                shutil.copytree(pristine, pkg)
                work.mkdir()
                pid = os.fork()
                if pid == 0:
                    _child(pkg, work, seed, original_png, original_digest, memory)
                running[pid] = (seed, case, time.perf_counter())
            if not running:
                break
            time.sleep(0.005)
            for pid, (seed, case, start) in list(running.items()):
                done, status, usage = os.wait4(pid, os.WNOHANG)
                elapsed = time.perf_counter() - start
                if done == 0 and elapsed < timeout:
                    continue
                if done == 0:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    result = {"seed": seed, "outcome": "hang", "message": f"over {timeout:g} s"}
                elif (case / "work" / "result.json").is_file():
                    result = json.loads((case / "work" / "result.json").read_text())
                else:
                    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
                    result = {
                        "seed": seed,
                        "outcome": "memory" if sig == signal.SIGKILL else "crash",
                        "message": f"exit status {status} (signal {sig})",
                    }
                result["seconds"] = round(elapsed, 3)
                result["max_rss_mb"] = round(usage.ru_maxrss / 1024) if done else None
                results.append(result)
                del running[pid]
                shutil.rmtree(case, ignore_errors=True)
                if progress:
                    progress(len(results), cases, time.perf_counter() - t0)
        summary = summarize(results, time.perf_counter() - t0, timeout, memory_gb)
        return sorted(results, key=lambda r: r["seed"]), summary
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def summarize(results: list[dict], seconds: float, timeout: float, memory_gb: float) -> dict:
    outcomes = Counter(r["outcome"] for r in results)
    by_kind: dict[str, Counter] = {}
    for r in results:
        by_kind.setdefault(r.get("kind", "?"), Counter())[r["outcome"]] += 1
    return {
        "cases": len(results),
        "seconds": round(seconds, 1),
        "timeout_s": timeout,
        "memory_cap_gb": memory_gb,
        "max_case_seconds": max((r["seconds"] for r in results), default=0),
        # a forked case's resident set includes the pages it shares with the harness (about 0.4 GB)
        "max_case_rss_mb": max((r["max_rss_mb"] or 0 for r in results), default=0),
        "outcomes": dict(outcomes),
        "by_mutation": {k: dict(v) for k, v in sorted(by_kind.items())},
        "inspect": dict(Counter(r.get("inspect", "?") for r in results)),
        "failures": [r for r in results if r["outcome"] in FAILURES][:50],
        "refusal_messages": dict(
            Counter(
                _signature(r.get("message", "")) for r in results if r["outcome"] == "refused"
            ).most_common(40)
        ),
    }


def _signature(message: str) -> str:
    """An error line without its values, to count kinds of refusal."""
    head = message.split(": ", 2)
    return ": ".join(head[:2])[:120]


def table(summary: dict) -> str:
    outcomes = ["identical", "refused", "changed", *FAILURES]
    lines = ["| mutation | " + " | ".join(outcomes) + " |", "|---|" + "---|" * len(outcomes)]
    for kind, counts in summary["by_mutation"].items():
        lines.append(f"| {kind} | " + " | ".join(str(counts.get(o, 0)) for o in outcomes) + " |")
    total = summary["outcomes"]
    lines.append("| **all** | " + " | ".join(f"**{total.get(o, 0)}**" for o in outcomes) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0, help="the first case's seed")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per case")
    p.add_argument("--memory-gb", type=float, default=2.0, help="address space per case beyond the parent's")
    p.add_argument("--json", default=None, help="write the summary and every case here")
    args = p.parse_args()

    def progress(done: int, total: int, seconds: float) -> None:
        if done % 50 == 0 or done == total:
            print(f"\r{done}/{total} cases, {seconds:.0f} s", end="", file=sys.stderr, flush=True)

    results, summary = fuzz(args.cases, args.seed, args.jobs, args.timeout, args.memory_gb, progress)
    print(file=sys.stderr)
    print(table(summary))
    print(
        f"{summary['cases']} cases in {summary['seconds']} s (slowest {summary['max_case_seconds']} s, "
        f"largest resident set {summary['max_case_rss_mb']} MB); "
        f"failures: {sum(summary['outcomes'].get(o, 0) for o in FAILURES)}"
    )
    for failure in summary["failures"][:20]:
        print(
            f"  seed {failure['seed']} {failure['outcome']}: {failure.get('mutation')} -> {failure.get('message')}"
        )
    if args.json:
        machine = {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        }
        import torch

        machine["torch"] = torch.__version__
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        rows = [
            [r["seed"], r.get("kind"), r["outcome"], r.get("inspect"), r["seconds"], r["max_rss_mb"]]
            for r in results
        ]
        report = {
            "machine": machine,
            "command": " ".join(sys.argv),
            "summary": summary,
            "case_columns": ["seed", "mutation", "outcome", "inspect", "seconds", "max_rss_mb"],
            "cases": rows,
        }
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if any(summary["outcomes"].get(o) for o in FAILURES) else 0


if __name__ == "__main__":
    sys.exit(main())
