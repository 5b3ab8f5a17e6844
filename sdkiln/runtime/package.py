"""Reading a package safely: the format's constants and every check made before a byte is used.

The writer (``sdkiln.export``) imports the constants from here, so the reader is the one place
that defines what a valid package is. ``docs/package-format.md`` is the prose version and
``docs/security.md`` the threat model.

``open_package`` verifies the manifest, the directory (no links, no stray files, every listed file
present, regular and of its listed size) and reads and hashes every small file (JSON, text, PNG),
keeping their bytes: every later reader of them parses those same bytes, so what is used is exactly
what was verified, even if someone rewrites the directory while it loads. Weights (``.safetensors``,
the bulk of a package) are read once, when they are used (``Package.tensors``): each tensor's bytes
go straight into that tensor's own storage, hashed on the way, and no tensor is handed out before the
whole file's sha256 matched. ``Package.verify`` hashes the files not read yet (``sdkiln inspect``,
``publish``). The manifest's own sha256 is the package **digest**: the manifest lists every file's
sha256, so one digest pins the whole package.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator
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
HEADER_LIMIT = 100 << 20  # bytes of a safetensors header: the safetensors library's own limit


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


WEIGHTS_SUFFIX = ".safetensors"
"""Files read when used (``Package.tensors``), not when the package is opened."""
HASH_CHUNK = 16 << 20


def read_head(stream: VerifiedStream) -> bytes:
    """A safetensors file's 8-byte header length and its header, from the start of ``stream``."""
    if stream.size < 8:
        raise stream.refuse(
            PackageError(f"{stream.rel}: {stream.size} bytes, too short for a safetensors file")
        )
    length = stream.read(8)
    n = int.from_bytes(length, "little")
    if n > min(HEADER_LIMIT, stream.size - 8):
        raise stream.refuse(
            PackageError(f"{stream.rel}: safetensors header of {n} bytes does not fit the file")
        )
    return length + stream.read(n)


class VerifiedStream:
    """One listed file, opened inside the package: every byte read is hashed, and ``finish`` checks
    that the file ended where the manifest says and that its sha256 matches. Nothing read from it
    may be used before ``finish`` returned."""

    def __init__(self, fh, rel: str, size: int, sha256: str):
        self.fh, self.rel, self.size, self.expected = fh, rel, size, sha256
        self.hash = hashlib.sha256()
        self.position = 0

    def read(self, n: int) -> bytes:
        data = bytearray(n)
        self.readinto(data)
        return bytes(data)

    def readinto(self, buffer) -> None:
        """Fill ``buffer`` (a writable buffer of bytes) from the file, in chunks; a file that ends
        first is one that changed size."""
        view = memoryview(buffer).cast("B")
        for start in range(0, len(view), HASH_CHUNK):
            chunk = view[start : start + HASH_CHUNK]
            filled = 0
            while filled < len(chunk):  # a raw read may return less than asked: read on
                got = self.fh.readinto(chunk[filled:])
                if not got:
                    raise PackageError(f"{self.rel}: changed size while it was read (being rewritten?)")
                filled += got
            self.hash.update(chunk)
        self.position += len(view)

    def drain(self, sink: Any = None) -> None:
        """Hash the rest of the file, a chunk at a time, handing each to ``sink`` (a writable file)
        when given; nothing is kept."""
        buffer = bytearray(min(HASH_CHUNK, max(self.size - self.position, 0)))
        while self.position < self.size:
            chunk = memoryview(buffer)[: min(len(buffer), self.size - self.position)]
            self.readinto(chunk)
            if sink is not None:
                sink.write(chunk)

    def finish(self) -> None:
        if self.position != self.size or self.fh.read(1):
            raise PackageError(f"{self.rel}: changed size while it was read (being rewritten?)")
        if self.hash.hexdigest() != self.expected:
            raise PackageError(f"{self.rel}: sha256 does not match {MANIFEST} (corrupt or tampered)")

    def refuse(self, error: PackageError) -> PackageError:
        """``error`` (the file's content is malformed), unless the file is not what the manifest
        lists: then that is the error to report."""
        self.drain()
        self.finish()
        return error


