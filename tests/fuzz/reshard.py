"""Rewrite a package's transformer as shards with an index (``sdkiln.export.shards``) and re-sign
the manifest: the sharded twin of a single-file package, with the same tensors bit for bit."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from safetensors import safe_open

from sdkiln.export.shards import Planned, write_shards
from sdkiln.runtime.package import MANIFEST, TRANSFORMER_WEIGHTS


def reshard(root: Path, max_bytes: int, attr: str = "transformer") -> list[str]:
    """Shard ``root``'s ``attr`` weights at ``max_bytes`` per shard; returns the new files."""
    single = root / attr / TRANSFORMER_WEIGHTS
    with safe_open(str(single), "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (safe_open is no dict)
    planned = [Planned(k, tuple(v.shape), v.dtype, lambda v=v: v) for k, v in tensors.items()]
    single.unlink()
    written = write_shards(root / attr, TRANSFORMER_WEIGHTS.removesuffix(".safetensors"), planned, max_bytes)
    manifest = json.loads((root / MANIFEST).read_text())
    del manifest["files"][f"{attr}/{TRANSFORMER_WEIGHTS}"]
    for path in sorted((root / attr).iterdir()):
        rel = f"{attr}/{path.name}"
        if rel in manifest["files"] and path.name not in written and not path.name.endswith(".index.json"):
            continue
        data = path.read_bytes()
        manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return sorted(f"{attr}/{name}" for name in written)
