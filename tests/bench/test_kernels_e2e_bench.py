"""bench/kernels.py and bench/e2e.py on CPU at their smallest settings, in-process.

What is checked: the JSON is standard and names the device, its driver field, the versions, the
thread count, the shapes and the dtype; every "ours" figure names the kernel that ran (on CPU the
reference); a failing implementation is recorded in its row and the run goes on. Tolerances: our
quantized outputs against the float ones by SQNR, with the usual int8 floor of 20 dB (STYLE.md
habit 12); exact float ops (the references in fp32 against the fp32 formula) at the cap.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from sdkiln.kernels.cpu_profile import cpu_profile

INT8_SQNR_FLOOR_DB = 20.0
_BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str, file: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _BENCH / file)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


kbench = _load("bench_kernels", "kernels.py")
e2e = _load("bench_e2e", "e2e.py")
cases = _load("kernel_cases", "kernel_cases.py")  # the modules the benches import, not copies
timing = _load("timing", "timing.py")

_INT8 = cpu_profile().int8_product
CPU_KERNELS = {"block_sparse_attention": "flash_gather", "w8a8_linear": _INT8, "w8a8_static_linear": _INT8}
"""The CPU kernels that run in place of the reference (``sdkiln.kernels.cpu``)."""
KERNEL_OPS = (
    "rms_norm",
    "layer_norm_modulate_quantize",
    "w8a8_linear",
    "fp8_linear",
    "weight_only_linear",
    "attention",
    "block_sparse_attention",
    "quantized_attention",
)


def _check_device(report):
    device = report["device"]
    assert device["type"] == "cpu" and device["kind"] == "cpu" and device["name"]
    assert "driver" in device
    assert {"torch", "triton", "diffusers", "torchao"} <= set(device["versions"])
    assert device["versions"]["torch"]
    assert device["torch_threads"] == torch.get_num_threads()
    assert report["small_shapes"] is True
    assert report["settings"]["dtype"] == "float32"


@pytest.fixture(scope="module")
def kernel_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels") / "kernels_cpu.json"
    argv = ["--device", "cpu", "--quick", "--no-compile", "--ops", ",".join(KERNEL_OPS), "--out", str(out)]
    report = kbench.main(argv)
    return report, json.loads(out.read_text())


def test_kernels_json_names_the_device_and_shapes(kernel_report):
    report, written = kernel_report
    assert written == json.loads(json.dumps(report, allow_nan=False))
    _check_device(written)
    assert written["settings"]["shapes"][0]["name"] == "small"
    assert written["peaks"]["matmul"]["tflop_per_s"] > 0
    assert written["peaks"]["copy"]["gb_per_s"] > 0
    assert {row["op"] for row in written["rows"]} == set(KERNEL_OPS)


def test_kernels_rows_say_which_kernel_ran_and_rate_it(kernel_report):
    _, written = kernel_report
    for row in written["rows"]:
        assert "error" not in row, row
        # the CPU runs every op's reference but block-sparse attention's gather + flash kernel and
        # the int8 linears' product chosen for this processor
        assert row["kernel"] and row["kernel"] == {
            op: CPU_KERNELS.get(op, "reference") for op in row["kernel"]
        }, row["kernel"]
        ours, eager = row["results"]["ours"], row["results"]["eager"]
        assert ours["ms"] > 0 and eager["ms"] > 0 and ours["calls"] >= 2
        assert eager["over_ours"] == pytest.approx(eager["ms"] / ours["ms"])
        assert ours["fraction_of_peak"] > 0
        assert ("tflop_per_s" in ours) == (row["flops"] is not None)
        assert row["results"]["compile"] == {"skipped": "--no-compile"}
        if row["op"] in ("w8a8_linear", "fp8_linear", "weight_only_linear", "layer_norm_modulate_quantize"):
            floor = 15.0 if row.get("weight") == "int4" else INT8_SQNR_FLOOR_DB
            assert ours["sqnr_db"] > floor, row
        if row["op"] == "quantized_attention":  # INT8 QK^T + FP8 PV against float SDPA
            assert (row["qk"], row["pv"]) == ("int8", "fp8") and 25.0 < ours["sqnr_db"] < 60.0, row
        if row["op"] in ("rms_norm", "attention"):
            assert ours["sqnr_db"] > 100 - 1e-9  # the fp32 reference equals the fp32 formula
    w8a8 = next(r for r in written["rows"] if r["op"] == "w8a8_linear")
    assert set(w8a8["kernel"]) == {"quantize_per_token_int8", "w8a8_linear"}
    sparse = [r for r in written["rows"] if r["op"] == "block_sparse_attention"]
    assert [r["sparsity"] for r in sparse] == [0.5, 0.9]
    assert all("sqnr_db" not in r["results"]["ours"] for r in sparse)  # dense baseline: another result
    assert all("ms" in r["results"]["ours dense attention"] for r in sparse)


def test_a_failing_implementation_is_recorded_and_the_row_goes_on():
    def broken(x):
        raise RuntimeError("no kernel here")

    case = cases.Case(
        "gelu_tanh",
        {"shape": "tiny"},
        lambda: (torch.randn(4, 8),),
        broken,
        cases.gelu_tanh_formula,
        lambda a: {"gelu_tanh": "reference"},
    )
    clock = timing.Clock(torch.device("cpu"), timing.Settings(1, 2, 0.1, min_repeats=2))
    row = kbench.run_case(case, clock, torch.device("cpu"), False, {"copy_gb_per_s": 1.0})
    assert row["results"]["ours"] == {"error": "RuntimeError: no kernel here"}
    assert row["results"]["eager"]["ms"] > 0 and "over_ours" not in row["results"]["eager"]


@pytest.mark.parametrize("slow_first_is_estimate, calls, warmup_calls", [(False, 3, 2), (True, 2, 1)])
def test_a_slow_first_call_is_its_own_estimate_when_asked(slow_first_is_estimate, calls, warmup_calls):
    """A zero budget makes every first call slow: the estimate call is skipped only when asked, and
    then ``min_repeats`` timed calls follow; the last call's output comes back."""
    seen = []
    settings = timing.Settings(3, 5, 0.0, min_repeats=1, slow_first_is_estimate=slow_first_is_estimate)
    result, out = timing.Clock(torch.device("cpu"), settings).measure(
        lambda x: seen.append(x) or x, [(1,), (2,)]
    )
    assert len(seen) == calls and out == seen[-1]
    assert result["calls"] == 1 and result["warmup_calls"] == warmup_calls


