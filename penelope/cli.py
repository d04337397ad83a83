"""The `penelope` command line. Each subcommand is a module of `penelope.commands` with
`add_parser(subparsers)` and `run(args) -> int`; those modules import heavy packages (torch)
only inside `run`, so `penelope cost` stays quick.

Exit codes: 0 done, 1 a runtime fault (a failed check, a file that could not be written, no
memory), 2 bad input (one line `penelope: error: ...` naming the input), 130 interrupted (Ctrl-C,
one line), 143 terminated (SIGTERM, one line; it unwinds like Ctrl-C, so child processes are
stopped and temporary files removed). Exceptions of other kinds are bugs and keep their traceback."""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from penelope.commands.fields import as_flags, field_flags
from penelope.errors import Interrupted, PenelopeError, UsageError
from penelope.outputs import forget_new_folders, remove_new_empty_folders

# Subcommand name -> module in penelope.commands, in the order `--help` lists them.
COMMANDS = ("reproduce", "cost", "simulate", "analyze", "load", "ab", "calibrate", "verify")
EXIT_USAGE, EXIT_FAULT, EXIT_INTERRUPTED, EXIT_TERMINATED = 2, 1, 130, 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so it unwinds like Ctrl-C."""


def _raise_terminated(signum, frame):
    raise Terminated


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (its default prints the whole usage first, which for
    `simulate` is a dozen lines above the one that matters)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"penelope: error: {one_line(message)} (see {self.prog} --help)\n")


def one_line(message: object) -> str:
    """`message` without line breaks (a path or a value may hold one)."""
    return str(message).replace("\r", "\\r").replace("\n", "\\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="penelope",
        description="Position-aware KV-cache eviction for agentic LLM serving.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"penelope.commands.{name}").add_parser(subparsers)
    return parser


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


def check_no_empty_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """An argument given an empty text (`--trace ""`, `analyze ""`, a shell variable that was not
    set) is an error: no argument of any command takes one, and read as a path it would mean the
    current folder or a default."""
    for action in command_parser(parser, args.command)._actions:
        value = getattr(args, action.dest, None)
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, str) and not v.strip() for v in values):
            name = action.option_strings[-1] if action.option_strings else action.metavar or action.dest.upper()
            raise UsageError(f"{name}: empty value")


def main(argv: list[str] | None = None) -> int:
    """Run one command (`argv`: its arguments; None: this process's) and return its exit code."""
    return _run(argv, program=False)


def program() -> int:
    """The `penelope` program (its console script and `python -m penelope.cli`): `main`, except
    that once the command has ended on Ctrl-C or SIGTERM, further ones are ignored while the
    process exits. A service manager or a terminal signals the whole group, often more than once;
    Python restores the signals' default actions as it shuts down, so one arriving then would
    kill the process without its exit code (130 or 143) or its one line."""
    return _run(None, program=True)


def _run(argv: list[str] | None, program: bool) -> int:
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
    ending = _ignore_stop_signals if program and in_main_thread else (lambda: None)
    try:
        return _main(argv, ending)
    except Terminated:
        ending()
        _say("penelope: terminated")
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        terminated = _terminated_too()
        ending()
        _say(f"penelope: {'terminated' if terminated else 'interrupted'}")
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    finally:
        if previous is not None and signal.getsignal(signal.SIGTERM) is _raise_terminated:
            signal.signal(signal.SIGTERM, previous)


def _ignore_stop_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _main(argv: list[str] | None, ending: Callable[[], None]) -> int:
    """The command's exit code; `ending()` is called when it ends on a signal, before its line."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:
        # --help (0) or a bad option, already reported in one line (2).
        return done.code if isinstance(done.code, int) else EXIT_USAGE
    if args.command is None:
        # No command: the help, as the error it is (on stderr, like every other usage error).
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    module = importlib.import_module(f"penelope.commands.{args.command}")
    forget_new_folders()
    try:
        check_no_empty_values(parser, args)
        return int(module.run(args) or 0)
    except UsageError as err:
        # An output folder created before the input was refused goes again.
        remove_new_empty_folders()
        # The library names the fields of its set-ups; the user typed flags.
        flags = field_flags(command_parser(parser, args.command), **getattr(module, "FIELD_ARGUMENTS", {}))
        _say(f"penelope: error: {one_line(as_flags(str(err), flags))}")
        return EXIT_USAGE
    except Interrupted as err:
        # A command that saved its partial results on Ctrl-C (or SIGTERM) says what it kept.
        terminated = isinstance(err.__context__, Terminated) or _terminated_too()
        ending()
        if terminated:
            _say(f"penelope: {one_line(err).replace('interrupted', 'terminated', 1)}")
            return EXIT_TERMINATED
        _say(f"penelope: {one_line(err)}")
        return EXIT_INTERRUPTED
    except PenelopeError as err:
        # CacheFullError, InvariantError: the run failed, not the input.
        _say(f"penelope: error: {type(err).__name__}: {one_line(err)}")
        return EXIT_FAULT
    except BrokenPipeError:
        # `penelope ... | head`: the reader left; say nothing more on a closed pipe.
        _silence_stdout()
        return EXIT_FAULT
    except OSError as err:
        where = f"{err.filename}: " if err.filename else ""
        _say(f"penelope: error: {one_line(where + (err.strerror or str(err)))}")
        return EXIT_FAULT
    except MemoryError:
        _say("penelope: error: out of memory")
        return EXIT_FAULT


def _terminated_too() -> bool:
    """Whether a SIGTERM is pending beside the Ctrl-C being handled. Python runs the handlers of
    signals that arrived before it could handle either in signal-number order, SIGINT (2) before
    SIGTERM (15), whatever the order they were sent in: the termination then wins."""
    try:
        # Handlers of pending signals run here.
        time.sleep(0)
    except Terminated:
        return True
    except KeyboardInterrupt:
        pass
    return False


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _silence_stdout() -> None:
    # Python flushes stdout again at exit, which would raise on the closed pipe once more.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(program())
