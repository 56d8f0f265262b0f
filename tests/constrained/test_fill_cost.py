"""The slow-fill guard (``constrained/fill_cost.py``): a matcher fails only after ``fills`` slow
fills in a row; a fast one starts the count again; batch kinds are suspects while slow."""

from __future__ import annotations

from espalier.constrained.errors import GrammarCostError
from espalier.constrained.fill_cost import FillCosts


def test_only_slow_fills_in_a_row_fail_a_matcher() -> None:
    costs = FillCosts(slow_s=0.01, fills=3)
    slow, other = object(), object()
    assert costs.charge(slow, 0.02) is None
    assert costs.charge(slow, 0.02) is None
    assert costs.charge(slow, 0.005) is None  # a fast fill: the count starts again
    assert costs.charge(slow, 0.02) is None
    assert costs.charge(other, 0.5) is None  # another matcher's count is its own
    assert costs.charge(slow, 0.02) is None
    error = costs.charge(slow, 0.03)
    assert isinstance(error, GrammarCostError)
    assert error.fills == 3 and error.limit_s == 0.01 and error.seconds == 0.03
    assert costs.charge(slow, 0.02) is None  # counted from zero after its error


def test_keep_forgets_matchers_out_of_the_step() -> None:
    costs = FillCosts(slow_s=0.01, fills=2)
    a, b = object(), object()
    costs.charge(a, 0.02)
    costs.charge(b, 0.02)
    costs.keep([b])
    assert costs.charge(a, 0.02) is None  # a's run was forgotten
    assert isinstance(costs.charge(b, 0.02), GrammarCostError)


def test_a_batch_kind_is_a_suspect_while_its_calls_are_slow() -> None:
    costs = FillCosts(slow_s=0.01, fills=2)
    assert not costs.suspect("llg")
    costs.batch_took("llg", 0.05)
    assert costs.suspect("llg") and not costs.suspect("xgr")
    costs.batch_took("llg", 0.001)
    assert not costs.suspect("llg")
