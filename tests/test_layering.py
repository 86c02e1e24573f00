"""The layering rule of ARCHITECTURE: an arrow means "may import".

    ops <- layers <- models <- train / eval / bench / analysis <- cli
    data <- train / eval / bench;   analysis never imports train.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "moeify"

ALLOWED = {
    "ops": {"ops", "errors"},
    "layers": {"ops", "layers", "errors"},
    "models": {"ops", "layers", "models", "errors"},
    "data": {"data", "errors"},
    "train": {"ops", "layers", "models", "data", "train", "eval", "errors"},
    "eval": {"ops", "layers", "models", "data", "eval", "errors"},
    "bench": {"ops", "layers", "models", "data", "bench", "errors"},
    "analysis": {"ops", "layers", "models", "data", "eval", "analysis", "errors"},
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


def test_no_upward_imports():
    problems = []
    for pkg, allowed in ALLOWED.items():
        if allowed is None:
            continue
        for f in (ROOT / pkg).rglob("*.py"):
            bad = imported_packages(f) - allowed
            if bad:
                problems.append(f"{f.relative_to(ROOT)} imports {sorted(bad)}")
    assert not problems, "layering violations:\n" + "\n".join(problems)


def test_every_package_is_covered():
    pkgs = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert pkgs <= set(ALLOWED), f"add the new package(s) to ALLOWED: {pkgs - set(ALLOWED)}"
