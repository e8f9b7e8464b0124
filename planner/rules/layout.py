"""Rules of a layout on a model and a device count, whatever the software stack: each a named function that
returns the sentences of the rules it finds broken (empty: none), naming the numbers.

`pin_problems` runs the rules that pins can break on their own or together, before any layout is tried (a
whole layout pins every degree); `layout_problems` adds what only a whole layout can break. The model is
read through the captured graph's attributes only (heads, kv groups, experts, blocks, sequence, modules).
"""
from __future__ import annotations

from cost_models.layout import (MEGATRON_ORDER, Layout, MoeDispatcher, Recompute, RecomputeModule, Schedule,
                                 nested_modules)
from cost_models.layout_codec import ATTRIBUTES, CHOICES
from cost_models.pipeline import dualpipev_micro_batch_problem, most_chunks, partition_problem

from .pins import Pins, pins_of


def layout_problems(layout: Layout, graph, num_devices: int) -> list[str]:
    """Every validity rule the layout breaks: the rules of pins (a full layout pins every degree) and those
    only a whole layout can break."""
    problems = value_problems(layout)
    if problems:
        return problems
    problems = pin_problems(pins_of(layout), graph, num_devices, layout.global_batch)
    return problems + expert_folding(layout) + partition(layout, graph.num_blocks) + mesh_order(layout)


def value_problems(layout: Layout) -> list[str]:
    """Values no layout may have, whatever the model (a `Layout` built in Python is not parsed)."""
    problems = [f"{name}={getattr(layout, name)} is not a positive integer" for name in
                ("dp", "tp", "pp", "vp", "cp", "ep", "etp", "micro_batch", "global_batch")
                if isinstance(getattr(layout, name), bool) or not isinstance(getattr(layout, name), int)
                or getattr(layout, name) < 1]
    if layout.zero not in (0, 1, 2, 3) or isinstance(layout.zero, bool):
        problems.append(f"zero={layout.zero} is not a ZeRO stage 0-3")
    for key, kind in CHOICES.items():
        value = getattr(layout, ATTRIBUTES[key])
        if not isinstance(value, kind):
            problems.append(f"{key}={str(value)!r} is not one of {', '.join(kind.texts())}")
    if not isinstance(layout.dualpipev, bool):
        problems.append(f"dualpipev={layout.dualpipev!r} is not True or False")
    elif layout.dualpipev and (layout.vp != 2 or layout.pp < 2):
        problems.append(f"schedule=dualpipev with pp={layout.pp}, vp={layout.vp}: DualPipeV runs two chunks "
                        "per rank (vp=2) on pp > 1 ranks")
    return problems + _recompute_values(layout)


def _recompute_values(layout: Layout) -> list[str]:
    problems = []
    count = layout.recompute_layers
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        problems.append(f"recompute_layers={count!r} is not a whole number >= 1")
    elif count is not None and layout.layer_recompute is None and layout.recompute is not Recompute.full:
        problems.append(f"recompute_layers={count} with recompute={layout.recompute}: it says how many blocks of "
                        "each chunk recompute fully (Megatron --recompute-granularity full --recompute-method block)")
    modules = layout.recompute_modules
    if not isinstance(modules, tuple) or not modules or not all(isinstance(m, RecomputeModule) for m in modules):
        problems.append(f"recompute_modules={modules!r} is not a non-empty tuple of "
                        f"{', '.join(RecomputeModule.texts())}")
    return problems


def pin_problems(pins: Pins, graph, num_devices: int, global_batch: int) -> list[str]:
    """The rule each pin breaks on its own or with the other pins, before any layout is tried."""
    return (degrees_fill_devices(pins, num_devices) + heads_divide(pins, graph) + experts_divide(pins, graph)
            + virtual_stages(pins) + schedule_pins(pins, global_batch) + chunks_fill(pins, graph)
            + recompute_pins(pins, graph) + sequence_splits(pins, graph) + batch_divides(pins, global_batch))


def degrees_fill_devices(pins: Pins, num_devices: int) -> list[str]:
    degrees = {name: getattr(pins, name) for name in ("tp", "cp", "pp", "dp") if getattr(pins, name)}
    product = 1
    for value in degrees.values():
        product *= value
    named = "*".join(degrees)
    if len(degrees) == 4 and product != num_devices:
        return [f"the degrees multiply to {product:,} ({named}), not the {num_devices:,} devices"]
    if degrees and num_devices % product:
        return [f"the pinned {named} = {product:,} does not divide the {num_devices:,} devices"]
    return []


def heads_divide(pins: Pins, graph) -> list[str]:
    problems = []
    heads, groups = graph.attention_heads, graph.kv_groups
    if pins.tp and heads and heads % pins.tp:
        problems.append(f"tp={pins.tp} does not divide the {heads} attention heads")
    if pins.tp and groups and groups % pins.tp and pins.tp % groups:
        problems.append(f"tp={pins.tp} and the {groups} kv groups do not divide one another")
    return problems


