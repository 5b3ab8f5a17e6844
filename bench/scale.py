"""``sdkiln optimize`` at real width: its peak memory and time, against the bound the pipeline's size sets.

Every case builds a model directory with real-width random weights (``tools/random_model.py
VARIANT --out DIR --depth N --dtype bf16``: FLUX ``--depth N`` is N double and 2N single blocks,
text encoders cut to min(N, real) layers) and runs ``python -m sdkiln optimize DIR --device D
--dtype T ...`` on it as a child process, one case at a time. Per case:

* ``peak_rss_bytes``: the child's own resident high-water mark, ``ru_maxrss`` from ``os.wait4``
  (KiB on Linux; exact, no sampling); ``wall_seconds``: the child's wall time;
* ``pipeline_bytes``: every component's parameter count, read from its safetensors headers (the
  weights are never loaded), times the run dtype's size (4 for float32); tensors stored as
  integers count their stored bytes;
* the bound: ``peak_rss_bytes <= BOUND_FACTOR x pipeline_bytes + BOUND_EXTRA_BYTES`` (1.3 x + 1.5 GB,
  decimal); ``ratio`` is ``peak_rss_bytes / pipeline_bytes``, the copies of the pipeline the run held;
* ``optimize_report``: the package's ``report/optimize.json`` (its phases, forwards, seconds, the
  planned peak and, on CUDA, ``peak_device_bytes``), or null when the package has none.

Between two depths of the same variant and recipe, ``depth_growth`` divides the growth of the peak
by the growth of the pipeline's bytes: one copy of the added blocks gives about 1; 1.6 or more
fails. A run that fails records its log's last lines; the report is written either way and the
script exits 1 when a run failed, a bound was exceeded or a growth failed.

Cases: on CPU (default) FLUX.1-dev at depth 2 and 4 with quant-auto and w8a8-dynamic-gptq at
128x128, 4 denoising steps, 64 text tokens; Wan2.1-T2V-14B at depth 2, 128x128, 9 frames, quant-auto.
Calibration is cut to 2 samples (quant-auto: 2 calibration + 1 sensitivity) by recipe files written
into the work directory. ``--full`` (a GPU): FLUX.1-dev at full depth with w8a8-dynamic and
quant-auto at 1024x1024, 8 steps, 2 evaluation samples, and Wan2.1-T2V-14B at 480x832, 9 frames,
in bfloat16. Model directories take several GB each: free disk is checked against an estimate
before each is built, and each is deleted after its cases unless ``--keep``.

    python bench/scale.py --dry-run             # the commands and the bound arithmetic; runs nothing heavy
    python bench/scale.py                       # the CPU cases (about 20 GB of RAM at depth 4)
    python bench/scale.py --device cuda --full  # the GPU pass (tools/gpu_pass.sh)
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import timing  # noqa: E402  (bench/timing.py: device description, the table)

from sdkiln.kernels.cpu_profile import read_cpu_info  # noqa: E402

BOUND_FACTOR = 1.3
BOUND_EXTRA_BYTES = 1_500_000_000
GROWTH_LIMIT = 1.6
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
STORED_DTYPE = "bf16"
SAFETENSORS_FLOAT = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
SAFETENSORS_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2}
SAFETENSORS_BYTES |= {"I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
HEADER_LIMIT = 100 * 2**20

# Billions of parameters of each variant, (at depth 0, per depth unit, at full depth), for the
# transformer and for the other components together: linear fits of the real configs built on
# torch's meta device (FLUX: a unit is 1 double + 2 single blocks, T5-XXL and CLIP-L one layer each;
# SD3.5: one joint block, T5, CLIP-L and CLIP-G one layer; Wan: one block, umT5 one layer). They
# only size the disk check and the dry run's estimates; a run measures its bytes from the headers.
PARAMS_BILLIONS: dict[str, dict[str, tuple[float, float, float]]] = {
    "flux-dev": {"transformer": (0.064, 0.623, 11.901), "other": (0.254, 0.200, 4.969)},
    "flux-schnell": {"transformer": (0.061, 0.623, 11.895), "other": (0.254, 0.200, 4.969)},
    "sd3.5-large": {"transformer": (0.0, 0.213, 8.057), "other": (0.318, 0.220, 5.664)},
    "sd3.5-medium": {"transformer": (0.0, 0.102, 2.243), "other": (0.318, 0.220, 5.664)},
    "wan2.1-t2v-14b": {"transformer": (0.233, 0.351, 14.288), "other": (1.177, 0.193, 5.808)},
    "wan2.1-t2v-1.3b": {"transformer": (0.026, 0.046, 1.419), "other": (1.177, 0.193, 5.808)},
}

# Recipe files: calibration cut to what a memory measurement needs (the forwards' count, not the
# quality, is what it varies). A recipe not named here is passed by name. quant-auto's floor is 20 dB,
# not its 40: random weights have no outlier structure and every layer scores about 30-35 dB for
# W8A8, so at 40 dB nothing would be quantized and the run would measure a float model; at 20 dB
# every layer is quantized, which is the case whose memory matters.
RECIPE_FILES: dict[str, dict[str, Any]] = {
    "quant-auto": {
        "steps": [{"kind": "quant_auto", "calib_samples": 2, "sensitivity_samples": 1, "sqnr_floor_db": 20}]
    },
    # GPTQ's addition to the model is its Hessian group (max_hessian_mb) plus two [K, K] matrices of the
    # widest layer while it inverts (FLUX's 15360-wide single-block output: 0.94 GB each in fp32); 1 GB
    # groups keep that within the 1.5 GB + 0.3x of a 2+4-block FLUX
    "w8a8-dynamic-gptq": {
        "steps": [
            {"kind": "w8a8_dynamic", "weight_rounding": "gptq", "calib_samples": 2, "max_hessian_mb": 1024}
        ]
    },
}


@dataclass(frozen=True)
class Case:
    variant: str
    depth: int | None
    """None: the variant's full depth"""
    recipe: str
    height: int
    width: int
    steps: int
    max_sequence_length: int
    eval_samples: int
    frames: int | None = None

    @property
    def model(self) -> str:
        """The model directory's name: the variant at its depth."""
        return f"{self.variant}-{'full' if self.depth is None else f'd{self.depth}'}"

    @property
    def id(self) -> str:
        return f"{self.model}-{self.recipe}"


