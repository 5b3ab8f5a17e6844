"""The similarity metrics of the library, its tests and its benches, implemented here so nothing
downloads a metric network.

* ``sqnr_db(reference, approx)``: signal-to-quantization-noise ratio of a tensor against its
  reference (a quantized layer against the float layer, a kernel against its reference op);
  ``ratio_db`` is the same from powers already summed (streaming sensitivity passes).
* Images are float arrays in [0, 1] shaped [N, H, W, C] (video [N, F, H, W, C] is scored frame by
  frame): ``psnr``, ``ssim``, ``cosine`` return one value per sample; reports aggregate them.
  ``rel_l2`` compares latents per sample.

Every function takes the reference first.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def ratio_db(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)``: +inf when the noise is 0, -inf when only the signal is."""
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """SQNR of ``approx`` against ``reference`` in dB: ``10 log10(sum ref² / sum (approx - ref)²)``,
    in float64 over every element."""
    ref, err = reference.detach().double(), approx.detach().double() - reference.detach().double()
    return ratio_db(float(ref.square().sum()), float(err.square().sum()))


def _frames(x: np.ndarray) -> torch.Tensor:
    """[N, ..., H, W, C] -> float64 [N, frames, C, H, W]."""
    t = torch.as_tensor(np.asarray(x), dtype=torch.float64)
    if t.ndim == 4:
        t = t.unsqueeze(1)
    if t.ndim != 5:
        raise ValueError(f"images must be [N,H,W,C] or [N,F,H,W,C], got shape {tuple(t.shape)}")
    return t.permute(0, 1, 4, 2, 3)


def psnr(reference: np.ndarray, test: np.ndarray, data_range: float = 1.0) -> np.ndarray:
    """Peak signal-to-noise ratio in dB per sample; identical samples give +inf."""
    ta, tb = _frames(reference), _frames(test)
    mse = ((ta - tb) ** 2).flatten(1).mean(1)
    with np.errstate(divide="ignore"):
        return (10 * torch.log10(data_range**2 / mse)).numpy()


def _gaussian_window(size: int, sigma: float) -> torch.Tensor:
    coords = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    g = g / g.sum()
    return g[:, None] * g[None, :]


def ssim(a: np.ndarray, b: np.ndarray, data_range: float = 1.0) -> np.ndarray:
    """Structural similarity per sample (Wang et al. 2004: 11x11 Gaussian window, sigma 1.5,
    K1=0.01, K2=0.03, mean over valid positions, channels and frames). Images smaller than the
    window use the largest odd window that fits."""
    ta, tb = _frames(a), _frames(b)
    n, f, c, h, w = ta.shape
    size = min(11, h if h % 2 else h - 1, w if w % 2 else w - 1)
    window = _gaussian_window(size, 1.5 * size / 11).expand(c, 1, size, size)
    x, y = ta.reshape(n * f, c, h, w), tb.reshape(n * f, c, h, w)

    def blur(z):
        return F.conv2d(z, window, groups=c)

    mu_x, mu_y = blur(x), blur(y)
    sxx = blur(x * x) - mu_x**2
    syy = blur(y * y) - mu_y**2
    sxy = blur(x * y) - mu_x * mu_y
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    s = ((2 * mu_x * mu_y + c1) * (2 * sxy + c2)) / ((mu_x**2 + mu_y**2 + c1) * (sxx + syy + c2))
    return s.reshape(n, -1).mean(1).numpy()


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    ta = torch.as_tensor(np.asarray(a), dtype=torch.float64).flatten(1)
    tb = torch.as_tensor(np.asarray(b), dtype=torch.float64).flatten(1)
    return F.cosine_similarity(ta, tb, dim=1, eps=1e-12).numpy()


def rel_l2(reference: torch.Tensor, test: torch.Tensor) -> np.ndarray:
    """||test - reference|| / ||reference|| per sample."""
    r, t = reference.detach().double().flatten(1).cpu(), test.detach().double().flatten(1).cpu()
    return ((t - r).norm(dim=1) / r.norm(dim=1).clamp_min(1e-30)).numpy()


def student_t_quantile(p: float, dof: int) -> float:
    """The ``p`` quantile (0.5 < p < 1) of Student's t with ``dof`` degrees of freedom: the CDF is
    integrated from the density by Simpson's rule and inverted by bisection (no scipy)."""
    if not 0.5 < p < 1.0 or dof < 1:
        raise ValueError("need 0.5 < p < 1 and dof >= 1")
    log_norm = math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)

    def cdf(x: float) -> float:
        t = np.linspace(0.0, x, 4001)
        density = np.exp(log_norm - (dof + 1) / 2 * np.log1p(t * t / dof))
        h = x / 4000
        return 0.5 + h / 3 * (
            density[0] + density[-1] + 4 * density[1:-1:2].sum() + 2 * density[2:-1:2].sum()
        )

    low, high = 0.0, 1.0
    while cdf(high) < p:
        low, high = high, high * 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return (low + high) / 2


def paired_interval(differences, confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the two-sided Student-t confidence interval of the mean of paired
    differences (one per sample, e.g. PSNR of method A minus method B on the same prompt and seed)."""
    d = np.asarray(differences, dtype=np.float64)
    if d.size < 2:
        raise ValueError("a paired interval needs at least two differences")
    mean, half = float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size))
    t = student_t_quantile(0.5 + confidence / 2, d.size - 1)
    return mean, mean - t * half, mean + t * half