def test_kernels_rejects_unknown_ops():
    with pytest.raises(ValueError, match="unknown ops"):
        kbench.run("cpu", quick=True, ops=("rms_norm", "conv"))


E2E_ROWS = ("eager", "ours-w8a8-ref", "ours-fp8-ref", "ours-w8a8-eager")


@pytest.fixture(scope="module")
def e2e_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "e2e_cpu.json"
    argv = ["--device", "cpu", "--quick", "--model", "both", "--rows", ",".join(E2E_ROWS), "--out", str(out)]
    report = e2e.main(argv)
    return report, json.loads(out.read_text())


def test_e2e_json_names_the_device_and_models(e2e_report):
    report, written = e2e_report
    assert written == json.loads(json.dumps(report, allow_nan=False))
    _check_device(written)
    assert [m["model"] for m in written["models"]] == ["flux", "wan"]
    for m in written["models"]:
        assert m["config_is"] == "small (CPU)" and m["tokens"] > 0
        assert [r["id"] for r in m["rows"]] == list(E2E_ROWS)


def test_e2e_rows_time_compare_and_name_kernels(e2e_report):
    _, written = e2e_report
    for m in written["models"]:
        rows = {r["id"]: r for r in m["rows"]}
        eager = rows["eager"]
        assert eager["status"] == "ok" and eager["rel_error"] == 0 and eager["finite"]
        assert len(m["layer_input_shapes"]) > 0
        for rid in ("ours-w8a8-ref", "ours-fp8-ref"):
            row = rows[rid]
            assert row["status"] == "ok", row
            assert row["weights_checksum"] == eager["weights_checksum"]
            assert row["ms"] > 0 and row["first_call_s"] > 0 and row["peak_memory_bytes"] > 0
            assert row["vs_float_eager"] == pytest.approx(eager["ms"] / row["ms"])
            assert 0 < row["rel_error"] < 0.1 and row["sqnr_db"] > INT8_SQNR_FLOOR_DB
            n = row["quantized_layers"]
            assert n == len(m["layer_input_shapes"])
            assert all(
                counts == {CPU_KERNELS.get(op, "reference"): n} for op, counts in row["kernels"].items()
            ), row["kernels"]
        assert set(rows["ours-w8a8-ref"]["kernels"]) == {"quantize_per_token_int8", "w8a8_linear"}
        assert set(rows["ours-fp8-ref"]["kernels"]) == {"fp8_quantize_per_token", "fp8_linear"}
        assert rows["ours-w8a8-eager"]["status"] == "skipped" and rows["ours-w8a8-eager"]["reason"]


@pytest.mark.slow
def test_compile_columns_and_rows_on_cpu(tmp_path):
    """The compiled paths: torch.compile columns of the kernel bench; the regional compile, torchao
    (recorded as not available where it is not installed) and our backend's row of the e2e bench."""
    report = kbench.main(
        ["--device", "cpu", "--quick", "--ops", "rms_norm,w8a8_linear", "--out", str(tmp_path / "k.json")]
    )
    for row in report["rows"]:
        for name, result in row["results"].items():
            assert "ms" in result, (name, result)
        assert row["results"]["compile"]["first_call_s"] > 0
    assert report["settings"]["compiler_start_s"] > 0
    rows = "compile,torchao-int8,ours-w8a8"
    argv = [
        "--device",
        "cpu",
        "--quick",
        "--model",
        "flux",
        "--rows",
        rows,
        "--out",
        str(tmp_path / "e.json"),
    ]
    report = e2e.main(argv)
    assert report["settings"]["compiler_start_s"] > 0
    rows = {r["id"]: r for r in report["models"][0]["rows"]}
    assert rows["compile"]["status"] == "ok" and rows["compile"]["compiled"].startswith("diffusers")
    assert rows["compile"]["vs_float_compile"] == 1.0
    torchao = rows["torchao-int8"]
    assert torchao["status"] == "ok" or (
        torchao["status"] == "not available" and "torchao" in torchao["error"]
    )
    assert rows["ours-w8a8"]["status"] == "ok", rows["ours-w8a8"]
    assert rows["ours-w8a8"]["compiled"].startswith("CompileConfig(backend='sdkiln'")
    assert set(rows["ours-w8a8"]["kernels"]) == {"quantize_per_token_int8", "w8a8_linear"}
