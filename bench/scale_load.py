"""``sdkiln.load`` at real width: the loader's peak and resident memory against the package's bytes.

Per model (``tools/random_model.py VARIANT --depth N --dtype bf16``: real-width random weights, the
dtype the originals ship in), two packages are written by ``sdkiln optimize DIR --recipe R
--eval-samples 0`` (``none``: the float model; ``w8a8-dynamic``: every block Linear int8), each
loaded by a fresh child process, ``sdkiln.load(PKG, device="cpu")``, which reports:

* ``peak_rss_bytes``: its resident high-water mark over the whole process (``ru_maxrss``: the
  imports, the load, nothing else); ``resident_bytes``: its resident size once ``load`` returned
  (``VmRSS``, after a garbage collection); ``imports_rss_bytes``: resident after importing torch,
  diffusers, transformers and sdkiln, before the load;
* ``cold_start``: the load's phases (``pipe.sdkiln_cold_start``).

The bounds (issue 32): peak <= 1.1 x package + 0.5 GB and resident <= 1.05 x package + 0.5 GB
(decimal GB; the package's bytes as on disk). For FLUX the smallest W8A8 transformer's files must
be at most 0.6 x the bf16 transformer's (``transformer_ratio``, against the model directory's
transformer): FLUX is also written with ``w8a8-dynamic+w8a16``, its adaLN modulations int8 too.
The rows go under ``"load"`` in ``bench/results/scale_<device kind>.json``, beside what
``bench/scale.py`` measured there.

On a GPU (``--device cuda --full``, ``make gpu-pass``): the full-size FLUX.1-dev directory, its
W8A8 package written by ``optimize --device cuda``, then loaded to the GPU twice by fresh processes
with ``CompileConfig(regional=True)`` and a compile cache in the work directory, each generating one
1024x1024 step: the first a cold start (the cache empty), the second a warm one (from the cache).
Each reports its peak host RSS (bound: the largest shard + 2 GB), its peak device memory
(``torch.cuda.max_memory_allocated``), its phases and its seconds from the call to ``load`` to the
end of the first step (goals: 60 s cold, 15 s warm). ``--dry-run`` prints the commands only.

    python bench/scale_load.py            # FLUX.1-dev and Wan2.1-T2V-14B at depth 2 (about 12 GB of disk)
    python bench/scale_load.py --device cuda --full
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import scale  # noqa: E402  (bench/scale.py: building the model directories, the child environment)
import timing  # noqa: E402
import torch  # noqa: E402

PEAK_FACTOR, RESIDENT_FACTOR, EXTRA_BYTES = 1.1, 1.05, 500_000_000
TRANSFORMER_RATIO_LIMIT = 0.6
RECIPES = ("none", "w8a8-dynamic")
WEIGHT_ONLY_AFTER = "w8a8-dynamic+w8a16"
"""FLUX only: its adaLN modulations (``weight_only_layers``) int8 too, activations float."""
GPU_HOST_EXTRA_BYTES = 2_000_000_000
COLD_GOAL_S, WARM_GOAL_S = 60.0, 15.0
CHILD = """
import gc, json, resource, sys, time
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
import torch, diffusers, transformers, sdkiln
from sdkiln.configs import CompileConfig
imports = rss()
package, device, cache = sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None
compile = None if cache is None else CompileConfig(regional=True, cache_dir=cache)
pipe = sdkiln.load(package, device=device, compile=compile)
gc.collect()
out = {"imports_rss_bytes": imports, "resident_bytes": rss()}
if device != "cpu":
    pipe(prompt="a photo of a cat", num_inference_steps=1, height=1024, width=1024, output_type="latent",
         generator=torch.Generator(device).manual_seed(0))
    torch.cuda.synchronize()
    out["peak_device_bytes"] = torch.cuda.max_memory_allocated()
    out["to_first_step_s"] = round(pipe.sdkiln_cold_start.total, 3)
    from torch._dynamo.utils import counters
    out["inductor"] = {k: v for k, v in counters["inductor"].items() if "cache" in k}
