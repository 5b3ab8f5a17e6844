"""Reading a package safely: the format's constants and every check made before a byte is used.

The writer (``sdkiln.export``) imports the constants from here, so the reader is the one place
that defines what a valid package is. ``docs/package-format.md`` is the prose version.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from sdkiln.errors import PackageError

FORMAT_NAME = "sdkiln-package"
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
TRANSFORMER_WEIGHTS = "diffusion_pytorch_model.safetensors"
QUALITY_REPORT = "eval/quality.json"
# Only these kinds of file may be in a package: no pickles, no code.
ALLOWED_SUFFIXES = (".json", ".safetensors", ".txt", ".png")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_relpath(rel: str) -> PurePosixPath:
    """A manifest path must be relative, POSIX, and stay inside the package."""
    p = PurePosixPath(rel)
    if (
        not rel
        or "\\" in rel
        or p.is_absolute()
        or rel.startswith("/")
        or ".." in p.parts
        or ":" in p.parts[0]
    ):
        raise PackageError(f"{MANIFEST}: path {rel!r} leaves the package (absolute or '..'); refusing it")
    if not rel.endswith(ALLOWED_SUFFIXES):
        raise PackageError(
            f"{MANIFEST}: file {rel!r} has a type packages may not hold (only {ALLOWED_SUFFIXES})"
        )
    return p


@dataclass(frozen=True)
class Package:
    """A verified package: its root and its parsed manifest."""

    root: Path
    manifest: dict[str, Any]

    def path(self, rel: str) -> Path:
        check_relpath(rel)
        if rel not in self.manifest["files"]:
            raise PackageError(f"{rel}: not listed in {MANIFEST}")
        return self.root / rel

    def read_json(self, rel: str) -> Any:
        with open(self.path(rel), encoding="utf-8") as fh:
            return json.load(fh)


def read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if path.is_symlink():
        raise PackageError(f"{path}: is a symlink; packages may not contain links")
    if not path.is_file():
        raise PackageError(f"{path}: no manifest (is {root} an sdkiln package?)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PackageError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise PackageError(f"{path}: not an sdkiln package manifest (format is not {FORMAT_NAME!r})")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise PackageError(
            f"{path}: unsupported schema_version {version!r}; this sdkiln reads version {SCHEMA_VERSION}"
        )
    for key in ("files", "model", "recipe", "modules"):
        if not isinstance(manifest.get(key), dict):
            raise PackageError(f"{path}: missing or malformed {key!r}")
    return manifest


def open_package(root: str | os.PathLike) -> Package:
    """Verify a package completely, then return it.

    Refuses: a missing or unparseable manifest, another schema version, symlinks anywhere, files
    not listed in the manifest, listed paths that leave the package, and any file whose size or
    sha256 differs from the manifest. Every file is hashed before anything reads it.
    """
    root = Path(root)
    if root.is_symlink():
        raise PackageError(f"{root}: the package directory is a symlink; refusing it")
    if not root.is_dir():
        raise PackageError(f"{root}: no such package directory")
    manifest = read_manifest(root)
    listed = manifest["files"]
    on_disk = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if full.is_symlink():
                raise PackageError(f"{rel}: is a symlink; packages may not contain links")
            if name in filenames and rel != MANIFEST:
                on_disk.add(rel)
    unlisted = sorted(on_disk - set(listed))
    if unlisted:
        raise PackageError(f"{unlisted[0]}: file not listed in {MANIFEST} (package was modified)")
    for rel, meta in listed.items():
        check_relpath(rel)
        full = root / rel
        if not full.resolve().is_relative_to(root.resolve()):
            raise PackageError(f"{rel}: resolves outside the package; refusing it")
        if not full.is_file():
            raise PackageError(f"{rel}: listed in {MANIFEST} but missing")
        size = full.stat().st_size
        if size != meta.get("size"):
            raise PackageError(
                f"{rel}: size {size} != {meta.get('size')} in {MANIFEST} (corrupt or tampered)"
            )
        if sha256_file(full) != meta.get("sha256"):
            raise PackageError(f"{rel}: sha256 does not match {MANIFEST} (corrupt or tampered)")
    return Package(root=root, manifest=manifest)
