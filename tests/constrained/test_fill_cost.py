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


def test_a_batch_kind_is_a_suspect_while_its_calls_are_slow() -> None:
    costs = FillCosts(slow_s=0.01, debt_s=0.05)
    assert not costs.suspect("llg")
    costs.batch_took("llg", 0.05)
    assert costs.suspect("llg") and not costs.suspect("xgr")
    costs.batch_took("llg", 0.001)
    assert not costs.suspect("llg")
