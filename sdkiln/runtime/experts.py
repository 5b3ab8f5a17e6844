"""The ``experts`` section: a pipeline's other transformers (Wan2.2-A14B's low-noise ``transformer_2``),
each restored as a package's transformer is, with sections of its own.

``manifest["experts"]`` maps the pipeline attribute of each other transformer to its entry:

* ``model``: its fingerprint (``config_hash``, ``weights_hash``), ``transformer_class``, ``dtype``
  and ``nonpersistent_buffers``, the fields the package's ``model`` has for its transformer;
* its sections, as a package has them: ``modules``, ``cache_schedule``, ``attention_quant``, ``sparse_attention`` (their
  files under ``experts/<attr>/``);
* ``steps``: what each recipe step decided on it (an audit record, as ``recipe.steps[i].result``).

Its weights are ``<attr>/`` beside ``transformer/``. Each expert is seen through a *view* of the
manifest, the package's core fields with the expert's model fields and sections in place of the
transformer's, so the other sections' handlers restore it unchanged: at ``build`` the expert is built
on meta from ``<attr>/config.json``, its sections' ``build`` handlers swap its modules, and its
weights are read and verified (on the device the loader places weights on) and handed to the loader,
which assembles the pipeline with it (``RestoreContext.transformers``); at ``attach`` its sections'
``attach`` handlers run on the assembled pipeline (its step tracker, its cache schedule).
"""

from __future__ import annotations

from typing import Any

from sdkiln.errors import PackageError
from sdkiln.model_zoo import get_spec
from sdkiln.runtime import loader, restore
from sdkiln.runtime.manifest_schema import (
    DTYPES,
    IDENTIFIER,
    MODEL_FIELDS,
    expect_dict,
    expect_list,
    expect_str,
)
from sdkiln.runtime.restore import CORE_FIELDS, RestoreContext, Section

NAME = "experts"
EXPERT_MODEL_FIELDS = ("config_hash", "weights_hash", "transformer_class", "dtype")
AUDIT = "steps"


def expert_views(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each expert's view of the manifest (the module docstring), its entry checked first."""
    where = f"manifest.json: {NAME}"
    entries = expect_dict(manifest.get(NAME, {}), where)
    info = manifest["model"]
    declared = get_spec(info["family"], info.get("variant")).experts
    if set(entries) != set(declared):
        raise PackageError(
            f"{where}: the package's experts are {sorted(entries)}, but {info['family']} pipelines have "
            f"{sorted(declared)}"
        )
    index = manifest["files"]
    views = {}
    for attr, entry in entries.items():
        at = f"{where}.{attr}"
        expect_str(attr, at, IDENTIFIER, 128)
        if attr == manifest["model"]["transformer_attr"]:
            raise PackageError(f"{at}: is the package's transformer, not another expert")
        if f"{attr}/config.json" not in index:
            raise PackageError(f"{at}: the package has no {attr}/config.json")
        expect_dict(entry, at, ("model",))
        model = expect_dict(entry["model"], f"{at}.model", EXPERT_MODEL_FIELDS)
        for key in EXPERT_MODEL_FIELDS:
            expect_str(model[key], f"{at}.model.{key}", *MODEL_FIELDS[key])
        if model["transformer_class"] != info["transformer_class"]:
            raise PackageError(
                f"{at}.model.transformer_class: must be {info['transformer_class']}, as the package's"
            )
        expect_dict(entry.get("modules", {}), f"{at}.modules")
        if model["dtype"] not in DTYPES:
            raise PackageError(f"{at}.model.dtype: must be one of {DTYPES}, got {model['dtype']!r}")
        for i, name in enumerate(expect_list(model.get("nonpersistent_buffers", []), f"{at}.model.buffers")):
            expect_str(name, f"{at}.model.nonpersistent_buffers[{i}]", max_len=1000)
        unknown = sorted(set(model) - set(EXPERT_MODEL_FIELDS) - {"nonpersistent_buffers"})
        if unknown:
            raise PackageError(f"{at}.model.{unknown[0]}: is not a model field of an expert")
        expect_list(entry.get(AUDIT, []), f"{at}.{AUDIT}", 100)
        sections = {k: v for k, v in entry.items() if k not in ("model", AUDIT)}
        if NAME in sections or set(sections) & set(CORE_FIELDS):
            raise PackageError(
                f"{at}: an expert carries sections, not {sorted(set(sections) & {NAME, *CORE_FIELDS})}"
            )
        views[attr] = {
            **{k: manifest[k] for k in CORE_FIELDS if k in manifest},
            "model": {**manifest["model"], "nonpersistent_buffers": [], **model, "transformer_attr": attr},
            "modules": {},
            **sections,
        }
    return views


def build_experts(ctx: RestoreContext) -> None:
    experts = {}
    for attr, view in expert_views(ctx.manifest).items():
        sections = restore.sections_of(view)
        expert = RestoreContext(ctx.package, loader.build_transformer(ctx.package, view["model"]), view=view)
        restore.run_stage("build", sections, expert)
        loader.load_weights(ctx.package, expert.transformer, ctx.device, view["model"])
        ctx.transformers[attr] = expert.transformer
        experts[attr] = (expert, sections)
    ctx.notes[NAME] = experts


def attach_experts(ctx: RestoreContext) -> None:
    for expert, sections in ctx.notes[NAME].values():
        expert.pipeline = ctx.pipeline
        restore.run_stage("attach", sections, expert)
    ctx.notes[NAME] = {attr: expert.notes for attr, (expert, _) in ctx.notes[NAME].items()}


def _present(manifest: dict[str, Any]) -> bool:
    """A package of a family with experts must carry them (``expert_views`` refuses one that does not);
    an expert's own view carries none."""
    info = manifest["model"]
    experts = get_spec(info["family"], info.get("variant")).experts
    return NAME in manifest or (bool(experts) and info["transformer_attr"] not in experts)


SECTION = Section(name=NAME, present=_present, build=build_experts, attach=attach_experts)
