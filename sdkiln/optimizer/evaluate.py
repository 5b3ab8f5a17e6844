"""The quality report: the original and the optimized pipeline on the same held-out prompts and seeds.

Sample i uses prompt ``prompts[i % len(prompts)]`` and seed ``seed + i``. The final latents are
captured through the pipeline's ``callback_on_step_end`` at the last step, so one call yields both
the decoded images and the latents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from sdkiln import metrics
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
) -> tuple[np.ndarray, torch.Tensor]:
    """Images (np, [N, ...] in [0, 1]) and final latents for ``prompts`` with one CPU generator per seed."""
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
        if "negative_prompt" in kwargs:
            kwargs["negative_prompt"] = [call_kwargs["negative_prompt"]] * len(batch)
        out = pipe(
            prompt=batch,
            generator=gens,
            callback_on_step_end=capture,
            callback_on_step_end_tensor_inputs=["latents"],
            **kwargs,
        )
        frames = out.frames if hasattr(out, "frames") else out.images
        images.append(np.asarray(frames, dtype=np.float32))
        latents.append(captured.pop("latents").float().cpu())
    return np.concatenate(images), torch.cat(latents)


def compare(
    base,
    optimized,
    spec: ModelSpec,
    num_samples: int,
    call: dict[str, Any] | None = None,
    seed: int = 1000,
    batch_size: int = 16,
) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """Quality of ``optimized`` against ``base`` at the pipeline ``call`` (default: the family's
    defaults): the report dict and both image arrays."""
    call = spec.call_kwargs() if call is None else call
    prompts, seeds = sample_plan(spec, num_samples, seed)
    base_imgs, base_lat = generate(base, call, prompts, seeds, batch_size, "original")
    runner = cache_runner(getattr(optimized, spec.transformer_attr))
    if runner is not None:
        runner.reset_counters()
    opt_imgs, opt_lat = generate(optimized, call, prompts, seeds, batch_size, "optimized")
    psnr = np.minimum(metrics.psnr(base_imgs, opt_imgs), PSNR_CAP_DB)
    report: dict[str, Any] = {
        "psnr": float(psnr.mean()),
        "psnr_p5": float(np.percentile(psnr, 5)),
        "psnr_min": float(psnr.min()),
        "ssim": float(metrics.ssim(base_imgs, opt_imgs).mean()),
        "cosine": float(metrics.cosine(base_imgs, opt_imgs).mean()),
        "latent_rel_l2": float(metrics.rel_l2(base_lat, opt_lat).mean()),
        "num_samples": num_samples,
        "steps": call.get("num_inference_steps"),
        "guidance": call.get(spec.guidance_arg),
        "seed": seed,
        "prompts": sorted(set(prompts)),
        "psnr_per_sample": [round(float(p), 3) for p in psnr],
    }
    if runner is not None:  # transformer block evaluations with the schedule over those without
        report["block_evaluations_ratio"] = runner.block_evaluations / (
            runner.transformer_calls * runner.num_blocks
        )
    if spec.metrics is not None:
        ours, theirs = spec.metrics(opt_imgs, prompts), spec.metrics(base_imgs, prompts)
        report.update(ours)
        report.update({f"base_{k}": v for k, v in theirs.items()})
    return report, base_imgs, opt_imgs


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
