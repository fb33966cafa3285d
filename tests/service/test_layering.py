"""The project's import graph: no cycle anywhere (lazy imports in functions count), and the rooms'
rules: service/doors/ and service/batching/ import no torch (an edge process loads the doors only),
model/ imports no grpc, service/server.py does not import service/multiproc/, the client imports
nothing of the service or the model, service/doors/ imports nothing above it. The doors' own rules (the one
call path, issue 38): no door imports another door, only the shared call layer plans a call and admits it,
and no module reaches for another module's private names. Checked on the source (ast) and, for torch, in a
fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("proto", "model", "service", "client")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "_pb2" in path.name:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` except those under `if TYPE_CHECKING:` (annotations only: never imported)."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def imports_of(module: str) -> set[str]:
    """The project modules `module` imports at run time, anywhere in its body (a lazy import counts;
    one under `if TYPE_CHECKING:` does not)."""
    tree = ast.parse(MODULES[module].read_text())
    found: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative: resolve against the package
                package = module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [node.module])
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in MODULES and m != module}


def all_imports(module: str) -> set[str]:
    """Every name `module` imports, project or not (first component), anywhere in its body."""
    tree = ast.parse(MODULES[module].read_text())
    names: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        if state.get(m) == 1:
            return path[path.index(m):] + [m]
        if state.get(m) == 2:
            return None
        state[m] = 1
        for n in sorted(graph[m]):
            if (cycle := visit(n, path + [m])) is not None:
                return cycle
        state[m] = 2
        return None

    for m in sorted(graph):
        if (cycle := visit(m, [])) is not None:
            return cycle
    return None


def test_no_import_cycle_in_the_project() -> None:
    # A package imports its own submodules' names through __init__: edges into a package's own
    # __init__ from its submodules are how Python resolves them, not a cycle of ours.
    graph = {m: {n for n in imports_of(m) if not m.startswith(n + ".")} for m in MODULES}
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_the_cycle_finder_can_fail() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("room", ["service.doors", "service.batching"])
def test_rooms_that_import_no_torch(room: str) -> None:
    for module in (m for m in MODULES if m == room or m.startswith(room + ".")):
        assert "torch" not in all_imports(module), f"{module} imports torch"
        reached = _closure(module)
        heavy = sorted(m for m in reached if "torch" in all_imports(m))
        assert not heavy, f"{module} reaches torch through {heavy}"


def test_the_batcher_and_the_model_know_nothing_of_tracing() -> None:
    """Tracing is a layer (service/tracing.py): the batcher is handed a generic hook and opaque per-request
    traces, and imports no opentelemetry; nor does the model."""
    for module in (m for m in MODULES if m.startswith(("service.batching", "model"))):
        assert "opentelemetry" not in all_imports(module), module
        assert "service.tracing" not in _closure(module), module


def test_server_does_not_import_multiproc_and_model_imports_no_grpc() -> None:
    assert not {m for m in _closure("service.server") if m.startswith("service.multiproc")}
    for module in (m for m in MODULES if m.startswith("model")):
        assert not {"grpc", "prometheus_client"} & all_imports(module), module
    for module in (m for m in MODULES if m.startswith("client")):
        assert not {m for m in imports_of(module) if m.startswith(("service", "model"))}, module


def test_an_edge_process_loads_no_torch() -> None:
    """What `python -m service.multiproc.edge_worker` imports, in a fresh interpreter."""
    code = "import sys, service.multiproc.edge_worker, service.doors.build; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def _closure(module: str) -> set[str]:
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(imports_of(m))
    return seen


# The doors' transports: each decodes its wire, runs the call on the shared call layer, encodes its wire.
# Only the assembly (service/doors/build.py) knows them all.
DOORS = ("service.doors.attention_v1", "service.doors.kserve.grpc_door", "service.doors.kserve.rest",
         "service.doors.http.openai", "service.doors.http.tei", "service.doors.http.encode",
         "service.doors.http.pooling", "service.doors.http.rerank", "service.doors.tei_v1")
# Private names of another module that a module may read, each for a stated reason.
PRIVATE_ALLOWED = {
    ("service.metrics", "_type"), ("service.metrics", "_name"), ("service.metrics", "_labelnames"),  # prometheus
    ("service.doors.http.server", "_shutdown_timeout"),  # aiohttp's AppRunner: this drain's grace
    ("service.process", "_exit"),  # os._exit
    ("service.server", "_startup"),  # its own Server's
    ("client.calls", "_cancel"), ("client.calls", "_LOCAL_CANCELLATION_DETAILS"),  # grpc.aio's: grpc/grpc#43360
}


def test_doors_import_no_other_door_and_nothing_above_them() -> None:
    assert set(DOORS) <= set(MODULES), sorted(set(DOORS) - set(MODULES))
    for module in MODULES:
        if module == "service.doors.build":
            continue
        imported = imports_of(module) & set(DOORS)
        assert not imported, f"{module} imports the door(s) {sorted(imported)} (only service/doors/build.py may)"
    for module in (m for m in MODULES if m.startswith("service.doors")):
        above = {m for m in imports_of(module) if m in ("service.process", "service.server", "service.engine",
                                                        "service.runner") or m.startswith("service.multiproc")}
        assert not above, f"{module} imports {sorted(above)}: the doors import nothing above them"


def _calls_in(module: str) -> set[str]:
    """The names `module` calls: `f(...)` and `x.f(...)`."""
    names = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else "")
    return names


def test_one_place_plans_a_call_and_hands_it_to_the_batcher() -> None:
    planning = {"plan_call", "plan", "plan_head", "submit", "compute"}
    callers = {m for m in MODULES if m.startswith("service.doors") and _calls_in(m) & planning}
    assert callers == {"service.doors.calls"}, sorted(callers)


def private_reads(module: str) -> set[str]:
    """Private names `module` takes from elsewhere: `from x import _name`, and `obj._name` on anything but
    `self` or `cls` (a dunder is not private)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom):
            found.update(a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__"))
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.add(node.attr)
    return found


def test_no_module_calls_a_private_name_of_another() -> None:
    offenders = {(m, name) for m in MODULES if m.startswith(("service", "proto", "client"))
                 for name in private_reads(m)} - PRIVATE_ALLOWED
    assert not offenders, sorted(offenders)


def test_the_layering_checks_can_fail(tmp_path: Path) -> None:
    source = tmp_path / "door.py"
    source.write_text("from service.doors.attention_v1 import _stream_error\n"
                      "def f(door):\n    return door._kserve._ready(), plan_call(1)\n")
    MODULES["tests.fake_door"] = source
    try:
        assert private_reads("tests.fake_door") == {"_stream_error", "_kserve", "_ready"}
        assert "service.doors.attention_v1" in imports_of("tests.fake_door")
        assert "plan_call" in _calls_in("tests.fake_door")
    finally:
        del MODULES["tests.fake_door"]
