"""Pipeline schedules: critical path and in-flight micro-batches per stage, and the partitions allowed."""
from __future__ import annotations

from dataclasses import dataclass

# Megatron-Core's flexible layout (--pipeline-model-parallel-layout, or account_for_embedding/loss_in_
# pipeline_split) and torchtitan's module names per stage let a chunk hold no decoder layer beside the
# embedding (first chunk) or the loss (last chunk); the planner allows that, and no other empty chunk.
PLACED_BESIDE_LAYERS = 2      # the embedding and the loss count as one layer each


def most_chunks(num_blocks: int) -> int:
    """pp * vp chunks a model of `num_blocks` decoder layers can fill."""
    return num_blocks + PLACED_BESIDE_LAYERS


def least_blocks(chunk: int, chunks: int) -> int:
    """Decoder layers chunk `chunk` of `chunks` must hold: none beside the embedding or the loss, else one."""
    return 0 if chunk in (0, chunks - 1) else 1


def partition_problem(stage_layers: tuple[int, ...], num_blocks: int, chunks: int) -> str | None:
    """Why a per-chunk layer count is not a layout the runtimes take, or None."""
    if len(stage_layers) != chunks or sum(stage_layers) != num_blocks:
        return (f"stage layers {list(stage_layers)} do not split {num_blocks} layers into pp*vp = {chunks} "
                "chunks")
    empty = [j for j, n in enumerate(stage_layers) if n < least_blocks(j, chunks)]
    if empty:
        return (f"chunks {empty} of {list(stage_layers)} hold nothing: only the first chunk (beside the "
                "embedding) and the last (beside the loss) may hold no decoder layer (Megatron-Core's "
                "embedding/loss accounting, torchtitan's module names per stage)")
    return None


def even_partition(num_blocks: int, chunks: int) -> tuple[int, ...]:
    """Megatron's even split; with more chunks than layers, the embedding and the loss count as one layer
    each (account_for_embedding_in_pipeline_split, account_for_loss_in_pipeline_split)."""
    if chunks <= num_blocks:
        base, extra = divmod(num_blocks, chunks)
        return tuple(base + (1 if i < extra else 0) for i in range(chunks))
    base, extra = divmod(num_blocks + PLACED_BESIDE_LAYERS, chunks)
    counts = [base + (1 if i < extra else 0) for i in range(chunks)]
    counts[0] -= 1
    counts[-1] -= 1
    return tuple(counts)


def pipeline_seconds(stage_work_s: list[float], num_micro_batches: int, virtual_stages: int = 1) -> float:
    """Critical path of 1F1B / interleaved 1F1B over stages with per-micro-batch work W_i (F + B).

    1F1B (PipeDream-Flush): the first micro-batch fills every stage and the last drains them (sum of
    W_i), the other m-1 are paced by the slowest stage: (m-1) max W + sum W; uniform stages give
    (m + p - 1) W, a bubble of (p-1)/m (Narayanan et al. SC21). Interleaved with v chunks per rank
    shrinks the fill and drain v-fold: uniform stages give (m + (p-1)/v) W (SC21, Llama 3 section 3.3.2).
    """
    return pipeline_scaled(sum(stage_work_s), max(stage_work_s), num_micro_batches, virtual_stages) / virtual_stages


def pipeline_scaled(total_work, slowest_work, num_micro_batches: int, virtual_stages: int):
    """v times `pipeline_seconds`, of the stages' summed and slowest work: v (m - 1) max W + sum W + (v - 1) max W.
    Integer coefficients only, so that the partition solver states the same formula over its variables."""
    v = virtual_stages
    return v * (num_micro_batches - 1) * slowest_work + total_work + (v - 1) * slowest_work


def schedule_scale(layout) -> int:
    """What `pipeline_scaled` (v) or `dualpipev_scaled` (2) multiply the step by."""
    return 2 if layout.dualpipev else layout.vp


