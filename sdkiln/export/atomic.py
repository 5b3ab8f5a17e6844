"""Write a directory atomically: build it beside the target, fsync it, then rename it into place.

An interrupted write leaves nothing at the target; an existing target is swapped out only once the
new directory is complete (renamed aside, the new one renamed in, the old one removed).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(Path(dirpath) / name, "rb") as fh:
                os.fsync(fh.fileno())
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextmanager
def atomic_directory(target: Path, mode: int = 0o755) -> Iterator[Path]:
    """Yield an empty temp directory beside ``target``; on success it becomes ``target``.

    The caller decides beforehand whether an existing ``target`` may be replaced.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(mode=0o700)
    try:
        yield tmp
        os.chmod(tmp, mode)
        fsync_tree(tmp)
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old)
        else:
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
