"""The ``sparse_attention`` section: a block-sparse attention plan, routed through the attention seam.

The manifest entry is ``{"file": "attention/sparse_attention.json"}``. On attach the plan is read
and checked against the loaded transformer (its config hash, and that every layer it names is an
attention module the family routes), the transformer's attention is routed to the ``"sparse"``
backend, and the denoising-step tracker is attached (the plan's dense steps and mask reuse follow
the scheduler's step).
"""

from __future__ import annotations

from typing import Any

from sdkiln.errors import PackageError
from sdkiln.model_zoo.fingerprint import config_hash
from sdkiln.runtime.restore import RestoreContext, Section, section_file, transformer_spec
from sdkiln.runtime.sparse.apply import attach_sparse_attention
from sdkiln.runtime.sparse.plan import SparseAttentionPlan

NAME = "sparse_attention"


def plan_file(manifest: dict[str, Any]) -> str | None:
    return section_file(manifest, NAME)


def attach_plan(ctx: RestoreContext) -> None:
    where = plan_file(ctx.manifest)
    plan = SparseAttentionPlan.from_dict(ctx.package.read_json(where), where)
    if plan.config_hash != config_hash(ctx.transformer.config):
        raise PackageError(f"{where}: the plan was calibrated for another transformer config")
    try:
        ctx.notes["sparse_attention"] = attach_sparse_attention(ctx.pipeline, transformer_spec(ctx), plan)
    except ValueError as exc:
        raise PackageError(f"{where}: {exc}") from None


SECTION = Section(name=NAME, present=lambda manifest: plan_file(manifest) is not None, attach=attach_plan)