@dataclass(frozen=True)
class RankPasses:
    """One pipeline rank's work for one micro-batch through both its chunks (DualPipeV), in seconds."""
    paired_s: float     # forward and backward, each forward beside another micro-batch's backward (F&B)
    alone_s: float      # forward and backward run alone: their communication exposed (F + B)
    bubble_s: float     # A + B - kW: the alone work, the backward alone, less k times its weight part
                        # (its layers' `LayerCost.dualpipev_bubble_s`, k from `dualpipev_weight_factor`)


def dualpipev_weight_factor(weight_split_in_cooldown: bool) -> int:
    """W's coefficient in DualPipeV's bubble term: 3 where the cooldown splits the backward (torch's action
    list), 1 where it runs whole (MindSpeed without --dualpipev-dw-detach): replays in tests/test_dualpipev.py."""
    return 3 if weight_split_in_cooldown else 1


def dualpipev_split_recompute_factor(stages: int, weight_pass_recompute: bool) -> float:
    """The coefficient on a layer's split-pass recomputation (`LayerCost.dualpipev_split_recompute_s`) in the
    bubble term, whose (p - 1)/2 it multiplies: (2p - 1)/(p - 1), so that the step gains (2p - 1)/2 times a rank's
    recomputation per split weight pass. Rank 1 of torch's list splits p - 1 backwards of each of its chunks
    (rank 0 as many of its second; the first chunk's weight pass is one autograd.backward); the replay with that
    much more work in those passes gains 2p - 1 times one pass's extra as it grows past the slack the passes fill
    (tests/test_dualpipev.py). 0 where the stack's weight pass recomputes nothing more."""
    return (2 * stages - 1) / (stages - 1) if weight_pass_recompute and stages > 1 else 0.0


def dualpipev_least_micro_batches(stages: int) -> int:
    """Micro-batches DualPipeV needs: 2 p, one per chunk (torch's ScheduleDualPipeV refuses fewer)."""
    return 2 * stages


def dualpipev_micro_batch_problem(micro_batches: int, stages: int) -> str | None:
    """Why DualPipeV cannot run this many micro-batches on `stages` ranks, or None."""
    least = dualpipev_least_micro_batches(stages)
    if micro_batches >= least:
        return None
    return (f"schedule=dualpipev with {micro_batches} micro-batches: it needs at least 2 pp = {least} "
            "(torch ScheduleDualPipeV)")


def dualpipev_seconds(ranks: list[RankPasses], num_micro_batches: int) -> float:
    """Critical path of DualPipeV (torch ScheduleDualPipeV) over p ranks and m >= 2p micro-batches.

    In chunk units (half a rank's work), torch's action list run with each action waiting for its inputs
    gives T = (2m - p - 2) F&B + (p + 2)(F + B) + (p - 1)(F + 2B - 3W): 2m - p - 2 overlapped pairs per
    rank, the rest alone, and the bubble of DeepSeek's DualPipe table, (p - 1)(F&B + B - 3W) with F&B =
    F + B; a cooldown without the weight split (MindSpeed's default) gives - W for - 3W. Per rank (both
    chunks): (m - p/2 - 1) X + (p + 2)/2 A + (p - 1)/2 (A + B - 3W); uneven ranks take the slowest in each
    term (tests/test_dualpipev.py replays the action list).
    """
    paired = max(r.paired_s for r in ranks)
    alone = max(r.alone_s for r in ranks)
    bubble = max(0.0, max(r.bubble_s for r in ranks))
    return dualpipev_scaled(paired, alone, bubble, len(ranks), num_micro_batches) / 2


def dualpipev_scaled(paired, alone, bubble, stages: int, num_micro_batches: int):
    """2 times `dualpipev_seconds`, of the ranks' slowest X, A and bubble term: (2m - p - 2) max X + (p + 2) max A
    + (p - 1) max(A + B - kW, 0), in integer coefficients (the partition solver states it over its variables)."""
    p, m = stages, num_micro_batches
    return (2 * m - p - 2) * paired + (p + 2) * alone + (p - 1) * bubble


