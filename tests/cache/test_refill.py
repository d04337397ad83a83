"""How a request with holes is admitted under a chunk budget and request rows (penelope.cache.refill),
checked against a slow simulation of the chunks a scheduler would run."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from penelope.cache.refill import RefillPlan, next_chunk, plan_refill
from penelope.errors import UsageError

HOLES = [(128, 256), (384, 448)]  # resident [0,128), [256,384), [448,512); new tokens from 512


def test_no_holes_changes_nothing():
    assert plan_refill([], 512, 65, 128, 1, 64) == RefillPlan((), 512)


def test_holes_ride_when_they_and_a_page_of_new_tokens_fit_and_rows_suffice():
    plan = plan_refill(HOLES, 512, 65, 256, 3, 64)
    assert plan.phantoms == tuple(HOLES) and plan.compute_from == 512 and not plan.hole_first
    assert plan.phantom_tokens == 192
    # SGLang charges the request's own tokens in whole pages, one token included.
    assert plan_refill(HOLES, 512, 1, 256, 3, 64).phantoms == tuple(HOLES)
    assert plan_refill(HOLES, 512, 1, 255, 3, 64).hole_first
    assert plan_refill(HOLES, 512, 1, 193, 3, 1).phantoms == tuple(HOLES)


@pytest.mark.parametrize(("budget", "rows"), [(255, 3), (10_000, 2), (10_000, 1)])
def test_short_budget_or_rows_computes_the_holes_first(budget, rows):
    plan = plan_refill(HOLES, 512, 65, budget, rows, 64)
    assert plan.phantoms == () and plan.compute_from == 128 and plan.first_chunk_end == 256
    assert plan.spans == ((128, 256, False), (256, 384, True), (384, 448, False), (448, 512, True))


def test_without_chunked_prefill_holes_without_a_row_are_dropped():
    assert plan_refill(HOLES, 512, 65, None, 3, 64) == RefillPlan(tuple(HOLES), 512)
    assert plan_refill(HOLES, 512, 65, None, 2, 64) == RefillPlan((HOLES[0],), 384)
    assert plan_refill(HOLES, 512, 65, None, 1, 64) == RefillPlan((), 128)


def test_next_chunk_jumps_resident_spans_and_stops_at_hole_ends():
    plan = plan_refill(HOLES, 512, 65, 64, 3, 64)
    assert next_chunk(plan, 128) == (128, 256)
    assert next_chunk(plan, 192) == (192, 256)
    assert next_chunk(plan, 256) == (384, 448)
    assert next_chunk(plan, 448) == (512, None)
    assert next_chunk(plan, 512) == (512, None)


def test_bad_plans_are_refused():
    with pytest.raises(UsageError, match="ordered"):
        plan_refill([(256, 384), (128, 200)], 512, 1, 128, 1, 64)
    with pytest.raises(UsageError, match="ordered"):
        plan_refill([(128, 600)], 512, 1, 128, 1, 64)
    with pytest.raises(UsageError, match=">= 1"):
        plan_refill(HOLES, 512, 0, 128, 1, 64)


def computed_positions(holes, compute_from, total, budget, rows, page):
    """Slow model of a scheduler serving one request under `plan_refill`: phantoms compute their
    holes in the first step; the request computes chunks of at most `budget` page-aligned tokens
    (only the first step's budget is reduced by phantoms), each stopping where `next_chunk` says."""
    plan = plan_refill(holes, compute_from, total - compute_from, budget, rows, page)
    done = [p for a, b in plan.phantoms for p in range(a, b)]
    position, cap, steps = plan.compute_from, plan.first_chunk_end, 0
    first_budget = None if budget is None else budget - plan.phantom_tokens
    while position < total:
        room = (first_budget if steps == 0 else budget)
        room = total - position if room is None else room // page * page
        if cap is not None:
            room = min(room, cap - position)
        end = min(total, position + max(room, 0))
        assert end > position, "no progress"
        done.extend(range(position, end))
        steps += 1
        position, cap = next_chunk(plan, end) if plan.hole_first else (end, None)
    return sorted(done), steps


@st.composite
def requests(draw):
    page = draw(st.sampled_from([1, 16, 64]))
    blocks = draw(st.integers(2, 24))
    states = draw(st.lists(st.booleans(), min_size=blocks, max_size=blocks))  # True: resident
    states[-1] = True  # the last matched block is resident: holes lie before it
    holes, start = [], None
    for i, resident in enumerate(states):
        if not resident and start is None:
            start = i
        if resident and start is not None:
            holes.append((start * page * 4, i * page * 4))
            start = None
    compute_from = blocks * page * 4
    total = compute_from + draw(st.integers(1, 5 * page))
    budget = draw(st.one_of(st.none(), st.integers(1, 12).map(lambda k: k * page)))
    return holes, compute_from, total, budget, draw(st.integers(1, 4)), page


@settings(max_examples=300, deadline=None)
@given(requests())
def test_exactly_the_holes_and_the_new_tokens_are_computed(request):
    """Whatever the budget and rows: every hole position and every new position is computed once,
    no resident position ever is, and the request finishes."""
    holes, compute_from, total, budget, rows, page = request
    done, steps = computed_positions(holes, compute_from, total, budget, rows, page)
    plan = plan_refill(holes, compute_from, total - compute_from, budget, rows, page)
    if budget is None and len(holes) >= rows:
        # Without chunked prefill and rows, dropped holes recompute from the first of them.
        want = [p for a, b in holes[:rows - 1] for p in range(a, b)] + list(range(plan.compute_from, total))
    else:
        want = [p for a, b in holes for p in range(a, b)] + list(range(compute_from, total))
    assert done == sorted(want)
    assert len(set(done)) == len(done)


def test_without_phantoms_holes_are_computed_first_or_dropped():
    """Where the attention backend reads a batch's prefix before storing it, no phantom rides."""
    plan = plan_refill(HOLES, 512, 65, 10_000, 3, 64, phantoms=False)
    assert plan.phantoms == () and plan.hole_first and plan.compute_from == 128
    assert plan_refill(HOLES, 512, 65, None, 3, 64, phantoms=False) == RefillPlan((), 128)


def test_the_jumped_resident_tokens_of_a_hole_first_plan():
    """[256, 384) and [448, 512) are resident between the holes and the new tokens."""
    assert plan_refill(HOLES, 512, 65, 64, 3, 64).jumped_tokens == 128 + 64
    assert plan_refill(HOLES, 512, 65, 10_000, 3, 64).jumped_tokens == 0


def test_aligned_chunks_need_an_alignment_unit_of_own_tokens_beside_phantoms():
    """A scheduler that cuts chunks at multiples of 4096 (deterministic mode) computes none of the
    request's own tokens beside phantoms that leave less than 4096 of the budget: phantoms only when
    the request's whole extend fits beside them, or a whole unit of it does."""
    assert plan_refill(HOLES, 512, 65, 4096, 3, 64, own_chunk=4096).phantoms == tuple(HOLES)
    assert plan_refill(HOLES, 512, 5000, 4096, 3, 64, own_chunk=4096).hole_first
    assert plan_refill(HOLES, 512, 5000, 4096 + 192, 3, 64, own_chunk=4096).phantoms == tuple(HOLES)