def default_cases(depths: list[int] | None) -> list[Case]:
    flux = dict(height=128, width=128, steps=4, max_sequence_length=64, eval_samples=1)
    recipes = ("quant-auto", "w8a8-dynamic-gptq")
    cases = [Case("flux-dev", d, r, **flux) for d in depths or (2, 4) for r in recipes]
    return cases + [Case("wan2.1-t2v-14b", d, "quant-auto", **flux, frames=9) for d in depths or (2,)]


def full_cases(depths: list[int] | None) -> list[Case]:
    flux = dict(height=1024, width=1024, steps=8, max_sequence_length=512, eval_samples=2)
    wan = dict(height=480, width=832, steps=8, max_sequence_length=512, eval_samples=2, frames=9)
    cases = [
        Case("flux-dev", d, r, **flux) for d in depths or (None,) for r in ("w8a8-dynamic", "quant-auto")
    ]
    return cases + [Case("wan2.1-t2v-14b", d, "quant-auto", **wan) for d in depths or (None,)]


def select(cases: list[Case], patterns: str | None) -> list[Case]:
    """The cases whose id matches one of the comma-separated ``patterns`` (a glob, or a substring)."""
    if not patterns:
        return cases
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    chosen = [c for c in cases if any(fnmatch.fnmatch(c.id, p) or p in c.id for p in pats)]
    if not chosen:
        raise SystemExit(f"--cases {patterns!r} matches none of: {', '.join(c.id for c in cases)}")
    return chosen


# ---------------------------------------------------------------------------------------------
# Bytes


