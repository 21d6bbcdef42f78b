"""The import layering of docs/architecture.md, read from the source with `ast`:

    protos <- dataservice <- core foundation <- moe <- orchestration (core.model, core.parallelize,
    core.trainer, core.cli, core.planner.*) <- interop <- bench

A module imports only its own layer or lower ones, no file-level import cycle exists, and every
import of a project module sits at module level (a function-local import hides a dependency
from readers and from this test)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protos", "dataservice", "core", "moe", "interop", "bench")
ORCHESTRATION = {"core.train.model", "core.train.parallelize", "core.train.trainer", "core.train.cli", "core.train.launcher", "core.train.rundir", "core.train.data", "core.train.dynamic_cp", "core.train.loss", "core.train.optim"}
LAYER_NAMES = ["protos", "dataservice", "core foundation", "moe", "orchestration", "interop", "bench"]


def layer_of(module: str) -> int:
    top = module.split(".")[0]
    if top == "core":
        return 4 if module in ORCHESTRATION or module.startswith(("core.planner", "core.train")) else 2
    return {"protos": 0, "dataservice": 1, "moe": 3, "interop": 5, "bench": 6}[top]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            found[module_name(path)] = path
    return found


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported project module, line, at module level) for every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from pkg import sub` imports the submodule pkg.sub where one exists.
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        else:
            continue
        top_level, parent = True, parents.get(node)
        while parent is not None:
            if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                top_level = False
            parent = parents.get(parent)
        for target in targets:
            if target.split(".")[0] in PACKAGES:
                found.append((target, node.lineno, top_level))
    return found


def import_graph() -> tuple[dict[str, set[str]], list[str], list[str]]:
    modules = project_modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    upward, local = [], []
    for module, path in modules.items():
        for target, line, top_level in imports_of(module, path, modules):
            where = f"{path.relative_to(ROOT)}:{line}"
            if not top_level:
                local.append(f"{where} imports {target} inside a function or class")
            if layer_of(target) > layer_of(module):
                upward.append(f"{where}: {module} ({LAYER_NAMES[layer_of(module)]}) imports {target} "
                              f"({LAYER_NAMES[layer_of(target)]})")
            if target in graph and target != module:
                graph[module].add(target)
    return graph, upward, local


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_imports_go_one_way_without_cycles_or_local_imports():
    graph, upward, local = import_graph()
    assert not upward, "imports against the layering:\n" + "\n".join(upward)
    assert not local, "function-local imports of project modules:\n" + "\n".join(local)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    assert len(graph) > 60  # the walk saw the tree, not an empty folder


def test_every_module_imports():
    """The fast lane touches every module: each one at least imports (on CPU, without a GPU)."""
    failed = []
    for module in sorted(project_modules()):
        try:
            importlib.import_module(module)
        except Exception as err:  # collect them all: one run names every broken module
            failed.append(f"{module}: {type(err).__name__}: {err}")
    assert not failed, "\n".join(failed)


def test_dataservice_stands_alone_and_moe_below_the_orchestration():
    graph, _, _ = import_graph()
    for module, targets in graph.items():
        if module.startswith("dataservice"):
            assert not {t for t in targets if t.split(".")[0] in ("core", "moe")}, module
        if module.startswith("moe"):
            assert not targets & ORCHESTRATION, module


def test_the_checker_catches_what_it_forbids(tmp_path):
    """Negative controls: the rules fire on an upward import, a local import and a cycle."""
    assert layer_of("moe.layer") > layer_of("core.layers") and layer_of("core.train.model") > layer_of("moe.layer")
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    source = tmp_path / "moe" / "bad.py"
    source.parent.mkdir()
    source.write_text("from core.train.model import GPT\n\ndef f():\n    import dataservice.client\n")
    modules = {"core.train.model": Path("x"), "dataservice.client": Path("y")}
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = imports_of("moe.bad", source, modules)
    finally:
        ROOT = saved
    assert ("core.train.model", 1, True) in found and ("dataservice.client", 4, False) in found


@pytest.mark.parametrize("tag", ["tp_shard_dim", "tp_full_shape", "expert_parallel", "ep_shard_dim", "ep_full_shape",
                                 "sequence_parallel_partial"])
def test_placement_tags_are_declared_once(tag):
    """Only core/placement.py names a placement tag in code (docstrings and comments may)."""
    users = []
    for module, path in project_modules().items():
        if module == "core.placement":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            accessor = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "placement"
            named = (isinstance(node, ast.Attribute) and node.attr == tag and not accessor) or \
                    (isinstance(node, ast.Constant) and node.value == tag and not _is_docstring(node))
            if named:
                users.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not users, f"{tag} used outside core/placement.py: {users}"


def _is_docstring(node: ast.Constant) -> bool:
    return isinstance(node.value, str) and "\n" in node.value