def experts_divide(pins: Pins, graph) -> list[str]:
    problems = []
    experts = graph.num_experts
    if pins.ep and pins.ep > 1 and not experts:
        problems.append(f"ep={pins.ep} needs experts, and {graph.name} is a dense model")
    elif pins.ep and experts and experts % pins.ep:
        problems.append(f"ep={pins.ep} does not divide the {experts} experts")
    if pins.etp and pins.etp > 1 and not experts:
        problems.append(f"etp={pins.etp} needs experts, and {graph.name} is a dense model")
    # how routed tokens move: a pin that would do nothing on a dense model is refused, not dropped in silence
    if pins.dispatcher is not None and pins.dispatcher != MoeDispatcher.alltoall and not experts:
        problems.append(f"dispatcher={pins.dispatcher} moves routed tokens, and {graph.name} is a dense model")
    if pins.a2a_overlap and not experts:
        problems.append(f"a2a_overlap=true overlaps MoE all-to-alls, and {graph.name} is a dense model")
    if pins.etp and pins.tp and pins.etp > pins.tp:
        problems.append(f"etp={pins.etp} exceeds tp={pins.tp}")
    return problems


def virtual_stages(pins: Pins) -> list[str]:
    if pins.vp and pins.vp > 1 and pins.pp == 1:
        return [f"vp={pins.vp} needs pp > 1 (interleaving splits a pipeline rank's layers into chunks)"]
    return []


def schedule_pins(pins: Pins, global_batch: int) -> list[str]:
    if pins.schedule == Schedule.one_f_one_b and pins.vp and pins.vp > 1 or \
            pins.schedule == Schedule.interleaved and pins.vp == 1:
        return [f"schedule={pins.schedule} with vp={pins.vp}: 1f1b runs one chunk per rank, interleaved-1f1b more"]
    if pins.schedule != Schedule.dualpipev:
        return []
    problems = []
    if pins.pp == 1:
        problems.append("schedule=dualpipev needs pp > 1")
    if pins.vp and pins.vp != 2:
        problems.append(f"schedule=dualpipev with vp={pins.vp}: DualPipeV runs two chunks per rank (vp=2)")
    if pins.dp and pins.mbs and pins.pp and global_batch % (pins.dp * pins.mbs) == 0:
        problem = dualpipev_micro_batch_problem(global_batch // (pins.dp * pins.mbs), pins.pp)
        problems += [problem] if problem else []
    return problems


def chunks_fill(pins: Pins, graph) -> list[str]:
    chunks = (pins.pp or 1) * (pins.vp or 1)
    if chunks > most_chunks(graph.num_blocks):
        return [f"{graph.num_blocks} layers, the embedding and the loss cannot fill pp*vp = {chunks} chunks"]
    return []


def recompute_pins(pins: Pins, graph) -> list[str]:
    problems = []
    if pins.recompute_layers is not None and pins.recompute is not Recompute.full:
        problems.append(f"recompute_layers={pins.recompute_layers} needs recompute=full: it says how many blocks of "
                        "each chunk recompute fully (Megatron --recompute-granularity full --recompute-method block)")
    nested = nested_modules(pins.recompute_modules or ())
    if nested:
        problems.append(f"recompute_modules={'+'.join(str(m) for m in pins.recompute_modules)}: moe recomputes "
                        f"{' and '.join(map(str, nested))} with the rest of the MoE layer (name one of them)")
    absent = [str(m) for m in pins.recompute_modules or () if m not in graph.recompute_modules]
    if absent:
        problems.append(f"recompute_modules={'+'.join(absent)}: no block of {graph.name} has it (capture found "
                        f"{', '.join(map(str, graph.recompute_modules)) or 'none'})")
    return problems


def sequence_splits(pins: Pins, graph) -> list[str]:
    if pins.cp and pins.cp > 1 and graph.seq_len % (2 * pins.cp):
        return [f"the sequence {graph.seq_len} does not split into 2*cp = {2 * pins.cp} causal chunks"]
    return []


def batch_divides(pins: Pins, global_batch: int) -> list[str]:
    if pins.dp and global_batch % (pins.dp * (pins.mbs or 1)):
        return [f"global batch {global_batch} is not a multiple of dp*mbs = {pins.dp}*{pins.mbs or 1}"]
    if pins.dp and pins.mbs and pins.pp and pins.vp and pins.vp > 1 and pins.schedule != Schedule.dualpipev:
        micro = global_batch // (pins.dp * pins.mbs)
        if micro % pins.pp:
            return [f"interleaving needs {micro} micro-batches divisible by pp={pins.pp}"]
    elif pins.mbs and global_batch % pins.mbs:
        return [f"global batch {global_batch} is not a multiple of mbs={pins.mbs}"]
    return []


def expert_folding(layout: Layout) -> list[str]:
    """MoE parallel folding: expert layers use etp x ep over the ranks attention uses for dp x cp x tp."""
    folded = layout.dp * layout.cp * layout.tp
    if (layout.ep > 1 or layout.etp > 1) and folded % (layout.ep * layout.etp):
        return [f"ep*etp = {layout.ep * layout.etp} does not divide dp*cp*tp = {folded}"]
    return []


def partition(layout: Layout, num_blocks: int) -> list[str]:
    if layout.stage_layers is None:
        return []
    problem = partition_problem(layout.stage_layers, num_blocks, layout.pp * layout.vp)
    return [problem] if problem else []


def mesh_order(layout: Layout) -> list[str]:
    if layout.mesh_order and sorted(layout.mesh_order) != sorted(MEGATRON_ORDER):
        return [f"mesh order {layout.mesh_order} is not a permutation of {MEGATRON_ORDER}"]
    return []
