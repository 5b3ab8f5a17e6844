"""Package mutations for the fuzz harness: each takes a copy of a good package and a seeded random
generator, damages the copy in one way, and says what it did.

Most mutations re-sign the manifest afterwards (every file's sha256 and size recomputed), so the
damage gets past the hash check to the parsers behind it; a package that loads after a mutation has
a different digest, which ``--digest`` must catch.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
HOSTILE = [
    -1,
    0,
    1,
    2,
    10**6,
    10**9,
    10**30,
    2**70,
    1e9,
    1e30,
    1.5,
    -0.0,
    True,
    False,
    None,
    "",
    "x",
    "manual_seed",
    "nn",
    "../../etc/passwd",
    "float16",
    "bfloat16",
    "W8A16",
    "W4A16",
    "W8A8_DYNAMIC",
    "diffusers:AutoencoderKL",
    [],
    {},
    [1, 2, 3],
    {"a": 1},
    "A" * 10_000,
    [[[[[[[[[[]]]]]]]]]],
]
RAW_JSON = [
    b"[" * 100_000 + b"]" * 100_000,
    b"1" * 5000,
    b"NaN",
    b'{"a": 1, "a": 2}',
    b"\xff\xfe{}",
    b"",
    b"null",
    b'{"format": "sdkiln-package"}',
]


def files_of(root: Path) -> list[str]:
    return sorted(
        p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def resign(root: Path) -> None:
    """Recompute every listed file's sha256 and size, as a forger would."""
    manifest = json.loads((root / MANIFEST).read_text())
    for rel in manifest["files"]:
        path = root / rel
        if path.is_file():
            data = path.read_bytes()
            manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2))


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:50]):
            out += _paths(v, (*prefix, i))
    return out


def _edit(tree: Any, rng: random.Random) -> tuple[Any, str]:
    path = rng.choice(_paths(tree)[1:] or [()])
    if not path:
        return rng.choice(HOSTILE), "root replaced"
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    key, op = path[-1], rng.random()
    old = parent[key]
    if op < 0.15 and isinstance(parent, dict):
        del parent[key]
        return tree, f"{'.'.join(map(str, path))} deleted"
    if op < 0.25 and isinstance(parent, dict):
        parent[f"unknown_{rng.randrange(100)}"] = rng.choice(HOSTILE)
        return tree, f"unknown key added beside {'.'.join(map(str, path))}"
    if op < 0.4 and type(old) in (int, float) and not isinstance(old, bool):
        new = rng.choice([old * 2, old + 1, old * 1000, -old, old * 10**9])
    else:
        new = rng.choice(HOSTILE)
    parent[key] = new
    return tree, f"{'.'.join(map(str, path))}: {str(old)[:40]!r} -> {str(new)[:40]!r}"


def _pick(root: Path, rng: random.Random, suffix: str | None = None) -> str:
    files = [f for f in files_of(root) if suffix is None or f.endswith(suffix)]
    return rng.choice(files)


def bit_flip(root: Path, rng: random.Random) -> str:
    rel = _pick(root, rng)
    data = bytearray((root / rel).read_bytes())
    if not data:
        return f"{rel}: empty, unchanged"
    # bias towards the start, where headers and small JSON live
    positions = [
        min(int(rng.expovariate(1 / 256)), len(data) - 1) if rng.random() < 0.7 else rng.randrange(len(data))
        for _ in range(rng.randint(1, 8))
    ]
    for pos in positions:
        data[pos] ^= 1 << rng.randrange(8)
    (root / rel).write_bytes(data)
    resign(root)
    return f"{rel}: bits flipped at {positions[:4]}"


def truncate(root: Path, rng: random.Random) -> str:
    rel = _pick(root, rng)
    data = (root / rel).read_bytes()
    cut = rng.choice([0, 1, 7, 8, 9, rng.randrange(len(data) + 1)])
    (root / rel).write_bytes(data[:cut])
    resign(root)
    return f"{rel}: truncated to {cut} of {len(data)} bytes"


def json_field(root: Path, rng: random.Random) -> str:
    rel = rng.choice([MANIFEST] * 4 + [f for f in files_of(root) if f.endswith(".json")])
    tree = json.loads((root / rel).read_text())
    tree, what = _edit(tree, rng)
    (root / rel).write_text(json.dumps(tree))
    if rel != MANIFEST:
        resign(root)
    return f"{rel}: {what}"


