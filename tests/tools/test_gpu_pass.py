"""tools/gpu_pass.sh --dry-run on CPU: every part runs in its smallest form, and the summary, the log and
each part's JSON are written and well-formed; a failing part does not stop the later ones. Also
bench/scale.py's measurement of a child: its peak resident memory from ``os.wait4`` and its kill at
the budget."""

import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ["wheels", "tests", "kernels", "e2e", "families", "load", "scale"]


def _pass(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    wheels = tmp_path / "no-wheels"
    wheels.mkdir()
    settings = {"OUT": str(out), "GPU_WHEELS": str(wheels), "PYTHON": sys.executable}
    # the CUDA tests are collected, not run: one folder of them keeps the rehearsal short
    settings |= {"GPU_PASS_TESTS": "tests/kernels", "OMP_NUM_THREADS": "1"} | env
    done = subprocess.run(
        ["bash", "tools/gpu_pass.sh", "--dry-run"],
        cwd=ROOT,
        env=os.environ | settings,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done, out


def _scale():
    if "bench_scale" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_scale", ROOT / "bench" / "scale.py")
        sys.modules["bench_scale"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["bench_scale"])
    return sys.modules["bench_scale"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    results = ROOT / "bench" / "results"
    before = {p.name: p.stat().st_mtime for p in results.iterdir()}
    done, out = _pass(tmp_path_factory.mktemp("gpu_pass"))
    after = {p.name: p.stat().st_mtime for p in results.iterdir()}
    return done, out, before, after


def test_dry_run_passes_every_part_and_writes_the_summary(dry_run):
    done, out, _, _ = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] is True and summary["device_kind"] == "cpu" and summary["passed"] is True
    assert [p["part"] for p in summary["parts"]] == PARTS
    for p in summary["parts"]:
        assert (p["status"], p["exit_code"]) == ("passed", 0), p
        assert 0 < p["seconds"] <= p["budget_s"]
    assert summary["results"] == [
        "e2e_cpu_quick.json",
        "families_cpu.json",
        "kernels_cpu_quick.json",
        "scale_cpu.json",
    ]
    text = (out / "summary.txt").read_text()
    assert text.splitlines()[-1] == "PASSED (cpu, dry run)"
    assert all(f"\n{name} " in text for name in PARTS)
    log = (out / "pass.log").read_text()
    assert all(f"== {name} (budget" in log for name in PARTS)
    assert "tests collected" in log and "no wheels in" in log


def test_dry_run_results_are_standard_json_and_stay_out_of_bench_results(dry_run):
    _, out, before, after = dry_run
    for name in ("kernels_cpu_quick.json", "e2e_cpu_quick.json", "scale_cpu.json"):
        report = json.loads((out / name).read_text(), parse_constant=pytest.fail)
        assert report["device"]["kind"] == "cpu"
        assert (out / "results" / name).read_text() == (out / name).read_text()
        assert before.get(name) == after.get(name), f"the dry run touched bench/results/{name}"


def test_scale_dry_run_plans_the_full_cases_and_checks_the_bound_arithmetic(dry_run):
    _, out, _, _ = dry_run
    scale = _scale()
    report = json.loads((out / "scale_cpu.json").read_text())
    assert report["dry_run"] is True and report["passed"] is True
    tiny = report["tiny"]
    assert tiny["float_params"] == tiny["float_params_loaded"] > 0
    assert tiny["pipeline_bytes"] == tiny["float_params"] * 2  # --full runs in bfloat16
    assert tiny["bound_bytes"] == int(1.3 * tiny["pipeline_bytes"] + 1.5e9)
    assert [c["id"] for c in report["cases"]] == [
        "flux-dev-full-w8a8-dynamic",
        "flux-dev-full-quant-auto",
        "wan2.1-t2v-14b-full-quant-auto",
    ]
    for case in report["cases"]:
        assert " -m sdkiln optimize " in case["command"] and "--dtype bfloat16" in case["command"]
        assert "tools/random_model.py" in case["build_command"] and "--depth" not in case["build_command"]
        assert case["estimated_bound_bytes"] == scale.bound(case["estimated_pipeline_bytes"])
    assert (
        "--frames 9" in report["cases"][2]["command"]
        and "--height 480 --width 832" in report["cases"][2]["command"]
    )


def test_a_failing_part_does_not_stop_the_later_ones(tmp_path):
    done, out = _pass(tmp_path, GPU_PASS_PARTS="tests,kernels", GPU_PASS_TESTS="tests/no_such_folder")
    assert done.returncode == 1
    summary = json.loads((out / "summary.json").read_text())
    assert [(p["part"], p["status"]) for p in summary["parts"]] == [
        ("tests", "failed"),
        ("kernels", "passed"),
    ]
    assert summary["parts"][0]["exit_code"] == 4  # pytest: usage error (no such path)
    assert summary["passed"] is False and summary["results"] == ["kernels_cpu_quick.json"]
    assert (out / "summary.txt").read_text().splitlines()[-1] == "FAILED (cpu, dry run)"


def test_scale_measures_a_childs_peak_memory_and_kills_it_at_the_budget(tmp_path):
    scale = _scale()
    grow = [sys.executable, "-c", "b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096])"]
    result = scale.run_measured(grow, tmp_path / "grow.log", dict(os.environ), timeout_s=60)
    assert result["returncode"] == 0 and not result["timed_out"], result
    # a forked child's mark starts at the parent's resident size (Linux): at most ours, plus its own
    ours = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert 300 * 2**20 <= result["peak_rss_bytes"] < max(ours, 300 * 2**20) + 300 * 2**20, result

    start = time.perf_counter()
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    result = scale.run_measured(sleep, tmp_path / "sleep.log", dict(os.environ), timeout_s=1)
    assert result["timed_out"] and result["returncode"] != 0, result
    assert time.perf_counter() - start < 30  # killed at its 1 s budget, not after its 60 s sleep


def test_scale_records_a_failed_build_and_a_short_disk_and_fails(tmp_path, monkeypatch):
    scale = _scale()
    fail = [sys.executable, "-c", "import sys; print('building'); sys.exit('no such variant')"]
    monkeypatch.setattr(scale, "build_command", lambda case, model_dir: fail)
    argv = ["--cases", "flux-dev-d2-quant-auto", "--workdir", str(tmp_path / "work")]
    report = scale.main([*argv, "--out", str(tmp_path / "built.json")])
    (row,) = report["cases"]
    assert (row["status"], report["passed"]) == ("failed", False)
    assert row["error_tail"].endswith("building\nno such variant") and row["build"]["returncode"] == 1
    assert json.loads((tmp_path / "built.json").read_text())["cases"][0]["status"] == "failed"

    usage = scale.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(scale.shutil, "disk_usage", lambda path: usage._replace(free=10**9))
    report = scale.main([*argv, "--out", str(tmp_path / "disk.json")])
    (row,) = report["cases"]
    assert row["status"] == "failed" and row["error_tail"].startswith("not enough disk at ")
    assert "about 8.0 GB needed" in row["error_tail"] and "1.0 GB free" in row["error_tail"]
