"""What every bench shares: the machine a result was measured on, a timed generation, and the
scores of generated images against a reference run (sdkiln's metrics and the family's own)."""

from __future__ import annotations

import os
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from sdkiln import metrics
from sdkiln.optimizer.evaluate import PSNR_CAP_DB, generate


def machine(packages: tuple[str, ...]) -> dict[str, Any]:
    """The CPU, its cores, the platform, Python, and the versions of ``packages`` (None: absent)."""
    cpu = "unknown"
    if Path("/proc/cpuinfo").is_file():
        lines = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")]
        cpu = lines[0].split(":", 1)[1].strip() if lines else cpu
    versions = {}
    for name in packages:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": int(os.environ.get("OMP_NUM_THREADS", 0)) or None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
    }


def timed_generate(pipe, call, prompts, seeds, batch_size: int, desc: str):
    """Images of ``generate`` and the wall time it took, per batch and per sample."""
    start = time.perf_counter()
    images, _ = generate(pipe, call, prompts, seeds, batch_size, desc)
    seconds = time.perf_counter() - start
    batches = -(-len(prompts) // batch_size)
    return images, {"seconds_per_batch": seconds / batches, "seconds_per_sample": seconds / len(prompts)}


def scores(images: np.ndarray, base_images: np.ndarray | None, spec, prompts: list[str]) -> dict[str, Any]:
    """PSNR (mean, 5th percentile, min, per sample) and SSIM against ``base_images`` when given, and
    the family's own metrics (``ModelSpec.metrics``)."""
    out: dict[str, Any] = {}
    if base_images is not None:
        psnr = np.minimum(metrics.psnr(base_images, images), PSNR_CAP_DB)
        out |= {
            "psnr": float(psnr.mean()),
            "psnr_p5": float(np.percentile(psnr, 5)),
            "psnr_min": float(psnr.min()),
            "ssim": float(metrics.ssim(base_images, images).mean()),
            "psnr_per_sample": [round(float(p), 3) for p in psnr],
        }
    if spec.metrics is not None:
        out |= spec.metrics(images, prompts)
    return out
