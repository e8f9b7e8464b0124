"""Whether any split of a leaf's blocks over its pipeline ranks can fit the device when every block recomputes
one way: the integer question the partition model's memory rows ask (`partition_model.PartitionModel.add_memory`,
in its units), without the order the blocks keep, the least blocks a chunk holds and the gradient peak. Dropping
constraints only widens what fits, so "no" is a proof that the leaf's model is infeasible, and its CP-SAT solve
need not be built.

It decides what `bounds.Bounds.memory_floor` leaves open: that floor weighs the ranks by a fractional split
and so lets a rank hold 3.8 blocks, where ranks hold 3 or 4. DeepSeek-V3 on 2,048 H800 at pp16 x vp3: of one
leaf's 37 module sets, 30 passed the floor and were then proven infeasible one solve each.

Ranks are independent given their block counts per kind, so a dynamic programme over the ranks, its state the
blocks placed of each kind but the most numerous, finds the most of that kind the others leave room for.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models.layer_costs import MeshCosts
from cost_models.layout import Recompute
from cost_models.memory import gradients_held_at_peak, logits_bytes, loss_gradient_bytes, usable_bytes
from cost_models.pipeline import in_flight_micro_batches
from cost_models.stage_terms import LayerTerms, TermContext

MEMORY_UNIT_BYTES = 1024    # the partition model's memory unit, 1 KiB
# past this many states the question is left to CP-SAT (a model of many kinds of many blocks each)
MOST_STATES = 64


def m(nbytes: float) -> int:
    """Bytes in the model's memory units, rounded as it rounds them."""
    return int(round(nbytes / MEMORY_UNIT_BYTES))


def block_units(base: LayerTerms, held: bool, flight: float) -> int:
    """A block's memory units at its rank's activation peak without recomputation: its states there and the
    activations of its micro-batches in flight."""
    return m(base.peak_state_bytes(held) + flight * base.activation_bytes)


def recompute_units(base: LayerTerms, more: LayerTerms, flight: float) -> int:
    """What recomputing a block (`more`, its terms under the method) changes of its units at the peak."""
    return m(flight * (more.activation_bytes - base.activation_bytes))


def rank_flight(costs: MeshCosts, rank: int) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at its peak."""
    lay = costs.layout
    return in_flight_micro_batches(rank, lay.pp, lay.num_micro_batches, lay.vp, costs.stack.hides_moe_a2a(lay),
                                   lay.dualpipev)


def rank_fixed_bytes(costs: MeshCosts, rank: int, flight: float, held: bool) -> float:
    """What rank `rank` holds at its activation peak whatever its blocks: the embedding on the first rank, the
    output layer and its fp32 logits and loss gradient on the last chunk's rank, and the communication buffers."""
    lay, model, context = costs.layout, costs.model, TermContext.of(costs)
    last = rank == lay.chunk_rank(lay.pp * lay.vp - 1)
    total = costs.comm_buffer_bytes
    for layer, on in ((model.embedding, rank == 0), (model.head, last)):
        if on:
            terms = LayerTerms.of(costs.layer(layer), Recompute.none, context)
            total += terms.peak_state_bytes(held) + flight * terms.activation_bytes
    if last:
        loss = costs.stack.loss_gradient
        total += logits_bytes(model.head, lay.tp, lay.cp, lay.micro_batch, loss) + loss_gradient_bytes(
            model.head, lay.tp, lay.cp, lay.micro_batch, loss)
    return total


@dataclass(frozen=True)
class KindMemory:
    """One kind of block on one rank, in memory units: each block's bytes at the peak, its recomputed working set."""
    count: int         # blocks of the kind in the model
    block: int
    working: int


def fits_some_split(costs: MeshCosts, method: Recompute) -> bool:
    """False only where no split of the blocks, each recomputing by `method`, fits every rank; True where one
    may (or the question has too many states to settle here)."""
    held = gradients_held_at_peak(costs.stack.gradient_buffer_in(costs.layout), costs.layout.num_micro_batches)
    context, capacity = TermContext.of(costs), m(usable_bytes(costs.cluster.device))
    counts: dict[str, int] = {}
    for name in costs.model.blocks:
        counts[name] = counts.get(name, 0) + 1
    names = sorted(counts, key=lambda name: (counts[name], name))   # the most numerous kind last
    layers = {name: costs.layer(costs.model.kind(name)) for name in names}
    ranks = []
    for rank in range(costs.layout.pp):
        flight = rank_flight(costs, rank)
        ranks.append(RankRoom(tuple(_kind_memory(layers[name], counts[name], method, context, held, flight)
                                    for name in names),
                              capacity - m(rank_fixed_bytes(costs, rank, flight, held))))
    return split_fits(ranks)


@dataclass(frozen=True)
class RankRoom:
    """One rank's question: its kinds (the model's, in one order on every rank, the most numerous last) and the
    memory units its blocks may fill."""
    kinds: tuple[KindMemory, ...]
    room: int


def split_fits(ranks: list[RankRoom]) -> bool:
    """Whether whole blocks of every kind can be spread over the ranks, each within its room; True where the
    programme would have more than MOST_STATES states, or a block takes no room (not this question)."""
    counts = [kind.count for kind in ranks[0].kinds]
    if not counts:   # no blocks: each rank holds its fixed part alone
        return all(rank.room >= 0 for rank in ranks)
    if math.prod(n + 1 for n in counts[:-1]) > MOST_STATES or any(
            kind.block <= 0 for rank in ranks for kind in rank.kinds):
        return True
    states: dict[tuple[int, ...], int] = {(0,) * (len(counts) - 1): 0}
    for rank in ranks:
        states = _place_on_rank(states, list(rank.kinds), rank.room)
        if not states:
            return False
    return states.get(tuple(counts[:-1]), -1) >= counts[-1]


def _kind_memory(layer, count: int, method: Recompute, context: TermContext, held: bool, flight: float) -> KindMemory:
    """As the partition model sums it: the block without recomputation, plus the method's change to its
    activations, each rounded; the working set only where the method recomputes."""
    base = LayerTerms.of(layer, Recompute.none, context)
    block = block_units(base, held, flight)
    working = 0
    if method is not Recompute.none:
        block += recompute_units(base, LayerTerms.of(layer, method, context), flight)
        working = m(layer.working_bytes)
    return KindMemory(count, block, working)


def _place_on_rank(states: dict[tuple[int, ...], int], kinds: list[KindMemory], room: int
                   ) -> dict[tuple[int, ...], int]:
    """The states after one more rank: for each way of adding blocks of the kinds but the last, the most blocks
    of the last kind that fit beside them (a rank's working set is the largest of its kinds')."""
    *others, last = kinds
    after: dict[tuple[int, ...], int] = {}
    for placed, most_last in states.items():
        for added in _additions(placed, others):
            used = sum(n * kind.block for n, kind in zip(added, others))
            working = max((kind.working for n, kind in zip(added, others) if n), default=0)
            if used + working > room:
                continue
            with_last = room - used - max(working, last.working)
            fit = min(with_last // last.block, last.count - most_last) if with_last >= last.block > 0 else 0
            key = tuple(p + n for p, n in zip(placed, added))
            after[key] = max(after.get(key, -1), most_last + fit)
    return after


def _additions(placed: tuple[int, ...], others: list[KindMemory]):
    """Every vector of blocks one rank may add of each kind but the last, within what is left of it."""
    vectors: list[tuple[int, ...]] = [()]
    for p, kind in zip(placed, others):
        vectors = [vector + (n,) for vector in vectors for n in range(kind.count - p + 1)]
    return vectors
