"""Pipeline schedules: critical path and in-flight micro-batches per stage, and the partitions allowed."""
from __future__ import annotations

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
    slowest = max(stage_work_s)
    total = sum(stage_work_s)
    v = virtual_stages
    return (num_micro_batches - 1) * slowest + (total + (v - 1) * slowest) / v


def in_flight_micro_batches(stage: int, stages: int, num_micro_batches: int, virtual_stages: int = 1,
                            paired: bool = False) -> float:
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
    """
    v = virtual_stages
    if v > 1:
        chunks = 2 * (stages - stage - 1) + (v - 1) * stages + 1 + (1 if paired else 0)
        return min(float(num_micro_batches), chunks / v)
    base = stages - stage
    if paired and stages == 1:
        base += 1
    return min(float(num_micro_batches), float(base))


def p2p_transfers_on_critical_path(stages: int, virtual_stages: int) -> int:
    """Sends that fill and drain the pipeline: 2 (p - 1), and v times as many chunk hops interleaved."""
    if stages <= 1:
        return 0
    return 2 * (stages * virtual_stages - 1)