def header_counts(directory: Path) -> dict[str, dict[str, int]]:
    """Per component (the folder a safetensors file is in): its floating parameter count and the
    bytes of its other tensors, from the files' headers alone."""
    out: dict[str, dict[str, int]] = {}
    for file in sorted(directory.rglob("*.safetensors")):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if not 0 < size <= HEADER_LIMIT:
                raise ValueError(f"{file}: safetensors header length {size}")
            header = json.loads(f.read(size))
        counts = out.setdefault(
            str(file.parent.relative_to(directory)), {"float_params": 0, "other_bytes": 0}
        )
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in entry["shape"]:
                numel *= d
            if entry["dtype"] in SAFETENSORS_FLOAT:
                counts["float_params"] += numel
            else:
                counts["other_bytes"] += numel * SAFETENSORS_BYTES[entry["dtype"]]
    return out


def pipeline_bytes(counts: dict[str, dict[str, int]], dtype: str) -> int:
    """The pipeline's bytes when every floating tensor is held in ``dtype``."""
    return sum(c["float_params"] * DTYPE_BYTES[dtype] + c["other_bytes"] for c in counts.values())


def bound(pipeline: int) -> int:
    return int(BOUND_FACTOR * pipeline + BOUND_EXTRA_BYTES)


def estimated_params(variant: str, depth: int | None) -> dict[str, float]:
    """Parameters of ``variant`` at ``depth`` (``PARAMS_BILLIONS``), transformer and the rest."""
    est = PARAMS_BILLIONS[variant]
    pick = lambda fixed, per, full: full if depth is None else min(full, fixed + per * depth)  # noqa: E731
    return {part: pick(*fit) * 1e9 for part, fit in est.items()}


def disk_needed(variant: str, depth: int | None, dtypes: set[str]) -> int:
    """Bytes of disk one model directory (bf16) and its largest package need together: a package
    holds the other components in the run dtype and the transformer at about a byte a weight."""
    p = estimated_params(variant, depth)
    package = max(p["other"] * DTYPE_BYTES[d] + p["transformer"] * 1.1 for d in dtypes)
    return int(2 * (p["transformer"] + p["other"]) + package)


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


# ---------------------------------------------------------------------------------------------
# Running a child and measuring it


def run_measured(cmd: list[str], log: Path, env: dict[str, str], timeout_s: float | None) -> dict[str, Any]:
    """Run ``cmd`` with its output in ``log``: its exit code, wall seconds and peak resident bytes
    (``ru_maxrss`` of ``os.wait4``: the child's own high-water mark, its waited-for children's if
    higher; Linux starts a forked child's mark at the parent's resident size, so it is never below
    this process's own, a few hundred MB with torch imported: far below what is measured). Past
    ``timeout_s`` its process group is killed (``timed_out``)."""
    start = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
    timed_out = False
    try:
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if timeout_s is not None and time.perf_counter() - start > timeout_s:
                os.killpg(proc.pid, signal.SIGKILL)
                timed_out = True
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        os.wait4(proc.pid, 0)
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "returncode": proc.returncode,
        "timed_out": timed_out,
        "wall_seconds": round(time.perf_counter() - start, 3),
        "peak_rss_bytes": usage.ru_maxrss * 1024,
    }


def tail(log: Path, lines: int = 40) -> str:
    text = log.read_text(errors="replace") if log.is_file() else ""
    return "\n".join(text.splitlines()[-lines:])