def dualpipev_in_flight(stages: int) -> float:
    """Micro-batches whose activations a DualPipeV rank holds at its peak, in units of its layers for one
    micro-batch: 2p + 1 chunk activations on every rank (torch's action list: 2p forwards before the first
    backward, one more while an overlapped pair runs; DualPipe's table: PP + 1)."""
    return (2 * stages + 1) / 2


def in_flight_micro_batches(stage: int, stages: int, num_micro_batches: int, virtual_stages: int = 1,
                            paired: bool = False, v_shape: bool = False) -> float:
    """Micro-batches whose activations a stage holds at its peak, in units of the stage's layers for one
    micro-batch.

    1F1B: stage i holds min(p - i, m) (design-notes). Interleaved with v chunks per rank: rank i runs
    2 (p - i - 1) + (v - 1) p chunk forwards before its first backward and one more before that backward
    (Megatron-Core get_pp_rank_microbatches with its default group of p micro-batches; torch's
    ScheduleInterleaved1F1B warms up alike), a chunk being 1/v of the stage: the first rank holds
    p + (p - 1)/v (Korthikanti et al. 2022's p (1 + (p-1)/(p v))), the last p - (p - 1)/v. Combined 1F1B
    (MoE all-to-all overlap, `paired`) runs one more forward before its first paired step: one more chunk
    interleaved (get_pp_rank_microbatches: num_warmup_microbatches + 1), and the next micro-batch's forward
    beside the last one's backward without a pipeline (combined_1f1b_schedule_for_no_pipelining).
    DualPipeV (`v_shape`): `dualpipev_in_flight`.
    """
    if v_shape:   # DualPipeV: the same on every rank
        return dualpipev_in_flight(stages)
    v = virtual_stages
    if v > 1:
        chunks = interleaved_warmup_forwards(stage, stages, v, paired) + 1
        return min(float(num_micro_batches), chunks / v)
    base = stages - stage
    if paired and stages == 1:
        base += 1
    return min(float(num_micro_batches), float(base))


def interleaved_warmup_forwards(stage: int, stages: int, virtual_stages: int, paired: bool = False) -> int:
    """Chunk forwards pipeline rank `stage` runs before its first backward, interleaved: 2 (p - i - 1) +
    (v - 1) p, one more under combined 1F1B (Megatron-Core schedules.py get_pp_rank_microbatches with its
    default group of p micro-batches)."""
    return 2 * (stages - stage - 1) + (virtual_stages - 1) * stages + (1 if paired else 0)


def combined_1f1b_paired_share(stages: int, virtual_stages: int, num_micro_batches: int) -> float:
    """Share of a rank's chunk forwards that combined 1F1B (MoE all-to-all overlap) runs beside another
    micro-batch's backward. Without a pipeline the first forward and the last backward run alone
    (combined_1f1b_schedule_for_no_pipelining); with one (interleaved: Megatron-Core pairs nothing else) a
    rank's warmup forwards and as many cooldown backwards run alone. Rank 0's count: it starts the first
    forward and ends the last backward, so its passes span the step."""
    passes = num_micro_batches * virtual_stages
    alone = 1 if stages == 1 else interleaved_warmup_forwards(0, stages, virtual_stages, paired=True)
    return max(0, passes - alone) / passes


def p2p_transfers_on_critical_path(stages: int, virtual_stages: int, v_shape: bool = False) -> int:
    """Sends that fill and drain the pipeline: 2 (p - 1), and v times as many chunk hops interleaved; a V
    (DualPipeV) passes its middle chunk to itself: 2 (2p - 2)."""
    if stages <= 1:
        return 0
    if v_shape:
        return 4 * (stages - 1)
    return 2 * (stages * virtual_stages - 1)
