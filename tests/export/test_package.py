"""Package format v1: atomic writes, verification before reading, refusals, and exact round trips."""

import json
import os
import shutil

import pytest

import sdkiln
from sdkiln.errors import PackageError
from sdkiln.export import atomic, package_writer
from sdkiln.runtime import W8A8DynamicLinear, open_package


@pytest.fixture(scope="module")
def flux_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("pkg") / "flux"
    return sdkiln.optimize("flux-tiny", "w8a8-dynamic", out, eval_samples=2)


def _copy(pkg, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(pkg, dst)
    return dst


def _rewrite_manifest(root, edit):
    path = root / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def test_save_load_is_bit_identical(flux_result, assert_same_outputs):
    loaded = sdkiln.load(flux_result.package, device="cpu")
    t = loaded.transformer
    assert sum(isinstance(m, W8A8DynamicLinear) for m in t.modules()) == len(flux_result.manifest["modules"])
    assert_same_outputs(flux_result, loaded)


def test_manifest_records_recipe_files_and_quality(flux_result):
    m = open_package(flux_result.package).manifest
    assert m["schema_version"] == 1 and m["recipe"]["steps"][0]["config"]["kind"] == "w8a8_dynamic"
    assert "transformer/diffusion_pytorch_model.safetensors" in m["files"]
    assert all(len(f["sha256"]) == 64 for f in m["files"].values())
    q = json.loads((flux_result.package / "eval/quality.json").read_text())
    assert {"psnr", "ssim", "cosine", "latent_rel_l2", "num_samples", "steps"} <= set(q)
    assert not any(p.suffix in (".bin", ".pt", ".pkl") for p in flux_result.package.rglob("*"))


def test_flipped_byte_names_the_file(flux_result, tmp_path):
    root = _copy(flux_result.package, tmp_path)
    weights = root / "transformer/diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(PackageError, match="transformer/diffusion_pytorch_model.safetensors: sha256"):
        sdkiln.load(root)


@pytest.mark.parametrize("bad", ["../outside.json", "/etc/passwd.json", "a/../../b.json"])
def test_paths_leaving_the_package_are_refused(flux_result, tmp_path, bad):
    root = _copy(flux_result.package, tmp_path)
    _rewrite_manifest(root, lambda m: m["files"].update({bad: {"sha256": "0" * 64, "size": 1}}))
    with pytest.raises(PackageError, match="leaves the package"):
        open_package(root)


def test_symlink_inside_package_is_refused(flux_result, tmp_path):
    root = _copy(flux_result.package, tmp_path)
    os.symlink("/etc/hostname", root / "eval" / "link.json")
    with pytest.raises(PackageError, match="symlink"):
        open_package(root)


def test_unlisted_pickle_and_schema_version_are_refused(flux_result, tmp_path):
    root = _copy(flux_result.package, tmp_path)
    (root / "transformer" / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(PackageError, match="pytorch_model.bin: file not listed"):
        open_package(root)
    os.remove(root / "transformer" / "pytorch_model.bin")
    _rewrite_manifest(root, lambda m: m.update(schema_version=2))
    with pytest.raises(PackageError, match="unsupported schema_version 2"):
        open_package(root)


def test_existing_target_needs_force_and_interrupted_export_leaves_nothing(
    flux_result, tmp_path, monkeypatch
):
    target = tmp_path / "pkg"
    target.mkdir()
    with pytest.raises(PackageError, match="already exists"):
        package_writer.write_package(target, flux_result.pipeline, flux_result.manifest, {}, "transformer")

    def die(*args, **kwargs):
        raise KeyboardInterrupt

    fresh = tmp_path / "fresh"
    monkeypatch.setattr(atomic, "fsync_tree", die)
    with pytest.raises(KeyboardInterrupt):
        package_writer.write_package(fresh, flux_result.pipeline, flux_result.manifest, {}, "transformer")
    assert not fresh.exists() and [p.name for p in tmp_path.iterdir()] == ["pkg"]
    with pytest.raises(KeyboardInterrupt):
        package_writer.write_package(
            target, flux_result.pipeline, flux_result.manifest, {}, "transformer", force=True
        )
    assert target.is_dir() and not any(target.iterdir()), "a failed --force export must keep the old target"
