"""The ``cache_schedule`` section: a searched cache schedule, attached once the pipeline is assembled.

The manifest entry is ``{"file": "schedules/cache_schedule.json"}``; a schema-1 package written
before sections were named carries the file alone, which counts too. The schedule is refused
unless its fingerprint matches the loaded transformer's (the model it was searched on).
"""

from __future__ import annotations

from typing import Any

from sdkiln.errors import PackageError
from sdkiln.model_zoo.fingerprint import fingerprint
from sdkiln.runtime.cache.hooks import attach_cache
from sdkiln.runtime.cache.schedule import SCHEDULE_FILE, CacheSchedule
from sdkiln.runtime.restore import RestoreContext, Section

NAME = "cache_schedule"


def schedule_file(manifest: dict[str, Any]) -> str | None:
    entry = manifest.get(NAME)
    if entry is None:
        return SCHEDULE_FILE if SCHEDULE_FILE in manifest["files"] else None
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
        raise PackageError(f"manifest.json: {NAME} must be an object with a 'file', got {entry!r}")
    return entry["file"]


def attach_schedule(ctx: RestoreContext) -> None:
    where = schedule_file(ctx.manifest)
    schedule = CacheSchedule.from_dict(ctx.package.read_json(where), where)
    schedule.check_fingerprint(fingerprint(ctx.transformer), where)
    ctx.notes["cache_runner"] = attach_cache(ctx.pipeline, schedule, ctx.transformer_attr)


SECTION = Section(
    name=NAME, present=lambda manifest: schedule_file(manifest) is not None, attach=attach_schedule
)
