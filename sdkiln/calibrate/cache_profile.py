"""How block outputs change across denoising steps: the profile a cache search starts from.

One uncached run of the calibration batch with forward hooks on every block of the stack. For
every step, CFG branch and block it records, against the previous step of the same branch:

* ``rel_l1``: |r_s - r_(s-1)|_1 / |r_(s-1)|_1 of the block's residual r = out - in (image stream);
* ``cosine``: the cosine similarity of r_s and r_(s-1);
* ``norm_ratio``: |r_s|_2 / |in_s|_2, how much the block changes its input at all;

and per step and branch the cheap indicators that threshold-based caches use: the first block's
residual change (First Block Cache, DBCache) and the stack input's change (TeaCache's modulated
input is the stack input plus the timestep; the input change is its model-free part), plus the
change of the transformer's output. Nothing is stored across steps but the previous step's
residuals, in the model's dtype (a bf16 model's in bf16; the statistics are computed in fp32), so
memory does not grow with the step count.

Branches are the calls of one step in order (``call0``, ``call1``; one call for a pipeline that
batches its CFG branches).
"""

from __future__ import annotations

import io
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw

from sdkiln.calibrate.trajectories import Trajectories
from sdkiln.runtime.cache.schedule import BlockLayout
from sdkiln.runtime.denoising import attach_step_tracker, detach_step_tracker, step_tracker

PROFILE_FILE = "calibration/cache_profile.json"
HEATMAP_FILE = "calibration/cache_profile.png"
STREAM = "hidden_states"
METRIC_NOTES = (
    "per block, against the previous step of the same branch: rel_l1 = |r_s - r_(s-1)|_1 / |r_(s-1)|_1 and "
    "cosine of the residual r = out - in (image stream), norm_ratio = |r_s|_2 / |in_s|_2; per step: "
    "first_block_change (block 0's rel_l1), input_change and output_change (rel L1 of the stack input "
    "and of the transformer output)"
)


def _rel_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().sum() / b.abs().sum().clamp_min(1e-12))


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def profile(traj: Trajectories, layout: list[BlockLayout]) -> dict[str, Any]:
    """Run ``traj`` uncached once and return the profile (JSON-ready)."""
    transformer = traj.transformer
    blocks = [getattr(transformer, b.attr)[i] for b in layout for i in range(b.count)]
    outputs = [b.outputs for b in layout for _ in range(b.count)]
    had_tracker = step_tracker(transformer) is not None
    tracker = attach_step_tracker(traj.pipeline, traj.spec.transformer_attr)
    prev: dict[tuple[str, Any], torch.Tensor] = {}
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    current: dict[str, Any] = {"step": None, "call": -1, "row": None}

    def begin(_module, args, kwargs):
        tracker.update()
        step = tracker.step
        current["call"] = current["call"] + 1 if step == current["step"] else 0
        current["step"] = step
        branch = f"call{current['call']}"
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        row = {"step": step, "blocks": [None] * len(blocks)}
        key = (branch, "input")
        if key in prev:
            row["input_change"] = _rel_l1(hidden.float(), prev[key].float())
        prev[key] = hidden.detach().clone()
        current["row"], current["branch"] = row, branch

    def end(_module, _args, _kwargs, output):
        out = output[0] if isinstance(output, tuple) else output.sample
        key = (current["branch"], "output")
        row = current["row"]
        if key in prev:
            row["output_change"] = _rel_l1(out.float(), prev[key].float())
        prev[key] = out.detach().clone()
        first = row["blocks"][0]
        if first is not None and "rel_l1" in first:
            row["first_block_change"] = first["rel_l1"]
        rows[current["branch"]].append(row)

    def block_hook(position: int):
        def hook(_module, args, kwargs, output):
            values = output if isinstance(output, tuple) else (output,)
            raw = dict(zip(outputs[position], values, strict=True))[STREAM]
            out = raw.float()
            inp = kwargs[STREAM].float() if STREAM in kwargs else args[0].float()
            residual = out - inp
            entry = {"norm_ratio": float(residual.norm() / inp.norm().clamp_min(1e-12))}
            key = (current["branch"], position)
            kept = residual.detach().to(raw.dtype)  # kept in the model's dtype, not fp32
            if key in prev:  # both residuals rounded alike, so the rounding adds no change of its own
                now, last = kept.float(), prev[key].float()
                entry |= {"rel_l1": _rel_l1(now, last), "cosine": _cosine(now, last)}
            prev[key] = kept
            current["row"]["blocks"][position] = entry

        return hook

    handles = [transformer.register_forward_pre_hook(begin, with_kwargs=True)]
    handles.append(transformer.register_forward_hook(end, with_kwargs=True))
    handles += [b.register_forward_hook(block_hook(p), with_kwargs=True) for p, b in enumerate(blocks)]
    try:
        after = traj.run()
    finally:
        for h in handles:
            h.remove()
        if not had_tracker:
            detach_step_tracker(transformer)
    traj.set_reference(after)  # the profile run was uncached: its latents are the reference
    return {
        "num_steps": traj.num_steps,
        "num_blocks": len(blocks),
        "samples": len(traj.prompts),
        "prompts": traj.prompts,
        "seeds": traj.seeds,
        "metric_notes": METRIC_NOTES,
        "branches": dict(rows),
    }


def heatmap_png(prof: dict[str, Any], cell: int = 14) -> bytes:
    """Steps (rows) x blocks (columns) of ``rel_l1`` for the first branch, log-scaled from 1e-3 (dark)
    to 1 (bright); step 0 (no previous step) is grey. Returns PNG bytes."""
    rows = next(iter(prof["branches"].values()))
    t, n = len(rows), prof["num_blocks"]
    margin = 40
    img = Image.new("RGB", (margin + n * cell + 8, margin + t * cell + 8), "white")
    draw = ImageDraw.Draw(img)
    for s, row in enumerate(rows):
        for b, entry in enumerate(row["blocks"]):
            value = None if entry is None else entry.get("rel_l1")
            if value is None:
                color = (160, 160, 160)
            else:
                x = float(np.clip((np.log10(max(value, 1e-3)) + 3) / 3, 0, 1))
                color = (int(255 * x), int(200 * x * (1 - x) * 4 * 0.6 + 40 * x), int(255 * (1 - x) * 0.8))
            x0, y0 = margin + b * cell, margin + s * cell
            draw.rectangle([x0, y0, x0 + cell - 1, y0 + cell - 1], fill=color)
        if s % 5 == 0:
            draw.text((4, margin + s * cell), str(s), fill="black")
    for b in range(n):
        draw.text((margin + b * cell + 2, margin - 14), str(b), fill="black")
    draw.text((4, 4), "rel. L1 change of block residuals: rows = steps, columns = blocks", fill="black")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
