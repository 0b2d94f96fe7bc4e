"""The package's shape, read from its source: Ray is imported only by the executor, its session (start and
shutdown) and placement (which asks the cluster what it declares), no import circle joins any of its modules,
and no module is over 600 lines.

Imports are read with ``ast``, function-local ones included: a circle held together by an import inside a
function is still a circle (it only moves the failure from import time to call time, and it means the two
modules are one concern split in two). The implicit import of a parent package is not an edge, as in
pylint's ``cyclic-import``.

Every ``.py`` under the package's folders (pyproject's ``package-dir``) is parsed; an import names the module
it loads (``from pkg import name`` names ``pkg.name`` when that is a module, else ``pkg``)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
#: the modules that may import Ray: the executor runs the units, ray_session starts and stops it, placement asks
#: the cluster for its GPUs / CPUs
RAY_ALLOWED = {"memgas.jobs.executor", "memgas.jobs.ray_session", "memgas.jobs.placement"}
#: the longest a module may be: past it, a module holds more than one concern
MAX_LINES = 600


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> source file, for every ``.py`` under the package's folders."""
    dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = {}
    for pkg, folder in dirs.items():
        for path in sorted((root / folder).glob("*.py")):
            out[pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"] = path
    return out


def imports(path: Path, module: str, known: set[str]) -> list[tuple[str, int]]:
    """(module imported, line) for every import in ``path``'s source, at any depth (function bodies too),
    and every ``importlib.import_module("...")`` of a literal name."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package's own folder
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub if sub in known else base, node.lineno))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == \
                "import_module" and node.args and isinstance(node.args[0], ast.Constant):
            out.append((str(node.args[0].value), node.lineno))
    return out


def ray_imports(root: Path = ROOT) -> list[str]:
    """``module:line`` of every Ray import outside :data:`RAY_ALLOWED`."""
    mods = package_modules(root)
    return [f"{m}:{line} imports {name}" for m, path in mods.items() if m not in RAY_ALLOWED
            for name, line in imports(path, m, set(mods)) if name == "ray" or name.startswith("ray.")]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """The package's modules and, per module, the package modules it imports (itself left out)."""
    mods = package_modules(root)
    known = set(mods)
    graph: dict[str, set[str]] = {}
    for m, path in mods.items():
        graph[m] = {name for name, _ in imports(path, m, known) if name in known and name != m}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module, each sorted."""
    g = nx.DiGraph([(m, n) for m, out in graph.items() for n in out])
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


def test_ray_is_imported_only_by_the_executor_its_session_and_placement() -> None:
    assert ray_imports() == []


def test_the_check_sees_a_function_local_ray_import(tmp_path: Path) -> None:
    """A stage module that imports Ray inside a function (as the associate stage did) is reported."""
    (tmp_path / "jobs").mkdir()
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = { "memgas.jobs" = "jobs" }\n')
    (tmp_path / "jobs" / "executor.py").write_text("import ray\n")
    (tmp_path / "jobs" / "stage.py").write_text("def run():\n    if True:\n        from ray import get\n")
    assert ray_imports(tmp_path) == ["memgas.jobs.stage:3 imports ray"]


def test_no_import_circle() -> None:
    assert circles(import_graph()) == []


def test_no_module_over_600_lines() -> None:
    long = {m: n for m, path in package_modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_check_sees_a_circle_held_by_a_function_local_import(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = { "memgas.pkg" = "pkg" }\n')
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from memgas.pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from memgas.pkg.a import x\n")
    (tmp_path / "pkg" / "c.py").write_text("from . import a\n")
    assert circles(import_graph(tmp_path)) == [["memgas.pkg.a", "memgas.pkg.b"]]
