"""Exceptions of the package. User-facing errors carry a one-line message."""


class PenelopeError(Exception):
    """Base class of every error Penelope raises on purpose."""


class UsageError(PenelopeError, ValueError):
    """Bad input from a user or a caller: the CLI prints it as one line and exits 2."""


class CacheFullError(PenelopeError):
    """The KV cache cannot free enough slots now: what is left is protected by running requests."""


class InvariantError(PenelopeError, AssertionError):
    """An internal consistency check of a data structure failed: a bug, never bad input."""


class Interrupted(PenelopeError):
    """Ctrl-C during a command that kept what it had finished: the CLI prints this one line and exits 130."""
