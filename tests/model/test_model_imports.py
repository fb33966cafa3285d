"""model/ imports without cycles: every `import model.x` inside model/ (lazy ones in functions included)
forms a graph with no loop, and each module imports on its own in a fresh interpreter, in any order."""

import ast
import itertools
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(f"model.{p.stem}" for p in (ROOT / "model").glob("*.py") if p.stem not in ("__init__", "__main__"))


def _imports(module: str) -> set[str]:
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    found: set[str] = set()
    for node in ast.walk(tree):  # walks function bodies too: a lazy import closes a cycle just the same
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m in MODULES and m != module}


def test_model_import_graph_has_no_cycle() -> None:
    graph = {m: _imports(m) for m in MODULES}
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, f"import cycle: {' -> '.join(path + (m,))}"
        if m not in done:
            for n in sorted(graph[m]):
                visit(n, path + (m,))
            done.add(m)

    for m in MODULES:
        visit(m, ())
    assert "model.fault_ops" in graph["model.faults"] and graph["model.fault_ops"] == set()


def test_bundle_and_faults_import_in_either_order() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for a, b in itertools.permutations(["model.bundle", "model.faults"]):
        code = f"import {a}, {b}; import model.bundle as m; m.load_bundle"
        subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], cwd=ROOT, env=env,
                       check=True, timeout=120, capture_output=True)
