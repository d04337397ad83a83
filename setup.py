"""Builds the compiled per-node loops of the cache's radix tree (`penelope/cache/_path_loops.c`);
everything else is configured in pyproject.toml. The extension is optional: where no C compiler
is found the install goes on, and the tree runs the same loops in Python (`path_loops.py`)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("penelope.cache._path_loops", ["penelope/cache/_path_loops.c"], optional=True)])
