"""Restore a package section by section: one handler per section, registered by name (ModelOpt's
restore per saved mode; STYLE habit 15).

A package's manifest holds the core fields every package has (``CORE_FIELDS``) and one top-level
entry per **section** it carries: ``modules`` (the quantized layers), ``cache_schedule``,
``attention_quant`` (``runtime.attention.quantized``), ``sparse_attention``, ``experts`` (a pipeline's other transformers, each with sections of its
own: ``runtime.experts``) and ``text_encoders`` (quantized text encoders: ``runtime.quant.encoders``). Each section has a
``Section`` handler in its own module, listed in ``SECTION_MODULES``; a manifest entry that no
handler claims is refused, so an older sdkiln never runs a newer package without a part of it.

``sdkiln.load`` runs every section's handler in three of its stages (``runtime/loader.py`` has the
whole order): ``build`` on the transformer built on the meta device, before its weights are loaded
(swap modules), ``component`` on each other model component built on meta, before its weights are
loaded (a quantized text encoder's modules), and ``attach`` on the assembled pipeline (hooks,
schedules, step trackers).
Sections run in ``SECTION_MODULES`` order within a stage.

Adding a section is one module with a ``SECTION`` and one line in ``SECTION_MODULES``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sdkiln.errors import PackageError
from sdkiln.runtime.package import MANIFEST, Package

CORE_FIELDS = ("format", "schema_version", "sdkiln_version", "created", "model", "call", "recipe", "files")
SECTION_MODULES = (
    "sdkiln.runtime.quant.restore",
    "sdkiln.runtime.cache.restore",
    "sdkiln.runtime.attention.quantized",
    "sdkiln.runtime.sparse.restore",
    "sdkiln.runtime.experts",
    "sdkiln.runtime.quant.encoders",
)


@dataclass
class RestoreContext:
    """What the handlers work on; the loader fills it in as it goes."""

    package: Package
    transformer: torch.nn.Module
    pipeline: Any = None
    notes: dict[str, Any] = field(default_factory=dict)
    """What a handler wants to tell later stages or the caller (e.g. the attached cache runner)."""
    view: dict[str, Any] | None = None
    """The manifest as this transformer's sections read it, when it is not the package's own: a
    pipeline's other transformer (``runtime.experts``) has its model fields and sections there."""
    device: torch.device | None = None
    """Where weights go as they are read (an accelerator, shard by shard); None: the host."""
    transformers: dict[str, torch.nn.Module] = field(default_factory=dict)
    """The pipeline's other transformers, by attribute, that a section built (``runtime.experts``):
    the pipeline is assembled with them."""

    @property
    def manifest(self) -> dict[str, Any]:
        return self.package.manifest if self.view is None else self.view

    @property
    def transformer_attr(self) -> str:
        return self.manifest["model"]["transformer_attr"]


@dataclass(frozen=True)
class Section:
    name: str
    """The manifest entry the section is stored under."""
    present: Callable[[dict[str, Any]], bool]
    """Whether a manifest carries the section (a schema-1 package may carry it without the entry)."""
    build: Callable[[RestoreContext], None] | None = None
    component: Callable[[RestoreContext, str, torch.nn.Module], None] | None = None
    """On a model component (not a transformer) by name, built on meta before its weights load."""
    attach: Callable[[RestoreContext], None] | None = None


def _load_sections() -> dict[str, Section]:
    sections = {}
    for module in SECTION_MODULES:
        section = importlib.import_module(module).SECTION
        if section.name in sections or section.name in CORE_FIELDS:
            raise ValueError(f"package section {section.name!r} is registered twice")
        sections[section.name] = section
    return sections


def sections_of(manifest: dict[str, Any]) -> list[Section]:
    """The sections a manifest carries, in restore order; PackageError for an entry no handler claims."""
    known = _load_sections()
    unknown = sorted(k for k in manifest if k not in CORE_FIELDS and k not in known)
    if unknown:
        raise PackageError(
            f"{MANIFEST}: unknown section {unknown[0]!r}; this sdkiln restores "
            f"{', '.join(known)}: the package needs a newer sdkiln"
        )
    return [s for s in known.values() if s.present(manifest)]


def section_file(manifest: dict[str, Any], name: str) -> str | None:
    """The file of a section stored as ``{"file": "<rel>"}`` (a plan, a schedule), None when absent."""
    entry = manifest.get(name)
    if entry is None:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or set(entry) != {"file"}:
        raise PackageError(f"{MANIFEST}: {name} must be an object with a 'file', got {entry!r}")
    return entry["file"]


def transformer_spec(ctx: RestoreContext):
    """The package's family spec, seen from the transformer ``ctx`` restores (an expert's own)."""
    import dataclasses

    from sdkiln.model_zoo import get_spec

    spec = get_spec(ctx.manifest["model"]["family"], ctx.manifest["model"].get("variant"))
    return dataclasses.replace(spec, transformer_attr=ctx.transformer_attr, experts=())


def run_stage(stage: str, sections: list[Section], ctx: RestoreContext) -> None:
    """Run every section's handler for ``stage`` ("build" or "attach")."""
    for section in sections:
        handler = getattr(section, stage)
        if handler is not None:
            handler(ctx)


def run_component(sections: list[Section], ctx: RestoreContext, name: str, model: torch.nn.Module) -> None:
    """Run every section's ``component`` handler on the component ``name``, built on meta."""
    for section in sections:
        if section.component is not None:
            section.component(ctx, name, model)