out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out["cold_start"] = {k: round(v, 3) for k, v in pipe.sdkiln_cold_start.phases.items()}
print(json.dumps(out))
"""


def measure(model_dir: Path, package: Path, recipe: str, log: Path, video: bool) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "sdkiln", "optimize", str(model_dir), "--recipe", recipe]
    cmd += ["--eval-samples", "0", "--out", str(package), "--force", "--height", "128", "--width", "128"]
    cmd += ["--frames", "9"] if video else []
    row: dict[str, Any] = {"recipe": recipe, "optimize_command": shlex.join(cmd)}
    print(f"[{package.name}] {shlex.join(cmd)}", file=sys.stderr)
    made = scale.run_measured(cmd, log, scale.child_env(), None)
    row["optimize"] = made
    if made["returncode"] != 0:
        return row | {"status": "failed", "error_tail": scale.tail(log)}
    row["package_bytes"] = scale.du(package)
    row["transformer_bytes"] = scale.du(package / "transformer")
    row["transformer_files"] = sorted(p.name for p in (package / "transformer").iterdir())
    loaded = load_child(package, "cpu")
    if "error_tail" in loaded:
        return row | {"status": "failed"} | loaded
    row |= loaded
    size = row["package_bytes"]
    row["peak_ratio"] = round(row["peak_rss_bytes"] / size, 4)
    row["resident_ratio"] = round(row["resident_bytes"] / size, 4)
    row["peak_bound_bytes"] = int(PEAK_FACTOR * size + EXTRA_BYTES)
    row["resident_bound_bytes"] = int(RESIDENT_FACTOR * size + EXTRA_BYTES)
    row["within_bound"] = (
        row["peak_rss_bytes"] <= row["peak_bound_bytes"]
        and row["resident_bytes"] <= row["resident_bound_bytes"]
    )
    return row | {"status": "ok"}


def full_depth_ratio(variant: str) -> dict[str, Any]:
    """The W8A8 (dynamic) transformer's bytes over the bf16 one's at the variant's full depth,
    computed from its real config built on the meta device (nothing is written): each block Linear
    the recipe quantizes is an int8 weight plus float32 scale and offset and a bf16 bias, everything
    else bf16; and the same with ``+w8a16``, the family's weight-only layers (FLUX's adaLN
    modulations) int8 too, with the same per-channel float32 scale and offset."""
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    from sdkiln.model_zoo import get_spec

    family, cls = (
        ("flux", FluxTransformer2DModel) if variant.startswith("flux") else ("wan", WanTransformer3DModel)
    )
    config = json.loads(
        (ROOT / "tools" / "model_configs" / variant / "transformer" / "config.json").read_text()
    )
    with torch.device("meta"):
        model = cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    spec = get_spec(family)
    bf16 = sum(p.numel() for p in model.parameters()) * 2
    quantized = float_listed = weight_only_saving = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not name.startswith(spec.block_prefixes()):
            continue
        weight = module.weight.numel()
        if spec.is_float_layer(name):  # FLUX's adaLN modulations: int8 only under +w8a16
            float_listed += weight
            weight_only_saving += weight - 8 * module.out_features
        else:  # int8 weight (1 byte instead of 2), float32 scale and offset per output channel
            quantized += weight - 8 * module.out_features
    w8a8 = bf16 - quantized
    return {
        "bf16_bytes": bf16,
        "w8a8_bytes": w8a8,
        "ratio": round(w8a8 / bf16, 4),
        "weight_only_layers_bytes": 2 * float_listed,
        "w8a8_dynamic+w8a16_bytes": w8a8 - weight_only_saving,
        "w8a8_dynamic+w8a16_ratio": round((w8a8 - weight_only_saving) / bf16, 4),
    }


def load_child(package: Path, device: str, cache: Path | None = None) -> dict[str, Any]:
    """A fresh process loads ``package`` (and, on a GPU, runs one 1024x1024 step): what it reports."""
    cmd = [sys.executable, "-c", CHILD, str(package), device, *([str(cache)] if cache else [])]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=scale.child_env(), cwd=ROOT)
    wall = round(time.perf_counter() - started, 3)
    if done.returncode != 0:
        return {"load_wall_seconds": wall, "error_tail": done.stderr[-4000:]}
    return {"load_wall_seconds": wall} | json.loads(done.stdout.strip().splitlines()[-1])


def run_gpu(workdir: Path, dry_run: bool) -> list[dict[str, Any]]:
    """The full-size FLUX.1-dev W8A8 package on the GPU: a cold and a warm start (module docstring)."""
    case = scale.Case("flux-dev", None, "w8a8-dynamic", 1024, 1024, 1, 512, 0)
    model_dir, package = workdir / case.model, workdir / f"{case.model}-w8a8-dynamic.pkg"
    build = scale.build_command(case, model_dir)
    make = [
        sys.executable,
        "-m",
        "sdkiln",
        "optimize",
        str(model_dir),
        "--recipe",
        "w8a8-dynamic",
        "--device",
        "cuda",
    ]
    make += ["--eval-samples", "0", "--out", str(package), "--force"]
    row: dict[str, Any] = {
        "model": case.model,
        "variant": "flux-dev",
        "recipe": "w8a8-dynamic",
        "device": "cuda",
    }
    row |= {"build_command": shlex.join(build), "optimize_command": shlex.join(make)}
    if dry_run:
        print(
            f"build: {row['build_command']}\noptimize: {row['optimize_command']}\nload: twice, compiled, cache in the workdir"
        )
        return [row | {"status": "dry run"}]
    for what, cmd in (("build", build), ("optimize", make)):
        done = scale.run_measured(cmd, workdir / f"{what}.log", scale.child_env(), None)
        row[what] = done
        if done["returncode"] != 0:
            return [row | {"status": "failed", "error_tail": scale.tail(workdir / f"{what}.log")}]
    shutil.rmtree(model_dir, ignore_errors=True)
    row["package_bytes"] = scale.du(package)
    shards = [p for p in (package / "transformer").glob("*.safetensors")]
    row["largest_shard_bytes"] = max(p.stat().st_size for p in shards)
    row["host_bound_bytes"] = row["largest_shard_bytes"] + GPU_HOST_EXTRA_BYTES
    cache = workdir / "compile-cache"
    for start in ("cold", "warm"):
        got = load_child(package, "cuda", cache)
        row[start] = got
        if "error_tail" in got:
            return [row | {"status": "failed"}]
    row["within_bound"] = all(row[s]["peak_rss_bytes"] <= row["host_bound_bytes"] for s in ("cold", "warm"))
    row["goals_met"] = {
        "cold_60s": row["cold"]["to_first_step_s"] <= COLD_GOAL_S,
        "warm_15s": row["warm"]["to_first_step_s"] <= WARM_GOAL_S,
    }
    return [row | {"status": "ok"}]


def run_model(variant: str, depth: int, workdir: Path) -> list[dict[str, Any]]:
    case = scale.Case(variant, depth, "none", 128, 128, 4, 64, 0)
    model_dir = workdir / case.model
    cmd = scale.build_command(case, model_dir)
    print(f"[{case.model}] building: {shlex.join(cmd)}", file=sys.stderr)
    built = scale.run_measured(cmd, workdir / f"{case.model}.build.log", scale.child_env(), None)
    if built["returncode"] != 0:
        return [
            {
                "model": case.model,
                "status": "failed",
                "error_tail": scale.tail(workdir / f"{case.model}.build.log"),
            }
        ]
    bf16_transformer = scale.du(model_dir / "transformer")
    rows = []
    for recipe in (*RECIPES, WEIGHT_ONLY_AFTER) if variant.startswith("flux") else RECIPES:
        package = workdir / f"{case.model}-{recipe}.pkg"
        row = {
            "model": case.model,
            "variant": variant,
            "depth": depth,
            "model_transformer_bytes": bf16_transformer,
        }
        row |= measure(model_dir, package, recipe, workdir / f"{package.name}.log", variant.startswith("wan"))
        if row.get("transformer_bytes"):
            row["transformer_ratio"] = round(row["transformer_bytes"] / bf16_transformer, 4)
        rows.append(row)
        shutil.rmtree(package, ignore_errors=True)
    shutil.rmtree(model_dir, ignore_errors=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    gb = lambda n: f"{n / 1e9:.2f}" if isinstance(n, int) else "-"  # noqa: E731
    lines = [
        "| package | GB | transformer / bf16 | imports GB | peak GB | peak ratio | resident GB | resident ratio | ok |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} {r.get('recipe', '')} | {gb(r.get('package_bytes'))} | {r.get('transformer_ratio', '-')} | "
            f"{gb(r.get('imports_rss_bytes'))} | {gb(r.get('peak_rss_bytes'))} | {r.get('peak_ratio', '-')} | "
            f"{gb(r.get('resident_bytes'))} | {r.get('resident_ratio', '-')} | {r.get('within_bound', r['status'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--models", default="flux-dev,wan2.1-t2v-14b")
    parser.add_argument(
        "--out", type=Path, help="JSON to merge into (default: bench/results/scale_<kind>.json)"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--full", action="store_true", help="with --device cuda: full-size FLUX.1-dev W8A8")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not args.dry_run and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    (ROOT / "build" / "scale").mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(dir=ROOT / "build" / "scale"))
    started = time.perf_counter()
    try:
        if args.device == "cuda" or args.full:
            rows = run_gpu(workdir, args.dry_run)
        elif args.dry_run:
            rows = [{"model": f"{v}-d{args.depth}", "status": "dry run"} for v in args.models.split(",")]
        else:
            rows = [
                row for variant in args.models.split(",") for row in run_model(variant, args.depth, workdir)
            ]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.dry_run:
        print(json.dumps(rows, indent=1))
        return 0
    device = scale.machine(args.device)
    w8a8 = [
        r
        for r in rows
        if str(r.get("recipe", "")).startswith("w8a8-dynamic") and r["model"].startswith("flux")
    ]
    smallest = {}
    for r in w8a8:  # per FLUX model (the bound), its smallest W8A8 package's transformer
        smallest[r["model"]] = min(smallest.get(r["model"], 9.0), r.get("transformer_ratio", 9.0))
    passed = all(r["status"] == "ok" and r["within_bound"] for r in rows) and all(
        ratio <= TRANSFORMER_RATIO_LIMIT for ratio in smallest.values()
    )
    full_depth = {v: full_depth_ratio(v) for v in ("flux-dev", "wan2.1-t2v-14b")}
    section = {
        "benchmark": "sdkiln.load at real width: peak and resident RSS against the package's bytes (bench/scale_load.py)",
        "command": shlex.join(
            ["python", "bench/scale_load.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "bounds": {
            "peak": [PEAK_FACTOR, EXTRA_BYTES],
            "resident": [RESIDENT_FACTOR, EXTRA_BYTES],
            "w8a8_flux_transformer_ratio": TRANSFORMER_RATIO_LIMIT,
        },
        "device": device,
        "rows": rows,
        "full_depth_w8a8_transformer": full_depth,
        "passed": passed,
        "total_seconds": round(time.perf_counter() - started, 1),
    }
    out = args.out or timing.RESULTS / f"scale_{device['kind']}.json"
    report = json.loads(out.read_text()) if out.is_file() else {}
    report["load"] = section
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    print(table(rows))
    print(f"wrote {out} (load)", file=sys.stderr)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
