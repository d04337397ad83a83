"""Import Penelope from the working tree without installing it.

``pyproject.toml`` maps packages to folders (``penelope.kernels`` lives in ``kernels/``,
``penelope.integration`` in ``integration/``), so the repository root on ``sys.path`` is not enough.
An editable install (``pip install --no-deps --no-build-isolation --no-index -e .``) works offline
only where the interpreter already has setuptools >= 77 (the build backend; from setuptools 70.1
on it needs no ``wheel``), and what the GPU machine has is not known until it runs; this finder
reads the same mapping and imports each mapped package from its folder, needs nothing but the
standard library and changes nothing outside the process.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def package_dirs(pyproject: Path = REPO / "pyproject.toml") -> dict[str, Path]:
    """Package name -> folder, from ``[tool.setuptools] package-dir`` (paths relative to the root)."""
    import tomllib

    table = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"]
    return {name: (pyproject.parent / folder).resolve() for name, folder in table.items()}


class MappedPackages(importlib.abc.MetaPathFinder):
    """Finds the packages of a ``package-dir`` mapping in their folders; modules inside a package
    are found through the package's ``__path__`` as usual."""

    def __init__(self, mapping: dict[str, Path]):
        self.mapping = mapping

    def find_spec(self, fullname, path=None, target=None):
        folder = self.mapping.get(fullname)
        if folder is None or not (folder / "__init__.py").exists():
            return None
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def use_source_tree(pyproject: Path = REPO / "pyproject.toml") -> MappedPackages:
    """Put the working tree's packages first on the import path (before any installed copy)."""
    finder = MappedPackages(package_dirs(pyproject))
    sys.meta_path.insert(0, finder)
    return finder
