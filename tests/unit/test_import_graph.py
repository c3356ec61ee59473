"""The package's import graph has no cycle, counting every import statement: those under
``TYPE_CHECKING`` and those inside functions too (a cycle hidden there is still a cycle in
the design, only one that happens not to crash at import time).

The modules are the files of the packages pyproject.toml lists (with its ``package-dir``
mapping), the test bed's included, read as source: nothing is imported, so optional
dependencies do not matter. The same graph shows the product apart from the test bed: no
product module imports ``ftengine.testbed`` or names one of its modules in a string.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from tests.package_support import (
    ROOT,
    ROOT_PACKAGE,
    TESTBED,
    in_testbed,
    module_files,
    package_dirs,
)

COMMAND_DISCOVERY = f"{ROOT_PACKAGE}.cli"
"""The one product module that names the test bed: its command-line discovery's fallback for
a source checkout without entry points (``ftengine/cli/__init__.py``)."""


def _imported_names(module: str, file: Path, modules: Mapping[str, Path]) -> Iterator[str]:
    """The dotted module names ``file`` imports by name (relative ones resolved).

    ``from P import x`` names the module ``P.x`` where that is a module, else ``P``.
    """
    is_package = file.name == "__init__.py"
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: None if is_package else -1]
                base = base[: len(base) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                yield submodule if submodule in modules else source


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """Edges module -> project modules it runs when imported.

    An explicit import of a name counts as an edge to that module; the parent packages an
    import runs implicitly count too, except the importer's own parents (they are the ones
    already being imported when the importer runs).
    """
    graph: dict[str, set[str]] = {}
    for module, file in modules.items():
        edges: set[str] = set()
        for name in _imported_names(module, file, modules):
            parts = name.split(".")
            for cut in range(1, len(parts) + 1):
                target = ".".join(parts[:cut])
                explicit = cut == len(parts)
                own_parent = module.startswith(target + ".")
                if target in modules and target != module and (explicit or not own_parent):
                    edges.add(target)
        graph[module] = edges
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_every_listed_package_has_modules() -> None:
    modules = module_files()
    assert f"{ROOT_PACKAGE}.engine" in modules
    assert f"{ROOT_PACKAGE}.policies.builtin" in modules
    assert f"{ROOT_PACKAGE}.backends.base" in modules
    assert f"{TESTBED}.cluster.supervisor" in modules
    assert f"{TESTBED}.chaos.campaign" in modules
    for package, folder in package_dirs().items():
        assert (folder / "__init__.py").is_file(), f"{package}: no {folder}/__init__.py"


def test_no_import_cycle() -> None:
    found = cycles(import_graph(module_files()))
    assert found == [], "import cycles (every import counted, TYPE_CHECKING too): " + "; ".join(
        " <-> ".join(component) for component in found
    )


def test_no_product_module_imports_the_test_bed() -> None:
    graph = import_graph(module_files())
    found = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if not in_testbed(module)
        for target in targets
        if in_testbed(target)
    )
    assert found == [], "product modules importing the test bed: " + "; ".join(found)


def named_modules(file: Path, modules: Mapping[str, Path]) -> set[str]:
    """The modules of ``modules`` that a string constant of ``file`` names, as ``pkg.mod``
    or ``pkg.mod:attribute`` (an ``importlib`` import, an entry point, a command line)."""
    return {
        node.value.partition(":")[0]
        for node in ast.walk(ast.parse(file.read_text(), str(file)))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if node.value.partition(":")[0] in modules
    }


def test_no_product_module_names_the_test_bed_but_the_command_discovery() -> None:
    modules = module_files()
    found = sorted(
        f"{module} names {target}"
        for module, file in modules.items()
        if not in_testbed(module) and module != COMMAND_DISCOVERY
        for target in named_modules(file, modules)
        if in_testbed(target)
    )
    assert found == [], "product modules naming a test-bed module: " + "; ".join(found)
    discovery = named_modules(modules[COMMAND_DISCOVERY], modules)
    assert {target for target in discovery if in_testbed(target)} == {f"{TESTBED}.cli"}


def test_the_checks_see_an_import_and_a_named_module(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text('import x.y\nPATH = "x.y:f"\nDOC = "x.y does it"\n')
    modules = {"m": tmp_path / "m.py", "x": tmp_path / "x.py", "x.y": tmp_path / "y.py"}
    (tmp_path / "x.py").write_text("")
    (tmp_path / "y.py").write_text("")
    assert import_graph(modules)["m"] == {"x", "x.y"}
    assert named_modules(modules["m"], modules) == {"x.y"}


def test_the_checker_sees_cycles_hidden_under_type_checking(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import B\n")
    (tmp_path / "pkg" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"
    )
    (tmp_path / "pkg" / "c.py").write_text("def f():\n    from . import a\n")
    modules = {
        "pkg": tmp_path / "pkg" / "__init__.py",
        **{f"pkg.{m}": tmp_path / "pkg" / f"{m}.py" for m in "abc"},
    }
    graph = import_graph(modules)
    assert graph["pkg.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


@pytest.mark.parametrize("folder", ["policies", "backends"])
def test_a_bare_import_of_a_source_folder_is_refused(folder: str) -> None:
    """``policies/`` and ``backends/`` install as ``ftengine.policies`` / ``ftengine.backends``;
    from the repository root a bare ``import policies`` would load the same files a second
    time as unrelated modules, so it must fail, naming the right import."""
    bare = subprocess.run(
        [sys.executable, "-c", f"import {folder}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert bare.returncode != 0
    assert f"import ftengine.{folder} instead" in bare.stderr
    proper = subprocess.run(
        [sys.executable, "-c", f"import ftengine.{folder} as m; print(m.__name__)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert proper.stdout.strip() == f"ftengine.{folder}"


def test_no_module_of_this_session_is_loaded_under_a_source_folder_name() -> None:
    doubles = sorted(name for name in sys.modules if name.split(".")[0] in {"policies", "backends"})
    assert doubles == []
