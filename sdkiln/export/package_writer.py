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
from sdkiln.export.shards import MAX_SHARD_BYTES, Planned, write_shards
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


def _keeps_float32(model: torch.nn.Module, name: str) -> bool:
    """diffusers keeps these modules in float32 whatever the model's dtype (``_keep_in_fp32_modules``)."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    return any(part in name.split(".") for part in keep)


def transformer_tensors(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> tuple[list[Planned], list[str]]:
    """The state dict plus non-persistent buffers (the runtime builds on meta and needs them too), as
    tensors to write one at a time from the model's own memory (``export.shards``). With ``dtype``
    (the deployment's 16-bit dtype), a float tensor of a diffusers or torch module is written in it;
    sdkiln's quantized modules keep their tensors' dtypes."""
    state = model.state_dict(keep_vars=True)
    extra = [n for n, _ in model.named_buffers() if n not in state]
    planned = []
    for name, value in [*state.items(), *((n, model.get_buffer(n)) for n in extra)]:
        owner = model.get_submodule(name.rpartition(".")[0])
        out = value.dtype
        if (
            dtype is not None
            and value.is_floating_point()
            and value.dtype != dtype
            and value.dtype.itemsize > 1
            and not type(owner).__module__.startswith("sdkiln.")
            and not _keeps_float32(model, name)
        ):
            out = dtype
        planned.append(Planned(name, tuple(value.shape), out, lambda value=value: value))
    return planned, extra


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")


CHAT_TEMPLATE_JINJA = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"


def _save_component(component, directory: Path, name: str) -> None:
    """``component.save_pretrained`` with every chat template in JSON, a file the loader reads under its
    strict JSON limits, rather than in a .jinja file (which packages do not hold). A tokenizer's
    (FLUX.2, Qwen-Image) stays inside its tokenizer_config.json (``save_jinja_files=False``). A
    processor (a transformers ``ProcessorMixin``: Qwen-Image-Edit's) has no such option: its template
    goes to chat_template.json, the single-template file its ``from_pretrained`` reads, and its
    tokenizer's files are written again with the tokenizer's template inside."""
    from transformers import ProcessorMixin

    def chat(obj) -> dict[str, bool]:
        return {"save_jinja_files": False} if getattr(obj, "chat_template", None) is not None else {}

    if not isinstance(component, ProcessorMixin):
        component.save_pretrained(directory, **chat(component))
        return
    template = component.chat_template
    if template is not None and not isinstance(template, str):
        raise PackageError(
            f"component {name!r} ({type(component).__name__}) has several chat templates, which transformers "
            "saves only as .jinja files; packages hold one, in JSON"
        )
    component.save_pretrained(directory)
    (directory / CHAT_TEMPLATE_JINJA).unlink(missing_ok=True)
    if template is not None:
        _write_json(directory / CHAT_TEMPLATE_JSON, {"chat_template": template})
    tokenizer = getattr(component, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory, **chat(tokenizer))


def _write_components(
    tmp: Path, pipeline, transformer_attrs: tuple[str, ...], dtype: torch.dtype | None, max_shard_bytes: int
) -> tuple[dict[str, list[str]], dict[str, tuple[str, int]]]:
    """Every component; each transformer streamed tensor by tensor. Returns each transformer's
    non-persistent buffers and the (sha256, size) of every file the shard writer hashed."""
    pipeline.save_config(tmp)  # model_index.json
    for name, component in pipeline.components.items():
        if component is None or name in transformer_attrs:
            continue
        if not hasattr(component, "save_pretrained"):
            raise PackageError(
                f"component {name!r} ({type(component).__name__}) cannot be saved without pickle"
            )
        _save_component(component, tmp / name, name)
    extras, hashed = {}, {}
    stem = TRANSFORMER_WEIGHTS.removesuffix(".safetensors")
    for attr in transformer_attrs:
        transformer = getattr(pipeline, attr)
        transformer.save_config(tmp / attr)
        planned, extras[attr] = transformer_tensors(transformer, dtype)
        written = write_shards(tmp / attr, stem, planned, max_shard_bytes)
        hashed.update({f"{attr}/{name}": value for name, value in written.items()})
    return extras, hashed


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
    transformer_attrs: str | tuple[str, ...],
    force: bool = False,
    extra_files: dict[str, Any] | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write ``pipeline`` (already optimized) with ``manifest`` fields and the quality report.

    ``manifest`` carries model/recipe/modules; this function adds format, versions, time and files.
    ``extra_files`` maps package paths to tensors (``.safetensors``), JSON objects (``.json``) or
    PNG bytes (``.png``). ``force`` lets it replace what ``check_replaceable`` allows; another
    sdkiln process writing ``out_dir`` at the same time makes it raise ``PackageError``. Each of
    ``transformer_attrs`` (the pipeline's transformer, then any other expert, whose entry in
    ``manifest["experts"]`` gets its non-persistent buffers) is streamed to shards of at most
    ``max_shard_bytes`` (``export.shards``), its float layers in the model's dtype
    (``manifest["model"]["dtype"]``).
    """
    target = Path(out_dir)
    with atomic_directory(target, check=lambda t: check_replaceable(t, force)) as tmp:
        dtype = getattr(torch, manifest.get("model", {}).get("dtype") or "", None)
        dtype = dtype if isinstance(dtype, torch.dtype) and dtype.itemsize == 2 else None
        attrs = (transformer_attrs,) if isinstance(transformer_attrs, str) else tuple(transformer_attrs)
        extras, hashed = _write_components(tmp, pipeline, attrs, dtype, max_shard_bytes)
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
            sha, size = hashed[rel] if rel in hashed else (sha256_file(path), path.stat().st_size)
            files[rel] = {"sha256": sha, "size": size}
        full = {
            "format": FORMAT_NAME,
            "schema_version": SCHEMA_VERSION,
            "sdkiln_version": __version__,
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            **manifest,
            "files": files,
        }
        full["model"] = {**full["model"], "nonpersistent_buffers": extras[attrs[0]]}
        for attr in attrs[1:]:  # the other transformers' (Wan2.2-A14B's transformer_2)
            expert = full["experts"][attr]
            expert["model"] = {**expert["model"], "nonpersistent_buffers": extras[attr]}
        _write_json(tmp / MANIFEST, full)
    return target
