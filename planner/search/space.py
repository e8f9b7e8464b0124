"""The layout space: the enumeration of candidate degrees, schedules and placements that the pins allow
(the rules a layout must keep are the rulebook's, `planner/rules/`)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models.layout import MEGATRON_ORDER, Layout, Schedule
from cost_models.layout_codec import layout_from
from cost_models.pipeline import dualpipev_least_micro_batches, most_chunks

from ..graph_capture.graph import ModelGraph
from ..rules.pins import Pins


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass(frozen=True)
class MeshShape:
    """The four degrees that multiply to the device count."""
    tp: int
    cp: int
    pp: int
    dp: int


def mesh_shapes(graph: ModelGraph, num_devices: int, global_batch: int, pins: Pins,
                fast_domain: int) -> list[MeshShape]:
    """Every valid tp x cp x pp x dp = devices that the pins allow."""
    out = []
    heads, groups = graph.attention_heads or 1, graph.kv_groups
    # tp stays inside the fast domain unless the user pins it (design-notes: TP inside NVLink/HCCS)
    tps = [t for t in divisors(num_devices) if heads % t == 0 and pins.allows("tp", t)
           and (t <= max(fast_domain, 1) or pins.tp == t) and not (groups and groups % t and t % groups)]
    for tp in tps:
        for cp in (c for c in divisors(num_devices // tp) if pins.allows("cp", c)):
            if cp > 1 and graph.seq_len % (2 * cp):
                continue
            for pp in (p for p in divisors(num_devices // (tp * cp)) if p <= most_chunks(graph.num_blocks)
                       and pins.allows("pp", p) and pins.allows_chunks(graph.num_blocks, p)):
                dp = num_devices // (tp * cp * pp)
                if pins.allows("dp", dp) and global_batch % dp == 0:
                    out.append(MeshShape(tp, cp, pp, dp))
    return out


@dataclass(frozen=True)
class ScheduleChoice:
    vp: int
    micro_batch: int
    dualpipev: bool = False


def schedule_choices(graph: ModelGraph, shape: MeshShape, global_batch: int, pins: Pins) -> list[ScheduleChoice]:
    """Virtual stages, micro-batch size and schedule: interleaving needs micro-batches divisible by pp.
    Virtual stages go up to 8, and beyond where they split the layers evenly (NeMo runs use up to 24).
    DualPipeV (vp = 2 as a V) where the stack runs it, with at least 2 pp micro-batches."""
    out = []
    blocks = graph.num_blocks
    # a chunk may hold just the embedding or the loss beside its layers (Megatron-Core, torchtitan)
    vps = [v for v in range(1, most_chunks(blocks) // shape.pp + 1)
           if (v <= 8 or blocks % (shape.pp * v) == 0 or most_chunks(blocks) % (shape.pp * v) == 0)
           and pins.allows_chunks(blocks, shape.pp * v)]   # the stack's even split
    interleaved = pins.interleaved_schedule and pins.schedule in (None, Schedule.interleaved)
    for micro_batch in (b for b in (1, 2, 4, 8) if (global_batch // shape.dp) % b == 0 and pins.allows("mbs", b)):
        micro = global_batch // (shape.dp * micro_batch)
        for vp in (v for v in vps if (shape.pp > 1 or v == 1) and pins.allows("vp", v)):
            if vp == 1 and pins.schedule in (None, Schedule.one_f_one_b):
                out.append(ScheduleChoice(vp, micro_batch))
            elif vp > 1 and interleaved and micro % shape.pp == 0:
                out.append(ScheduleChoice(vp, micro_batch))
        if _dualpipev_allowed(graph, shape, micro, pins):
            out.append(ScheduleChoice(2, micro_batch, dualpipev=True))
    return sorted(out, key=lambda c: (c.dualpipev, c.vp, c.micro_batch))


def _dualpipev_allowed(graph: ModelGraph, shape: MeshShape, micro_batches: int, pins: Pins) -> bool:
    rules = pins.dualpipev
    # a pinned vp without a schedule means the interleaved one (as the layout text reads it)
    if rules is None or not (pins.schedule == Schedule.dualpipev or (pins.schedule is None and pins.vp is None)):
        return False
    if shape.pp < 2 or micro_batches < dualpipev_least_micro_batches(shape.pp) \
            or 2 * shape.pp > most_chunks(graph.num_blocks):
        return False
    return not rules.problems(shape.pp, shape.cp, graph.num_blocks, "")


def placement_choices(graph: ModelGraph, shape: MeshShape, pins: Pins,
                      fast_domain: int) -> list[tuple[int, int, tuple[str, ...]]]:
    """(expert tp, ep, mesh order) triples: experts fold over etp x ep inside dp x cp x tp."""
    experts, out = graph.num_experts, []
    for etp in sorted(t for t in ({1, shape.tp} if experts else {1}) if pins.allows("etp", t)):
        eps = [e for e in divisors(shape.dp * shape.cp * shape.tp // etp) if experts % e == 0] if experts else [1]
        for ep in (e for e in eps if pins.allows("ep", e)):
            orders = [pins.order] if pins.order else mesh_orders(shape.tp, shape.cp, shape.dp, shape.pp, fast_domain)
            for order in orders:
                out.append((etp, ep, order))
    return out


def zero_choices(pins: Pins) -> tuple[int, ...]:
    return tuple(z for z in (0, 1, 2, 3) if pins.allows("zero", z))


def make_layout(shape: MeshShape, global_batch: int, pins: Pins, precision: str, *, vp: int = 1, micro_batch: int = 1,
                etp: int = 1, ep: int = 1, order: tuple[str, ...] = MEGATRON_ORDER, zero: int = 0,
                moe_a2a_overlap: bool = False, dualpipev: bool = False, moe_dispatcher: str | None = None,
                tp_comm_overlap: bool = False) -> Layout:
    chosen = {key: getattr(pins, key) for key in ("sp", "grad_reduce", "fp8_recipe", "recompute", "recompute_modules",
                                                  "recompute_layers") if getattr(pins, key) is not None}
    chosen["a2a_overlap"] = moe_a2a_overlap
    if tp_comm_overlap:
        chosen["tp_overlap"] = True
    if moe_dispatcher is not None:
        chosen["dispatcher"] = moe_dispatcher
    if dualpipev:
        chosen["schedule"] = Schedule.dualpipev
    return layout_from({"dp": shape.dp, "tp": shape.tp, "pp": shape.pp, "vp": vp, "cp": shape.cp, "ep": ep,
                        "etp": etp, "mbs": micro_batch, "gbs": global_batch, "zero": zero, "precision": precision,
                        "order": order, **chosen})


def with_tp_overlap(layout: Layout, stack, device, pinned: bool | None) -> Layout:
    """The layout with TP communication overlap as pinned, where it applies; else as the search chooses it
    (`SoftwareStack.tp_overlap_choice`: on wherever combined 1F1B does not rule it out)."""
    on = stack.tp_overlap_applies(layout) if pinned else pinned is None and stack.tp_overlap_choice(layout, device)
    return layout if on == layout.tp_comm_overlap else replace(layout, tp_comm_overlap=on)


def candidate_layouts(graph: ModelGraph, num_devices: int, global_batch: int, pins: Pins,
                      precision: str, fast_domain: int) -> list[Layout]:
    """Every valid combination of degrees, micro-batch and ZeRO stage that the pins allow."""
    out = []
    for shape in mesh_shapes(graph, num_devices, global_batch, pins, fast_domain):
        placements = placement_choices(graph, shape, pins, fast_domain)
        for choice in schedule_choices(graph, shape, global_batch, pins):
            for etp, ep, order in placements:
                out.extend(make_layout(shape, global_batch, pins, precision, vp=choice.vp, micro_batch=choice.micro_batch, etp=etp,
                                       ep=ep, order=order, zero=zero, dualpipev=choice.dualpipev)
                           for zero in zero_choices(pins))
    return out


def mesh_orders(tp: int, cp: int, dp: int, pp: int, fast_domain: int) -> list[tuple[str, ...]]:
    """Which dims share the fast domain with tp: Megatron's tp-cp-ep-dp-pp, and where the domain has
    room left and the choice matters, data-parallel or pipeline ranks next to tp instead."""
    orders = [MEGATRON_ORDER]
    if tp < fast_domain:
        if cp > 1 and dp > 1:
            orders.append(("tp", "dp", "cp", "ep", "pp"))
        if pp > 1 and cp * dp > 1:
            orders.append(("tp", "pp", "cp", "ep", "dp"))
    return orders
