"""Atomic writes: the target is never missing or partial (kill -9 anywhere, a failed rename, no
renameat2), one writer at a time, ``--force`` replaces only packages and empty directories, and
``optimize`` refuses a wrong ``out_dir`` before it loads anything.

Writers in child processes load ``atomic.py`` from its file, not through ``sdkiln.export`` (whose
``__init__`` imports torch), so a child starts in about 30 ms and a trial costs well under 0.2 s.
"""

import errno
import importlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sdkiln.errors import PackageError
from sdkiln.export import atomic, package_writer

CHILD_PRELUDE = f"""
import importlib.util, os, shutil, signal, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("atomic", {atomic.__file__!r})
atomic = importlib.util.module_from_spec(spec)
spec.loader.exec_module(atomic)
target, a, b = map(Path, sys.argv[1:4])
if sys.argv[4] == "fallback":
    atomic._renameat2 = None
"""

KILL_LOOP = """
print("ready", flush=True)
for i in range(10**9):
    with atomic.atomic_directory(target, check=lambda t: None) as tmp:
        shutil.copytree((b, a)[i % 2], tmp, dirs_exist_ok=True)
    print("wrote", flush=True)
"""


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _versions(tmp_path: Path) -> tuple[Path, Path]:
    """Two complete versions of a directory, A and B: several files, some in a subdirectory,
    sizes differing between versions, about 300 KB each, every byte saying which version it is."""
    for tag in "AB":
        for i in range(6):
            path = tmp_path / "ref" / tag / f"d{i % 2}" / f"f{i}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(tag.encode() * (40_000 + 1_000 * i + (7 if tag == "B" else 0)))
    return tmp_path / "ref" / "A", tmp_path / "ref" / "B"


def _child(body: str, target: Path, a: Path, b: Path, mode: str, **kw) -> subprocess.Popen:
    argv = [sys.executable, "-c", CHILD_PRELUDE + body, str(target), str(a), str(b), mode]
    return subprocess.Popen(argv, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def _nothing_there(t: Path) -> None:
    if os.path.lexists(t):
        raise PackageError(f"{t}: already exists")


@pytest.fixture
def versions(tmp_path):
    a, b = _versions(tmp_path)
    target = tmp_path / "out" / "t"
    target.parent.mkdir()
    shutil.copytree(a, target)
    return target, a, b


@pytest.mark.parametrize("mode", ["exchange", "fallback"])
def test_a_writer_killed_at_random_leaves_the_old_or_the_new_version_complete(versions, mode, capfd):
    if mode == "exchange" and atomic._renameat2 is None:
        pytest.skip("this libc has no renameat2")
    target, a, b = versions
    expected = {"A": _tree(a), "B": _tree(b)}
    rng = random.Random(14)
    seen, writes, recovered = set(), 0, 0
    for _ in range(24):
        child = _child(KILL_LOOP, target, a, b, mode)
        assert child.stdout.readline() == "ready\n"
        time.sleep(rng.uniform(0.0, 0.12))
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate()
        writes += out.count("wrote")
        with atomic.target_lock(target):
            got = _tree(target)
            assert got in expected.values(), "the target is partial or a mix of versions"
            seen.add("A" if got == expected["A"] else "B")
        recovered += capfd.readouterr().err.count("left by an interrupted write")
        assert os.listdir(target.parent) == ["t"], "recovery left something beside the target"
    assert writes > 0 and recovered > 0 and seen == {"A", "B"}, (writes, recovered, seen)


KILL_AT = {
    "second rename": """
real, calls = os.rename, []
def rename(src, dst):
    calls.append(src)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    real(src, dst)
os.rename = rename
""",
    "removing the old one": "shutil.rmtree = lambda path: os.kill(os.getpid(), signal.SIGKILL)\n",
}

REPLACE_WITH_B = """
with atomic.atomic_directory(target, check=lambda t: None) as tmp:
    shutil.copytree(b, tmp, dirs_exist_ok=True)
"""


@pytest.mark.parametrize(
    "mode, kill_at, version",
    [
        ("fallback", "second rename", "A"),  # the old one is aside, the new one not yet in
        ("fallback", "removing the old one", "B"),
        ("exchange", "removing the old one", "B"),
    ],
)
def test_a_kill_at_each_step_of_a_replace_is_repaired_by_the_next_writer(
    versions, mode, kill_at, version, capfd
):
    if mode == "exchange" and atomic._renameat2 is None:
        pytest.skip("this libc has no renameat2")
    target, a, b = versions
    child = _child(KILL_AT[kill_at] + REPLACE_WITH_B, target, a, b, mode)
    child.communicate()
    assert child.returncode == -signal.SIGKILL
    leftovers = [n for n in os.listdir(target.parent) if n.startswith((".t.tmp-", ".t.old-"))]
    assert os.path.lexists(target) == (kill_at != "second rename")
    assert len(leftovers) == (2 if kill_at == "second rename" else 1)
    with atomic.target_lock(target):
        assert _tree(target) == _tree({"A": a, "B": b}[version])
    err = capfd.readouterr().err.splitlines()
    assert len(err) == len(leftovers) and all("left by an interrupted write" in line for line in err)
    if kill_at == "second rename":
        assert err[0].startswith(f"sdkiln: restored {target} from .t.old-")
    assert os.listdir(target.parent) == ["t"]


def _failing_rename(monkeypatch, fail_at: set[int]) -> list:
    real, calls = os.rename, []

    def rename(src, dst):
        calls.append((src, dst))
        if len(calls) in fail_at:
            raise OSError(errno.EIO, "injected failure", str(src))
        real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    return calls


def _replace_with(target: Path, src: Path) -> None:
    with atomic.atomic_directory(target, check=lambda t: None) as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True)


