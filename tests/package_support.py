"""The package's modules as pyproject.toml lists them: ``{module: file}`` read from the
``packages`` list and the ``package-dir`` mapping, so that import checks read the same files
an install would ship."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
ROOT_PACKAGE = "ftengine"
TESTBED = f"{ROOT_PACKAGE}.testbed"


def in_testbed(module: str) -> bool:
    """Whether ``module`` is the test bed or one of its modules."""
    return module == TESTBED or module.startswith(f"{TESTBED}.")


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """``{package: folder}`` for every package pyproject.toml lists."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped: dict[str, str] = setuptools.get("package-dir", {})
    found = {}
    for package in setuptools["packages"]:
        parts = package.split(".")
        for cut in range(len(parts), 0, -1):
            base = ".".join(parts[:cut])
            if base in mapped:
                found[package] = root / mapped[base] / Path(*parts[cut:])
                break
        else:
            found[package] = root / Path(*parts)
    return found


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """``{module: file}`` for every module of the listed packages (packages as ``__init__``)."""
    modules = {}
    for package, folder in package_dirs(root).items():
        for file in sorted(folder.glob("*.py")):
            name = package if file.stem == "__init__" else f"{package}.{file.stem}"
            modules[name] = file
    return modules
