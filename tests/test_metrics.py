import numpy as np
import pytest
import torch

from sdkiln import metrics

rng = np.random.default_rng(0)


def test_psnr_matches_its_formula():
    a = rng.random((3, 16, 16, 3)).astype(np.float32)
    b = np.clip(a + rng.normal(0, 0.05, a.shape), 0, 1).astype(np.float32)
    mse = ((a.astype(np.float64) - b) ** 2).reshape(3, -1).mean(1)
    np.testing.assert_allclose(metrics.psnr(b, a), 10 * np.log10(1 / mse), rtol=1e-10)
    assert np.isinf(metrics.psnr(a, a)).all()


def test_ssim_single_window_matches_direct_formula():
    # An 11x11 image has exactly one valid window: SSIM is the Gaussian-weighted formula itself.
    a = rng.random((1, 11, 11, 1))
    b = np.clip(a + rng.normal(0, 0.1, a.shape), 0, 1)
    g = np.exp(-((np.arange(11) - 5) ** 2) / (2 * 1.5**2))
    w = np.outer(g, g) / np.outer(g, g).sum()
    x, y = a[0, :, :, 0], b[0, :, :, 0]
    mx, my = (w * x).sum(), (w * y).sum()
    sx, sy, sxy = (w * x * x).sum() - mx**2, (w * y * y).sum() - my**2, (w * x * y).sum() - mx * my
    c1, c2 = 0.01**2, 0.03**2
    expected = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx**2 + my**2 + c1) * (sx + sy + c2))
    np.testing.assert_allclose(metrics.ssim(b, a), [expected], rtol=1e-10)


def test_ssim_properties_and_video_shapes():
    a = rng.random((2, 24, 24, 3))
    assert np.allclose(metrics.ssim(a, a), 1.0)
    noisy = np.clip(a + rng.normal(0, 0.2, a.shape), 0, 1)
    s = metrics.ssim(noisy, a)
    assert (s < 0.9).all() and np.allclose(s, metrics.ssim(a, noisy))
    video = rng.random((2, 3, 16, 16, 3))
    assert metrics.ssim(video, video).shape == (2,)


def test_cosine_and_rel_l2():
    a = rng.random((2, 8, 8, 1))
    np.testing.assert_allclose(metrics.cosine(a, 3 * a), 1.0)
    ref = torch.randn(2, 10)
    np.testing.assert_allclose(metrics.rel_l2(ref, ref * 1.1), 0.1, rtol=1e-6)


def test_sqnr_db_takes_the_reference_first():
    ref = torch.tensor([3.0, -4.0, 0.0], dtype=torch.float64)
    approx = ref + torch.tensor([0.0, 0.5, 0.0], dtype=torch.float64)
    assert metrics.sqnr_db(ref, approx) == pytest.approx(10 * np.log10(25 / 0.25))
    assert metrics.sqnr_db(ref, ref) == np.inf
    assert metrics.sqnr_db(torch.zeros(3), torch.ones(3)) == -np.inf
    assert metrics.ratio_db(25.0, 0.25) == pytest.approx(20.0)


def test_student_t_quantiles_and_the_paired_interval():
    # two-sided 95% critical values from any t table
    for dof, value in [(1, 12.706), (4, 2.776), (9, 2.262), (19, 2.093), (1000, 1.962)]:
        assert abs(metrics.student_t_quantile(0.975, dof) - value) < 1e-3
    assert abs(metrics.student_t_quantile(0.95, 4) - 2.132) < 1e-3
    mean, low, high = metrics.paired_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    half = 2.776 * (2.5**0.5) / 5**0.5
    assert mean == 3.0 and abs(low - (3.0 - half)) < 1e-3 and abs(high - (3.0 + half)) < 1e-3
    with pytest.raises(ValueError, match="at least two"):
        metrics.paired_interval([1.0])
