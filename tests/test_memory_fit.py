"""The integer memory check a leaf's module sets pass before their CP-SAT solve (planner/search/memory_fit.py):
its programme against every assignment of blocks to ranks, and its "no" against every split of a small model
that the step-time estimate's memory model fits."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.layout import Recompute, nested_modules
from planner.search.memory_fit import KindMemory, RankRoom, split_fits


def _every_assignment_fits(ranks: list[RankRoom]) -> bool:
    """Brute force: each rank takes any count of each kind; some choice places every block within every room."""
    counts = [kind.count for kind in ranks[0].kinds]
    per_rank = [list(itertools.product(*(range(n + 1) for n in counts))) for _ in ranks]
    for choice in itertools.product(*per_rank):
        if any(sum(taken[k] for taken in choice) != counts[k] for k in range(len(counts))):
            continue
        if all(sum(n * kind.block for n, kind in zip(taken, rank.kinds))
               + max((kind.working for n, kind in zip(taken, rank.kinds) if n), default=0) <= rank.room
               for taken, rank in zip(choice, ranks)):
            return True
    return False


@st.composite
def _questions(draw):
    counts = draw(st.lists(st.integers(0, 3), min_size=1, max_size=3))
    counts[-1] = max(counts[-1], max(counts))   # the most numerous kind last, as fits_some_split orders them
    ranks = []
    for _ in range(draw(st.integers(1, 3))):
        kinds = tuple(KindMemory(n, draw(st.integers(1, 9)), draw(st.integers(0, 6))) for n in counts)
        ranks.append(RankRoom(kinds, draw(st.integers(-2, 40))))
    return ranks


@settings(max_examples=300, deadline=None)
@given(_questions())
def test_the_programme_answers_what_every_assignment_of_blocks_answers(ranks):
    assert split_fits(ranks) == _every_assignment_fits(ranks)


def test_a_question_it_cannot_settle_is_left_to_the_solver():
    """Past MOST_STATES states, or with a block that takes no room, the check answers "may fit" (True), never a
    refusal it has not proven; a rank whose fixed part alone overflows refuses even an empty split."""
    from planner.search.memory_fit import MOST_STATES
    many = tuple(KindMemory(MOST_STATES, 1, 0) for _ in range(2))
    assert split_fits([RankRoom(many, 0)])                       # 65 states past 64: not settled here
    assert split_fits([RankRoom((KindMemory(3, 0, 0),), 0)])     # a block of no bytes
    assert not split_fits([RankRoom((KindMemory(0, 5, 0),), -1)])
    assert split_fits([RankRoom((KindMemory(0, 5, 0),), 0)])
    assert split_fits([RankRoom((), 0)]) and not split_fits([RankRoom((), 0), RankRoom((), -1)])   # no blocks


def _splits(blocks: int, chunks: int):
    """Every split of the blocks into contiguous chunks that `cost_models.pipeline` allows."""
    from cost_models.pipeline import least_blocks
    for sizes in itertools.product(range(blocks + 1), repeat=chunks):
        if sum(sizes) == blocks and all(n >= least_blocks(j, chunks) for j, n in enumerate(sizes)):
            yield sizes


@pytest.mark.parametrize("pp,vp,dp,ep", [(2, 1, 16, 2), (2, 2, 8, 4), (4, 1, 8, 8)])
def test_a_module_set_refused_has_no_split_that_the_estimate_fits(pp, vp, dp, ep):
    """The mixed dense/MoE model, every block recomputing one module set selectively, at memory sizes from
    roomy to tight: wherever the check says no split fits, none of the splits enumerated fits by
    `estimate(...).fits` (cost_models.memory, not the partition model's sums); it says no at some size, and a
    split fits at some other."""
    from cost_models.layer_costs import MeshCosts
    from cost_models.step_time import estimate
    from planner.search.memory_fit import fits_some_split
    from tests.test_recompute_modules import _mixed_moe_leaf

    stack, model, choices, base, squeezed = _mixed_moe_leaf(pp, vp, dp, ep)
    sets = [subset for size in range(1, len(choices) + 1) for subset in itertools.combinations(choices, size)
            if not nested_modules(subset)]
    blocks = len(model.blocks)
    splits = list(_splits(blocks, pp * vp))
    refused = fitted = 0
    for share in (1.2, 0.9, 0.7, 0.5):
        cluster = squeezed(share)
        for subset in sets[::2]:
            layout = replace(base, recompute_modules=subset)
            says = fits_some_split(MeshCosts(model, cluster, layout, stack), Recompute.selective)
            fits = any(estimate(model, cluster, replace(layout, stage_layers=split,
                                                        layer_recompute=(Recompute.selective,) * blocks), stack).fits
                       for split in splits)
            assert says or not fits, (share, subset)
            refused += not says
            fitted += fits
    assert refused and fitted
