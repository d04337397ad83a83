"""Test-wide setup: without a GPU, Triton kernels run in the interpreter (set before any kernel
module imports triton). scripts/test.sh sets TRITON_INTERPRET=1 too; this makes a bare
`python -m pytest` behave the same."""
import os
import signal
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests send SIGINT to the commands they start, as a terminal's Ctrl-C would. A suite started in
# the background of a non-interactive shell inherits SIGINT ignored, and so would every command
# it starts (Python then installs no KeyboardInterrupt handler): give them the default back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def one_torch_thread():
    """Tiny model shapes on a shared 2-core machine: extra intra-op threads only add contention
    (the engine tests ran 4x slower with the default thread count)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def pytest_collection_modifyitems(items):
    """The long tests (marked `slow`) first, in their collected order: a parallel run hands them
    out before the short ones, so it does not end waiting on one of them."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_sessionfinish(session):
    """A parallel run's worker sends its fuzz counts to the controller (`pytest_testnodedown`)."""
    tally = sys.modules.get("fuzz_tally")
    output = getattr(session.config, "workeroutput", None)
    if output is not None and tally is not None and tally.TALLY:
        output["fuzz_tally"] = [[target, outcome, n] for (target, outcome), n in tally.TALLY.items()]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist, on the controller: add a finished worker's fuzz counts to the run's."""
    counts = getattr(node, "workeroutput", {}).get("fuzz_tally")
    if counts:
        import fuzz_tally

        for target, outcome, n in counts:
            fuzz_tally.TALLY[target, outcome] += n


def pytest_terminal_summary(terminalreporter, config):
    """The hostile-input fuzz suite's count of inputs and outcomes (see fuzz_tally.py), when it ran.
    A failed run prints it too, but then its counts are not the closing figures. In a parallel run
    the controller prints the workers' counts added up; the workers print nothing."""
    if hasattr(config, "workeroutput"):
        return
    tally = sys.modules.get("fuzz_tally")
    if tally is None or not tally.TALLY:
        return
    terminalreporter.write_sep("-", "hostile-input fuzz")
    terminalreporter.write_line(tally.summary())
    path = os.environ.get("PENELOPE_FUZZ_SUMMARY")
    if path:
        with open(path, "w") as handle:
            handle.write(tally.as_json() + "\n")
