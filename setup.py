"""Builds the compiled per-node loops of the cache's radix tree (`penelope/cache/_path_loops.c`);
everything else is configured in pyproject.toml. The extension is optional: where no C compiler
is found the install goes on, and the tree runs the same loops in Python (`path_loops.py`). The
build records the SHA-256 of the C source it compiled (`_path_loops.SOURCE_SHA256`), so a test
can tell a stale build (a later edit that failed to compile) from a current one."""
import hashlib
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "penelope/cache/_path_loops.c"
digest = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()

try:
    # The loops read numpy arrays through numpy's C API (pyproject.toml's build requirements).
    import numpy
except ImportError:
    numpy = None
    print("penelope: numpy is missing at build time; the cache tree will run its loops in Python")

setup(ext_modules=[Extension("penelope.cache._path_loops", [SOURCE], optional=True,
                             include_dirs=[numpy.get_include()],
                             define_macros=[("PATH_LOOPS_SOURCE_SHA256", f'"{digest}"')])] if numpy else [])
