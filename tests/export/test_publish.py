"""``sdkiln publish`` against a local fake hub, and ``modelscope://`` ids resolved through
modelscope's own cache: the card and the layout, every failure leaving the package byte-identical,
a downloaded package verified and loaded, a base model optimized by id, and one clear line when a
snapshot is absent."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import sdkiln
from sdkiln import hub
from sdkiln.cli import main
from sdkiln.errors import ModelError, PackageError, SdkilnError
from sdkiln.export import publish as publish_module
from sdkiln.export.publish import CARD, CONFIGURATION, _license, publish
from sdkiln.model_zoo import load_model
from sdkiln.runtime.package import MANIFEST, open_package

pytest.importorskip("modelscope", reason="the [hub] extra (make test installs it)")

TOKEN = "ms-secret-token-123"


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (and beside it, to catch a stage left behind) with its bytes' hash."""
    out = {}
    for path in sorted(root.parent.rglob("*")):
        rel = path.relative_to(root.parent).as_posix()
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return out


def snapshot_dir(cache: Path, repo: str) -> Path:
    """Where modelscope's cache keeps the default revision of ``repo``."""
    return cache / "models" / repo.replace("/", "--") / "snapshots" / "master"


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    root = tmp_path_factory.mktemp("publish")
    return sdkiln.optimize("flux-tiny", "w8a8-dynamic", root / "pkg", eval_samples=2).package


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "mscache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "mscache"


def fake_hub(cache: Path, calls: list):
    """An uploader that copies the stage into modelscope's cache layout, as a download would leave it."""

    def upload(folder, repo, hub_name, private, token):
        calls.append(
            (sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()), token)
        )
        dst = snapshot_dir(cache, repo)
        shutil.copytree(folder, dst)
        return f"file://{dst}"

    return upload


def test_publish_writes_card_and_layout_and_the_download_loads(package, cache, monkeypatch):
    monkeypatch.setenv("MODELSCOPE_API_TOKEN", TOKEN)
    before = tree(Path(package))
    calls = []
    result = publish(package, "sdkiln-test/flux-w8a8", uploader=fake_hub(cache, calls))
    assert tree(Path(package)) == before  # the package is never written, the stage is gone
    pkg = open_package(package)
    expected = sorted([MANIFEST, *pkg.manifest["files"], CARD, CONFIGURATION])
    assert result.files == expected and calls[0] == (expected, TOKEN)
    snap = snapshot_dir(cache, "sdkiln-test/flux-w8a8")
    card = (snap / CARD).read_text()
    front, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    assert "license: apache-2.0" in front and "text-to-image-synthesis" in front and "quantized" in front
    assert (
        f"Quantized layers: {len(pkg.manifest['modules'])} ({len(pkg.manifest['modules'])} layers W8A8_DYNAMIC)"
        in body
    )
    assert "`w8a8_dynamic`" in body and pkg.digest in body
    assert "PSNR" in body and "2 samples" in body  # the stored quality report
    assert "modelscope://sdkiln-test/flux-w8a8" in body
    config = json.loads((snap / CONFIGURATION).read_text())
    assert config["framework"] == "pytorch" and config["sdkiln"]["digest"] == pkg.digest
    # the downloaded package verifies (the hub's files at its root are allowed) and loads by id
    loaded = sdkiln.load("modelscope://sdkiln-test/flux-w8a8", "cpu", digest=pkg.digest)
    direct = sdkiln.load(package, "cpu")
    x = torch.randn(2, 5, loaded.transformer.transformer_blocks[0].attn.to_q.in_features)
    layer = "transformer_blocks.0.attn.to_q"
    assert torch.equal(loaded.transformer.get_submodule(layer)(x), direct.transformer.get_submodule(layer)(x))
    assert TOKEN not in "".join(p.read_text(errors="ignore") for p in snap.rglob("*") if p.is_file())


def test_every_failure_leaves_the_package_byte_identical(package, cache, monkeypatch):
    before = tree(Path(package))

    def broken(folder, repo, hub_name, private, token):
        raise ConnectionError(f"could not reach the hub with token {token}")

    monkeypatch.delenv("MODELSCOPE_API_TOKEN", raising=False)
    with pytest.raises(SdkilnError, match="MODELSCOPE_API_TOKEN"):
        publish(package, "org/name", uploader=broken)
    monkeypatch.setenv("MODELSCOPE_API_TOKEN", TOKEN)
    with pytest.raises(SdkilnError, match="ORG/NAME"):
        publish(package, "org/../name", uploader=broken)
    with pytest.raises(SdkilnError, match="--hub"):
        publish(package, "org/name", hub="github", uploader=broken)
    with pytest.raises(SdkilnError, match=r"failed: could not reach the hub with token \*\*\*") as exc:
        publish(package, "org/name", uploader=broken)
    assert TOKEN not in str(exc.value)
    monkeypatch.setattr(publish_module, "require", _missing)
    with pytest.raises(SdkilnError, match=r"sdkiln\[hub\]"):
        publish(package, "org/name")
    assert tree(Path(package)) == before
    # a tampered package is refused before anything is staged
    (Path(package) / "stray.txt").write_text("x")
    try:
        with pytest.raises(PackageError, match="stray.txt"):
            publish(package, "org/name", uploader=broken)
    finally:
        (Path(package) / "stray.txt").unlink()
    assert tree(Path(package)) == before


