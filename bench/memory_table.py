"""The memory table's estimates against what a resident run measures, at real width on this machine.

Each case builds a real-config model directory with random weights and cut depth
(``tools/random_model.py VARIANT --depth N --dtype bf16``), optimizes it in float32 on the CPU
(``te-w8a16+w8a8-dynamic`` at the case's deployment, no quality report: ``python -m sdkiln optimize``,
a child process), then loads the package with the resident plan and generates one image or video
of one denoising step at that deployment in a second child (``--measure``). On the CPU the device
is the host, so the table's device bytes are the child's resident bytes. That child reads its own
``VmRSS`` and resets and reads its ``VmHWM`` (``/proc/self/clear_refs``) around each phase:

* ``baseline``: after importing torch, diffusers, transformers and sdkiln;
* ``load_peak`` and ``loaded``: the high-water mark while ``sdkiln.load`` ran, and what stays after,
  both above the baseline: against the table's bytes of every component (``model_bytes``);
* ``run_peak``: the high-water mark of the generation above the baseline: against the table's
  resident peak (``resident_peak``, the components plus the largest activation estimate);
* ``activations``: ``run_peak - loaded``: against that largest activation estimate (a transformer
  call's, or the VAE decode's);
* ``moments``: per component call (each text encoder, the transformer, the VAE's decode), the
  high-water mark reset before it, read after it, above the resident bytes it found: against the
  table's estimate for that moment (an encoder's, a transformer call's, the decode's);
* ``vae.decode tiled``: the same latents decoded again in tiles (``residency.tile_decode``, what the
  ``+tiled`` plans run), its moment against the tiled estimate, its seconds and its PSNR against the
  untiled decode (``tiled_decode``).

``ratio`` is measured over estimated; the acceptance is the resident peak within 20% (0.8 to 1.2).

    python bench/memory_table.py                     # the CPU cases, about 15 minutes and 20 GB of disk
    python bench/memory_table.py --cases flux-dev-d2-512
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import harness  # noqa: E402
import scale  # noqa: E402  (bench/scale.py: the child runner and its environment)

RECIPE = "te-w8a16+w8a8-dynamic"
BOUND = (0.8, 1.2)


@dataclass(frozen=True)
class Case:
    id: str
    variant: str
    depth: int
    height: int
    width: int
    max_sequence_length: int
    frames: int | None = None


CASES = (
    Case("flux-dev-d2-512", "flux-dev", 2, 512, 512, 512),
    Case("flux-dev-d2-1024", "flux-dev", 2, 1024, 1024, 512),
    Case("wan2.1-1.3b-d2-480p", "wan2.1-t2v-1.3b", 2, 480, 832, 512, frames=9),
)


def _proc_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    raise KeyError(key)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)


def measure(package: Path) -> dict[str, Any]:
    """In this process: the phases' resident bytes (module docstring) and the table's estimates."""
    import diffusers  # noqa: F401
    import torch
    import transformers  # noqa: F401

    import sdkiln
    from sdkiln.configs import MemoryConfig
    from sdkiln.model_zoo import get_spec
    from sdkiln.runtime.memory.residency import tile_decode
    from sdkiln.runtime.memory.table import memory_table
    from sdkiln.runtime.package import open_package

    torch.set_grad_enabled(False)
    baseline = _proc_kib("VmRSS") * 1024
    _reset_peak()
    pipe = sdkiln.load(package, device="cpu", memory=MemoryConfig(plan="resident"))
    load_peak, loaded = _proc_kib("VmHWM") * 1024 - baseline, _proc_kib("VmRSS") * 1024 - baseline
    manifest = pipe.sdkiln_manifest
    spec = get_spec(manifest["model"]["family"], manifest["model"].get("variant"))
    call = {**manifest["call"]["defaults"], "num_inference_steps": 1, "output_type": "np"}
    moments: dict[str, int] = {}
    found: list[int] = [0]

    def before(*_: Any) -> None:
        _reset_peak()
        found[0] = _proc_kib("VmRSS")

    def after(name: str) -> Any:
        def hook(*_: Any) -> None:
            rise = (_proc_kib("VmHWM") - found[0]) * 1024  # above what the call found
            moments[name] = max(moments.get(name, 0), rise)

        return hook

    names = [n for n, c in pipe.components.items() if isinstance(c, torch.nn.Module) and n != "vae"]
    for name in names:
        getattr(pipe, name).register_forward_pre_hook(before)
        getattr(pipe, name).register_forward_hook(after(name))
    decode = pipe.vae.decode

    decoded: list[Any] = []

    def timed_decode(*args: Any, **kwargs: Any) -> Any:
        before()
        start = time.perf_counter()
        out = decode(*args, **kwargs)
        after("vae.decode")()
        decoded.append((args, kwargs, out, time.perf_counter() - start))
        return out

    pipe.vae.decode = timed_decode
    _reset_peak()
    start = time.perf_counter()
    pipe(
        prompt="a photo of a red bus",
        generator=torch.Generator().manual_seed(0),
        **call,
        **spec.condition(call),
    )
    seconds = time.perf_counter() - start
    run_peak = max(_proc_kib("VmHWM") * 1024 - baseline, *(m + loaded for m in moments.values()))
    # the same latents decoded again in tiles (the +tiled plans' decode), and how far that is
    args, kwargs, untiled, untiled_seconds = decoded[0]
    tile_decode(pipe.vae)
    tiled_seconds = time.perf_counter()
    before()
    tiled = decode(*args, **kwargs)
    after("vae.decode tiled")()
    tiled_seconds = time.perf_counter() - tiled_seconds
    a, b = (
        untiled[0] if isinstance(untiled, tuple) else untiled.sample,
        tiled[0] if isinstance(tiled, tuple) else tiled.sample,
    )
    tiled_psnr = float(10 * torch.log10(4.0 / (a.float() - b.float()).square().mean()))  # outputs in [-1, 1]
    table = memory_table(open_package(package))
    model = sum(c["memory_bytes"] for c in table["components"].values())
    est = table["estimates"]
    largest = max(est["transformer_call_activation_bytes"], est["decode_activation_bytes"])
    resident = table["plans"]["resident"]["peak_bytes"]
    return {
        "baseline_bytes": baseline,
        "deployment": table["deployment"],
        "components": {n: c["memory_bytes"] for n, c in table["components"].items()},
        "estimates": est,
        "load": {"measured_peak": load_peak, "measured": loaded, "estimated": model, "ratio": loaded / model},
        "load_peak_ratio": load_peak / model,
        "activations": {
            "measured": run_peak - loaded,
            "estimated": largest,
            "ratio": (run_peak - loaded) / largest,
        },
        "resident_peak": {"measured": run_peak, "estimated": resident, "ratio": run_peak / resident},
        "moments": {
            name: {
                "measured": moments[name],
                "estimated": est["decode_activation_bytes"]
                if name == "vae.decode"
                else est["decode_tiled_activation_bytes"]
                if name == "vae.decode tiled"
                else est["transformer_call_activation_bytes"]
                if name == "transformer"
                else est["encode_activation_bytes"],
            }
            for name in moments
        },
        "generate_seconds": round(seconds, 1),
        "tiled_decode": {
            "seconds": round(tiled_seconds, 1),
            "untiled_seconds": round(untiled_seconds, 1),
            "psnr_db_vs_untiled": tiled_psnr,
        },
        "plan": pipe.sdkiln_memory.plan.name,
        "widened": sorted(pipe.sdkiln_widened),
    }


def run_case(case: Case, workdir: Path, keep: bool) -> dict[str, Any]:
    model_dir, package = workdir / case.id, workdir / f"{case.id}.pkg"
    env = scale.child_env()
    row: dict[str, Any] = {"case": asdict(case), "recipe": RECIPE}
    steps = [
        ("build", [sys.executable, "tools/random_model.py", case.variant, "--out", str(model_dir),
                   "--depth", str(case.depth), "--dtype", "bf16", "--force"]),
        ("optimize", [sys.executable, "-m", "sdkiln", "optimize", str(model_dir), "--device", "cpu",
                      "--dtype", "float32", "--recipe", RECIPE, "--out", str(package), "--force",
                      "--height", str(case.height), "--width", str(case.width), "--steps", "1",
                      "--max-sequence-length", str(case.max_sequence_length), "--eval-samples", "0",
                      *([] if case.frames is None else ["--frames", str(case.frames)])]),
        ("measure", [sys.executable, str(Path(__file__).resolve()), "--measure", str(package),
                     "--json", str(workdir / f"{case.id}.json")]),
    ]  # fmt: skip
    try:
        for name, cmd in steps:
            log = workdir / f"{case.id}.{name}.log"
            result = scale.run_measured(cmd, log, env, None)
            row[f"{name}_seconds"] = result["wall_seconds"]
            if result["returncode"] != 0:
                row["error"] = f"{name} failed ({result['returncode']}): {scale.tail(log, 15)}"
                return row
            print(f"{case.id}: {name} done in {result['wall_seconds']:.0f} s", file=sys.stderr, flush=True)
        row.update(json.loads((workdir / f"{case.id}.json").read_text()))
    finally:
        if not keep:
            shutil.rmtree(model_dir, ignore_errors=True)
            shutil.rmtree(package, ignore_errors=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default="*", help="fnmatch pattern over case ids")
    parser.add_argument("--workdir", type=Path, default=ROOT / "build" / "memory_table")
    parser.add_argument("--keep", action="store_true", help="keep the model directories and packages")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "memory_table_cpu.json")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure is not None:
        args.json.write_text(json.dumps(measure(args.measure), indent=1))
        return 0
    import fnmatch

    args.workdir.mkdir(parents=True, exist_ok=True)
    rows = [run_case(c, args.workdir, args.keep) for c in CASES if fnmatch.fnmatch(c.id, args.cases)]
    report = {
        "bench": "memory_table",
        "machine": harness.machine(("torch", "diffusers", "transformers")),
        "bound": list(BOUND),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    gib = 2**30
    print(
        f"{'case':<22} {'model est':>9} {'loaded':>7} {'act est':>8} {'act':>7} {'peak est':>9} {'peak':>7} {'ratio':>6}"
    )
    failed = False
    for r in rows:
        if "error" in r:
            print(f"{r['case']['id']:<22} {r['error']}")
            failed = True
            continue
        load, act, peak = r["load"], r["activations"], r["resident_peak"]
        ok = BOUND[0] <= peak["ratio"] <= BOUND[1]
        failed |= not ok
        print(
            f"{r['case']['id']:<22} {load['estimated'] / gib:8.2f}G {load['measured'] / gib:6.2f}G "
            f"{act['estimated'] / gib:7.2f}G {act['measured'] / gib:6.2f}G {peak['estimated'] / gib:8.2f}G "
            f"{peak['measured'] / gib:6.2f}G {peak['ratio']:6.2f}{'' if ok else '  outside ' + str(BOUND)}"
        )
    print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
