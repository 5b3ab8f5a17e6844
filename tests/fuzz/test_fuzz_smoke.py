"""The fuzz harness's fixed-seed smoke set: mutated packages through ``sdkiln inspect`` and
``sdkiln run``, each in a forked process under a 10 s and 2 GB cap. ``make fuzz`` runs the long
version (bench/results/fuzz.json holds a 10,000-case run)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fuzz_harness import FAILURES, fuzz, table  # noqa: E402

SMOKE_CASES = 300


def assert_no_failures(results: list[dict], summary: dict) -> None:
    failures = [r for r in results if r["outcome"] in FAILURES]
    assert not failures, (
        table(summary)
        + "\n"
        + "\n".join(
            f"seed {r['seed']} {r['outcome']}: {r.get('mutation')} -> {r.get('message')}" for r in failures
        )
    )


def test_fuzz_smoke_set_has_no_tracebacks_hangs_or_silent_changes():
    results, summary = fuzz(SMOKE_CASES, first_seed=0, jobs=2, timeout=10.0, memory_gb=2.0)
    assert len(results) == SMOKE_CASES
    assert_no_failures(results, summary)
    outcomes = summary["outcomes"]
    # the set reaches every outcome that is not a failure, so a harness that refused everything
    # (or loaded nothing) would not pass
    assert outcomes.get("identical", 0) > 30 and outcomes.get("refused", 0) > 100, outcomes
    assert outcomes.get("changed", 0) >= 1, outcomes
    assert {r["kind"] for r in results} == {
        "bit_flip",
        "truncate",
        "json_field",
        "json_raw",
        "safetensors_header",
        "path_trick",
    }


SHARDED_CASES = 100


def test_fuzz_smoke_set_on_a_sharded_package():
    """The same mutations on the seed package with its transformer in four shards and an index."""
    results, summary = fuzz(
        SHARDED_CASES, first_seed=10_000, jobs=2, timeout=10.0, memory_gb=2.0, shard_bytes=1 << 20
    )
    assert_no_failures(results, summary)
    outcomes = summary["outcomes"]
    assert outcomes.get("identical", 0) > 10 and outcomes.get("refused", 0) > 30, outcomes
    assert any("-of-" in (r.get("mutation") or "") for r in results), "no mutation touched a shard"
