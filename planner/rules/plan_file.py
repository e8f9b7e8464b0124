"""A plan file's records against each other: what a hand-edited plan must still agree on before it is
exported or run (each rule a named function returning the problems it finds)."""
from __future__ import annotations

import re

from cost_models.layout import Layout, Schedule
from hardware_profiles.stack import A2A_OVERLAP_DISPATCHER_RULE, A2A_OVERLAP_DISPATCHERS
from cost_models.pipeline import partition_problem

# a module's dotted name as torch names it (layers.3, model.embed_tokens): it goes into exported commands,
# so nothing that a shell or a flag parser could read otherwise ('--output=/tmp/x', 'a b', '$(...)')
MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")


def record_problems(record) -> list[str]:
    """The layout record on its own: virtual stages need a pipeline, the schedule follows vp, the batch splits."""
    problems = []
    if record.vp > 1 and record.pp == 1:
        problems.append(f"vp={record.vp} needs pp > 1")
    if record.schedule == Schedule.dualpipev:
        if record.vp != 2:
            problems.append(f"schedule dualpipev runs two chunks per rank, not vp={record.vp}")
    elif record.schedule != (Schedule.interleaved if record.vp > 1 else Schedule.one_f_one_b):
        problems.append(f"schedule {record.schedule} does not match vp={record.vp}")
    if record.gbs % (record.dp * record.mbs):
        problems.append(f"gbs={record.gbs} is not a multiple of dp*mbs = {record.dp * record.mbs}")
    folded = record.dp * record.cp * record.tp
    if (record.ep > 1 or record.etp > 1) and folded % (record.ep * record.etp):
        problems.append(f"ep*etp = {record.ep * record.etp} does not divide dp*cp*tp = {folded}")
    if record.etp > record.tp:
        problems.append(f"etp={record.etp} exceeds tp={record.tp}")
    if record.tp_comm_overlap and (record.tp == 1 or not record.sp):
        problems.append(f"tp_comm_overlap with tp={record.tp}{'' if record.sp else ' without sequence parallelism'}: "
                        "TP overlap's rings gather and scatter sequence-parallel activations (tp > 1, sp)")
    if record.offload_layers and (record.pp > 1 or record.recompute != "none" or record.moe_a2a_overlap):
        beside = [f"pp={record.pp}"] if record.pp > 1 else []
        beside += [f"recompute={record.recompute}"] if record.recompute != "none" else []
        beside += ["moe_a2a_overlap"] if record.moe_a2a_overlap else []
        problems.append(f"offload_layers={record.offload_layers} with {', '.join(beside)}: activation offloading runs "
                        "at pp=1 without recomputation or combined 1F1B (Megatron-Core's TransformerConfig)")
    if record.moe_a2a_overlap and record.moe_dispatcher not in A2A_OVERLAP_DISPATCHERS:
        problems.append(f"moe_a2a_overlap with the {record.moe_dispatcher} dispatcher: {A2A_OVERLAP_DISPATCHER_RULE}")
    return problems


def plan_problems(plan) -> list[str]:
    """The layout against the device count and nodes, and the stage records against the layout."""
    lay = plan.layout
    problems = []
    world = lay.dp * lay.tp * lay.pp * lay.cp
    if world != plan.num_devices:
        problems.append(f"layout dp*tp*pp*cp = {world} does not equal num_devices={plan.num_devices}")
    if len(plan.stages) != lay.pp * lay.vp:
        problems.append(f"{len(plan.stages)} stages where pp*vp = {lay.pp * lay.vp}")
    elif not problems:
        problems += stage_problems(plan)
    if plan.devices_per_node and plan.num_devices % plan.devices_per_node \
            and plan.devices_per_node % plan.num_devices:
        problems.append(f"num_devices={plan.num_devices} does not fill nodes of {plan.devices_per_node}")
    return problems


def stage_problems(plan) -> list[str]:
    """Stages in chunk order, each on the pipeline rank the schedule gives it, holding consecutive layers that
    together are every block once, in a split the runtimes take."""
    lay, stages = plan.layout, plan.stages
    problems = []
    placed = Layout(pp=lay.pp, vp=lay.vp, dualpipev=lay.schedule == Schedule.dualpipev)
    for j, stage in enumerate(stages):
        rank = placed.chunk_rank(j)
        if stage.index != j:
            problems.append(f"stage {j} is recorded as index {stage.index}")
        if stage.pipeline_rank != rank:
            problems.append(f"stage {j} runs on pipeline rank {rank} (pp={lay.pp}, {lay.schedule}), "
                            f"not {stage.pipeline_rank}")
        bad = [name for name in stage.modules if not MODULE_NAME.match(name)]
        if bad:
            problems.append(f"stage {j} names module {bad[0]!r}, which is not a dotted module name (layers.3)")
    layers = [b for stage in stages for b in stage.layers]
    if lay.offload_layers >= len(layers) > 0:
        problems.append(f"offload_layers={lay.offload_layers}: fewer than the plan's {len(layers)} layers are offloaded "
                        "(Megatron-Core's TransformerConfig)")
    if layers != list(range(len(layers))):
        problems.append("the stages' layers are not 0, 1, 2, ... in order, each once")
    else:
        problem = partition_problem(tuple(len(s.layers) for s in stages), len(layers), len(stages))
        problems += [problem] if problem else []
    return problems
