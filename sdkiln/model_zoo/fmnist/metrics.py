"""Quality metrics of generated Fashion-MNIST images, measured by the shipped metric classifier.

``fmnist_metrics`` is what the rest of sdkiln calls (``ModelSpec.metrics``): class accuracy of
the images against the classes their prompts name, and FD-FMNIST, the Fréchet distance between
Gaussians fitted to the classifier's penultimate features of the generated images and of the
10,000 real test images (the latter's statistics ship with the classifier). FD-FMNIST is not FID:
the feature network is our small classifier, not Inception, so values are comparable only with
each other. With few samples the estimate is biased upwards; compare runs at the same N.
"""

from __future__ import annotations

import numpy as np

from sdkiln.model_zoo.fmnist.classifier import classify, load_classifier
from sdkiln.model_zoo.fmnist.text import caption_class


def frechet_distance(mu1: np.ndarray, cov1: np.ndarray, mu2: np.ndarray, cov2: np.ndarray) -> float:
    """``|mu1 - mu2|^2 + tr(cov1 + cov2 - 2 (cov1 cov2)^(1/2))`` in float64.

    ``tr((cov1 cov2)^(1/2))`` is the sum of the square roots of the eigenvalues of the symmetric
    ``s cov2 s`` with ``s = cov1^(1/2)``; eigh keeps it real and stable for rank-deficient
    covariances (N below the feature dimension)."""
    mu1, mu2 = np.asarray(mu1, np.float64), np.asarray(mu2, np.float64)
    cov1, cov2 = np.asarray(cov1, np.float64), np.asarray(cov2, np.float64)
    w, v = np.linalg.eigh(cov1)
    s = (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T
    cross = np.linalg.eigvalsh(s @ cov2 @ s)
    tr_sqrt = np.sqrt(np.clip(cross, 0.0, None)).sum()
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(cov1) + np.trace(cov2) - 2.0 * tr_sqrt)


def fd_fmnist(features: np.ndarray) -> float:
    """FD-FMNIST of penultimate features ``[N, D]`` (N >= 2) against the real test split."""
    if features.ndim != 2 or features.shape[0] < 2:
        raise ValueError(f"FD-FMNIST needs features [N>=2, D], got {features.shape}")
    _, mean, cov = load_classifier()
    return frechet_distance(features.mean(0), np.cov(features, rowvar=False), mean.numpy(), cov.numpy())


def per_class_accuracy(predicted: np.ndarray, labels: np.ndarray) -> dict[int, float]:
    return {int(c): float((predicted[labels == c] == c).mean()) for c in np.unique(labels)}


def fmnist_metrics(images: np.ndarray, prompts: list[str]) -> dict[str, float]:
    """Model-specific metrics of the embedded model.

    ``images``: ``[N, H, W, 1]`` in [0, 1] (the pipeline's ``output_type="np"``; 32x32 canvas or
    28x28 crop), ``prompts``: the N prompts they were generated from, each a caption the model was
    trained on (``text.caption_class``). Returns ``{"class_accuracy": 0..1, "fd_fmnist": >= 0}``.
    """
    images = np.asarray(images)
    if len(prompts) != len(images):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
    labels = np.array([caption_class(p) for p in prompts])
    predicted, features = classify(images)
    return {"class_accuracy": float((predicted == labels).mean()), "fd_fmnist": fd_fmnist(features)}