@pytest.mark.parametrize("fail_at", [1, 2])
def test_a_failed_rename_in_the_fallback_keeps_the_old_version(versions, monkeypatch, fail_at):
    target, a, b = versions
    monkeypatch.setattr(atomic, "_renameat2", None)
    calls = _failing_rename(monkeypatch, {fail_at})
    with pytest.raises(OSError, match="injected failure"):
        _replace_with(target, b)
    assert len(calls) == fail_at + (fail_at == 2)  # a failed second rename is followed by a restore
    assert _tree(target) == _tree(a) and os.listdir(target.parent) == ["t"]
    monkeypatch.undo()
    _replace_with(target, b)
    assert _tree(target) == _tree(b)


def test_a_failed_restore_is_repaired_by_the_next_writer(versions, monkeypatch, capfd):
    target, a, b = versions
    monkeypatch.setattr(atomic, "_renameat2", None)
    _failing_rename(monkeypatch, {2, 3})
    with pytest.raises(OSError, match="injected failure"):
        _replace_with(target, b)
    monkeypatch.undo()
    with atomic.target_lock(target):
        assert _tree(target) == _tree(a)
    assert capfd.readouterr().err.startswith(f"sdkiln: restored {target} from .t.old-")
    assert os.listdir(target.parent) == ["t"]


def _fake_renameat2(err: int, calls: list):
    def renameat2(*args):
        calls.append(args)
        atomic.ctypes.set_errno(err)
        return -1

    return renameat2


def test_a_failed_exchange_keeps_the_old_version(versions, monkeypatch):
    target, a, b = versions
    calls = []
    monkeypatch.setattr(atomic, "_renameat2", _fake_renameat2(errno.EIO, calls))
    with pytest.raises(OSError, match="Input/output error"):
        _replace_with(target, b)
    assert len(calls) == 1 and _tree(target) == _tree(a) and os.listdir(target.parent) == ["t"]


