"""Triton kernels of Penelope (imported as ``penelope.kernels``).

Each kernel lives in its own sub-package with ``kernel.py`` (Triton kernel and launcher) and
``naive.py`` (torch fp32 reference)."""
