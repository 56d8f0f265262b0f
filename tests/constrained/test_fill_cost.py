"""The slow-fill guard (``constrained/fill_cost.py``): a matcher fails once its slow fills' time
past the limit (halved at each fast fill) passes the debt limit; batch kinds are suspects while
slow."""

from __future__ import annotations

from espalier.constrained.errors import GrammarCostError
from espalier.constrained.fill_cost import FillCosts


def test_slow_fills_add_debt_and_fast_ones_halve_it() -> None:
    costs = FillCosts(slow_s=0.01, debt_s=0.1)
    slow, other = object(), object()
    assert costs.charge(slow, 0.05) is None  # debt 0.04
    assert costs.charge(slow, 0.05) is None  # 0.08
    assert costs.charge(slow, 0.005) is None  # a fast fill: 0.04
    assert costs.charge(other, 0.1) is None  # another matcher's debt is its own (0.09)
    assert costs.charge(slow, 0.05) is None  # 0.08
    error = costs.charge(slow, 0.04)  # 0.11
    assert isinstance(error, GrammarCostError)
    assert error.limit_s == 0.01 and error.seconds == 0.04 and abs(error.debt_s - 0.11) < 1e-9
    assert costs.charge(slow, 0.05) is None  # counted from zero after its error


def test_one_fill_far_over_the_limit_ends_at_once() -> None:
    costs = FillCosts(slow_s=0.05, debt_s=1.0)
    assert isinstance(costs.charge(object(), 2.1), GrammarCostError)


def test_keep_forgets_matchers_out_of_the_step() -> None:
    costs = FillCosts(slow_s=0.01, debt_s=0.05)
    a, b = object(), object()
    costs.charge(a, 0.04)
    costs.charge(b, 0.04)
    costs.keep([b])
    assert costs.charge(a, 0.04) is None  # a's debt was forgotten
    assert isinstance(costs.charge(b, 0.04), GrammarCostError)


def test_a_limit_bounds_only_matchers_with_a_debt() -> None:
    """A matcher's limit is when its next fill would fail it anyway; past it the fill is
    abandoned, and the error says the mask was still running."""
    costs = FillCosts(slow_s=0.05, debt_s=1.0)
    fresh, slow = object(), object()
    assert not costs.watching and costs.limit(fresh) is None
    assert costs.charge(slow, 0.45) is None  # debt 0.4
    assert costs.watching and costs.limit(fresh) is None
    limit = costs.limit(slow)
    assert limit is not None and abs(limit - 0.65) < 1e-9  # 0.05 + 1.0 - 0.4
    assert costs.charge(slow, limit - 1e-6) is None  # just under it: still charged, no error
    assert isinstance(costs.charge(slow, 0.05 + 1.0), GrammarCostError)  # over any limit
    assert costs.charge(slow, 0.45) is None
    tree_limit = costs.limit(slow, budget_s=0.01)  # a tree's time is charged past its budget
    assert tree_limit is not None and abs(tree_limit - 0.66) < 1e-9
    error = costs.abandoned(slow, 0.7)
    assert isinstance(error, GrammarCostError) and "still running after 700 ms" in str(error)
    assert abs(error.debt_s - 1.05) < 1e-9
    assert costs.limit(slow) is None  # its request ends: its debt is gone


def test_a_batch_kind_is_a_suspect_while_its_calls_are_slow() -> None:
    costs = FillCosts(slow_s=0.01, debt_s=0.05)
    assert not costs.suspect("llg")
    costs.batch_took("llg", 0.05)
    assert costs.suspect("llg") and not costs.suspect("xgr")
    costs.batch_took("llg", 0.001)
    assert not costs.suspect("llg")
