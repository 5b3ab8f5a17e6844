"""The quality report: the original and the optimized pipeline on the same held-out prompts and seeds.

Sample i uses prompt ``prompts[i % len(prompts)]`` and seed ``seed + i``. The final latents are
captured after the last step (``calibrate.steps``), so one call yields both
the decoded images and the latents. Samples go in batches sized to the deployment
(``default_eval_batch``), decoded one at a time and, when large, in tiles (``bounded_decode``).
``reference`` (the original) and ``measure`` (the optimized model) run apart, so ``optimize`` makes
the reference before it optimizes the model in place and ``sdkiln eval`` frees the base model before
it loads the package.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from sdkiln import metrics
from sdkiln.calibrate.steps import on_step_end
from sdkiln.model_zoo import ModelSpec
from sdkiln.runtime.cache import cache_runner

PSNR_CAP_DB = 100.0
"""Identical samples have infinite PSNR; reports cap it here so the JSON stays standard."""


def sample_plan(spec: ModelSpec, num_samples: int, seed: int) -> tuple[list[str], list[int]]:
    prompts = [spec.eval_prompts[i % len(spec.eval_prompts)] for i in range(num_samples)]
    return prompts, [seed + i for i in range(num_samples)]


@torch.inference_mode()
def generate(
    pipe,
    call_kwargs: dict[str, Any],
    prompts: list[str],
    seeds: list[int],
    batch_size: int = 16,
    desc: str = "generate",
    inputs: dict[str, Any] | None = None,
) -> tuple[np.ndarray, torch.Tensor]:
    """Images (np, [N, ...] in [0, 1]) and final latents for ``prompts`` with one CPU generator per seed;
    ``inputs``: pipeline inputs besides the call's (``ModelSpec.condition``: a conditioning image), where
    a list holds one entry per prompt and is cut into batches with the prompts. Each batch
    decodes through ``bounded_decode``."""
    images, latents = [], []
    captured: dict[str, torch.Tensor] = {}

    def capture(_pipe, _step, _t, kwargs):
        captured["latents"] = kwargs["latents"].detach().clone()
        return kwargs

    pipe.set_progress_bar_config(disable=True)
    kwargs = {**call_kwargs, "output_type": "np"}
    for start in tqdm(range(0, len(prompts), batch_size), desc=desc, unit="batch", leave=False):
        batch = prompts[start : start + batch_size]
        gens = [torch.Generator("cpu").manual_seed(s) for s in seeds[start : start + batch_size]]
        batch_inputs = {
            k: v[start : start + batch_size] if isinstance(v, list) else v for k, v in (inputs or {}).items()
        }
        if "negative_prompt" in kwargs:
            kwargs["negative_prompt"] = [call_kwargs["negative_prompt"]] * len(batch)
        with on_step_end(pipe, capture) as extra, bounded_decode(pipe, call_kwargs):
            out = pipe(prompt=batch, generator=gens, **extra, **kwargs, **batch_inputs)
        frames = out.frames if hasattr(out, "frames") else out.images
        images.append(np.asarray(frames, dtype=np.float32))
        latents.append(captured.pop("latents").float().cpu())
    return np.concatenate(images), torch.cat(latents)


DEFAULT_EVAL_PIXELS = 4 * 1024 * 1024
"""The pixels (height x width x frames) one quality-report batch generates by default: 4 images at
1024x1024, 16 at 512x512 and below, one 81-frame video at 480x832 (the batch never goes below 1)."""
MAX_EVAL_BATCH = 16


def default_eval_batch(call: dict[str, Any]) -> int:
    """Samples per quality-report batch for the deployment ``call``: what fits ``DEFAULT_EVAL_PIXELS``."""
    pixels = int(call.get("height") or 64) * int(call.get("width") or 64) * int(call.get("num_frames") or 1)
    return max(1, min(MAX_EVAL_BATCH, DEFAULT_EVAL_PIXELS // pixels))


@contextlib.contextmanager
def bounded_decode(pipe, call: dict[str, Any]):
    """Decode one sample at a time (the VAE's slicing) and, for an image or video above
    ``TILED_DECODE_PIXELS``, in tiles (its tiling), as diffusers offers them; left as found after.
    Both the original and the optimized pipeline decode the same way, so the comparison is fair."""
    vae = getattr(pipe, "vae", None)
    pixels = int(call.get("height") or 0) * int(call.get("width") or 0) * int(call.get("num_frames") or 1)
    switched = []
    if vae is not None:
        wanted = [("slicing", True), ("tiling", pixels > TILED_DECODE_PIXELS)]
        for name, on in wanted:
            if on and hasattr(vae, f"enable_{name}") and not getattr(vae, f"use_{name}", False):
                getattr(vae, f"enable_{name}")()
                switched.append(name)
    try:
        yield
    finally:
        for name in switched:
            getattr(vae, f"disable_{name}")()


TILED_DECODE_PIXELS = 1024 * 1024 * 2
"""Above this many pixels (height x width x frames) the report decodes in tiles."""


@dataclass
class Reference:
    """The original model's samples for a quality report, made before the model is optimized (in
    place) or before the package is loaded (``sdkiln eval``): never both models resident."""

    prompts: list[str]
    seeds: list[int]
    images: np.ndarray
    latents: torch.Tensor
    call: dict[str, Any]
    seed: int
    metrics: dict[str, float] | None = None


def reference(
    base,
    spec: ModelSpec,
    num_samples: int,
    call: dict[str, Any] | None = None,
    seed: int = 1000,
    batch_size: int | None = None,
) -> Reference:
    """The original's images and final latents on the report's samples at ``call`` (default: the
    family's defaults), ``batch_size`` samples at a time (default: ``default_eval_batch``)."""
    call = spec.call_kwargs() if call is None else call
    batch_size = batch_size or default_eval_batch(call)
    prompts, seeds = sample_plan(spec, num_samples, seed)
    images, latents = generate(
        base, call, prompts, seeds, batch_size, "original", spec.condition(call, len(prompts))
    )
    theirs = spec.metrics(images, prompts) if spec.metrics is not None else None
    return Reference(prompts, seeds, images, latents, call, seed, theirs)


def measure(
    optimized, spec: ModelSpec, ref: Reference, batch_size: int | None = None
) -> tuple[dict[str, Any], np.ndarray]:
    """The report of ``optimized`` against the reference samples, and its images."""
    call = ref.call
    batch_size = batch_size or default_eval_batch(call)
    # every transformer's schedule (Wan2.2-A14B: each expert has its own)
    runners = [r for a in spec.transformer_attrs if (r := cache_runner(getattr(optimized, a))) is not None]
    for runner in runners:
        runner.reset_counters()
    opt_imgs, opt_lat = generate(
        optimized,
        call,
        ref.prompts,
        ref.seeds,
        batch_size,
        "optimized",
        spec.condition(call, len(ref.prompts)),
    )
    base_imgs, prompts = ref.images, ref.prompts
    psnr = np.minimum(metrics.psnr(base_imgs, opt_imgs), PSNR_CAP_DB)
    report: dict[str, Any] = {
        "psnr": float(psnr.mean()),
        "psnr_p5": float(np.percentile(psnr, 5)),
        "psnr_min": float(psnr.min()),
        "ssim": float(metrics.ssim(base_imgs, opt_imgs).mean()),
        "cosine": float(metrics.cosine(base_imgs, opt_imgs).mean()),
        "latent_rel_l2": float(metrics.rel_l2(ref.latents, opt_lat).mean()),
        "num_samples": len(prompts),
        "steps": call.get("num_inference_steps"),
        "guidance": (  # HunyuanVideo-1.5: its guider component's scale
            call.get(spec.guidance_arg)
            if spec.guidance_arg
            else getattr(optimized.guider, "guidance_scale", None)
        ),
        "seed": ref.seed,
        "prompts": sorted(set(prompts)),
        "psnr_per_sample": [round(float(p), 3) for p in psnr],
    }
    if runners:  # transformer block evaluations with the schedules over those without
        report["block_evaluations_ratio"] = sum(r.block_evaluations for r in runners) / sum(
            r.transformer_calls * r.num_blocks for r in runners
        )
    if spec.metrics is not None:
        report.update(spec.metrics(opt_imgs, prompts))
        report.update({f"base_{k}": v for k, v in (ref.metrics or {}).items()})
    return report, opt_imgs


def compare(
    base,
    optimized,
    spec: ModelSpec,
    num_samples: int,
    call: dict[str, Any] | None = None,
    seed: int = 1000,
    batch_size: int | None = None,
) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """Quality of ``optimized`` against ``base`` at the pipeline ``call`` (default: the family's
    defaults): the report dict and both image arrays (``reference`` then ``measure``)."""
    ref = reference(base, spec, num_samples, call, seed, batch_size)
    report, opt_imgs = measure(optimized, spec, ref, batch_size)
    return report, ref.images, opt_imgs


def _tile(images: np.ndarray, cols: int, scale: int) -> Image.Image:
    imgs = images[:, 0] if images.ndim == 5 else images  # video: first frame
    n, h, w, c = imgs.shape
    rows = -(-n // cols)
    canvas = np.ones((rows * h, cols * w, c), dtype=np.float32)
    for i, img in enumerate(imgs):
        r, col = divmod(i, cols)
        canvas[r * h : (r + 1) * h, col * w : (col + 1) * w] = img
    arr = (np.clip(canvas, 0, 1) * 255).round().astype(np.uint8)
    pil = Image.fromarray(arr[..., 0] if c == 1 else arr)
    return pil.resize((pil.width * scale, pil.height * scale), Image.NEAREST)


def save_side_by_side(base_imgs: np.ndarray, opt_imgs: np.ndarray, path: str | Path, cols: int = 10) -> Path:
    """One PNG: the original's samples on the left, the optimized model's on the right."""
    h = base_imgs.shape[-3]
    scale = max(1, 64 // h)
    left, right = _tile(base_imgs, cols, scale), _tile(opt_imgs, cols, scale)
    gap = 8 * scale
    out = Image.new(left.mode, (left.width * 2 + gap, left.height), 255)
    out.paste(left, (0, 0))
    out.paste(right, (left.width + gap, 0))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out.save(path)
    return path
