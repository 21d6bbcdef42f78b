"""The import layering of docs/architecture.md, read from the source with `ast`, as a rule over
folders: each room (a package, or one of `core/`'s sub-folders; `core`'s own top-level modules are
a room of their own) names the rooms it may import, and those rules form no cycle.

A module imports only its own room or the rooms its room may import, no file-level import cycle
exists, and every import of a project module sits at module level (a function-local import hides
a dependency from readers and from this test)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protos", "dataservice", "core", "moe", "interop", "bench")
CORE_ROOMS = ("kernels", "parallel", "precision", "state", "train", "planner")

# Which room may import which (besides itself). Below `moe`: core's foundation (`core`, its
# kernels, parallel steps, precision and state), which knows nothing of MoE; above it: the
# training run (`core.train`) and the planner, the only core code that may name `moe`.
MAY_IMPORT: dict[str, set[str]] = {
    "protos": set(),
    "dataservice": {"protos"},
    "core.kernels": set(),
    "core": {"core.kernels", "dataservice", "protos"},
    "core.parallel": {"core", "core.kernels", "dataservice"},
    "core.precision": {"core", "core.kernels", "core.parallel", "dataservice"},
    "core.state": {"core", "core.kernels", "core.parallel", "dataservice"},
    "moe": {"core", "core.kernels", "core.parallel", "core.precision", "core.state", "dataservice"},
    "core.planner": {"core", "core.parallel", "dataservice", "protos"},
    "core.train": {"core", "core.kernels", "core.parallel", "core.precision", "core.state", "core.planner", "moe",
                   "dataservice", "protos"},
    "interop": {"core", "core.kernels", "core.parallel", "core.precision", "core.state", "core.train", "moe",
                "dataservice", "protos"},
    "bench": {"core", "core.kernels", "core.parallel", "core.precision", "core.state", "core.train", "core.planner",
              "moe", "interop", "dataservice", "protos"},
}


def room_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "core" and len(parts) > 2 and parts[1] in CORE_ROOMS:
        return f"core.{parts[1]}"
    if parts[0] == "core" and len(parts) == 2 and parts[1] in CORE_ROOMS:
        return f"core.{parts[1]}"  # the sub-package's own __init__
    return parts[0]


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
            source, dest = room_of(module), room_of(target)
            if dest != source and dest not in MAY_IMPORT[source]:
                upward.append(f"{where}: {module} (room {source}) imports {target} (room {dest}); "
                              f"{source} may import only {sorted(MAY_IMPORT[source]) or 'nothing of ours'}")
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


def test_the_room_rules_form_no_cycle_and_keep_moe_above_the_foundation():
    assert find_cycle({room: set(targets) for room, targets in MAY_IMPORT.items()}) is None
    foundation = {"core", "core.kernels", "core.parallel", "core.precision", "core.state"}
    assert not any("moe" in MAY_IMPORT[room] for room in foundation)
    assert not MAY_IMPORT["dataservice"] & (foundation | {"moe", "core.train"})
    rooms = {room_of(module) for module in project_modules()}
    assert rooms == set(MAY_IMPORT), f"rooms without a rule or rules without a room: {rooms ^ set(MAY_IMPORT)}"


def test_core_keeps_at_most_fifteen_top_level_modules():
    top = sorted(p.stem for p in (ROOT / "core").glob("*.py") if p.stem != "__init__")
    assert len(top) <= 15, f"{len(top)} modules at core/'s top level: {top}"


def test_config_is_a_leaf():
    """core/config.py is the schema: it imports no project module."""
    modules = project_modules()
    found = imports_of("core.config", modules["core.config"], modules)
    assert not found, f"core/config.py imports {sorted({target for target, _, _ in found})}"


def test_no_test_module_imports_another():
    """Tests share code through tests/support/, never by importing another test module."""
    offenders = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else []
            if any(name.startswith("tests.test_") or (name == "tests" and isinstance(node, ast.ImportFrom)
                                                      and any(a.name.startswith("test_") for a in node.names))
                   for name in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, "test modules importing test modules:\n" + "\n".join(offenders)


def test_the_checker_catches_what_it_forbids(tmp_path):
    """Negative controls: the rules fire on an upward import, a local import and a cycle."""
    assert "moe" not in MAY_IMPORT[room_of("core.layers")] and "moe" in MAY_IMPORT[room_of("core.train.model")]
    assert room_of("core.precision.blockwise") == "core.precision" and room_of("core.mesh") == "core"
    assert room_of("core.train") == "core.train" and room_of("moe.layer") == "moe"
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
