"""What a layout needs of the job it runs in: the rules the runtime checks on every rank before any collective."""
from __future__ import annotations

from cost_models.layout import Layout
from cost_models.pipeline import even_partition, most_chunks, partition_problem


def runtime_problems(layout: Layout, world_size: int, num_blocks: int) -> list[str]:
    """The layout against the ranks the job has and the model's layers, and what this runtime folds."""
    problems = []
    if layout.world_size != world_size:
        problems.append(f"dp*tp*pp*cp = {layout.dp}*{layout.tp}*{layout.pp}*{layout.cp} = {layout.world_size} but "
                        f"the job has {world_size} ranks")
    chunks = layout.pp * layout.vp
    if chunks > most_chunks(num_blocks):
        problems.append(f"{num_blocks} layers, the embedding and the loss do not split into pp*vp = {chunks} chunks")
    else:
        problem = partition_problem(layout.stage_layers or even_partition(num_blocks, chunks), num_blocks, chunks)
        if problem:
            problems.append(problem)
    if layout.etp not in (1, layout.tp):
        problems.append(f"etp={layout.etp} must be 1 or tp={layout.tp} in this runtime")
    if layout.ep > 1 and layout.dp % layout.ep:
        problems.append(f"ep={layout.ep} must divide dp={layout.dp}: this runtime folds experts over data-parallel "
                        "ranks")
    return problems
