"""Every zoo family through optimize and load on one device: W8A8-dynamic in bf16 against the float
model (the package's quality report), then the loaded package's generation, with the kernels that ran.

    python bench/families_device.py --device cuda --out bench/results/families_h100.json
    python bench/families_device.py --device cpu --families flux-kontext-tiny   # the plumbing, on CPU

The families' tiny builds (the real diffusers classes at test size), not their published sizes: what
this shows is that each family's optimize, package and load run on the device's kernels and how far the
quantized model is from the float one there. Real-size steps of the new families need their variants
in tools/random_model.py (issue 33's note). Timings of tiny models measure overheads, not kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import announce, error_text, load_kernels, sync  # noqa: E402

import sdkiln  # noqa: E402
from sdkiln import kernels  # noqa: E402
from sdkiln.model_zoo import get_spec, spec_names  # noqa: E402


def one(name: str, device: torch.device, dtype: torch.dtype, root: Path) -> dict:
    spec = get_spec(name)
    row: dict = {"family": spec.family, "zoo": name}
    t0 = time.perf_counter()
    result = sdkiln.optimize(
        name, "w8a8-dynamic", root / name, eval_samples=2, dtype=dtype, device=device, progress=False
    )
    row["optimize_s"] = round(time.perf_counter() - t0, 2)
    row["quantized_layers"] = len(result.manifest["modules"])
    row["psnr_db_vs_float"] = (result.quality or {}).get("psnr")
    del result
    pipe = sdkiln.load(root / name, device=device)
    pipe.set_progress_bar_config(disable=True)
    call = {**pipe.sdkiln_manifest["call"]["defaults"], "output_type": "latent"}
    inputs = spec.condition(call)
    kernels.reset_kernel_counts()
    times = []
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        pipe(prompt=spec.eval_prompts[0], generator=torch.Generator().manual_seed(0), **call, **inputs)
        sync(device)
        times.append(time.perf_counter() - t0)
    row["generate_s_first"] = round(times[0], 3)
    row["generate_s_warm"] = round(min(times[1:]), 3)
    row["kernels"] = {"/".join(key): calls for key, calls in kernels.kernel_counts().items()}
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--families", default=None, help="comma-separated zoo names (default: all but fmnist-flux)"
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    names = args.families.split(",") if args.families else [n for n in spec_names() if n != "fmnist-flux"]
    report = {
        "benchmark": "families_device",
        "device": announce(device, dtype, "tiny builds of every family"),
        "dtype": args.dtype,
        "device_kernels": load_kernels(device),
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="sdkiln-families-") as tmp:
        for name in names:
            try:
                row = one(name, device, dtype, Path(tmp))
            except Exception as exc:  # one family's failure is its row; the others still run
                row = {"zoo": name, "error": error_text(exc)}
            print(json.dumps(row), flush=True)
            report["rows"].append(row)
            report["passed"] = all("error" not in r for r in report["rows"])
            if args.out is not None:  # after every family: a run stopped by its budget keeps what it did
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(report, indent=1) + "\n")
    report["finished"] = True
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
