"""The layering rule (docs/layout.md): an arrow means "may import".

    ops <- layers <- models <- rundir <- train / eval / bench / analysis / interop <- sweep <- cli
    data <- rundir, train / eval / bench;   analysis never imports train.

And no circle of imports between the modules of one package, counting imports inside functions
(a late import hides a circle from the interpreter, not from the design) and imports under
``if TYPE_CHECKING:`` (an annotation is a dependency too: move the shared type to a module both
sides may import, or describe what is needed with a Protocol on the using side).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "moeify"

ALLOWED = {
    "ops": {"ops", "errors"},
    "layers": {"ops", "layers", "errors"},
    "models": {"ops", "layers", "models", "errors"},
    "data": {"data", "errors"},
    "train": {"ops", "layers", "models", "data", "train", "eval", "rundir", "errors"},
    "eval": {"ops", "layers", "models", "data", "eval", "errors"},
    "bench": {"ops", "layers", "models", "data", "bench", "errors"},
    "analysis": {"ops", "layers", "models", "data", "eval", "analysis", "rundir", "errors"},
    "interop": {"ops", "layers", "models", "data", "train", "eval", "interop", "rundir", "errors"},
    # The run-directory package sits above models and data, below train / analysis / interop.
    "rundir": {"models", "data", "rundir", "errors"},
    # Training runs side by side (compare, sweep): a child trains and scores, the parent tabulates.
    "sweep": {"ops", "layers", "models", "data", "train", "eval", "analysis", "rundir", "sweep",
              "runtime", "errors"},
    "cli": None,  # may import anything
}


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        for n in names:
            parts = n.split(".")
            if parts[0] == "moeify" and len(parts) > 1:
                found.add(parts[1])
    return found


# Top-level modules.
MODULES = {"errors": set(), "runtime": set()}


def test_no_upward_imports():
    problems = []
    for pkg, allowed in ALLOWED.items():
        if allowed is None:
            continue
        for f in (ROOT / pkg).rglob("*.py"):
            bad = imported_packages(f) - allowed
            if bad:
                problems.append(f"{f.relative_to(ROOT)} imports {sorted(bad)}")
    for mod, allowed in MODULES.items():
        bad = imported_packages(ROOT / f"{mod}.py") - allowed
        if bad:
            problems.append(f"{mod}.py imports {sorted(bad)}")
    assert not problems, "layering violations:\n" + "\n".join(problems)


def _module_name(f: Path, root: Path) -> str:
    parts = list(f.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the modules of the same tree it imports anywhere (top level, in a function, or
    under ``if TYPE_CHECKING:``), ``from pkg import mod`` resolved to the module, relative
    imports resolved."""
    files = {_module_name(f, root): f for f in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, f in files.items():
        pkg = name if f.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(f.read_text())
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                cands = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                cands = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                         for a in node.names]
            else:
                continue
            for c in cands:
                while c and c not in files:
                    c = c.rpartition(".")[0]
                if c and c != name:
                    targets.add(c)
        graph[name] = targets
    return graph


def package_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles among modules of one package: strongly connected components (more
    than one module) of the graph restricted to edges inside a package."""
    def package(m: str) -> str:
        return m.rpartition(".")[0]

    edges = {m: {t for t in ts if package(t) == package(m) and t != package(m)}
             for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle_inside_a_package():
    circles = package_circles(import_graph(ROOT))
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_check_finds_a_planted_circle(tmp_path):
    pkg = tmp_path / "demo" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "demo" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from demo.sub import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")  # hidden in a function
    (pkg / "c.py").write_text("import demo.sub.a\n")
    (pkg / "d.py").write_text("x = 1\n")
    (pkg / "e.py").write_text("from demo.sub.d import x\n")  # one way only: no circle
    circles = package_circles(import_graph(tmp_path / "demo"))
    assert circles == [["demo.sub.a", "demo.sub.b", "demo.sub.c"]]


def test_the_circle_check_finds_a_circle_through_annotations_only(tmp_path):
    """A circle whose one side is a ``typing.TYPE_CHECKING`` import (the interpreter never runs
    it) is still a circle of the design, and the check reports it."""
    pkg = tmp_path / "demo" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "demo" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("from demo.sub.model import Model\n\n"
                                   "class Config:\n    def build(self):\n"
                                   "        return Model(self)\n")
    (pkg / "model.py").write_text("from __future__ import annotations\n\n"
                                  "import typing\n\nif typing.TYPE_CHECKING:\n"
                                  "    from demo.sub.config import Config\n\n"
                                  "class Model:\n    def __init__(self, config: Config):\n"
                                  "        self.config = config\n")
    (pkg / "other.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                  "    from demo.sub.model import Model\n")  # one way: fine
    graph = import_graph(tmp_path / "demo")
    assert "demo.sub.config" in graph["demo.sub.model"]  # the annotation-only import counts
    assert package_circles(graph) == [["demo.sub.config", "demo.sub.model"]]


def test_every_package_is_covered():
    pkgs = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert pkgs <= set(ALLOWED), f"add the new package(s) to ALLOWED: {pkgs - set(ALLOWED)}"


def test_tests_mirror_src():
    # tests/<package>/ holds the tests of src/moeify/<package>/; only shared files sit on top.
    tests = Path(__file__).resolve().parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders <= set(ALLOWED), f"test folders without a src package: {folders - set(ALLOWED)}"
    top = sorted(p.name for p in tests.glob("test_*.py"))
    assert top == ["test_layering.py", "test_readme.py"], top


def private_members(pkg: str) -> set[str]:
    """The private names (one leading underscore) that ``pkg`` defines: module-level functions,
    classes and variables, methods and class attributes, and ``self._x`` attributes."""
    names = set()
    for f in (ROOT / pkg).rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and n != "_" and not n.startswith("__")}


def test_layers_import_nothing_of_train():
    assert "train" not in ALLOWED["layers"]
    bad = [str(f.relative_to(ROOT)) for f in (ROOT / "layers").rglob("*.py")
           if "train" in imported_packages(f)]
    assert not bad, bad


def test_train_names_no_private_layer_member():
    """Parallelism, balancing and checkpointing reach the layers through their public surface
    (e.g. ``RoutedExperts.run`` / ``weights``), never a layer's private member; ``self._x`` in
    train is train's own."""
    private = private_members("layers")
    assert "_Deferred" in private  # the collection sees what it should
    problems = []
    for f in (ROOT / "train").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                problems.append(f"{f.relative_to(ROOT)}:{node.lineno} .{node.attr}")
            elif (isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "moeify.layers")):
                problems += [f"{f.relative_to(ROOT)}:{node.lineno} imports {a.name}"
                             for a in node.names if a.name.startswith("_")]
    assert not problems, "train names private layer members:\n" + "\n".join(problems)


def test_the_run_directory_package_owns_checkpoint_writing_and_the_run_lock():
    """Checkpoints are written (single-file and sharded) and runs locked in rundir/ only, so
    interop, upcycling and sweep write and lock runs without importing train."""
    owned = {"save_checkpoint", "save_sharded", "publish_checkpoint", "restore_sharded",
             "RunLock", "sweep_stale", "set_aside"}
    found = []
    for f in ROOT.rglob("*.py"):
        for node in ast.parse(f.read_text()).body:  # top level only (Trainer has methods)
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in owned:
                found.append((f.relative_to(ROOT).parts[0], node.name))
    assert {name for _, name in found} == owned
    assert {pkg for pkg, _ in found} == {"rundir"}, found
