"""The package's shape: imports go one way, (deltaserve.cli) -> bench -> cluster -> workers -> layers ->
layers.kernels, with no cycle among deltaserve's modules (imports inside functions counted); the
protos are used by cluster only; deltaserve.envs imports nothing of deltaserve; inside cluster the
engine core never reaches an executor implementation or an entry point. Also: pyproject's package
list is the tree's package folders. `scripts/lint-imports` checks the same layers with import-linter."""

# test phase: parallel (its child process parses the tree and exits)

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS = PYPROJECT["tool"]["setuptools"]["package-dir"]

# rank of each part: an import may go to the same rank or lower, never higher
RANKS = {
    "deltaserve.cli": 6,
    "deltaserve": 4,  # the top package's __init__: a lazy facade over cluster's public names
    "deltaserve.bench": 5,
    "deltaserve.cluster": 4,
    "deltaserve.protos": 3,  # below cluster, and only cluster may use it (checked apart)
    "deltaserve.workers": 2,
    "deltaserve.layers": 1,
    "deltaserve.layers.kernels": 0,
    "deltaserve.envs": -1,  # importable by all, imports nothing of deltaserve
}
# inside cluster: who must not import whom
CLUSTER = "deltaserve.cluster"
CLUSTER_FORBIDDEN = {
    f"{CLUSTER}.config": (f"{CLUSTER}.core", f"{CLUSTER}.executors", f"{CLUSTER}.entrypoints"),
    # the factory (executors/__init__) too: only entry points build executors
    f"{CLUSTER}.core": (f"{CLUSTER}.entrypoints", f"{CLUSTER}.executors.local", f"{CLUSTER}.executors.ray"),
    f"{CLUSTER}.executors": (f"{CLUSTER}.core", f"{CLUSTER}.entrypoints"),
}
CORE_MAY_NOT_IMPORT_EXACTLY = f"{CLUSTER}.executors"


def source_modules() -> dict[str, Path]:
    """Every deltaserve module -> its file, from pyproject's package-dir mapping."""
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            if any(part in ("__pycache__",) or not part.isidentifier() for part in rel.parts):
                continue
            if any(not (base / Path(*rel.parts[:i]) / "__init__.py").is_file() for i in range(1, len(rel.parts))):
                continue  # a folder without __init__.py is no subpackage
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            modules[".".join((package, *parts))] = path
    return modules


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The deltaserve modules `name` imports anywhere in its file (function bodies included, type-checking
    blocks not: they never run); `from pkg import mod` counts as importing pkg.mod."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    skip: set[int] = set()
    for node in ast.walk(tree):
        if _type_checking_block(node):
            skip.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from pkg import mod` imports pkg.mod; `from mod import name` imports mod
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` or a name inside a module
                target = target.rpartition(".")[0]
            if target and target.startswith("deltaserve") and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = source_modules()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """import_graph() from a child process: CPython 3.11.7's ast module keeps one recursion counter per
    interpreter, so a parse here beside a thread an earlier test left running (the Triton interpreter
    rewrites kernels' ASTs) can fail with "AST constructor recursion depth mismatch" (gh-106905)."""
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return {name: set(imports) for name, imports in json.loads(done.stdout).items()}


def part(module: str) -> str:
    """The longest RANKS key that `module` is or lies under."""
    best = ""
    for key in RANKS:
        if (module == key or module.startswith(key + ".")) and len(key) > len(best):
            best = key
    return best


def test_graph_covers_the_tree(graph):
    for name in ("deltaserve.cli", f"{CLUSTER}.core.engine", "deltaserve.workers.wire", "deltaserve.layers.model"):
        assert name in graph
    # the function-level import of the Ray executor's worker is seen
    assert "deltaserve.workers.worker" in graph["deltaserve.cluster.executors.ray"]


def test_no_import_cycle(graph):
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    counter = [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
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
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_imports_go_one_way(graph):
    wrong = []
    for source, targets in graph.items():
        for target in targets:
            a, b = part(source), part(target)
            if RANKS[b] > RANKS[a]:
                wrong.append(f"{source} -> {target}")
            if b == "deltaserve.protos" and a not in ("deltaserve.cluster", "deltaserve.protos"):
                wrong.append(f"{source} -> {target} (protos are cluster's)")
            if a == "deltaserve.envs":
                wrong.append(f"{source} -> {target} (envs imports nothing of deltaserve)")
    assert wrong == []


def test_cluster_rooms(graph):
    wrong = []
    for source, targets in graph.items():
        for room, forbidden in CLUSTER_FORBIDDEN.items():
            if source != room and not source.startswith(room + "."):
                continue
            for target in targets:
                if any(target == f or target.startswith(f + ".") for f in forbidden):
                    wrong.append(f"{source} -> {target}")
                if room == f"{CLUSTER}.core" and target == CORE_MAY_NOT_IMPORT_EXACTLY:
                    wrong.append(f"{source} -> {target}")
    assert wrong == []


def test_pyproject_packages_are_the_package_folders():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    tree = {name for name, path in source_modules().items() if path.name == "__init__.py"}
    assert listed == tree


def test_license_is_an_spdx_string():
    # the table form makes setuptools warn at every install
    assert PYPROJECT["project"]["license"] == "Apache-2.0"


if __name__ == "__main__":
    print(json.dumps({name: sorted(imports) for name, imports in import_graph().items()}))
