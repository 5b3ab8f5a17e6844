"""tools/readme_numbers.py on canned logs (tests/fixtures/readme_numbers): what it reads from pytest's
and the demo's output, the section it writes, and the README rewrite. Nothing here runs make."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CANNED = ROOT / "tests" / "fixtures" / "readme_numbers"
_spec = importlib.util.spec_from_file_location("readme_numbers", ROOT / "tools" / "readme_numbers.py")
rn = sys.modules["readme_numbers"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rn)


def _log(name):
    return rn.read_log((CANNED / name).read_text())


def _canned():
    record = json.loads((CANNED / "measured.json").read_text())
    return (
        record,
        rn.parse_tests(_log("test.log")),
        rn.parse_demo(_log("demo.log"), record["demo"]["seconds"]),
    )


def test_reads_pytest_counts_its_seconds_the_set_up_and_the_skip_reasons():
    tests = rn.parse_tests(_log("test.log"))
    assert (tests["passed"], tests["skipped"], tests["pytest_seconds"]) == (434, 229, 119.35)
    assert tests["seconds_before_pytest"] == 51.2  # make's echo of the pytest command
    assert tests["skip_reasons"]["no CUDA device"] == 200  # summed over the -ra lines that give it
    assert "torchao is not in the test extra; `make bench-quant` installs it" in tests["skip_reasons"]
    assert sum(tests["skip_reasons"].values()) == tests["skipped"]


@pytest.mark.parametrize(
    "closing",
    ["1 failed, 433 passed, 229 skipped in 119.35s (0:01:59)", "434 passed, 2 errors in 9.00s", ""],
)
def test_refuses_a_test_run_that_did_not_pass(closing):
    lines = [(0.0, ".venv/bin/python -m pytest -q"), (9.0, closing)]
    with pytest.raises(ValueError, match="did not pass|no pytest summary"):
        rn.parse_tests(lines)


def test_reads_each_demo_command_its_seconds_and_its_quality_report():
    _, _, demo = _canned()
    seconds = demo["seconds"]
    assert seconds["optimize"] == pytest.approx(241.29) and seconds["eval"] == pytest.approx(312.6 - 252.4)
    assert (demo["recipe"], demo["images"]) == ("default", 3)
    stored = demo["quality"]["optimize"]
    assert (stored["num_samples"], stored["steps"], stored["guidance"]) == (50, 28, "4.0")
    assert (stored["psnr"], stored["psnr_p5"], stored["block_evaluations_ratio"]) == (
        "32.86",
        "24.98",
        "0.286",
    )
    assert stored["metrics"]["class_accuracy"] == {"original": "1.000", "optimized": "0.9600"}
    # a header naming its source ("recomputed now ...") reads the same as the plain one
    assert demo["quality"]["eval"] == demo["quality"]["inspect"] == stored


def test_section_names_the_machine_and_says_where_each_number_comes_from():
    record, tests, demo = _canned()
    text = rn.section(record, tests, demo)
    assert "on 2000-01-01, commit 0000000: 2 CPU cores (Intel(R) Xeon(R) Processor), torch 2.13.0+cpu" in text
    assert "`OMP_NUM_THREADS=1`; load average 0.08 at the start, 1.97 at the end" in text
    assert "| 2 min 50 s | set-up 51 s, pytest 1 min 59 s: 434 passed, 229 skipped |" in text
    assert "| `make demo` (`.venv` present) | 5 min 13 s | `optimize --recipe default` 4 min 1 s" in text
    assert "- 200: no CUDA device" in text
    assert "class_accuracy original 1.000 / optimized 0.9600" in text
    assert "`eval` recomputed the same numbers" in text


def test_section_lists_reports_that_differ_with_their_sample_counts():
    record, tests, demo = _canned()
    demo["quality"]["optimize"] = demo["quality"]["inspect"] = demo["quality"]["optimize"] | {
        "num_samples": 20,
        "psnr": "31.90",
    }
    text = rn.section(record, tests, demo)
    assert "quality reports that differ" in text
    assert "- `optimize` (measured and stored in the package; 20 samples): PSNR 31.90 dB" in text
    assert "- `eval` (recomputed from the package on disk against the rebuilt base model; 50 samples)" in text


def test_rewrite_replaces_only_the_text_between_the_markers():
    readme = f"# x\n\n## Times\n\nintro\n\n{rn.START}\nold numbers\n{rn.END}\n\nafter\n"
    out = rn.rewrite(readme, "new numbers")
    assert out == f"# x\n\n## Times\n\nintro\n\n{rn.START}\nnew numbers\n{rn.END}\n\nafter\n"
    assert rn.rewrite(out, "new numbers") == out
    with pytest.raises(ValueError, match="needs one"):
        rn.rewrite("# no markers\n", "new numbers")
    with pytest.raises(ValueError, match="needs one"):
        rn.rewrite(f"{rn.END}\n{rn.START}\n", "new numbers")


def test_the_readme_has_the_markers_and_a_dry_run_leaves_it_alone(tmp_path, capsys):
    readme = (ROOT / "README.md").read_text()
    assert readme.count(rn.START) == readme.count(rn.END) == 1
    copy = tmp_path / "README.md"
    copy.write_text(readme)
    rn.main(["--from", str(CANNED), "--readme", str(copy), "--dry-run"])
    assert copy.read_text() == readme
    assert capsys.readouterr().out.startswith("Measured by `tools/readme_numbers.py`")
    rn.main(["--from", str(CANNED), "--readme", str(copy)])
    assert "commit 0000000" in copy.read_text() and copy.read_text().count(rn.START) == 1


def test_a_logged_run_reads_back_and_a_failed_one_stops(tmp_path, capsys):
    """run_logged's log is what read_log reads; the lines are real pytest output (-q -ra)."""
    printed = [
        ".venv/bin/python -m pytest -q",
        "SKIPPED [1] tests/bench/test_cache_bench.py:113: matplotlib is in the bench extra",
        "1 passed, 1 skipped, 17 deselected in 3.88s",
    ]
    code = "import sys; sys.stdout.write(sys.argv[1])"
    log = tmp_path / "test.log"
    rn.run_logged([sys.executable, "-c", code, "\n".join(printed) + "\n"], tmp_path, log, dict(os.environ))
    lines = rn.read_log(log.read_text())
    assert [line for _, line in lines] == printed and capsys.readouterr().out.splitlines() == printed
    tests = rn.parse_tests(lines)
    assert (tests["passed"], tests["skipped"], tests["skip_reasons"]) == (
        1,
        1,
        {"matplotlib is in the bench extra": 1},
    )
    with pytest.raises(SystemExit, match="exited 3"):
        rn.run_logged([sys.executable, "-c", "raise SystemExit(3)"], tmp_path, log, dict(os.environ))
