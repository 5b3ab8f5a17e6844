"""Model ids on a hub: ``modelscope://ORG/NAME`` resolves to a local snapshot directory.

Resolution goes through modelscope's own cache and ``snapshot_download``: first a snapshot already
in the cache (``local_files_only=True``, which answers at once: without it an unreachable hub
costs about 22 s before it fails), then, unless the machine is offline (``HF_HUB_OFFLINE=1`` or
``MODELSCOPE_OFFLINE=1``), a download. What comes back is a directory like any other: a package is
verified by the loader, a base model loaded by diffusers. ``model_zoo.load_model`` (base models of
``sdkiln optimize``) and ``runtime.package.open_package`` (every command that reads a package) call
it; modelscope comes with the ``[hub]`` extra.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from sdkiln.errors import ModelError
from sdkiln.extras import require

SCHEME = "modelscope://"
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}/[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
OFFLINE_ENV = ("HF_HUB_OFFLINE", "MODELSCOPE_OFFLINE")


def is_hub_id(source: object) -> bool:
    return isinstance(source, str) and source.startswith(SCHEME)


def valid_repo_id(rid: object) -> bool:
    """Whether ``rid`` is a hub repository id, ``ORG/NAME`` (the ids publishing and loading take)."""
    return isinstance(rid, str) and REPO_ID.fullmatch(rid) is not None and ".." not in rid


def repo_id(source: str) -> str:
    """``modelscope://ORG/NAME`` -> ``ORG/NAME``; ModelError for anything else after the scheme."""
    rid = source[len(SCHEME) :]
    if not valid_repo_id(rid):
        raise ModelError(f"{source!r}: a ModelScope id is modelscope://ORG/NAME (letters, digits, _ . -)")
    return rid


def offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in OFFLINE_ENV)


def resolve(source: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The local snapshot directory of ``modelscope://ORG/NAME`` (``cache_dir`` None: modelscope's
    default, ``MODELSCOPE_CACHE``). ModelError, one line, when it is neither cached nor downloadable."""
    rid = repo_id(source)
    require("modelscope", extra="hub", what=f"loading {source}")
    from modelscope import snapshot_download
    from modelscope_hub.errors import CacheNotFound

    # read now: modelscope reads MODELSCOPE_CACHE once, at import
    cache_dir = cache_dir or os.environ.get("MODELSCOPE_CACHE")
    where = {} if cache_dir is None else {"cache_dir": str(cache_dir)}
    try:
        return Path(snapshot_download(rid, local_files_only=True, **where))
    except CacheNotFound as exc:
        cached_error = " ".join(str(exc).split())
    if offline():
        raise ModelError(
            f"{source}: no snapshot in the local ModelScope cache and this machine is offline "
            f"({'/'.join(OFFLINE_ENV)} set): {cached_error}"
        )
    try:
        return Path(snapshot_download(rid, **where))
    except Exception as exc:  # any network or hub failure: one line naming the id
        raise ModelError(
            f"{source}: not in the local ModelScope cache, and the download failed: {exc}"
        ) from None
