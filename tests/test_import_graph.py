"""The walls between sdkiln's packages, read from the source: no import cycle among its modules, and
the runtime, kernels and server never import the offline side (not even lazily, inside a function)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "sdkiln"
OFFLINE = ("sdkiln.optimizer", "sdkiln.calibrate", "sdkiln.export", "sdkiln.sparsify")
ONLINE = ("sdkiln.runtime", "sdkiln.kernels", "sdkiln.serve")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def imported(node: ast.AST, current: str) -> list[str]:
    """The sdkiln modules an import statement names (``from a import b`` names ``a.b`` when that is
    a module, else ``a``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("sdkiln")]
    if isinstance(node, ast.ImportFrom):
        assert not node.level, f"{current}: a relative import; sdkiln imports absolutely"
        base = node.module or ""
        if not base.startswith("sdkiln"):
            return []
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    return []


def module_level_imports(name: str) -> set[str]:
    """What importing the module runs: imports at its top level, not in functions or TYPE_CHECKING."""
    tree = ast.parse(MODULES[name].read_text())
    out: set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            out.update(imported(node, name))
            if isinstance(node, ast.If | ast.Try | ast.With):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, field, []) or []:
                        visit(child.body if isinstance(child, ast.ExceptHandler) else [child])

    visit(tree.body)
    return {m for m in out if m in MODULES}


def test_no_import_cycle_among_sdkiln_modules():
    graph = {name: module_level_imports(name) for name in MODULES}
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def strongconnect(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            strongconnect(v)
    assert len(graph) > 80 and not cycles, cycles


def test_the_runtime_and_kernels_import_nothing_offline_anywhere():
    offenders = []
    for name, path in MODULES.items():
        if not name.startswith(ONLINE):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            offenders += [(name, m) for m in imported(node, name) if m.startswith(OFFLINE)]
    assert not offenders, offenders


def test_the_scanner_sees_imports():
    """The checks above would pass on a scanner that finds nothing: it finds the known edges."""
    assert "sdkiln.kernels.registry" in module_level_imports("sdkiln.kernels.ops.int8")
    assert "sdkiln.runtime.restore" in module_level_imports("sdkiln.runtime.loader")
    assert "sdkiln.optimizer.quant.calibration" in module_level_imports("sdkiln.optimizer.quant.w8a8_static")