def child_env() -> dict[str, str]:
    """The environment of the children: sdkiln importable from this tree without an install."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    return env


def build_command(case: Case, model_dir: Path) -> list[str]:
    cmd = [sys.executable, "tools/random_model.py", case.variant, "--out", str(model_dir)]
    cmd += ["--dtype", STORED_DTYPE, "--force"]
    return cmd + ([] if case.depth is None else ["--depth", str(case.depth)])


def optimize_command(
    case: Case, model_dir: Path, package: Path, device: str, dtype: str, recipe: str
) -> list[str]:
    cmd = [sys.executable, "-m", "sdkiln", "optimize", str(model_dir), "--device", device, "--dtype", dtype]
    cmd += ["--recipe", recipe, "--out", str(package), "--force"]
    cmd += ["--height", str(case.height), "--width", str(case.width), "--steps", str(case.steps)]
    cmd += ["--max-sequence-length", str(case.max_sequence_length), "--eval-samples", str(case.eval_samples)]
    return cmd + ([] if case.frames is None else ["--frames", str(case.frames)])


def write_recipes(workdir: Path) -> dict[str, str]:
    """The recipe files in ``workdir``: recipe name -> what ``--recipe`` gets."""
    out = {}
    for name, recipe in RECIPE_FILES.items():
        path = workdir / f"{name}.json"
        path.write_text(json.dumps({"name": name, **recipe}, indent=1) + "\n")
        out[name] = str(path)
    return out


def read_optimize_report(package: Path) -> dict[str, Any] | None:
    path = package / "report" / "optimize.json"
    return json.loads(path.read_text()) if path.is_file() else None


def measure_case(
    case: Case, model_dir: Path, counts, recipes, args, workdir: Path, deadline
) -> dict[str, Any]:
    package = workdir / f"{case.id}.pkg"
    log = workdir / f"{case.id}.log"
    recipe = recipes.get(case.recipe, case.recipe)
    cmd = optimize_command(case, model_dir, package, args.device, args.dtype, recipe)
    size = pipeline_bytes(counts, args.dtype)
    row: dict[str, Any] = {"id": case.id, **asdict(case), "dtype": args.dtype, "device": args.device}
    row |= {"recipe_file": RECIPE_FILES.get(case.recipe), "command": shlex.join(cmd)}
    row |= {"pipeline_bytes": size, "bound_bytes": bound(size)}
    print(f"[{case.id}] {shlex.join(cmd)}", file=sys.stderr)
    left = None if deadline is None else deadline - time.monotonic()
    result = run_measured(cmd, log, child_env(), left)
    row |= result
    report = read_optimize_report(package)
    row["optimize_report"] = report
    if report is None:
        row["optimize_report_note"] = "the package has no report/optimize.json"
    else:
        row["phases"] = report.get("phases")
        row["peak_device_bytes"] = report.get("peak_device_bytes")
        row["plan_estimated_peak_bytes"] = (report.get("plan") or {}).get("estimated_peak_bytes")
    row["package_bytes"] = du(package)
    manifest = package / "manifest.json"
    if manifest.is_file():  # how much was quantized: a run that quantized nothing measures a float model
        m = json.loads(manifest.read_text())
        row["layers_quantized"] = len(m.get("modules", {}))
        row["model"] = {k: m["model"].get(k) for k in ("family", "variant", "dtype")}
    if result["returncode"] != 0:
        row["status"] = "timed out (budget)" if result["timed_out"] else "failed"
        row["error_tail"] = tail(log)
    else:
        row["status"] = "ok"
        row["ratio"] = round(result["peak_rss_bytes"] / size, 4)
        row["within_bound"] = result["peak_rss_bytes"] <= row["bound_bytes"]
    if not args.keep:
        shutil.rmtree(package, ignore_errors=True)
    return row


def not_run(case: Case, args, status: str, why: str) -> dict[str, Any]:
    row = {"id": case.id, **asdict(case), "dtype": args.dtype, "device": args.device}
    return row | {"status": status, "error_tail": why}


def run_group(cases: list[Case], recipes, args, workdir: Path, deadline) -> list[dict[str, Any]]:
    """Build one model directory, run every case on it, delete it (unless ``--keep``)."""
    first = cases[0]
    model_dir = workdir / first.model
    need = disk_needed(first.variant, first.depth, {args.dtype})
    free = shutil.disk_usage(workdir).free
    if free < need:
        why = (
            f"not enough disk at {workdir}: about {need / 1e9:.1f} GB needed for the model directory "
            f"and its package, {free / 1e9:.1f} GB free; free some or pass --workdir on a larger disk"
        )
        print(f"[{first.variant}] {why}", file=sys.stderr)
        return [not_run(c, args, "failed", why) for c in cases]
    cmd = build_command(first, model_dir)
    print(f"[{first.variant}] building: {shlex.join(cmd)}", file=sys.stderr)
    log = workdir / f"{model_dir.name}.build.log"
    left = None if deadline is None else deadline - time.monotonic()
    built = run_measured(cmd, log, child_env(), left)
    build = {"command": shlex.join(cmd), **built, "model_dir_bytes": du(model_dir)}
    if built["returncode"] != 0:
        why = "building the model directory failed:\n" + tail(log)
        rows = [
            not_run(c, args, "timed out (budget)" if built["timed_out"] else "failed", why) for c in cases
        ]
    else:
        counts = header_counts(model_dir)
        build |= {"components": counts}
        rows = []
        for case in cases:
            if deadline is not None and time.monotonic() > deadline:
                rows.append(not_run(case, args, "not run (budget)", "the run's --budget-s was spent"))
                continue
            rows.append(measure_case(case, model_dir, counts, recipes, args, workdir, deadline))
    if not args.keep:
        shutil.rmtree(model_dir, ignore_errors=True)
    return [row | {"build": build} for row in rows]


def depth_growth(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per variant and recipe, between consecutive measured depths: the peak's growth over the
    pipeline's growth."""
    out = []
    keys = sorted({(r["variant"], r["recipe"]) for r in rows})
    for variant, recipe in keys:
        ok = [r for r in rows if (r["variant"], r["recipe"]) == (variant, recipe) and r["status"] == "ok"]
        ok = sorted((r for r in ok if r["depth"] is not None), key=lambda r: r["depth"])
        for a, b in zip(ok, ok[1:], strict=False):
            d_peak = b["peak_rss_bytes"] - a["peak_rss_bytes"]
            d_bytes = b["pipeline_bytes"] - a["pipeline_bytes"]
            ratio = d_peak / d_bytes if d_bytes > 0 else None
            out.append(
                {
                    "variant": variant,
                    "recipe": recipe,
                    "depths": [a["depth"], b["depth"]],
                    "d_peak_rss_bytes": d_peak,
                    "d_pipeline_bytes": d_bytes,
                    "growth_ratio": None if ratio is None else round(ratio, 4),
                    "ok": ratio is not None and ratio < GROWTH_LIMIT,
                }
            )
    return out


