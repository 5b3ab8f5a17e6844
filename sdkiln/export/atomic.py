"""Write a directory atomically: at every instant the target is either the old directory complete or
the new one complete, never missing and never partial, even when the writer is killed.

The new directory is built in ``.NAME.tmp-XXXXXXXX`` beside the target and fsynced. A new target is
one ``rename``. An existing one is swapped with the new directory in one ``renameat2``
(``RENAME_EXCHANGE``, Linux); where the kernel, libc or filesystem lacks it, the old target is
renamed aside to ``.NAME.old-XXXXXXXX`` and the new one renamed in, so a kill between the two
renames leaves the complete old directory at ``.old-*``. Either way the old contents are removed
only after the new directory is in place.

Writers take an exclusive ``flock`` on ``.NAME.lock`` beside the target first (``target_lock``), so
a second writer is refused instead of silently replacing the first one's output. Whoever holds the
lock knows every ``.NAME.tmp-*`` and ``.NAME.old-*`` is a killed writer's leftover: it puts an
``.old-*`` back if the target is missing, removes the rest, and says so, one line each on stderr
(a line, not a warning: it reports what was done, and must not be filtered or deduplicated).

This module imports neither torch nor the package format: the caller decides what may be replaced.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from sdkiln.errors import PackageError

AT_FDCWD = -100
RENAME_EXCHANGE = 2


def _find_renameat2():
    """libc's ``renameat2``, or None where libc has none (macOS, glibc before 2.28)."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return fn


_renameat2 = _find_renameat2()

_held: dict[Path, int] = {}
"""Lock files this process holds, each with the thread holding it: that thread may take it again."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(Path(dirpath) / name, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(Path(dirpath))


def _exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` in one step. False where this system cannot (then nothing was done)."""
    if _renameat2 is None:
        return False
    if _renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS):  # an old kernel, or a filesystem without exchange
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _replace(new: Path, target: Path) -> Path:
    """Put the complete directory ``new`` at the existing ``target``; return where the old one now is."""
    if _exchange(new, target):
        return new
    old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)
        raise
    # renamed to a temp name before it is removed: recovery restores only a complete .old-*, and
    # a kill during the removal leaves a partial directory that recovery must only delete
    os.rename(old, new)
    return new


def _recover(target: Path) -> None:
    """Undo what a killed writer left beside ``target``. Only a lock holder may call this."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(tmp|old)-[0-9a-f]{{8}}")
    found = [m for n in sorted(os.listdir(target.parent)) if (m := pattern.fullmatch(n))]
    leftovers = [target.parent / m.group(0) for m in found]
    olds = [target.parent / m.group(0) for m in found if m.group(1) == "old"]
    if olds and not os.path.lexists(target):
        if len(olds) > 1:
            raise PackageError(
                f"{target}: missing, and {len(olds)} previous versions lie beside it "
                f"({', '.join(p.name for p in olds)}); rename the one to keep to {target.name}"
            )
        os.rename(olds[0], target)
        _fsync_dir(target.parent)
        leftovers.remove(olds[0])
        print(f"sdkiln: restored {target} from {olds[0].name}, left by an interrupted write", file=sys.stderr)
    for path in leftovers:
        shutil.rmtree(path)
        print(f"sdkiln: removed {path}, left by an interrupted write of {target.name}", file=sys.stderr)


@contextmanager
def target_lock(target: Path) -> Iterator[None]:
    """Hold the right to write ``target``, or raise ``PackageError`` if another writer has it.

    The lock is an exclusive ``flock`` on ``.NAME.lock`` beside the target, so the kernel drops it
    when its holder dies. The thread holding it may take it again (``optimize`` holds it from the
    start; ``write_package`` takes it at the end); another thread or process is refused at once,
    not made to wait, since it would replace what the first one writes. Taking it recovers from
    killed writers (see the module docstring). Its holder removes the lock file on release; a
    process that opened the file just before then finds, after locking, that the path names
    another file, and tries again.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    path = Path(os.path.realpath(target.parent)) / f".{target.name}.lock"
    if _held.get(path) == threading.get_ident():
        yield
        return
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise PackageError(
                f"{target}: another sdkiln process is writing it (it holds {path}); wait for it to "
                "finish or choose another output directory"
            ) from None
        try:
            current = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)
    _held[path] = threading.get_ident()
    try:
        _recover(target)
        yield
    finally:
        del _held[path]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


@contextmanager
def atomic_directory(target: Path, *, check: Callable[[Path], None], mode: int = 0o755) -> Iterator[Path]:
    """Yield an empty temp directory beside ``target``; on success it becomes ``target``.

    ``check(target)`` is the caller's rule for what may be replaced: it raises to refuse. It runs
    under the lock, after recovery, so its answer still holds when the new directory lands.
    """
    with target_lock(target):
        check(target)
        tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(mode=0o700)
        try:
            yield tmp
            os.chmod(tmp, mode)
            fsync_tree(tmp)
            if os.path.lexists(target):
                old = _replace(tmp, target)
                _fsync_dir(target.parent)
                shutil.rmtree(old)
            else:
                os.rename(tmp, target)
                _fsync_dir(target.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def check_export_target(target: Path, force: bool, marker: str, what: str) -> None:
    """Refuse an existing ``target`` unless ``force`` and it is an earlier export of this kind (it
    holds ``marker``): ``--force`` never replaces what sdkiln did not write."""
    if not os.path.lexists(target):
        return
    if not force:
        raise PackageError(f"{target}: already exists; pass --force (force=True) to replace it")
    if target.is_symlink() or not target.is_dir() or not (target / marker).is_file():
        raise PackageError(f"{target}: is not {what} ({marker} missing); refusing to replace it")