def json_raw(root: Path, rng: random.Random) -> str:
    rel = rng.choice([MANIFEST] + [f for f in files_of(root) if f.endswith(".json")])
    raw = rng.choice(RAW_JSON)
    (root / rel).write_bytes(raw)
    if rel != MANIFEST:
        resign(root)
    return f"{rel}: replaced by {raw[:20]!r}... ({len(raw)} bytes)"


def rewrite_header(path: Path, change) -> None:
    """Apply ``change`` to a safetensors file's JSON header in place, the data left as it is."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n :])


def safetensors_header(root: Path, rng: random.Random) -> str:
    rel = _pick(root, rng, ".safetensors")
    what = {}
    rewrite_header(root / rel, lambda header: what.update(_edit_header(header, rng)))
    resign(root)
    return f"{rel}: header entry {what['name']!r} edited ({what['op']})"


def _edit_header(header: dict, rng: random.Random) -> dict:
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    op = rng.randrange(7)
    if op == 0:
        entry["dtype"] = rng.choice(["F32", "F16", "BF16", "I8", "U8", "I64", "F8_E4M3", "BOOL", "X9", 3])
    elif op == 1:
        shape = entry["shape"]
        entry["shape"] = rng.choice(
            [shape[::-1], [*shape, 1], [], [10**12], [-1], "abc", [s + 1 for s in shape]]
        )
    elif op == 2:
        a, b = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[a, b + 4], [a + 4, b], [b, a], [0, b - a], [a, 10**15], "x"])
    elif op == 3:
        header[name + rng.choice(["_renamed", "x", ""]) if rng.random() < 0.8 else rng.choice(names)] = (
            header.pop(name)
        )
    elif op == 4:
        del header[name]
    elif op == 5:
        header["__metadata__"] = rng.choice([{"format": 1}, [], "x", {"format": "pt"}])
    else:
        other = rng.choice(names)
        header[name], header[other] = header[other], header[name]
    return {"name": name, "op": op}


def path_trick(root: Path, rng: random.Random) -> str:
    manifest = json.loads((root / MANIFEST).read_text())
    files = manifest["files"]
    op = rng.randrange(8)
    victim = rng.choice(sorted(files))
    outside = root.parent / f"outside-{rng.randrange(10**6)}.json"
    outside.write_text("{}")
    meta = {"sha256": hashlib.sha256(b"{}").hexdigest(), "size": 2}
    if op == 0:
        files["../" + outside.name] = meta
        what = "listed ../ path"
    elif op == 1:
        files[str(outside)] = meta
        what = "listed absolute path"
    elif op == 2:
        (root / "link.json").symlink_to(outside)
        files["link.json"] = meta
        what = "symlink to outside, listed"
    elif op == 3:
        (root / "linkdir").symlink_to(root / Path(victim).parent)
        what = "symlinked directory"
    elif op == 4:
        (root / "extra.json").write_text("{}")
        what = "unlisted extra file"
    elif op == 5:
        (root / "evil.pkl").write_bytes(b"\x80\x04K\x01.")
        files["evil.pkl"] = {"sha256": hashlib.sha256(b"\x80\x04K\x01.").hexdigest(), "size": 5}
        what = "listed pickle"
    elif op == 6:
        new = victim.replace(".", "_moved.", 1)
        os.rename(root / victim, root / new)
        files[new] = files.pop(victim)
        what = f"{victim} renamed to {new}"
    else:
        (root / victim).unlink()
        (root / victim).mkdir()
        what = f"{victim} replaced by a directory"
    (root / MANIFEST).write_text(json.dumps(manifest))
    return what


MUTATIONS = {
    "bit_flip": (bit_flip, 3),
    "truncate": (truncate, 1),
    "json_field": (json_field, 5),
    "json_raw": (json_raw, 1),
    "safetensors_header": (safetensors_header, 3),
    "path_trick": (path_trick, 1),
}


def mutate(root: Path, seed: int) -> tuple[str, str]:
    """Damage the package at ``root`` in one seeded way: (mutation kind, what was done)."""
    rng = random.Random(seed)
    kinds = list(MUTATIONS)
    kind = rng.choices(kinds, weights=[MUTATIONS[k][1] for k in kinds])[0]
    return kind, MUTATIONS[kind][0](root, rng)