# ---------------------------------------------------------------------------------------------
# The dry run


def tiny_arithmetic(workdir: Path, dtype: str) -> dict[str, Any]:
    """The bound's arithmetic on a tiny FLUX directory (the zoo's flux-tiny, saved): its header
    counts, checked against the tensors loaded from the same files."""
    from safetensors.torch import load_file

    from sdkiln.model_zoo import get_spec

    directory = workdir / "flux-tiny"
    get_spec("flux-tiny").build().save_pretrained(str(directory))
    counts = header_counts(directory)
    loaded = sum(
        t.numel()
        for f in directory.rglob("*.safetensors")
        for t in load_file(str(f)).values()
        if t.is_floating_point()
    )
    header = sum(c["float_params"] for c in counts.values())
    if header != loaded:
        raise AssertionError(f"header parameter count {header} != loaded {loaded} in {directory}")
    size = pipeline_bytes(counts, dtype)
    return {
        "directory": "flux-tiny saved by sdkiln.model_zoo",
        "components": counts,
        "float_params": header,
        "float_params_loaded": loaded,
        "dtype": dtype,
        "pipeline_bytes": size,
        "bound_bytes": bound(size),
        "arithmetic": f"{BOUND_FACTOR} x {size} + {BOUND_EXTRA_BYTES} = {bound(size)}",
    }


