"""``sdkiln serve`` under load: throughput and latency with and without batching, in one run.

The embedded model's default package (made here unless ``--package`` names one) is served by
``python -m sdkiln serve`` once per ``--max-batch`` setting (1, 4, 8 by default), each on a free
loopback port; ``--clients`` concurrent clients (16) send ``--requests`` requests (48) in all, one image
each, distinct seeds. Reported per setting: images per second over the whole run, the latency's median
and 95th percentile (queue included, as the client sees it), the mean images per pipeline call (from
``/metrics``), and the throughput's ratio to ``--max-batch 1`` (unbatched: one request per call).
Every answer must be 200.

    OMP_NUM_THREADS=2 python bench/serve.py        # about 3 minutes on 2 cores, the package included

JSON to bench/results/serve_fmnist.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(httpx, url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(r"^(\S+) (\S+)$", text, re.M)}


def measure(package: Path, max_batch: int, clients: int, requests: int, log_dir: Path) -> dict:
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = log_dir / f"serve-{max_batch}.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sdkiln", "serve", str(package), "--port", str(port), "--device", "cpu",
             "--max-batch", str(max_batch), "--max-queue", str(requests)],
            stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)

        def post(seed: int) -> float:
            t0 = time.perf_counter()
            r = httpx.post(
                f"{url}/v1/images/generations",
                json={"prompt": "a pair of sneakers", "seed": seed},
                timeout=600,
            )
            if r.status_code != 200:
                raise SystemExit(f"request {seed}: {r.status_code} {r.text[:300]}")
            return time.perf_counter() - t0

        started = time.perf_counter()
        with cf.ThreadPoolExecutor(clients) as pool:
            latencies = list(pool.map(post, range(requests)))
        wall = time.perf_counter() - started
        m = _metrics(httpx, url)
        calls = m["sdkiln_batch_images_count"]  # the warm-up runs before the worker: not counted
        return {
            "max_batch": max_batch,
            "images_per_s": requests / wall,
            "wall_s": wall,
            "latency_p50_s": float(np.median(latencies)),
            "latency_p95_s": float(np.percentile(latencies, 95)),
            "images_per_call": m["sdkiln_batch_images_sum"] / calls,
            "calls": int(calls),
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--package", type=Path, default=None, help="default: make the default-recipe package")
    parser.add_argument("--max-batch", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serve_fmnist.json")
    args = parser.parse_args(argv)
    info = machine(("torch", "diffusers", "fastapi", "uvicorn"))
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="sdkiln-bench-serve-"))
    package = args.package
    if package is None:
        import sdkiln

        package = work / "default"
        sdkiln.optimize("fmnist-flux", "default", package, eval_samples=0)
    rows = []
    for max_batch in args.max_batch:
        row = measure(package, max_batch, args.clients, args.requests, work)
        rows.append(row)
        print(
            f"--max-batch {max_batch}: {row['images_per_s']:.2f} images/s, latency p50 {row['latency_p50_s']:.2f} s "
            f"p95 {row['latency_p95_s']:.2f} s, {row['images_per_call']:.2f} images per call",
            flush=True,
        )
    base = next((r for r in rows if r["max_batch"] == 1), None)
    for row in rows:
        row["throughput_vs_unbatched"] = None if base is None else row["images_per_s"] / base["images_per_s"]
    out = {
        "bench": "serve",
        "machine": info,
        "threads_per_server": int(os.environ.get("OMP_NUM_THREADS", 0)) or None,
        "package": "default recipe, fmnist-flux" if args.package is None else str(args.package),
        "clients": args.clients,
        "requests": args.requests,
        "rows": rows,
        "minutes": round((time.perf_counter() - started) / 60, 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for row in rows:
        ratio = row["throughput_vs_unbatched"]
        print(f"--max-batch {row['max_batch']}: {ratio:.2f}x the unbatched throughput" if ratio else "")
    print(f"wrote {args.out} ({out['minutes']} min)")
    return out


if __name__ == "__main__":
    main()
