"""docs/families.md against the specs: every family has its row and every refusal its reason, word for
word (tests/families/test_capabilities.py asserts each refusal; tools/families_table.py writes the page)."""

import importlib.util
import re
import sys
from pathlib import Path

from sdkiln.model_zoo import get_spec, spec_names

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "families.md"


def _tool():
    spec = importlib.util.spec_from_file_location("families_table", ROOT / "tools" / "families_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("families_table", module)
    spec.loader.exec_module(module)
    return module


def test_the_page_has_every_family_and_every_refusal_reason():
    text = PAGE.read_text(encoding="utf-8")
    rows = {m[1] for m in re.finditer(r"^\| ([a-z0-9.-]+) \| `", text, re.M)}
    specs = [get_spec(n) for n in spec_names() if n != "fmnist-flux"]
    assert rows == {s.family for s in specs}
    listed = {
        (m[1], m[2]): m[3] for m in re.finditer(r"^- \*\*([a-z0-9.-]+), ([a-z-]+)\*\*: (.*)$", text, re.M)
    }
    assert listed == {(s.family, c): reason for s in specs for c, reason in s.refusals.items()}
    assert not re.search(r"\| FAILED", text)  # no capability cell says the suite failed it


def test_outcomes_read_capabilities_and_refusals_from_junit(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="c" name="test_quant[qwen-image-tiny]"/>'
        '<testcase classname="c" name="test_refused[qwen-image-tiny-onnx]"/>'
        '<testcase classname="c" name="test_refused[flux2-tiny-cfg-parallel]"><failure message="x"/></testcase>'
        '<testcase classname="c" name="test_onnx[flux-tiny]"><skipped message="slow"/></testcase>'
        "</testsuite></testsuites>"
    )
    found = _tool().outcomes(xml)
    assert found == {
        ("qwen-image-tiny", "quant"): "passed",
        ("qwen-image-tiny", "refused:onnx"): "passed",
        ("flux2-tiny", "refused:cfg-parallel"): "failed",
        ("flux-tiny", "onnx"): "skipped",
    }
