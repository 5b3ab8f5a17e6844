"""Write a package atomically: build it in a temp directory beside the target, fsync, swap it in.

An interrupted export leaves the target as it was; an existing target is replaced only with
``force=True``, only if it is a package or an empty directory, and only after the new package is
complete (``sdkiln.export.atomic``). The format is defined by the reader (``sdkiln.runtime.package``)
and described in ``docs/package-format.md``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from sdkiln import __version__
from sdkiln.errors import PackageError
from sdkiln.export.atomic import atomic_directory
from sdkiln.runtime.package import (
    ALLOWED_SUFFIXES,
    FORMAT_NAME,
    MANIFEST,
    QUALITY_REPORT,
    SCHEMA_VERSION,
    TRANSFORMER_WEIGHTS,
    check_relpath,
    sha256_file,
)


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as safetensors writes it: on the CPU and contiguous, without a copy when it already
    is (safetensors writes from the tensors' memory); a view that shares storage with another
    tensor (safetensors refuses shared memory) is copied, that one tensor only."""
    t = tensor.detach().cpu().contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def transformer_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The state dict plus non-persistent buffers (the runtime builds on meta and needs them too),
    sharing the model's memory on the CPU: no second copy of the model while the file is written."""
    state = model.state_dict()
    extra = [n for n, _ in model.named_buffers() if n not in state]
    tensors, seen = {}, set()
    for name, value in [*state.items(), *((n, model.get_buffer(n)) for n in extra)]:
        t = _host(value)
        if t.numel() and t.data_ptr() in seen:  # a tied tensor under a second name: its own bytes
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
    return tensors, extra


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def _write_components(tmp: Path, pipeline, transformer_attr: str) -> list[str]:
    pipeline.save_config(tmp)  # model_index.json
    for name, component in pipeline.components.items():
        if component is None or name == transformer_attr:
            continue
        if not hasattr(component, "save_pretrained"):
            raise PackageError(
                f"component {name!r} ({type(component).__name__}) cannot be saved without pickle"
            )
        component.save_pretrained(tmp / name)
    transformer = getattr(pipeline, transformer_attr)
    transformer.save_config(tmp / transformer_attr)
    tensors, extra = transformer_tensors(transformer)
    save_file(tensors, str(tmp / transformer_attr / TRANSFORMER_WEIGHTS), metadata={"format": "pt"})
    return extra


def _write_extra(tmp: Path, extra_files: dict[str, Any]) -> None:
    for rel, content in extra_files.items():
        check_relpath(rel)
        path = tmp / rel
        if path.exists():
            raise PackageError(f"{rel}: two writers for one package file")
        path.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(".safetensors"):
            save_file({k: v.detach().cpu().contiguous() for k, v in content.items()}, str(path))
        elif isinstance(content, bytes):  # a rendered figure (.png)
            path.write_bytes(content)
        else:
            _write_json(path, content)


def check_replaceable(target: Path, force: bool) -> None:
    """Refuse ``target`` unless nothing is there or, with ``force``, it is an sdkiln package or an
    empty directory. ``--force`` must never delete what sdkiln did not write: a file, a link or a
    directory of the user's files is refused and left as it is.

    ``optimize`` calls this (under ``target_lock``) before any work, so a wrong ``--out`` is refused
    in a second instead of after the optimization; ``write_package`` calls it again under the lock.
    """
    if not os.path.lexists(target):
        return
    if not force:
        raise PackageError(f"{target}: already exists; pass --force (force=True) to replace it")
    if not target.is_symlink() and target.is_dir():
        if not any(target.iterdir()):
            return
        try:
            manifest = json.loads((target / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):  # no manifest, or one that is not JSON: not a package
            manifest = None
        if isinstance(manifest, dict) and manifest.get("format") == FORMAT_NAME:
            return
    raise PackageError(
        f"{target}: is neither an sdkiln package nor an empty directory; --force replaces only those, "
        "so it is left as it is"
    )


def write_package(
    out_dir: str | os.PathLike,
    pipeline,
    manifest: dict[str, Any],
    quality: dict[str, Any],
    transformer_attr: str,
    force: bool = False,
    extra_files: dict[str, Any] | None = None,
) -> Path:
    """Write ``pipeline`` (already optimized) with ``manifest`` fields and the quality report.

    ``manifest`` carries model/recipe/modules; this function adds format, versions, time and files.
    ``extra_files`` maps package paths to tensors (``.safetensors``), JSON objects (``.json``) or
    PNG bytes (``.png``). ``force`` lets it replace what ``check_replaceable`` allows; another
    sdkiln process writing ``out_dir`` at the same time makes it raise ``PackageError``.
    """
    target = Path(out_dir)
    with atomic_directory(target, check=lambda t: check_replaceable(t, force)) as tmp:
        extra = _write_components(tmp, pipeline, transformer_attr)
        _write_json(tmp / QUALITY_REPORT, quality)
        _write_extra(tmp, extra_files or {})
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            rel = path.relative_to(tmp).as_posix()
            if not rel.endswith(ALLOWED_SUFFIXES):
                raise PackageError(
                    f"{rel}: written by a component's save_pretrained, but packages hold only {ALLOWED_SUFFIXES}"
                )
            os.chmod(path, 0o644)
            files[rel] = {"sha256": sha256_file(path), "size": path.stat().st_size}
        full = {
            "format": FORMAT_NAME,
            "schema_version": SCHEMA_VERSION,
            "sdkiln_version": __version__,
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            **manifest,
            "files": files,
        }
        full["model"] = {**full["model"], "nonpersistent_buffers": extra}
        _write_json(tmp / MANIFEST, full)
    return target
