"""The book of waiting sessions (`penelope.cache.hints.WaitBook`), by hand: which arrival a finish
ends, what the book counts, and the expected remaining wait."""
import math

import numpy as np

from penelope.cache.hints import Hint, WaitBook


def seq(*blocks: int) -> np.ndarray:
    """Prefix hashes of a sequence: block i's hash is the running tuple hash of the ids so far."""
    out, h = [], 0
    for block in blocks:
        h = hash((h, block)) & (2**63 - 1)
        out.append(h)
    return np.asarray(out, dtype=np.uint64)


def finish(book, hashes, now, kind="tool"):
    return book.finished(hashes, Hint(now, "finished", kind))


def test_a_finish_ends_the_arrival_it_continues_or_that_continues_it():
    book = WaitBook()
    book.arrived(seq(1, 2, 3), 0.0)
    book.arrived(seq(7, 8), 0.0)
    # Prompt and reply at the finish: the arrival of the prompt ends.
    finish(book, seq(1, 2, 3, 4), 1.0)
    assert [len(h) for h in book.arrived_hashes] == [2]
    # Ended before its whole prompt was cached (an abort mid-prefill): its longer arrival ends.
    book.arrived(seq(5, 6, 9, 9), 1.0)
    finish(book, seq(5, 6), 2.0)
    assert [len(h) for h in book.arrived_hashes] == [2]
    # A finish of another sequence, or of no whole block, ends nobody's arrival.
    finish(book, seq(3), 3.0)
    finish(book, seq(), 3.0)
    assert book.in_system == 1
    finish(book, seq(7, 8), 4.0)
    assert book.counts() == {"observed_tool": 0, "observed_human": 0, "waiting_tool": 4, "waiting_human": 0,
                             "waiting_unknown": 0, "in_system": 0}


def test_the_next_turn_ends_a_wait_and_the_remaining_wait_follows_the_observed_ones():
    book = WaitBook()
    for i, wait in enumerate([2.0, 4.0, 6.0]):
        finish(book, seq(100 + i), 0.0)
        book.arrived(seq(100 + i, 1), wait)
    assert book.observed["tool"] == [2.0, 4.0, 6.0] and not book.waiting
    record = finish(book, seq(1), 10.0)
    book.advance(13.0)
    # Waited 3 s: of the waits seen, 4 and 6 s are longer; the median of those (6) less 3.
    assert book.expected_remaining(record) == 3.0
    book.advance(20.0)
    assert book.expected_remaining(record) == math.inf
