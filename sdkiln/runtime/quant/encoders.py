"""The ``text_encoders`` section: text encoders a recipe quantized (``TextEncoderQuantConfig``).

``manifest["text_encoders"]`` maps a component's name (``text_encoder_2``) to ``{"modules": {...}}``,
its quantized Linears named and described as the transformer's are in ``modules``. At the
``component`` stage each named encoder, built on meta, has those Linears replaced by their schemes'
modules (``swap_into``), so its safetensors (written by ``save_pretrained`` with the modules'
tensors) load into them; at ``attach`` every named encoder must have been built that way, so an
entry naming a component the package does not load as a model is refused.
"""

from __future__ import annotations

from torch import nn

from sdkiln.errors import PackageError
from sdkiln.runtime.manifest_schema import expect_dict
from sdkiln.runtime.quant.restore import swap_into
from sdkiln.runtime.restore import RestoreContext, Section

SECTION_NAME = "text_encoders"
_DONE = "text_encoders_swapped"


def _entries(ctx: RestoreContext) -> dict:
    entries = expect_dict(ctx.manifest[SECTION_NAME], f"manifest.json: {SECTION_NAME}")
    other = sorted(n for n in entries if not n.startswith("text_encoder"))
    if other:
        raise PackageError(f"manifest.json: {SECTION_NAME} names {other[0]!r}, which is not a text encoder")
    return entries


def swap_encoder(ctx: RestoreContext, name: str, model: nn.Module) -> None:
    entries = _entries(ctx)
    if name not in entries:
        return
    entry = expect_dict(entries[name], f"manifest.json: {SECTION_NAME}.{name}")
    unknown = sorted(set(entry) - {"modules"})
    if unknown or "modules" not in entry:
        raise PackageError(f"manifest.json: {SECTION_NAME}.{name} must hold 'modules' only")
    swap_into(model, entry["modules"], name)
    ctx.notes.setdefault(_DONE, set()).add(name)


def check_swapped(ctx: RestoreContext) -> None:
    missing = sorted(set(_entries(ctx)) - ctx.notes.get(_DONE, set()))
    if missing:
        raise PackageError(
            f"manifest.json: {SECTION_NAME} names {missing[0]!r}, which is not a model component of the package"
        )


SECTION = Section(
    name=SECTION_NAME,
    present=lambda manifest: bool(manifest.get(SECTION_NAME)),
    component=swap_encoder,
    attach=check_swapped,
)
