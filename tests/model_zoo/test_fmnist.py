"""The embedded model (fmnist-flux): shipped pipeline, determinism, save/load, metric network."""

import json

import numpy as np
import pytest
import torch

from sdkiln.model_zoo import get_spec
from sdkiln.model_zoo.fmnist.classifier import predict_classes
from sdkiln.model_zoo.fmnist.data import dataset_available, load_split
from sdkiln.model_zoo.fmnist.metrics import fmnist_metrics, frechet_distance
from sdkiln.model_zoo.fmnist.pipeline import FmnistFluxPipeline
from sdkiln.model_zoo.fmnist.text import CAPTIONS, caption_class, eval_prompt

needs_dataset = pytest.mark.skipif(
    not dataset_available(), reason="Fashion-MNIST not installed (Debian package dataset-fashion-mnist)"
)
PROMPTS = ["a photo of a sneaker", "a pair of trousers"]


@pytest.fixture(scope="module")
def pipe():
    pipe = get_spec("fmnist-flux").build()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generate(pipe, seed=0, **kwargs):
    generators = [torch.Generator().manual_seed(seed + i) for i in range(len(PROMPTS))]
    kwargs = {"num_inference_steps": 4, "output_type": "np", "generator": generators, **kwargs}
    return pipe(PROMPTS, **kwargs).images


def test_pipeline_loads_offline_in_float32(pipe):
    assert isinstance(pipe, FmnistFluxPipeline)
    assert pipe.transformer.dtype == torch.float32
    assert pipe._execution_device == torch.device("cpu")
    n_params = sum(p.numel() for p in pipe.transformer.parameters())
    assert 2e6 < n_params < 6e6


def test_generation_shape_and_determinism(pipe):
    a = _generate(pipe)
    assert a.shape == (2, 32, 32, 1) and a.dtype == np.float32
    assert a.min() >= 0.0 and a.max() <= 1.0
    np.testing.assert_array_equal(a, _generate(pipe))
    assert not np.array_equal(a, _generate(pipe, seed=7))


def test_output_types_and_callback(pipe):
    seen = []

    def callback(p, i, t, kwargs):
        seen.append(i)
        return {"latents": kwargs["latents"]}

    latents = _generate(pipe, output_type="latent", callback_on_step_end=callback)
    assert latents.shape == (2, 256, 4) and seen == [0, 1, 2, 3]
    pil = _generate(pipe, output_type="pil")
    assert len(pil) == 2 and pil[0].mode == "L" and pil[0].size == (32, 32)
    pt = _generate(pipe, output_type="pt")
    np.testing.assert_allclose(pt.permute(0, 2, 3, 1).numpy(), _generate(pipe), atol=1e-6)


def test_save_pretrained_roundtrip(pipe, tmp_path):
    pipe.save_pretrained(tmp_path)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.suffix for p in files} <= {".json", ".safetensors", ".txt"}, files
    assert json.loads((tmp_path / "model_index.json").read_text())["_class_name"] == "FmnistFluxPipeline"
    loaded = FmnistFluxPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    np.testing.assert_array_equal(_generate(loaded), _generate(pipe))


def test_captions_map_to_classes():
    for c, caps in enumerate(CAPTIONS):
        assert caps[0] == eval_prompt(c)
        assert all(caption_class(cap) == c for cap in caps)
    assert caption_class("  A Photo of an Ankle Boot ") == 9
    with pytest.raises(KeyError, match="not a Fashion-MNIST caption"):
        caption_class("a photo of a cat")


@needs_dataset
def test_classifier_accuracy_on_test_images():
    images, labels = load_split("test")
    x = images[:500, :, :, None].astype(np.float32) / 255.0
    assert (predict_classes(x) == labels[:500]).mean() >= 0.88


@needs_dataset
def test_fmnist_metrics_on_real_images():
    images, labels = load_split("test")
    idx = np.arange(10000, 0, -1)[:300] - 1
    x = images[idx, :, :, None].astype(np.float32) / 255.0
    m = fmnist_metrics(x, [eval_prompt(int(c)) for c in labels[idx]])
    assert set(m) == {"class_accuracy", "fd_fmnist"}
    assert m["class_accuracy"] >= 0.85
    noise = fmnist_metrics(
        np.random.default_rng(0).random((300, 32, 32, 1), dtype=np.float32), [PROMPTS[0]] * 300
    )
    assert 0.0 <= m["fd_fmnist"] < noise["fd_fmnist"] / 10


def test_frechet_distance_matches_closed_form():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(5, 5))
    cov = a @ a.T
    assert frechet_distance(np.zeros(5), cov, np.zeros(5), cov) == pytest.approx(0.0, abs=1e-8)
    # Diagonal covariances: sum (sqrt(s1) - sqrt(s2))^2 plus the squared mean difference.
    s1, s2 = np.array([1.0, 4.0]), np.array([9.0, 1.0])
    expected = 1.0 + (1 - 3) ** 2 + (2 - 1) ** 2
    assert frechet_distance(np.array([1.0, 0.0]), np.diag(s1), np.zeros(2), np.diag(s2)) == pytest.approx(
        expected
    )


def test_spec_metrics_and_prompts():
    spec = get_spec("fmnist-flux")
    assert spec.metrics is fmnist_metrics
    assert [caption_class(p) for p in spec.eval_prompts] == list(range(10))
    assert not set(spec.calibration_prompts) & set(spec.eval_prompts)
    assert spec.call_kwargs(num_inference_steps=4)["num_inference_steps"] == 4