def plan(cases: list[Case], args, workdir: Path) -> list[dict[str, Any]]:
    """What a run would do per case: its commands, and the bound from the estimated parameters."""
    recipes = {name: str(workdir / f"{name}.json") for name in RECIPE_FILES}
    rows = []
    for case in cases:
        model_dir = workdir / case.model
        p = estimated_params(case.variant, case.depth)
        size = int((p["transformer"] + p["other"]) * DTYPE_BYTES[args.dtype])
        recipe = recipes.get(case.recipe, case.recipe)
        cmd = optimize_command(case, model_dir, workdir / f"{case.id}.pkg", args.device, args.dtype, recipe)
        rows.append(
            {
                "id": case.id,
                **asdict(case),
                "status": "planned",
                "build_command": shlex.join(build_command(case, model_dir)),
                "command": shlex.join(cmd),
                "recipe_file": RECIPE_FILES.get(case.recipe),
                "estimated_pipeline_bytes": size,
                "estimated_bound_bytes": bound(size),
                "disk_needed_bytes": disk_needed(case.variant, case.depth, {args.dtype}),
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------
# The report


def gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def table(report: dict[str, Any]) -> str:
    if report["dry_run"]:
        t = report["tiny"]
        lines = [
            f"tiny FLUX directory: {t['float_params']} parameters (headers = loaded), {t['dtype']}: "
            f"pipeline {t['pipeline_bytes']} bytes, bound {t['arithmetic']}"
        ]
        rows = [["case", "est. pipeline GB", "est. bound GB", "disk GB"]]
        for r in report["cases"]:
            rows.append(
                [
                    r["id"],
                    gb(r["estimated_pipeline_bytes"]),
                    gb(r["estimated_bound_bytes"]),
                    gb(r["disk_needed_bytes"]),
                ]
            )
        free = report["disk_free_bytes"]
        return "\n".join(lines + timing.align(rows) + [f"free disk at the work directory: {gb(free)} GB"])
    rows = [
        [
            "case",
            "status",
            "wall s",
            "pipeline GB",
            "peak RSS GB",
            "bound GB",
            "ratio",
            "within",
            "planned GB",
            "GPU GB",
            "layers q",
        ]
    ]
    for r in report["cases"]:
        if r["status"] != "ok":
            why = (r.get("error_tail") or "").strip().splitlines()
            rows.append([r["id"], r["status"]] + [""] * 9)
            rows.append(f"    {why[-1][:160] if why else ''}")
            continue
        rows.append(
            [
                r["id"],
                "ok",
                f"{r['wall_seconds']:.1f}",
                gb(r["pipeline_bytes"]),
                gb(r["peak_rss_bytes"]),
                gb(r["bound_bytes"]),
                f"{r['ratio']:.2f}",
                "yes" if r["within_bound"] else "NO",
                gb(r.get("plan_estimated_peak_bytes")),
                gb(r.get("peak_device_bytes")),
                str(r.get("layers_quantized", "")),
            ]
        )
    out = timing.align(rows)
    for g in report["depth_growth"]:
        if g["growth_ratio"] is None:
            verdict = "FAILS: the pipeline did not grow"
        else:
            verdict = "ok" if g["ok"] else f"FAILS: >= {GROWTH_LIMIT}"
        out.append(
            f"depth {g['depths'][0]} -> {g['depths'][1]} {g['variant']} {g['recipe']}: peak "
            f"{g['d_peak_rss_bytes'] / 1e9:+.2f} GB for pipeline {g['d_pipeline_bytes'] / 1e9:+.2f} GB, "
            f"growth {g['growth_ratio']} ({verdict})"
        )
    out.append(f"bound: peak RSS <= {BOUND_FACTOR} x pipeline bytes + {BOUND_EXTRA_BYTES / 1e9} GB")
    return "\n".join(out)


def machine(device: str) -> dict[str, Any]:
    info = timing.device_info(torch.device(device))
    cpu = read_cpu_info()
    mem = {}
    if Path("/proc/meminfo").is_file():
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                mem[key] = int(value.split()[0]) * 1024
    return info | {"cpu_isa": sorted(cpu.features), "cpu_aten": cpu.aten_capability, "memory_bytes": mem}


def run(args, cases: list[Case], workdir: Path) -> dict[str, Any]:
    started = time.perf_counter()
    report: dict[str, Any] = {
        "benchmark": "sdkiln optimize at real width: peak RSS and time against the pipeline's bytes (bench/scale.py)",
        "dry_run": args.dry_run,
        "settings": {
            "dtype": args.dtype,
            "stored_dtype": STORED_DTYPE,
            "full": args.full,
            "bound": {"factor": BOUND_FACTOR, "extra_bytes": BOUND_EXTRA_BYTES},
            "growth_limit": GROWTH_LIMIT,
            "budget_s": args.budget_s,
            "peak_rss": "ru_maxrss of os.wait4 (the child's own high-water mark)",
        },
        "disk_free_bytes": shutil.disk_usage(workdir).free,
    }
    if args.dry_run:
        report["tiny"] = tiny_arithmetic(workdir, args.dtype)
        report["cases"] = plan(cases, args, workdir)
        built = set()
        for r in report["cases"]:
            if r["build_command"] not in built:
                built.add(r["build_command"])
                print(f"build: {r['build_command']}")
            print(f"[{r['id']}] {r['command']}")
        report["depth_growth"] = []
        report["passed"] = True
    else:
        recipes = write_recipes(workdir)
        deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
        groups: dict[tuple, list[Case]] = {}
        for case in cases:
            groups.setdefault((case.variant, case.depth), []).append(case)
        rows = []
        for group in groups.values():
            if deadline is not None and time.monotonic() > deadline:
                rows += [
                    not_run(c, args, "not run (budget)", "the run's --budget-s was spent") for c in group
                ]
                continue
            rows += run_group(group, recipes, args, workdir, deadline)
        report["cases"] = rows
        report["depth_growth"] = depth_growth(rows)
        report["passed"] = all(r["status"] == "ok" and r["within_bound"] for r in rows) and all(
            g["ok"] for g in report["depth_growth"]
        )
    report["total_seconds"] = round(time.perf_counter() - started, 3)
    # after the runs: describing a GPU opens a CUDA context here, which would hold memory the
    # children's peaks should not share
    report["device"] = machine(args.device)
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--dtype",
        choices=tuple(DTYPE_BYTES),
        default=None,
        help="the run's dtype (default: float32; --full bfloat16)",
    )
    parser.add_argument(
        "--full", action="store_true", help="the GPU cases: full-size FLUX.1-dev and Wan2.1-14B"
    )
    parser.add_argument("--cases", help="comma-separated case ids or globs (e.g. 'flux-dev-d2-*')")
    parser.add_argument("--depth", help="comma-separated depths for every variant (default: FLUX 2,4; Wan 2)")
    parser.add_argument("--keep", action="store_true", help="keep the model directories and packages")
    parser.add_argument(
        "--workdir", type=Path, help="where models and packages go (default: a new build/scale/tmp*)"
    )
    parser.add_argument(
        "--budget-s", type=float, help="stop starting cases, and kill the running one, after this"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the commands and the bound arithmetic only"
    )
    parser.add_argument(
        "--out", type=Path, help="JSON path (default: bench/results/scale_<device kind>.json)"
    )
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.full else "float32")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    depths = [int(d) for d in args.depth.split(",")] if args.depth else None
    cases = select((full_cases if args.full else default_cases)(depths), args.cases)
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        workdir, made = args.workdir, False
    else:
        (ROOT / "build" / "scale").mkdir(parents=True, exist_ok=True)
        workdir, made = Path(tempfile.mkdtemp(dir=ROOT / "build" / "scale")), True
    try:
        report = run(args, cases, workdir)
    finally:
        if made and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    report["command"] = shlex.join(
        ["python", "bench/scale.py", *(argv if argv is not None else sys.argv[1:])]
    )
    out = args.out
    if out is None and not args.dry_run:
        out = timing.RESULTS / f"scale_{report['device']['kind']}.json"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.is_file() and "load" in (kept := json.loads(out.read_text())):
            report["load"] = kept["load"]  # bench/scale_load.py's section
        out.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    print(table(report))
    if out is not None:
        print(f"wrote {out}", file=sys.stderr)
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
