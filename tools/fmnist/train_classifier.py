"""Train the metric classifier and write ``weights/classifier.{safetensors,json}``.

``python tools/fmnist/train_classifier.py [--epochs 8] [--seed 0]``

Augmentation: random horizontal flips and shifts of up to two pixels on the 32x32 canvas (the
garment stays inside the canvas's padding), so the classifier does not depend on exact centring,
which generated images do not promise.

Deterministic for a seed on a given torch build and thread count. After training it measures
accuracy on the whole test split and stores the test images' penultimate feature mean and
covariance, the reference side of FD-FMNIST, so evaluation needs no data set at run time.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from tqdm import tqdm

from sdkiln.model_zoo.fmnist.classifier import (
    CLASSIFIER_WEIGHTS,
    ClassifierConfig,
    FmnistClassifier,
    save_classifier,
)
from sdkiln.model_zoo.fmnist.data import load_split, to_canvas


def _augment(x: torch.Tensor, generator: torch.Generator, max_shift: int = 2) -> torch.Tensor:
    """Random horizontal flip and a random shift of up to ``max_shift`` pixels per image."""
    flip = torch.rand(len(x), generator=generator) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    padded = nn.functional.pad(x, (max_shift,) * 4, value=-1.0)
    side = x.shape[-1]
    dy, dx = torch.randint(0, 2 * max_shift + 1, (2, len(x)), generator=generator)
    rows = (dy[:, None] + torch.arange(side))[:, None, :, None].expand(-1, 1, -1, padded.shape[-1])
    x = padded.gather(2, rows)
    cols = (dx[:, None] + torch.arange(side))[:, None, None, :].expand(-1, 1, side, -1)
    return x.gather(3, cols)


@torch.no_grad()
def _evaluate(model: FmnistClassifier, x: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
    model.eval()
    feats = torch.cat([model.features(chunk) for chunk in x.split(1000)])
    acc = (model.head(feats).argmax(-1) == y).float().mean().item()
    return acc, feats.double()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    train_images, train_labels = load_split("train")
    test_images, test_labels = load_split("test")
    x_train, y_train = to_canvas(train_images), torch.from_numpy(train_labels)
    x_test, y_test = to_canvas(test_images), torch.from_numpy(test_labels)

    model = FmnistClassifier(ClassifierConfig())
    steps_per_epoch = len(x_train) // args.batch_size
    total = steps_per_epoch * args.epochs
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.15)
    print(f"classifier: {sum(p.numel() for p in model.parameters()):,} params, {total} steps")

    start = time.time()
    bar = tqdm(total=total, desc="classifier")
    for epoch in range(args.epochs):
        model.train()
        perm = torch.randperm(len(x_train), generator=generator)
        running = 0.0
        for step in range(steps_per_epoch):
            idx = perm[step * args.batch_size : (step + 1) * args.batch_size]
            x = _augment(x_train[idx], generator)
            loss = nn.functional.cross_entropy(model(x), y_train[idx], label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            running = 0.98 * running + 0.02 * loss.item() if step else loss.item()
            bar.update(1)
            bar.set_postfix(loss=f"{running:.3f}")
        acc, _ = _evaluate(model, x_test, y_test)
        tqdm.write(f"epoch {epoch + 1}/{args.epochs}: loss {running:.3f}, test accuracy {acc:.4f}")
    bar.close()

    acc, feats = _evaluate(model, x_test, y_test)
    mean = feats.mean(0)
    cov = torch.cov(feats.T)
    save_classifier(model, mean, cov)
    print(
        f"test accuracy {acc:.4f} on {len(x_test)} images; trained in {time.time() - start:.0f} s; "
        f"wrote {CLASSIFIER_WEIGHTS}"
    )


if __name__ == "__main__":
    main()