@pytest.mark.parametrize("err", [errno.EINVAL, errno.ENOSYS])
def test_a_filesystem_without_exchange_falls_back_to_two_renames(versions, monkeypatch, err):
    target, a, b = versions
    exchanges = []
    monkeypatch.setattr(atomic, "_renameat2", _fake_renameat2(err, exchanges))
    renames = _failing_rename(monkeypatch, set())
    _replace_with(target, b)
    assert len(exchanges) == 1 and len(renames) == 3  # aside, in, and the old one to a temp name
    assert _tree(target) == _tree(b) and os.listdir(target.parent) == ["t"]


def test_the_exchange_is_one_call_when_renameat2_exists(versions, monkeypatch):
    if atomic._renameat2 is None:
        pytest.skip("this libc has no renameat2")
    target, a, b = versions
    renames = _failing_rename(monkeypatch, set())
    _replace_with(target, b)
    assert renames == [] and _tree(target) == _tree(b)


def test_a_failed_rename_of_a_new_target_leaves_nothing(tmp_path, monkeypatch):
    a, _ = _versions(tmp_path)
    target = tmp_path / "out" / "new"
    _failing_rename(monkeypatch, {1})
    with pytest.raises(OSError, match="injected failure"):
        _replace_with(target, a)
    assert os.listdir(target.parent) == []


CONCURRENT_WRITER = """
sys.stdin.readline()
try:
    with atomic.atomic_directory(target, check=lambda t: nothing_there(t)) as tmp:
        shutil.copytree(a, tmp, dirs_exist_ok=True)
        (tmp / "writer").write_text(str(os.getpid()))
        time.sleep(0.3)
except atomic.PackageError as exc:
    print(exc, file=sys.stderr)
    sys.exit(3)
"""


def test_two_writers_without_force_one_wins_one_is_refused(tmp_path):
    a, b = _versions(tmp_path)
    target = tmp_path / "out" / "t"
    check = "def nothing_there(t):\n    if os.path.lexists(t): raise atomic.PackageError('exists')\n"
    writers = [
        _child(check + CONCURRENT_WRITER, target, a, b, "exchange", stdin=subprocess.PIPE) for _ in range(2)
    ]
    for w in writers:
        w.stdin.write("go\n")
        w.stdin.flush()
    results = sorted((w.wait(), w.stderr.read(), w.pid) for w in writers)
    assert [rc for rc, _, _ in results] == [0, 3]
    assert "another sdkiln process is writing it" in results[1][1]
    assert (target / "writer").read_text() == str(results[0][2])
    assert sorted(os.listdir(target.parent)) == ["t"]


@contextmanager
def _locked_by_another_thread(target: Path) -> Iterator[None]:
    held, release = threading.Event(), threading.Event()

    def other_writer():
        with atomic.target_lock(target):
            held.set()
            release.wait()

    thread = threading.Thread(target=other_writer)
    thread.start()
    held.wait()
    try:
        yield
    finally:
        release.set()
        thread.join()


def test_the_lock_is_reentrant_in_its_thread_and_refuses_other_threads(tmp_path):
    target = tmp_path / "t"
    with _locked_by_another_thread(target):
        with pytest.raises(PackageError, match="another sdkiln process is writing it"):
            with atomic.atomic_directory(target, check=_nothing_there):
                pass
    with atomic.target_lock(target), atomic.atomic_directory(target, check=_nothing_there) as tmp:
        (tmp / "x.txt").write_text("x")
    assert sorted(os.listdir(tmp_path)) == ["t"]  # the lock file goes with its holder
    assert _tree(target) == {"x.txt": b"x"}


def test_recovery_touches_only_its_own_targets_leftovers(tmp_path, capfd):
    target = tmp_path / "t"
    for name in [".t.tmp-0123abcd", ".t2.tmp-0123abcd", ".t.tmp-x.tmp-0123abcd", ".t.tmp-0123abcd.keep"]:
        (tmp_path / name).mkdir()
    with atomic.target_lock(target):
        pass
    assert sorted(os.listdir(tmp_path)) == [
        ".t.tmp-0123abcd.keep",
        ".t.tmp-x.tmp-0123abcd",
        ".t2.tmp-0123abcd",
    ]
    assert (
        capfd.readouterr().err
        == f"sdkiln: removed {tmp_path}/.t.tmp-0123abcd, left by an interrupted write of t\n"
    )
    (tmp_path / ".t.old-0123abcd").mkdir()
    (tmp_path / ".t.old-4567abcd").mkdir()
    with pytest.raises(PackageError, match="missing, and 2 previous versions lie beside it"):
        with atomic.target_lock(target):
            pass


