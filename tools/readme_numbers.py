"""Measure the README's times and printed numbers on this machine and write its "Times" section.

    make readme-numbers                                   # `make test`, then `make demo`, here
    make readme-numbers ARGS=--fresh-clone                # `CI=true bash .ci/run` in a fresh clone of
                                                          # HEAD (set-up included), then `make demo` there
    python3 tools/readme_numbers.py --from build/readme-numbers --dry-run   # print what saved logs give

Each command's output is saved line by line with the seconds since it started
(``build/readme-numbers/{test,demo}.log``, its stderr beside it in ``.err``), and ``measured.json``
records the machine, the commit and the load average, so a section can be written again from saved
logs (``--from``) without measuring. Read from the logs: pytest's closing line (its counts and its own
seconds) and the ``-ra`` skip reasons; make's echo of the pytest command (what came before it is the
set-up); the seconds between the demo commands make echoes; and the quality reports ``sdkiln
optimize``, ``inspect`` and ``eval`` print. A run that failed, or whose output cannot be read, is refused:
the README never gets numbers from it.

The load average at the start and the end goes into the section: measure on a quiet machine. The
script uses only the standard library; torch's version is read from the measured checkout's .venv.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "build" / "readme-numbers"
START = "<!-- readme-numbers:start -->"
END = "<!-- readme-numbers:end -->"
SEPARATOR = " | "
"""Between a log line's seconds and its text."""

SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+, )*\d+ \w+) in ([\d.]+)s\b")
SKIPPED = re.compile(r"^SKIPPED \[(\d+)\] \S+?(?::\d+)?: (.*)$")
PYTEST_ECHO = re.compile(r"-m pytest\b")
DEMO_ECHO = re.compile(r"^(?:\S*/)?sdkiln (optimize|inspect|run|eval)\b(.*)")
QUALITY = re.compile(r"^quality\b[^(]*\((\d+) samples, (\d+) steps, guidance ([^;)]+)")
PSNR = re.compile(r"PSNR (\S+) dB \(5th pct (\S+), min (\S+)\)\s+SSIM (\S+)")
METRIC = re.compile(r"^\s+(\w+): original (\S+)\s+optimized (\S+)$")
CACHE = re.compile(r"^\s+cache schedule: (\S+)x the block evaluations")
IMAGE = re.compile(r"^\S+: '.*' +\(")
SOURCES = {
    "optimize": "measured and stored in the package",
    "inspect": "read back from the package",
    "eval": "recomputed from the package on disk against the rebuilt base model",
}
"""The demo commands that print a quality report, and where their report comes from."""


# --- measuring ---------------------------------------------------------------------------------


def run_logged(cmd: list[str], cwd: Path, log: Path, env: dict[str, str]) -> float:
    """Run ``cmd``, echoing its stdout and saving each line to ``log`` with the seconds since the start
    (stderr goes to ``log`` with suffix ``.err``); returns the seconds it took; exits on failure."""
    started = time.perf_counter()
    with log.open("w") as out, log.with_suffix(".err").open("w") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        for line in proc.stdout:
            out.write(f"{time.perf_counter() - started:.2f}{SEPARATOR}{line.rstrip()}\n")
            print(line, end="", flush=True)
        code = proc.wait()
    if code != 0:
        sys.exit(f"readme-numbers: {' '.join(cmd)} exited {code} in {cwd}; see {log} and its .err")
    return time.perf_counter() - started


