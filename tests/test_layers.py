"""The layers of ``src/daf`` point one way: every import goes to a lower floor (docs/architecture.md).

Imports inside functions count too: a lazy import is still a dependency.
"""

import ast
from pathlib import Path

import daf

SOURCE = Path(daf.__file__).parent

# The floors, bottom up; a package may import only from lower floors.
FLOORS = {
    "format": 0, "report": 0, "allocator": 0,
    "config": 1, "kernels": 1, "tracing": 1,
    "codec": 2, "policy": 2, "memory": 2,
    "runtime": 3,
    "api": 4,
    "__init__": 5,  # the package's face: ``import daf``
    "workloads": 6, "integrations": 6,
    "bench": 7,
    "cli": 8,
}


def _package(path: Path) -> str:
    parts = path.relative_to(SOURCE).with_suffix("").parts
    return parts[0]


def _daf_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        for name in names:
            if name == "daf":
                found.add("__init__")
            elif name.startswith("daf."):
                found.add(name.split(".")[1])
    return found


def _edges() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = {}
    for path in SOURCE.rglob("*.py"):
        source = _package(path)
        for target in _daf_imports(path) - {source}:
            edges.setdefault((source, target), []).append(str(path.relative_to(SOURCE)))
    return edges


def test_every_package_has_a_floor():
    packages = {_package(path) for path in SOURCE.rglob("*.py")}
    assert packages <= set(FLOORS), f"give these a floor in FLOORS and docs/architecture.md: {packages - set(FLOORS)}"


def test_imports_point_down_only():
    upward = {f"{a} -> {b}": files for (a, b), files in _edges().items() if FLOORS[a] <= FLOORS[b]}
    assert not upward, f"imports that do not point down: {upward}"


def test_the_oracle_of_a_test_is_not_shipped():
    assert "brute_force" not in (SOURCE / "policy" / "allocator.py").read_text()
