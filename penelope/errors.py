"""Exceptions of the package. User-facing errors carry a one-line message."""


class PenelopeError(Exception):
    """Base class of every error Penelope raises on purpose."""


class UsageError(PenelopeError, ValueError):
    """Bad input from a user or a caller: the CLI prints it as one line and exits 2."""
