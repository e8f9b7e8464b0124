"""The ranking measure (benchmarks/ranking.py): the planner orders a job's layouts as published sweeps measured."""
import pytest

from benchmarks.ranking import Sweep, Variant, published_sweeps


def test_agreement_and_regret_count_as_defined():
    """Three variants measured 1 < 2 < 3 s and predicted in the order b, a, c: of the three pairs only (a, b) is
    reversed; the variant predicted fastest (b) ran 2 s against the fastest's 1 s: regret +100%. A predicted
    tie agrees with neither order."""
    sweep = Sweep("s", "t", (Variant("a", 1.0, 2.0), Variant("b", 2.0, 1.0), Variant("c", 3.0, 3.0)))
    assert sweep.agreeing() == 2 and len(sweep.pairs) == 3
    assert sweep.top1_regret() == pytest.approx(1.0)
    assert Sweep("s", "t", (Variant("a", 1.0, 2.0), Variant("b", 2.0, 2.0))).agreeing() == 0


@pytest.mark.heavy
def test_published_sweeps_are_ordered_as_measured():
    """Never-fitted sweeps (benchmarks/sweeps.yaml: torchtitan's pipeline schedules, async TP and Float8 tables):
    each pair of variants is predicted in the order its source measured."""
    sweeps = published_sweeps()
    assert len(sweeps) >= 4
    for sweep in sweeps:
        assert sweep.agreeing() == len(sweep.pairs), sweep
