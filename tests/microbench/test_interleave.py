"""Interleaved comparisons (microbench/interleave.py): balanced orders and the median's interval,
checked against direct counts and the binomial distribution."""

import importlib.util
import itertools
import math
import random
from collections import Counter
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "microbench" / "interleave.py"
_spec = importlib.util.spec_from_file_location("microbench_interleave", PATH)
interleave = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(interleave)


@pytest.mark.parametrize("n", range(1, 9))
def test_every_name_follows_every_other_equally_often(n):
    names = [f"c{i}" for i in range(n)]
    orders = interleave.balanced_orders(names)
    assert len(orders) == (2 * n if n % 2 and n > 1 else n)
    assert all(sorted(order) == names for order in orders)
    follows = Counter((a, b) for order in orders for a, b in itertools.pairwise(order))
    pairs = list(itertools.permutations(names, 2))
    assert set(follows) == set(pairs)
    assert len(set(follows[p] for p in pairs)) <= 1
    # Every name also takes every position equally often.
    for position in range(n):
        assert len(set(Counter(order[position] for order in orders).values())) == 1


def test_a_rotated_fixed_order_is_not_balanced():
    """The check above can fail: rotations of one order give each name one predecessor only."""
    names = ["a", "b", "c", "d", "e"]
    rotations = [names[i:] + names[:i] for i in range(len(names))]
    follows = Counter((a, b) for order in rotations for a, b in itertools.pairwise(order))
    assert set(follows) != set(itertools.permutations(names, 2))


def test_balanced_orders_refuse_repeated_names():
    with pytest.raises(ValueError, match="distinct"):
        interleave.balanced_orders(["a", "b", "a"])
    assert interleave.balanced_orders([]) == []
    assert interleave.balanced_orders(["a"]) == [["a"]]


def test_the_scrub_writes_its_whole_buffer():
    scrub = interleave.Scrub(1 << 20)
    scrub()
    scrub()
    assert scrub._buffer.nbytes == 1 << 20 and (scrub._buffer == 2).all()


def _coverage(n: int, j: int) -> float:
    """P(x_(j) <= median <= x_(n+1-j)) = P(j <= Binomial(n, 1/2) <= n - j), summed directly."""
    return sum(math.comb(n, k) for k in range(j, n - j + 1)) / 2 ** n


@pytest.mark.parametrize("n", [6, 7, 10, 20, 21, 40, 101])
def test_the_median_interval_is_the_narrowest_one_with_its_coverage(n):
    values = list(range(100, 100 + n))
    random.Random(n).shuffle(values)
    median, low, high = interleave.median_interval(values)
    assert median == (sorted(values)[(n - 1) // 2] + sorted(values)[n // 2]) / 2
    j = int(low) - 100 + 1  # 1-based rank of the low end
    assert int(high) - 100 + 1 == n + 1 - j
    assert _coverage(n, j) >= 0.95
    assert _coverage(n, j + 1) < 0.95


def test_the_median_interval_against_the_published_ranks():
    """Published ranks of the 95% interval of a median: n = 20 -> 6th and 15th values;
    n = 10 -> 2nd and 9th."""
    assert interleave.median_interval(range(1, 21))[1:] == (6, 15)
    assert interleave.median_interval(range(1, 11))[1:] == (2, 9)


def test_few_values_give_the_whole_range_and_bad_input_is_refused():
    assert interleave.median_interval([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert interleave.median_interval([5.0]) == (5.0, 5.0, 5.0)
    with pytest.raises(ValueError, match="at least one"):
        interleave.median_interval([])
    with pytest.raises(ValueError, match="confidence"):
        interleave.median_interval([1.0, 2.0], confidence=1.0)
    with pytest.raises(ValueError, match="NaN"):
        interleave.median_interval([1.0, float("nan"), 2.0])