@dataclass(frozen=True)
class Package:
    """A verified package: its root, its parsed manifest, its digest, the verified bytes of its small
    files (``data``), and its weights files, read and verified when used (``tensors``)."""

    root: Path
    manifest: dict[str, Any]
    digest: str
    blobs: dict[str, bytes] = field(repr=False, default_factory=dict)
    manifest_bytes: bytes = field(repr=False, default=b"")
    """The manifest as read, whose sha256 is ``digest`` (what a copy of the package must carry)."""
    verified: set[str] = field(repr=False, default_factory=set)
    """Weights files read (or hashed) and found to match the manifest."""
    headers: dict[str, bytes] = field(repr=False, default_factory=dict)
    """Safetensors headers read ahead of their file (``header``), to be matched when it is read."""

    @property
    def files(self) -> list[str]:
        """Every listed file, sorted."""
        return sorted(self.manifest["files"])

    def data(self, rel: str) -> bytes:
        """The verified bytes of a listed small file (JSON, text, PNG)."""
        check_relpath(rel)
        if rel not in self.manifest["files"]:
            raise PackageError(f"{rel}: not listed in {MANIFEST}")
        if rel not in self.blobs:
            raise PackageError(f"{rel}: a weights file, read with Package.tensors, not as bytes")
        return self.blobs[rel]

    def read_json(self, rel: str) -> Any:
        return parse_json(self.data(rel), rel)

    @contextlib.contextmanager
    def open(self, rel: str) -> Iterator[VerifiedStream]:
        """Read the listed file ``rel`` through a ``VerifiedStream``; the caller calls ``finish``."""
        check_relpath(rel)
        meta = self.manifest["files"].get(rel)
        if meta is None:
            raise PackageError(f"{rel}: not listed in {MANIFEST}")
        root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            fd = _open_listed(root_fd, rel, meta["size"])
        finally:
            os.close(root_fd)
        with os.fdopen(fd, "rb", buffering=0) as fh:
            yield VerifiedStream(fh, rel, meta["size"], meta["sha256"])

    def header(self, rel: str) -> bytes:
        """The header of the safetensors file ``rel`` (its 8-byte length and JSON), read ahead of the
        file to size a model before its weights are read. Not verified yet: ``tensors`` reads the
        file and refuses it if this header is not the one the verified file holds."""
        if rel not in self.headers:
            with self.open(rel) as stream:
                self.headers[rel] = read_head(stream)
        return self.headers[rel]

    def tensors(self, rel: str, device: Any = None) -> dict[str, Any]:
        """Every tensor of the safetensors file ``rel``, each in storage of its own (no tensor views
        the whole file), after the file's sha256 matched; on ``device`` if given, where each goes
        once the file is verified (the host copy is freed as it goes)."""
        from sdkiln.runtime.safetensors_data import read_tensors

        with self.open(rel) as stream:
            tensors = read_tensors(stream, rel, self.headers.get(rel))
        self.verified.add(rel)
        if device is not None:
            for name in list(tensors):
                tensors[name] = tensors[name].to(device)
        return tensors

    def copy(self, rel: str, dest: Path) -> None:
        """Write the listed file ``rel`` to ``dest``, verified: a file that does not match is an error
        (and ``dest`` holds unverified bytes: write into a directory that is discarded on error)."""
        if rel in self.blobs:
            dest.write_bytes(self.blobs[rel])
            return
        with self.open(rel) as stream, open(dest, "wb") as out:
            stream.drain(out)
            stream.finish()
        self.verified.add(rel)

    def verify(self) -> None:
        """Hash every weights file not read yet (one pass over each, nothing kept but its header, so
        ``header`` then returns what was verified)."""
        for rel in self.files:
            if rel.endswith(WEIGHTS_SUFFIX) and rel not in self.verified:
                self.verify_file(rel)

    def verify_file(self, rel: str) -> None:
        """Hash the weights file ``rel`` (one pass, nothing kept but its header)."""
        with self.open(rel) as stream:
            head = read_head(stream)
            stream.drain()
            stream.finish()
        if self.headers.setdefault(rel, head) != head:
            raise PackageError(f"{rel}: changed while it was read (being rewritten?)")
        self.verified.add(rel)


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


def _check_meta(rel: str, meta: Any) -> None:
    if not isinstance(meta, dict) or set(meta) != {"sha256", "size"}:
        raise PackageError(f"{MANIFEST}: files[{rel!r}] must be {{'sha256': ..., 'size': ...}}")
    size, expected = meta["size"], meta["sha256"]
    if type(size) is not int or size < 0 or not isinstance(expected, str):
        raise PackageError(f"{MANIFEST}: files[{rel!r}] has a malformed size or sha256")


def _open_listed(root_fd: int, rel: str, size: int) -> int:
    """An open descriptor of the regular file ``rel`` of exactly ``size`` bytes."""
    try:
        fd = _open_inside(root_fd, rel)
    except FileNotFoundError:
        raise PackageError(f"{rel}: listed in {MANIFEST} but missing") from None
    except OSError as exc:
        raise PackageError(
            f"{rel}: cannot be opened ({exc.strerror}); packages may not contain links"
        ) from None
    stat = os.fstat(fd)
    problem = None
    if not S_ISREG(stat.st_mode):
        problem = f"{rel}: not a regular file"
    elif stat.st_size != size:
        problem = f"{rel}: size {stat.st_size} != {size} in {MANIFEST} (corrupt or tampered)"
    if problem:
        os.close(fd)
        raise PackageError(problem)
    return fd


def _read_small(root_fd: int, rel: str, meta: dict[str, Any]) -> bytes:
    with os.fdopen(_open_listed(root_fd, rel, meta["size"]), "rb") as fh:
        stream = VerifiedStream(fh, rel, meta["size"], meta["sha256"])
        data = stream.read(meta["size"])
        stream.finish()
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
        blobs = {}
        for rel, meta in listed.items():
            _check_meta(rel, meta)
            if rel.endswith(WEIGHTS_SUFFIX):
                os.close(_open_listed(root_fd, rel, meta["size"]))  # there, regular, of its size
            else:
                blobs[rel] = _read_small(root_fd, rel, meta)
    finally:
        os.close(root_fd)
    return Package(root=root, manifest=manifest, digest=found, blobs=blobs, manifest_bytes=raw)
