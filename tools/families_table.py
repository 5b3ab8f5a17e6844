"""Write docs/families.md: the family x capability table, from the specs and the family suite's results.

    python tools/families_table.py                  # run tests/families (fast cases), then write
    python tools/families_table.py --run-slow       # the whole suite (make test-all's cases), then write
    python tools/families_table.py --from-xml R.xml # from a JUnit XML of an earlier run

The suite names its tests ``test_<capability>[<zoo name>]`` and ``test_refused[<zoo name>-<capability>]``
(tests/families/test_capabilities.py). A cell says what the run found: "yes" (the capability's test
passed), "refused" (the spec refuses it and test_refused asserted the one-line error), "FAILED",
or "not run" (a slow case without --run-slow). The refusal reasons are the specs' own words.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sdkiln.model_zoo import get_spec, spec_names  # noqa: E402
from sdkiln.model_zoo.spec import CAPABILITIES  # noqa: E402

OUT = ROOT / "docs" / "families.md"
_NAME = re.compile(r"test_(?P<capability>\w+)\[(?P<param>[^\]]+)\]")


def outcomes(xml_path: Path) -> dict[tuple[str, str], str]:
    """(zoo name, capability) -> passed / failed / skipped, from a JUnit XML of tests/families."""
    found = {}
    for case in ET.parse(xml_path).iter("testcase"):
        match = _NAME.fullmatch(case.get("name", ""))
        if match is None:
            continue
        capability, param = match["capability"], match["param"]
        if capability == "refused":
            name, capability = next(
                (param[: -len(c) - 1], c) for c in CAPABILITIES if param.endswith("-" + c)
            )
            capability = "refused:" + capability
        else:
            name, capability = param, capability.replace("_", "-")
        if case.find("failure") is not None or case.find("error") is not None:
            found[name, capability] = "failed"
        elif case.find("skipped") is not None:
            found[name, capability] = "skipped"
        else:
            found[name, capability] = "passed"
    return found


def cell(name: str, capability: str, results: dict) -> str:
    spec = get_spec(name)
    if capability in spec.refusals:
        outcome = results.get((name, "refused:" + capability))
        return {"passed": "refused", "failed": "FAILED (refusal)"}.get(outcome, "refused (not run)")
    # the suite tests Ulysses and CFG parallel together; ring is tested in tests/runtime/test_parallel.py
    key = "parallel" if capability in ("cfg-parallel", "ulysses", "ring") else capability
    outcome = results.get((name, key))
    if capability == "ring":  # not in the suite: tests/runtime/test_parallel.py runs it for flux and wan
        return "not in suite"
    cell = {"passed": "yes", "failed": "FAILED", "skipped": "not run"}.get(outcome, "not run")
    if capability == "compile" and spec.compile_regional and cell == "yes":
        return "yes (by block)"
    return cell


def table(results: dict, how: str) -> str:
    names = [n for n in spec_names() if n != "fmnist-flux"]
    lines = [
        "# Model families",
        "",
        "<!-- written by tools/families_table.py; do not edit by hand -->",
        "",
        "Each family is one `ModelSpec` (`sdkiln/model_zoo/<family>.py`); a diffusers directory is recognised by",
        "its pipeline class and its variant by its transformer's width (`sdkiln optimize --help` lists them).",
        "The family suite (`tests/families/test_capabilities.py`) puts each family's tiny build of the real",
        "diffusers classes through every capability on CPU. A cell is what the suite's run below found:",
        "**yes** (the capability's test passed), **refused** (the family refuses it, with the reason below,",
        "and a test asserted the one-line error), **not run** (a slow case the run left out), **FAILED**,",
        "**not in suite** (ring attention: tested for flux and wan in tests/runtime/test_parallel.py only).",
        f"This table: {how}.",
        "",
        "| family | pipeline | variants | " + " | ".join(CAPABILITIES) + " |",
        "|---|---|---|" + "---|" * len(CAPABILITIES),
    ]
    for name in names:
        spec = get_spec(name)
        variants = ", ".join(v for v in spec.variant_names() if v != "tiny")
        row = [spec.family, f"`{spec.pipeline_class.split(':')[-1]}`", variants or "-"]
        row += [cell(name, c, results) for c in CAPABILITIES]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## Refusals", ""]
    for name in names:
        spec = get_spec(name)
        for capability, reason in spec.refusals.items():
            lines.append(f"- **{spec.family}, {capability}**: {reason}")
        if spec.compile_regional:
            lines.append(f"- **{spec.family}, compile by block**: {spec.compile_regional}")
    lines += [
        "",
        "## What the capabilities mean",
        "",
        "- **quant**: a W8A8-dynamic package loads and generates the in-memory optimized model's output bit for bit.",
        "- **cache**: cache-auto searches a schedule and the loaded package reuses blocks.",
        "- **sparse**: calibrated block-sparse attention is searched, packaged and restored (slow case).",
        "- **cfg-parallel / ulysses**: two gloo ranks against one process, bit-identical (within 1e-6 where the",
        "  pipeline batches both guidance branches) (slow case); **ring** is not in the suite: it is tested for",
        "  flux and wan in tests/runtime/test_parallel.py, and where a family refuses it the suite asserts that.",
        "- **compile**: sdkiln's backend compiles the float transformer with no graph break, its fused patterns",
        "  in every block, equal to eager. **yes (by block)**: the family's forward does not trace as one",
        "  graph (`ModelSpec.compile_regional`, the reason below), so `sdkiln.load` compiles its repeated blocks,",
        "  one graph per block kind, and says so.",
        "- **ascend**: the package exports to MindIE SD's description and weights under its rules.",
        "- **onnx**: the transformer exports to ONNX and onnxruntime matches the runtime (slow case).",
        "",
        "flux, sd3 and wan also have each capability tested in depth in tests/runtime and tests/export; in the",
        "suite their cases are slow ones.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-slow", action="store_true", help="run the suite's slow cases too")
    parser.add_argument("--from-xml", type=Path, default=None, help="read this JUnit XML instead of running")
    parser.add_argument("--jobs", type=int, default=2, help="pytest-xdist workers (1: none)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.from_xml is not None:
        xml, how = args.from_xml, f"from {args.from_xml.name}"
    else:
        xml = Path(tempfile.mkdtemp()) / "families.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *(["-n", str(args.jobs), "--dist", "load"] if args.jobs > 1 else ["-p", "no:xdist"]),
            "tests/families",
            f"--junitxml={xml}",
        ]
        if args.run_slow:
            cmd.append("--run-slow")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
        subprocess.run(cmd, cwd=ROOT, env=env, check=False)
        how = "`python tools/families_table.py" + (" --run-slow`" if args.run_slow else "` (fast cases only)")
    args.out.write_text(table(outcomes(xml), how), encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
