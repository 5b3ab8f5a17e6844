"""Reading a package safely: the format's constants and every check made before a byte is used.

The writer (``sdkiln.export``) imports the constants from here, so the reader is the one place
that defines what a valid package is. ``docs/package-format.md`` is the prose version and
``docs/security.md`` the threat model.

Each file is read once: its bytes are hashed and kept, and every later reader (JSON, safetensors,
the tokenizer files) parses those same bytes, so what is used is exactly what was verified, even
if someone rewrites the directory while it loads. The manifest's own sha256 is the package
**digest**: the manifest lists every file's sha256, so one digest pins the whole package.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from stat import S_ISREG
from typing import Any

from sdkiln import hub
from sdkiln.errors import PackageError

FORMAT_NAME = "sdkiln-package"
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
TRANSFORMER_WEIGHTS = "diffusion_pytorch_model.safetensors"
QUALITY_REPORT = "eval/quality.json"
# Only these kinds of file may be in a package: no pickles, no code.
ALLOWED_SUFFIXES = (".json", ".safetensors", ".txt", ".png")
MAX_FILES = 10_000
HUB_FILES = frozenset({"README.md", "configuration.json", ".gitattributes", ".mdl", ".msc", ".mv"})
"""Files a hub puts at a repository's root beside a published package: the model card, ModelScope's
``configuration.json``, git's attributes and ModelScope's cache records. Unlisted there, they are
allowed and never read (``sdkiln publish`` writes the first two; ``docs/security.md``)."""
MAX_MANIFEST_BYTES = 64 << 20
MAX_JSON_DEPTH = 64
# Python refuses integers over 4300 digits with a ValueError; nothing in a package needs more than
# transformers' "no limit" model_max_length (int(1e30), 31 digits).
MAX_INT_DIGITS = 40
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _parse_constant(name: str) -> float:
    """``Infinity`` and ``-Infinity`` are what Python's json writes for infinite floats (a scheduler's
    ``lambda_min_clipped``); NaN compares unequal to everything and is refused."""
    if name == "NaN":
        raise ValueError("NaN is not allowed")
    return float(name.replace("Infinity", "inf"))


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {dup!r} appears twice in one object")
    return out


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, d)
            if d > MAX_JSON_DEPTH:
                break
            stack.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def parse_json(data: bytes | bytearray | memoryview, where: str) -> Any:
    """Strict JSON: UTF-8, no NaN, no duplicate keys, integers of at most 40 digits, at most 64 levels
    of nesting; anything else is a PackageError naming ``where``. Infinite floats pass here (Python
    writes them); fields that need finite numbers check that themselves."""
    try:
        value = json.loads(
            bytes(data).decode("utf-8"),
            parse_int=_parse_int,
            parse_constant=_parse_constant,
            object_pairs_hook=_unique_keys,
        )
    except RecursionError:
        raise PackageError(f"{where}: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise PackageError(f"{where}: not valid JSON ({str(exc)[:200]})") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise PackageError(f"{where}: JSON nested more than {MAX_JSON_DEPTH} levels deep")
    return value


def check_relpath(rel: str) -> PurePosixPath:
    """A manifest path must be relative, POSIX, and stay inside the package."""
    if not isinstance(rel, str):
        raise PackageError(f"{MANIFEST}: a file path must be a string, got {type(rel).__name__}")
    p = PurePosixPath(rel)
    if (
        not rel
        or "\\" in rel
        or "\x00" in rel
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


def check_digest(digest: str) -> str:
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        raise PackageError(f"digest {digest!r}: expected 'sha256:' and 64 lowercase hex digits")
    return digest


@dataclass(frozen=True)
class Package:
    """A verified package: its root, its parsed manifest, its digest, and the verified bytes of
    every file it lists (``data``)."""

    root: Path
    manifest: dict[str, Any]
    digest: str
    blobs: dict[str, bytearray] = field(repr=False, default_factory=dict)
    manifest_bytes: bytes = field(repr=False, default=b"")
    """The manifest as read, whose sha256 is ``digest`` (what a copy of the package must carry)."""

    def data(self, rel: str) -> bytearray:
        """The verified bytes of a listed file."""
        check_relpath(rel)
        if rel not in self.blobs:
            raise PackageError(f"{rel}: not listed in {MANIFEST}")
        return self.blobs[rel]

    def read_json(self, rel: str) -> Any:
        return parse_json(self.data(rel), rel)


def _open_inside(root_fd: int, rel: str) -> int:
    """Open ``rel`` below the directory ``root_fd`` one component at a time, following no link, so a
    directory swapped for a link after the walk cannot lead outside the package."""
    *dirs, name = rel.split("/")
    fd = root_fd
    try:
        for part in dirs:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            if fd != root_fd:
                os.close(fd)
            fd = nxt
        # O_NONBLOCK: a FIFO planted in the package must not block the open
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    finally:
        if fd != root_fd:
            os.close(fd)


def _read_verified(root_fd: int, rel: str, meta: Any) -> bytearray:
    if not isinstance(meta, dict) or set(meta) != {"sha256", "size"}:
        raise PackageError(f"{MANIFEST}: files[{rel!r}] must be {{'sha256': ..., 'size': ...}}")
    size, expected = meta["size"], meta["sha256"]
    if type(size) is not int or size < 0 or not isinstance(expected, str):
        raise PackageError(f"{MANIFEST}: files[{rel!r}] has a malformed size or sha256")
    try:
        fd = _open_inside(root_fd, rel)
    except FileNotFoundError:
        raise PackageError(f"{rel}: listed in {MANIFEST} but missing") from None
    except OSError as exc:
        raise PackageError(
            f"{rel}: cannot be opened ({exc.strerror}); packages may not contain links"
        ) from None
    with os.fdopen(fd, "rb") as fh:
        stat = os.fstat(fh.fileno())
        if not S_ISREG(stat.st_mode):
            raise PackageError(f"{rel}: not a regular file")
        actual = stat.st_size
        if actual != size:
            raise PackageError(f"{rel}: size {actual} != {size} in {MANIFEST} (corrupt or tampered)")
        try:
            data = bytearray(size)
        except MemoryError:
            raise PackageError(f"{rel}: {size:,} bytes do not fit in this machine's memory") from None
        if fh.readinto(data) != size or fh.read(1):
            raise PackageError(f"{rel}: changed size while it was read (being rewritten?)")
    if hashlib.sha256(data).hexdigest() != expected:
        raise PackageError(f"{rel}: sha256 does not match {MANIFEST} (corrupt or tampered)")
    return data


def open_package(root: str | os.PathLike, digest: str | None = None) -> Package:
    """Verify a package completely, then return it with the verified bytes of every file.
    ``root`` is a directory or a ``modelscope://ORG/NAME`` id (``sdkiln.hub``).

    Refuses: a missing or unparseable manifest, another schema version, a manifest that breaks the
    schema (``runtime.manifest_schema``), a digest other than ``digest`` when one is given, symlinks
    anywhere, files not listed in the manifest (but a hub's own files at the root, ``HUB_FILES``,
    which are never read), listed paths that leave the package, and any file
    whose size or sha256 differs from the manifest.
    """
    from sdkiln.runtime.manifest_schema import check_manifest  # it imports this module's constants

    if digest is not None:
        check_digest(digest)
    if hub.is_hub_id(root):  # modelscope://ORG/NAME: its cached (or downloaded) snapshot
        root = hub.resolve(root)
    root = Path(root)
    if root.is_symlink():
        raise PackageError(f"{root}: the package directory is a symlink; refusing it")
    if not root.is_dir():
        raise PackageError(f"{root}: no such package directory")
    path = root / MANIFEST
    if path.is_symlink():
        raise PackageError(f"{path}: is a symlink; packages may not contain links")
    if not path.is_file():
        raise PackageError(f"{path}: no manifest (is {root} an sdkiln package?)")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise PackageError(f"{path}: larger than {MAX_MANIFEST_BYTES >> 20} MiB; not a manifest")
    raw = path.read_bytes()
    found = "sha256:" + hashlib.sha256(raw).hexdigest()
    if digest is not None and found != digest:
        raise PackageError(f"{path}: package digest {found} != the expected {digest}; refusing it")
    manifest = parse_json(raw, MANIFEST)
    check_manifest(manifest)
    listed = manifest["files"]
    on_disk = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if full.is_symlink():
                raise PackageError(f"{rel}: is a symlink; packages may not contain links")
            if name in filenames and rel != MANIFEST and not (rel in HUB_FILES and rel not in listed):
                on_disk.add(rel)
        if len(on_disk) > MAX_FILES:
            raise PackageError(f"{root}: more than {MAX_FILES} files; not a package")
    unlisted = sorted(on_disk - set(listed))
    if unlisted:
        raise PackageError(f"{unlisted[0]}: file not listed in {MANIFEST} (package was modified)")
    for rel in listed:
        check_relpath(rel)
        if not (root / rel).resolve().is_relative_to(root.resolve()):
            raise PackageError(f"{rel}: resolves outside the package; refusing it")
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        blobs = {rel: _read_verified(root_fd, rel, meta) for rel, meta in listed.items()}
    finally:
        os.close(root_fd)
    return Package(root=root, manifest=manifest, digest=found, blobs=blobs, manifest_bytes=raw)