def _missing(*modules, extra, what):
    raise SdkilnError(f"{what} needs {modules[0]}, which is not installed: pip install 'sdkiln[{extra}]'")


def test_the_real_upload_passes_the_token_to_each_call_and_stores_nothing(
    package, cache, monkeypatch, tmp_path
):
    """``upload`` with modelscope's client replaced by a recorder: no ``login`` (which would store
    credentials under the home directory), the token on each call, the stage uploaded whole."""
    import importlib

    api_module = importlib.import_module("modelscope.hub.api")
    calls = []

    class Recorder:
        def __init__(self, token=None, **kwargs):
            calls.append(("init", token))

        def login(self, *args, **kwargs):
            raise AssertionError("login stores credentials")

        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id, kwargs["token"], kwargs["visibility"]))

        def upload_folder(self, repo_id, folder_path, **kwargs):
            files = sorted(
                p.relative_to(folder_path).as_posix() for p in Path(folder_path).rglob("*") if p.is_file()
            )
            calls.append(("upload_folder", repo_id, kwargs["token"], files))

    monkeypatch.setattr(api_module, "HubApi", Recorder)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MODELSCOPE_API_TOKEN", TOKEN)
    result = publish(package, "org/name", private=True)
    assert calls[0] == ("init", TOKEN) and calls[1] == ("create_repo", "org/name", TOKEN, "private")
    assert calls[2][:3] == ("upload_folder", "org/name", TOKEN) and calls[2][3] == result.files
    assert result.url == "https://www.modelscope.cn/models/org/name"
    assert not (tmp_path / "home").exists()


def test_a_relative_package_path_is_staged_outside_it(package, cache, monkeypatch):
    monkeypatch.setenv("MODELSCOPE_API_TOKEN", TOKEN)
    before = tree(Path(package))
    seen = []

    def upload(folder, repo, hub_name, private, token):
        seen.append(folder.resolve())
        raise KeyboardInterrupt  # killed mid-upload: the stage must still be outside the package

    monkeypatch.chdir(package)
    with pytest.raises(KeyboardInterrupt):
        publish(".", "org/name", uploader=upload)
    assert not seen[0].is_relative_to(Path(package).resolve())
    assert tree(Path(package)) == before


def test_a_package_listing_a_hub_file_is_refused(package, tmp_path, monkeypatch):
    monkeypatch.setenv("MODELSCOPE_API_TOKEN", TOKEN)
    copy = tmp_path / "pkg"
    shutil.copytree(package, copy)
    body = b'{"framework": "mine"}'
    (copy / CONFIGURATION).write_bytes(body)
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["files"][CONFIGURATION] = {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}
    (copy / MANIFEST).write_text(json.dumps(manifest))
    open_package(copy)  # listed, it is verified like any file
    before = tree(copy)
    with pytest.raises(SdkilnError, match="lists configuration.json itself"):
        publish(copy, "org/name", uploader=lambda *a: "unused")
    assert tree(copy) == before


def test_cli_publish_without_token_is_one_line(package, cache, monkeypatch, capsys):
    monkeypatch.delenv("MODELSCOPE_API_TOKEN", raising=False)
    assert main(["publish", str(package), "--repo", "org/name"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "MODELSCOPE_API_TOKEN" in err


def test_licence_is_inherited_or_required():
    zoo = {"model": {"base_id": "flux-tiny"}}
    assert _license(zoo, None) == "apache-2.0"
    assert _license(zoo, "mit") == "mit"
    with pytest.raises(SdkilnError, match="--license"):
        _license({"model": {"base_id": "/models/FLUX.1-dev"}}, None)
    with pytest.raises(SdkilnError, match="licence id"):
        _license(zoo, "mit; rm -rf")


def test_only_the_hub_files_may_sit_unlisted_in_a_package(package, tmp_path):
    copy = tmp_path / "pkg"
    shutil.copytree(package, copy)
    (copy / CARD).write_text("# card")
    (copy / CONFIGURATION).write_text("{}")
    open_package(copy)
    (copy / "notes.md").write_text("x")
    with pytest.raises(PackageError, match="notes.md"):
        open_package(copy)
    (copy / "notes.md").unlink()
    (copy / CARD).unlink()
    (copy / CARD).mkdir()  # a directory by a hub file's name holds files nobody listed
    (copy / CARD / "x").write_text("x")
    with pytest.raises(PackageError, match="README.md/x"):
        open_package(copy)
    shutil.rmtree(copy / CARD)
    os.symlink("/etc/passwd", copy / CARD)
    with pytest.raises(PackageError, match="symlink"):
        open_package(copy)


def test_modelscope_ids_resolve_through_the_cache(cache, flux_tiny):
    spec, pipe = flux_tiny
    pipe.save_pretrained(snapshot_dir(cache, "org/flux-tiny-base"))
    loaded, loaded_spec, base_id = load_model("modelscope://org/flux-tiny-base")
    assert loaded_spec.name == spec.name and base_id == "modelscope://org/flux-tiny-base"
    with pytest.raises(ModelError, match=r"modelscope://org/absent: no snapshot .* offline") as exc:
        hub.resolve("modelscope://org/absent")
    assert "\n" not in str(exc.value)
    for bad in ("modelscope://org", "modelscope://org/a/b", "modelscope://../x", "modelscope://org/.."):
        with pytest.raises(ModelError, match="ORG/NAME"):
            hub.resolve(bad)
    with pytest.raises(ModelError, match="no snapshot"):
        sdkiln.load("modelscope://org/absent", "cpu")
