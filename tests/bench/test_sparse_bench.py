"""bench/sparse.py's attention part at a small setting, in-process: every row says which kernel ran,
more sparsity computes fewer blocks, and the JSON is standard; its allocation part (slow) compares
plans of equal cost."""

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_sparse", Path(__file__).resolve().parents[2] / "bench" / "sparse.py"
)
sbench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sbench)


def test_sparse_bench_attention_rows(tmp_path):
    out = tmp_path / "sparse.json"
    argv = "--parts attention --tokens 2048 --sparsities 0.5 0.9 --repeats 1".split() + ["--out", str(out)]
    report = sbench.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, allow_nan=False))
    assert report["machine"]["cpu"] and "embedded" not in report
    low, high = report["attention"]
    for row in (low, high):
        assert row["kernel"] == "flash_gather" and row["frames"] == 4
        assert 0 < row["kept_block_pairs"] < 1 and row["attention_rel_l1"] > 0
    assert high["kept_block_pairs"] < low["kept_block_pairs"]  # more sparsity computes fewer blocks


@pytest.mark.slow
def test_sparse_bench_allocation_at_equal_cost(tmp_path):
    """The allocation part at a tiny setting: the minimax plan keeps no more key blocks than
    uniform top-k and, keeping as many, computes the same fraction of block pairs."""
    out = tmp_path / "allocation.json"
    argv = "--parts allocation --targets 0.8 --calib-samples 1 --allocation-samples 2".split() + [
        "--out",
        str(out),
    ]
    report = sbench.main(argv)
    (row,) = report["allocation"]["rows"]
    kept, allowed = row["kept_blocks"]
    assert kept <= allowed and row["key_blocks"] > 1
    if kept == allowed:
        assert row["computed_block_pairs"][0] == row["computed_block_pairs"][1]
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, allow_nan=False))
