"""Outcomes of the hostile-input fuzz suite (`test_fuzz_hostile.py`), counted per target.

Every input a fuzz target tries ends in one of two outcomes, or fails the test:
- `clear error`: a `UsageError` (a `CacheFullError` for cache calls that are legal but cannot be
  served now) whose message is one non-empty line naming the input;
- `accepted`: the call returned and the test's checks of the result held (nothing silently
  wrong, invariants hold).
Any other exception (a traceback), a crash, a state change after a rejected call or a changed
output file fails the test, so a passing run has zero of them. `conftest.py` prints the table at
the end of a pytest run; with `PENELOPE_FUZZ_SUMMARY=FILE` it also writes it as JSON.

Seeds are fixed, so one command tries the same inputs on every run. Hypothesis also draws
constants from the modules loaded, so the whole suite (`scripts/test.sh`, as CI) and this file
alone try slightly different inputs, each the same every time.
"""
from __future__ import annotations

import json
from collections import Counter

from penelope.errors import CacheFullError, UsageError

CLEAR_ERROR, ACCEPTED = "clear error", "accepted"
TALLY: Counter = Counter()


def attempt(target: str, call, names=(), errors=(UsageError,)):
    """Run `call()`: (ACCEPTED, its value) or (CLEAR_ERROR, the exception). Exceptions outside
    `errors` propagate (the test fails); a clear error's message must be one line containing
    every string of `names`."""
    try:
        value = call()
    except errors as err:
        check_message(str(err), names)
        TALLY[target, CLEAR_ERROR] += 1
        return CLEAR_ERROR, err
    TALLY[target, ACCEPTED] += 1
    return ACCEPTED, value


def count(target: str, outcome: str) -> None:
    """Count an outcome decided by the test itself (a CLI exit code)."""
    TALLY[target, outcome] += 1


def check_message(message: str, names=()) -> None:
    assert message and "\n" not in message and "Traceback" not in message, repr(message)
    for name in names:
        assert name in message, (name, message)


CACHE_ERRORS = (UsageError, CacheFullError)


def rows() -> list[tuple[str, int, int]]:
    """(target, clear errors, accepted) per target, in first-seen order."""
    targets = list(dict.fromkeys(target for target, _ in TALLY))
    return [(t, TALLY[t, CLEAR_ERROR], TALLY[t, ACCEPTED]) for t in targets]


def summary() -> str:
    """The table printed at the end of the run."""
    table = rows()
    errors = sum(r[1] for r in table)
    accepted = sum(r[2] for r in table)
    lines = [f"hostile-input fuzz: {errors + accepted:,} inputs tried: {errors:,} clear errors, {accepted:,} "
             "correctly accepted; 0 tracebacks, crashes, hangs, silent-wrong results, corruptions (any would "
             "have failed the run)"]
    width = max(len(r[0]) for r in table)
    lines.append(f"  {'target':<{width}}  {'inputs':>7}  {'clear error':>11}  {'accepted':>8}")
    for target, error, ok in table:
        lines.append(f"  {target:<{width}}  {error + ok:>7,}  {error:>11,}  {ok:>8,}")
    return "\n".join(lines)


def as_json() -> str:
    return json.dumps({"targets": [{"target": t, "clear_error": e, "accepted": a} for t, e, a in rows()],
                       "inputs": sum(e + a for _, e, a in rows())}, indent=2)