def _snapshot(root: Path) -> list:
    return [
        (
            p.relative_to(root).as_posix(),
            p.is_symlink(),
            p.read_bytes() if p.is_file() else None,
            p.lstat().st_mtime_ns,
        )
        for p in sorted(root.rglob("*"))
    ]


def test_force_refuses_anything_but_a_package_or_an_empty_directory(tmp_path):
    user = tmp_path / "photos"
    (user / "2024").mkdir(parents=True)
    (user / "2024" / "cat.jpg").write_bytes(b"\xff\xd8 a cat")
    (user / "manifest.json").write_text(json.dumps({"format": "my-own-format"}))
    afile, link = tmp_path / "notes.txt", tmp_path / "link"
    afile.write_text("keep me")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "manifest.json").write_text(json.dumps({"format": "sdkiln-package"}))
    link.symlink_to(pkg)
    before = _snapshot(tmp_path)
    for target in (user, afile, link):
        with pytest.raises(PackageError, match="neither an sdkiln package nor an empty directory"):
            package_writer.write_package(target, None, {}, {}, "transformer", force=True)
    with pytest.raises(PackageError, match="already exists"):
        package_writer.write_package(pkg, None, {}, {}, "transformer")
    assert _snapshot(tmp_path) == before


def test_force_replaces_a_package_or_an_empty_directory(tmp_path, flux_tiny):
    _, pipe = flux_tiny
    pkg, empty = tmp_path / "pkg", tmp_path / "empty"
    (pkg / "transformer").mkdir(parents=True)
    (pkg / "manifest.json").write_text(json.dumps({"format": "sdkiln-package", "schema_version": 0}))
    (pkg / "transformer" / "old.safetensors").write_bytes(b"old")
    empty.mkdir()
    for target in (pkg, empty):
        package_writer.write_package(target, pipe, {"model": {}}, {}, "transformer", force=True)
        listed = json.loads((target / "manifest.json").read_text())["files"]
        assert sorted(listed) == sorted(set(_tree(target)) - {"manifest.json"})
        assert "transformer/old.safetensors" not in listed and "transformer/config.json" in listed
    assert sorted(os.listdir(tmp_path)) == ["empty", "pkg"]


def test_optimize_refuses_a_wrong_out_dir_before_loading_anything(tmp_path, monkeypatch):
    module = importlib.import_module("sdkiln.optimizer.optimize")

    def load_model(*args):
        raise AssertionError("optimize loaded the model")

    monkeypatch.setattr(module, "load_model", load_model)
    existing, user, empty = tmp_path / "existing", tmp_path / "user", tmp_path / "empty"
    for d in (existing, user, empty):
        d.mkdir()
    (existing / "manifest.json").write_text(json.dumps({"format": "sdkiln-package"}))
    (user / "thesis.tex").write_text("keep me")
    with pytest.raises(PackageError, match="already exists"):
        module.optimize("flux-tiny", "default", existing)
    with pytest.raises(PackageError, match="neither an sdkiln package"):
        module.optimize("flux-tiny", "default", user, force=True)
    with _locked_by_another_thread(tmp_path / "new"):
        with pytest.raises(PackageError, match="another sdkiln process is writing it"):
            module.optimize("flux-tiny", "default", tmp_path / "new")
    with pytest.raises(AssertionError, match="optimize loaded the model"):
        module.optimize("flux-tiny", "default", empty, force=True)  # allowed: the work starts
    assert sorted(os.listdir(tmp_path)) == ["empty", "existing", "user"]
