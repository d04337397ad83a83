"""Output files of the CLI: checked before any work starts, written whole or not at all.

`check_outputs` refuses, naming the option, an output path that is a folder, whose folder is
missing or not writable, that is one of the command's inputs (or would be read as one: a `.json`
inside a WEKA trace folder), that another output of the same command also names, or a plot whose
extension matplotlib cannot write. It runs before the workload is loaded, so a bad path costs
nothing and a long run is never lost to it.

`write_text` and `save_figure` write into a temporary file beside the target and rename it over
the target, so an interrupted or failed write leaves the old file as it was.
"""
from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

from penelope.errors import UsageError


def check_outputs(outputs: Mapping[str, str | None], inputs: Mapping[str, str | None] | None = None,
                  plots: Iterable[str] = ("--plot",)) -> None:
    """Check output paths before any work.

    outputs: option -> path (None: not asked for); options in `plots` are images.
    inputs: option -> path the command reads (a file or a folder; None: not given)."""
    given = {flag: path for flag, path in outputs.items() if path is not None}
    read = {flag: path for flag, path in (inputs or {}).items() if path is not None}
    seen: dict[str, str] = {}
    for flag, path in given.items():
        target = check_output(flag, path)
        for input_flag, input_path in read.items():
            _check_not_input(flag, path, target, input_flag, input_path)
        if target in seen:
            raise UsageError(f"{flag} {path} is the file {seen[target]} also writes")
        seen[target] = flag
        if flag in plots:
            check_plot_format(flag, path)


def check_output(flag: str, path: str) -> str:
    """Raise UsageError unless `path` can be written as a file; returns its resolved path."""
    if not str(path).strip():
        raise UsageError(f"{flag}: empty file name")
    if "\0" in str(path):
        raise UsageError(f"{flag} {path!r}: a file name cannot hold a NUL byte")
    if str(path).endswith(("/", os.sep)):
        raise UsageError(f"{flag} {path} names a folder; give a file name")
    target = os.path.realpath(path)
    if os.path.isdir(target):
        raise UsageError(f"{flag} {path} is a folder; give a file name")
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: folder {os.path.dirname(os.path.abspath(path)) or '.'} does not exist")
    exists = os.path.exists(target)
    if exists and not os.path.isfile(target):
        # A device or a pipe (/dev/null, /dev/stdout): written in place. A named pipe nobody
        # reads would block the write forever, after the whole run.
        if stat.S_ISFIFO(os.stat(target).st_mode):
            try:
                os.close(os.open(target, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                raise UsageError(f"{flag} {path} is a named pipe that no process reads") from None
        return target
    if not os.access(target if exists else folder, os.W_OK):
        raise UsageError(f"{flag} {path}: not writable")
    _probe(flag, path, target, folder)
    return target


def _probe(flag: str, path: str, target: str, folder: str) -> None:
    # os.access says yes to root everywhere; a file that cannot be created (a read-only or
    # virtual file system) shows only when we try. Appending nothing changes no byte or time.
    try:
        if os.path.exists(target):
            with open(target, "a"):
                pass
        else:
            probe = os.path.join(folder, f".{os.path.basename(target)}.{os.getpid()}.probe")
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            os.unlink(probe)
    except OSError as err:
        raise UsageError(f"{flag} {path}: cannot write there ({err.strerror})") from None


def _check_not_input(flag: str, path: str, target: str, input_flag: str, input_path: str) -> None:
    source = os.path.realpath(input_path)
    if target == source or (os.path.exists(target) and os.path.exists(source) and os.path.samefile(target, source)):
        raise UsageError(f"{flag} {path} is the input {input_flag} {input_path}; it would be overwritten")
    if (input_flag in ("--trace", "PATH") and os.path.isdir(source) and os.path.dirname(target) == source
            and target.endswith(".json")):
        raise UsageError(f"{flag} {path} is inside the trace folder {input_path}, where it would be read as a "
                         "trace; write it elsewhere")


MISSING_MATPLOTLIB = "plots need matplotlib: pip install 'penelope-kv[plot]'"


def plot_formats() -> tuple[str, ...]:
    """File extensions matplotlib can write (png, pdf, svg, ...)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise UsageError(MISSING_MATPLOTLIB) from None

    return tuple(sorted(FigureCanvasBase.get_supported_filetypes()))


def check_plot_format(flag: str, path: str) -> None:
    """Raise UsageError unless `path` ends in an extension matplotlib writes (it would otherwise
    add `.png` to a name without one and write a file under another name than the one asked)."""
    extension = Path(path).suffix.lower().lstrip(".")
    formats = plot_formats()
    if extension not in formats:
        what = f"extension .{extension}" if extension else "no extension"
        raise UsageError(f"{flag} {path}: {what}; use one of {', '.join('.' + f for f in formats)}")


# The folders check_folder created, deepest last: a command refused after creating its output
# folder removes them again while they are empty (remove_new_empty_folders).
_created: list[Path] = []


def check_folder(flag: str, path: str) -> Path:
    """An output folder: created when missing (with its parents); raises UsageError when `path` is
    a file or cannot be created or written."""
    folder = Path(path)
    try:
        if folder.exists() and not folder.is_dir():
            raise UsageError(f"{flag} {path} is a file, not a folder")
        missing = [p for p in (folder, *folder.absolute().parents) if not p.exists()]
        folder.mkdir(parents=True, exist_ok=True)
        _created.extend(reversed(missing))
    except OSError as err:
        raise UsageError(f"{flag} {path}: cannot create this folder ({err.strerror})") from None
    _probe(flag, path, os.path.join(os.path.realpath(folder), ".penelope"), os.path.realpath(folder))
    return folder


def forget_new_folders() -> None:
    """Start a command: folders created before it are not its own."""
    _created.clear()


def remove_new_empty_folders() -> None:
    """Remove the folders check_folder created that are still empty (a command refused its input
    after creating them), deepest first."""
    while _created:
        try:
            _created.pop().rmdir()
        except OSError:
            pass


def write_text(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file renamed over it (devices and pipes in place)."""
    target = os.path.realpath(path)
    if os.path.exists(target) and not os.path.isfile(target):
        try:
            with open(target, "w") as handle:
                handle.write(text)
        except OSError as err:
            raise OSError(err.errno, f"{path}: {err.strerror}") from None
        return
    _replace(target, lambda temporary: Path(temporary).write_text(text))


def save_figure(fig, path: str, **options) -> None:
    """`fig.savefig(path)` through a temporary file renamed over `path`."""
    target = os.path.realpath(path)
    extension = Path(target).suffix.lstrip(".").lower()
    _replace(target, lambda temporary: fig.savefig(temporary, format=extension, **options))


def _replace(target: str, write) -> None:
    temporary = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.{os.getpid()}.tmp")
    try:
        write(temporary)
        if os.path.exists(target):
            # Keep the permissions of the file being replaced.
            os.chmod(temporary, os.stat(target).st_mode & 0o7777)
        os.replace(temporary, target)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