def machine(checkout: Path) -> dict[str, Any]:
    """Cores, CPU model and the instruction sets that decide sdkiln's CPU kernels, and the torch the
    checkout's .venv runs."""
    isa = subprocess.run(
        [
            str(checkout / ".venv" / "bin" / "python"),
            "-c",
            "from sdkiln.kernels.cpu_profile import read_cpu_info as r; i = r(); "
            "print(i.name); print(' '.join(sorted(i.features)) or 'none')",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    cpu = f"{isa[0]}; {isa[1]}"
    torch = subprocess.run(
        [
            str(checkout / ".venv" / "bin" / "python"),
            "-c",
            "import importlib.metadata as m; print(m.version('torch'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return {"cores": os.cpu_count(), "cpu": cpu, "torch": torch}


def measure(out: Path, fresh_clone: bool) -> dict[str, Any]:
    """Run the test command and ``make demo`` in this checkout or a fresh clone; write the logs and
    ``measured.json`` to ``out``; returns what ``measured.json`` holds."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env |= {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    )
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    record: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "commit": commit.stdout.strip(),
        "uncommitted_changes": bool(dirty.stdout.strip()) and not fresh_clone,
        "fresh_clone": fresh_clone,
        "omp_num_threads": env["OMP_NUM_THREADS"],
        "load_average": {"start": list(os.getloadavg())},
    }
    with tempfile.TemporaryDirectory(prefix="sdkiln-readme-numbers-") as tmp:
        checkout = ROOT
        test_cmd = ["make", "test"]
        if fresh_clone:
            checkout = Path(tmp) / "sdkiln"
            subprocess.run(["git", "clone", "--quiet", str(ROOT), str(checkout)], check=True)
            test_cmd = ["bash", ".ci/run"]
            env["CI"] = "true"
        record["test"] = {
            "command": "CI=true bash .ci/run" if fresh_clone else "make test",
            "seconds": run_logged(test_cmd, checkout, out / "test.log", env),
        }
        record["demo"] = {
            "command": "make demo",
            "seconds": run_logged(["make", "demo"], checkout, out / "demo.log", env),
        }
        record["machine"] = machine(checkout)
    record["load_average"]["end"] = list(os.getloadavg())
    (out / "measured.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


# --- reading the logs --------------------------------------------------------------------------


def read_log(text: str) -> list[tuple[float, str]]:
    """``(seconds, line)`` of a saved log."""
    lines = []
    for row in text.splitlines():
        seconds, sep, line = row.partition(SEPARATOR)
        if not sep:
            raise ValueError(f"not a readme-numbers log line: {row!r}")
        lines.append((float(seconds), line))
    return lines


def parse_tests(lines: list[tuple[float, str]]) -> dict[str, Any]:
    """pytest's counts, its own seconds, its skip reasons (``-ra``) and the seconds before it started;
    raises when pytest did not pass."""
    summaries = [m for _, line in lines if (m := SUMMARY.match(line))]
    if not summaries:
        raise ValueError("no pytest summary line (like '434 passed, 229 skipped in 119.35s') in the test log")
    counts = {word: int(n) for n, word in (part.split(" ", 1) for part in summaries[-1][1].split(", "))}
    bad = {k: v for k, v in counts.items() if k in ("failed", "error", "errors") and v}
    if bad or not counts.get("passed"):
        raise ValueError(f"pytest did not pass: {summaries[-1][0].strip('= ')}")
    reasons: dict[str, int] = {}
    for _, line in lines:
        if m := SKIPPED.match(line):
            reasons[m[2]] = reasons.get(m[2], 0) + int(m[1])
    started = next((t for t, line in lines if PYTEST_ECHO.search(line)), None)
    if started is None:
        raise ValueError("no echo of the pytest command in the test log")
    return {
        "passed": counts["passed"],
        "skipped": counts.get("skipped", 0),
        "pytest_seconds": float(summaries[-1][2]),
        "skip_reasons": dict(sorted(reasons.items(), key=lambda r: -r[1])),
        "seconds_before_pytest": started,
    }


def parse_quality(lines: list[str]) -> dict[str, Any] | None:
    """The quality block ``sdkiln`` printed in ``lines`` (``_quality_lines``), as printed; None if none."""
    found = [(i, m) for i, line in enumerate(lines) if (m := QUALITY.match(line))]
    if not found:
        return None
    i, m = found[0]
    out: dict[str, Any] = {"num_samples": int(m[1]), "steps": int(m[2]), "guidance": m[3].strip()}
    for line in lines[i + 1 :]:
        if not line.startswith(" "):
            break
        if p := PSNR.search(line):
            out |= {"psnr": p[1], "psnr_p5": p[2], "psnr_min": p[3], "ssim": p[4]}
        elif c := CACHE.match(line):
            out["block_evaluations_ratio"] = c[1]
        elif k := METRIC.match(line):
            out.setdefault("metrics", {})[k[1]] = {"original": k[2], "optimized": k[3]}
    if "psnr" not in out:
        raise ValueError(f"a quality header without its PSNR line: {lines[i]!r}")
    return out


def parse_demo(lines: list[tuple[float, str]], total: float) -> dict[str, Any]:
    """Each ``sdkiln`` command make echoed: its seconds (to the next echo, or the end) and what it
    printed; the quality reports of ``SOURCES``."""
    starts = [(i, m) for i, (_, line) in enumerate(lines) if (m := DEMO_ECHO.match(line))]
    names = [m[1] for _, m in starts]
    if names != ["optimize", "inspect", "run", "eval"]:
        raise ValueError(f"expected make demo to run sdkiln optimize, inspect, run, eval; found {names}")
    commands: dict[str, Any] = {}
    for k, (i, m) in enumerate(starts):
        j = starts[k + 1][0] if k + 1 < len(starts) else len(lines)
        end = lines[j][0] if j < len(lines) else total
        text = [line for _, line in lines[i + 1 : j]]
        commands[m[1]] = {"seconds": end - lines[i][0], "args": m[2].strip(), "output": text}
    reports = {name: parse_quality(commands[name]["output"]) for name in SOURCES}
    missing = [name for name, q in reports.items() if q is None]
    if missing:
        raise ValueError(f"make demo printed no quality report from {', '.join(missing)}")
    recipe = re.search(r"--recipe (\S+)", commands["optimize"]["args"])
    return {
        "seconds": {name: c["seconds"] for name, c in commands.items()},
        "recipe": recipe[1] if recipe else "default",
        "images": sum(bool(IMAGE.match(line)) for line in commands["run"]["output"]),
        "quality": reports,
    }


# --- writing -----------------------------------------------------------------------------------


def duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"


def _quality_text(q: dict[str, Any]) -> str:
    parts = [f"PSNR {q['psnr']} dB (5th pct {q['psnr_p5']}) against the original"]
    parts += [
        f"{name} original {v['original']} / optimized {v['optimized']}"
        for name, v in q.get("metrics", {}).items()
    ]
    if "block_evaluations_ratio" in q:
        parts.append(f"{q['block_evaluations_ratio']}x the block evaluations of the uncached run")
    return ", ".join(parts)


def section(record: dict[str, Any], tests: dict[str, Any], demo: dict[str, Any]) -> str:
    """The README's "Times" section between the markers."""
    m, load = record["machine"], record["load_average"]
    at = f"commit {record['commit']}" + (" with uncommitted changes" if record["uncommitted_changes"] else "")
    head = (
        f"Measured by `tools/readme_numbers.py` (`make readme-numbers`) on {record['date']}, {at}: "
        f"{m['cores']} CPU cores ({m['cpu']}), torch {m['torch']}, `OMP_NUM_THREADS={record['omp_num_threads']}`; "
        f"load average {load['start'][0]:.2f} at the start, {load['end'][0]:.2f} at the end."
    )
    pytest_text = (
        f"pytest {duration(tests['pytest_seconds'])}: {tests['passed']} passed, {tests['skipped']} skipped"
    )
    if record["fresh_clone"]:
        test_row = (
            f"| `CI=true bash .ci/run` on a fresh clone (set-up of `.venv`, then `make test`) | "
            f"{duration(record['test']['seconds'])} | set-up {duration(tests['seconds_before_pytest'])}, {pytest_text} |"
        )
    else:
        test_row = (
            f"| `make test` (`.venv` present) | {duration(record['test']['seconds'])} | {pytest_text} |"
        )
    s, stored, recomputed = demo["seconds"], demo["quality"]["optimize"], demo["quality"]["eval"]
    demo_row = (
        f"| `make demo` (`.venv` present) | {duration(record['demo']['seconds'])} | "
        f"`optimize --recipe {demo['recipe']}` {duration(s['optimize'])} (its quality report on "
        f"{stored['num_samples']} samples included), `inspect` {duration(s['inspect'])}, `run` of "
        f"{demo['images']} images {duration(s['run'])}, `eval` of {recomputed['num_samples']} samples with "
        f"the grid {duration(s['eval'])} |"
    )
    lines = [head, "", "| command | time | of which |", "|---|---|---|", test_row, demo_row, ""]
    if tests["skip_reasons"]:
        lines += ["The skipped tests, by the reason pytest gives (`-ra`):", ""]
        lines += [f"- {n}: {reason}" for reason, n in tests["skip_reasons"].items()]
        lines.append("")
    reports = demo["quality"]
    if all(q == stored for q in reports.values()):
        lines.append(
            f"`make demo` printed ({stored['num_samples']} samples, {stored['steps']} steps, guidance "
            f"{stored['guidance']}): {_quality_text(stored)}. `optimize` measured these and stored them in "
            "the package, `inspect` read them back, and `eval` recomputed the same numbers from the package "
            "on disk against the rebuilt base model."
        )
    else:
        lines += ["`make demo` printed quality reports that differ:", ""]
        lines += [
            f"- `{name}` ({SOURCES[name]}; {q['num_samples']} samples): {_quality_text(q)}"
            for name, q in reports.items()
        ]
    return "\n".join(lines)


def rewrite(readme: str, body: str) -> str:
    """``readme`` with the text between the markers replaced by ``body``."""
    if readme.count(START) != 1 or readme.count(END) != 1 or readme.index(START) > readme.index(END):
        raise ValueError(f"the README needs one {START} and one {END} after it")
    before, rest = readme.split(START)
    _, after = rest.split(END)
    return f"{before}{START}\n{body}\n{END}{after}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fresh-clone",
        action="store_true",
        help="run the tests as CI does: CI=true bash .ci/run in a fresh clone",
    )
    parser.add_argument(
        "--from", dest="source", type=Path, help="write from the logs and measured.json saved in this folder"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where measuring saves its logs")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the section instead of writing the README"
    )
    args = parser.parse_args(argv)
    folder = args.source or args.out
    record = (
        json.loads((folder / "measured.json").read_text())
        if args.source
        else measure(folder, args.fresh_clone)
    )
    tests = parse_tests(read_log((folder / "test.log").read_text()))
    demo = parse_demo(read_log((folder / "demo.log").read_text()), record["demo"]["seconds"])
    body = section(record, tests, demo)
    if args.dry_run:
        print(body)
        return
    args.readme.write_text(rewrite(args.readme.read_text(), body))
    print(f"readme-numbers: wrote the Times section of {args.readme}", file=sys.stderr)


if __name__ == "__main__":
    main()
