"""Measure the embedded model: class accuracy, per-class accuracy and FD-FMNIST, plus a sample grid.

``python tools/fmnist/measure.py --steps 20 28 50 --per-class 20``

Each class is sampled from its canonical prompt (``text.eval_prompt``) with one generator per
image, seeded ``seed + 1000 * class + index``, so every number here is reproducible. The grid
(one row per class, ``--grid-columns`` samples each) comes from the run at ``--grid-steps``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import PIL.Image
import torch

from sdkiln.model_zoo.fmnist.classifier import classify
from sdkiln.model_zoo.fmnist.data import CLASS_NAMES
from sdkiln.model_zoo.fmnist.metrics import fd_fmnist, per_class_accuracy
from sdkiln.model_zoo.fmnist.pipeline import DEFAULT_GUIDANCE, FmnistFluxPipeline, new_scheduler
from sdkiln.model_zoo.fmnist.text import eval_prompt, load_text_encoder

DEFAULT_GRID = Path(__file__).resolve().parents[2] / "docs" / "img" / "fmnist_samples.png"


def generate(
    pipe: FmnistFluxPipeline, per_class: int, steps: int, guidance: float, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``(images [10 * per_class, 32, 32, 1] in [0,1], labels)``, one pipeline call per class."""
    images, labels = [], []
    for c in range(len(CLASS_NAMES)):
        generators = [torch.Generator().manual_seed(seed + 1000 * c + j) for j in range(per_class)]
        out = pipe(
            eval_prompt(c),
            num_images_per_prompt=per_class,
            num_inference_steps=steps,
            guidance_scale=guidance,
            generator=generators,
            output_type="np",
        )
        images.append(out.images)
        labels += [c] * per_class
    return np.concatenate(images), np.array(labels)


def quick_accuracy(transformer, per_class: int, steps: int, guidance: float) -> float:
    """Class accuracy of ``transformer`` (e.g. the EMA copy during training) on a few samples."""
    text_encoder, tokenizer = load_text_encoder()
    pipe = FmnistFluxPipeline(transformer, text_encoder, tokenizer, new_scheduler())
    pipe.set_progress_bar_config(disable=True)
    images, labels = generate(pipe, per_class, steps, guidance)
    return float((classify(images)[0] == labels).mean())


def evaluate(pipe: FmnistFluxPipeline, per_class: int, steps: int, guidance: float, seed: int = 0) -> dict:
    start = time.time()
    images, labels = generate(pipe, per_class, steps, guidance, seed)
    predicted, features = classify(images)
    per_class_acc = per_class_accuracy(predicted, labels)
    return {
        "steps": steps,
        "guidance": guidance,
        "samples": len(labels),
        "class_accuracy": float((predicted == labels).mean()),
        "fd_fmnist": fd_fmnist(features),
        "per_class_accuracy": {CLASS_NAMES[c]: acc for c, acc in per_class_acc.items()},
        "seconds": round(time.time() - start, 1),
        "_images": images,
    }


def save_grid(images: np.ndarray, labels: np.ndarray, columns: int, path: Path, scale: int = 2) -> None:
    rows = []
    for c in range(len(CLASS_NAMES)):
        row = images[labels == c][:columns, ..., 0]
        rows.append(np.concatenate(list(row), axis=1))
    grid = (np.concatenate(rows, axis=0) * 255).round().astype(np.uint8)
    img = PIL.Image.fromarray(grid)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.resize((img.width * scale, img.height * scale), PIL.Image.NEAREST).save(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, nargs="+", default=[28])
    parser.add_argument("--per-class", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=DEFAULT_GUIDANCE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grid", type=Path, default=DEFAULT_GRID)
    parser.add_argument("--grid-steps", type=int, default=28)
    parser.add_argument("--grid-columns", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    pipe = FmnistFluxPipeline.from_shipped()
    pipe.set_progress_bar_config(disable=True)
    results = []
    for steps in args.steps:
        r = evaluate(pipe, args.per_class, steps, args.guidance, args.seed)
        images = r.pop("_images")
        if steps == args.grid_steps:
            labels = np.repeat(np.arange(len(CLASS_NAMES)), args.per_class)
            save_grid(images, labels, min(args.grid_columns, args.per_class), args.grid)
            r["grid"] = str(args.grid)
        results.append(r)
        per_class = ", ".join(f"{k} {v:.2f}" for k, v in r["per_class_accuracy"].items())
        print(
            f"{steps} steps, guidance {args.guidance}, {r['samples']} samples: class accuracy "
            f"{r['class_accuracy']:.4f}, FD-FMNIST {r['fd_fmnist']:.2f} ({r['seconds']} s)\n  per class: {per_class}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
