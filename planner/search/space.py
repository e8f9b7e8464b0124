"""The layout space: validity rules and the enumeration of candidate degrees."""
from __future__ import annotations

from dataclasses import dataclass, fields

from cost_models.layout import (MEGATRON_ORDER, Fp8Recipe, GradReduce, Layout, Recompute, RecomputeModule, Schedule,
                                 nested_modules)
from cost_models.layout_codec import CHOICES, FULL_KEYS, layout_from, values_of
from cost_models.pipeline import (dualpipev_least_micro_batches, dualpipev_micro_batch_problem, most_chunks,
                                  partition_problem)

from ..capture.graph import ModelGraph


@dataclass(frozen=True)
class DualPipeVRules:
    """Where the software stack runs DualPipeV (`SoftwareStack.dualpipev_*`)."""
    even_split: bool = False     # layers a multiple of 2 pp, split evenly
    beside_cp: bool = True       # with context parallelism

    def problems(self, pp: int | None, cp: int | None, num_blocks: int | None, stack_name: str) -> list[str]:
        """What of these degrees the stack's DualPipeV cannot run (a degree or layer count not known: no rule)."""
        problems = []
        if cp and cp > 1 and not self.beside_cp:
            problems.append(f"schedule=dualpipev with cp={cp}: the {stack_name} stack runs DualPipeV without "
                            "context parallelism")
        if self.even_split and pp and num_blocks is not None and num_blocks % (2 * pp):
            problems.append(f"schedule=dualpipev with pp={pp}: the {stack_name} stack splits the layers evenly "
                            f"over 2 pp = {2 * pp} chunks, and the model has {num_blocks}")
        return problems


@dataclass(frozen=True)
class Pins:
    """Parts of the layout the user fixed (`--fix tp=8,pp=16` or `planner.plan(..., tp=8)`)."""
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    vp: int | None = None
    cp: int | None = None
    ep: int | None = None
    etp: int | None = None
    mbs: int | None = None
    zero: int | None = None
    recompute: Recompute | None = None
    sp: bool | None = None
    a2a_overlap: bool | None = None         # combined 1F1B; searched where the stack has it
    grad_reduce: GradReduce | None = None   # not searched: fp32 unless given
    fp8_recipe: Fp8Recipe | None = None     # not searched: delayed unless given
    order: tuple[str, ...] | None = None   # mesh order, innermost first ('order=tp-pp-cp-ep-dp')
    recompute_modules: tuple[RecomputeModule, ...] | None = None   # not searched: core_attn unless given
    schedule: Schedule | None = None        # the pipeline schedule, where pinned ('schedule=dualpipev')
    recompute_layers: int | None = None     # full recomputation of the first N blocks of each chunk only
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)   # what the software stack runs (`stack_rules.stack_pins`)
    dualpipev: DualPipeVRules | None = None       # ... and its DualPipeV, None where it has none
    interleaved_schedule: bool = True             # ... and whether it interleaves virtual stages

    def allows(self, name: str, value) -> bool:
        if name == "zero" and value not in self.zero_stages:
            return False
        pinned = getattr(self, name)
        return pinned is None or pinned == value


def pins_from(values: dict) -> Pins:
    known = {f.name for f in fields(Pins)} - {"zero_stages", "dualpipev", "interleaved_schedule"}
    return Pins(**{k: v for k, v in values.items() if k in known})


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def layout_problems(layout: Layout, graph: ModelGraph, num_devices: int) -> list[str]:
    """Every validity rule the layout breaks, each as a sentence naming the numbers: the rules of pins
    (a full layout pins every degree) and those only a whole layout can break."""
    problems = value_problems(layout)
    if problems:
        return problems
    problems = pin_problems(pins_of(layout), graph, num_devices, layout.global_batch)
    folded = layout.dp * layout.cp * layout.tp
    if (layout.ep > 1 or layout.etp > 1) and folded % (layout.ep * layout.etp):
        problems.append(f"ep*etp = {layout.ep * layout.etp} does not divide dp*cp*tp = {folded}")
    if layout.stage_layers is not None:
        problem = partition_problem(layout.stage_layers, graph.num_blocks, layout.pp * layout.vp)
        if problem:
            problems.append(problem)
    if layout.mesh_order and sorted(layout.mesh_order) != sorted(MEGATRON_ORDER):
        problems.append(f"mesh order {layout.mesh_order} is not a permutation of {MEGATRON_ORDER}")
    return problems


def pins_of(layout: Layout) -> Pins:
    """A whole layout as pins: every degree fixed."""
    return pins_from(values_of(layout, FULL_KEYS + ("recompute_modules", "schedule")))


def value_problems(layout: Layout) -> list[str]:
    """Values no layout may have, whatever the model (a `Layout` built in Python is not parsed)."""
    problems = [f"{name}={getattr(layout, name)} is not a positive integer" for name in
                ("dp", "tp", "pp", "vp", "cp", "ep", "etp", "micro_batch", "global_batch")
                if isinstance(getattr(layout, name), bool) or not isinstance(getattr(layout, name), int)
                or getattr(layout, name) < 1]
    if layout.zero not in (0, 1, 2, 3) or isinstance(layout.zero, bool):
        problems.append(f"zero={layout.zero} is not a ZeRO stage 0-3")
    for key, kind in CHOICES.items():
        value = getattr(layout, key)
        if not isinstance(value, kind):
            problems.append(f"{key}={str(value)!r} is not one of {', '.join(kind.texts())}")
    if not isinstance(layout.dualpipev, bool):
        problems.append(f"dualpipev={layout.dualpipev!r} is not True or False")
    elif layout.dualpipev and (layout.vp != 2 or layout.pp < 2):
        problems.append(f"schedule=dualpipev with pp={layout.pp}, vp={layout.vp}: DualPipeV runs two chunks "
                        "per rank (vp=2) on pp > 1 ranks")
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


def pin_problems(pins: Pins, graph: ModelGraph, num_devices: int, global_batch: int) -> list[str]:
    """The rule each pin breaks on its own or with the other pins, before any layout is tried."""
    problems = []
    degrees = {name: getattr(pins, name) for name in ("tp", "cp", "pp", "dp") if getattr(pins, name)}
    product = 1
    for value in degrees.values():
        product *= value
    named = "*".join(degrees)
    if len(degrees) == 4 and product != num_devices:
        problems.append(f"the degrees multiply to {product:,} ({named}), not the {num_devices:,} devices")
    elif degrees and num_devices % product:
        problems.append(f"the pinned {named} = {product:,} does not divide the {num_devices:,} devices")
    heads, groups, experts = graph.attention_heads, graph.kv_groups, graph.num_experts
    if pins.tp and heads and heads % pins.tp:
        problems.append(f"tp={pins.tp} does not divide the {heads} attention heads")
    if pins.tp and groups and groups % pins.tp and pins.tp % groups:
        problems.append(f"tp={pins.tp} and the {groups} kv groups do not divide one another")
    if pins.ep and pins.ep > 1 and not experts:
        problems.append(f"ep={pins.ep} needs experts, and {graph.name} is a dense model")
    elif pins.ep and experts and experts % pins.ep:
        problems.append(f"ep={pins.ep} does not divide the {experts} experts")
    if pins.etp and pins.etp > 1 and not experts:
        problems.append(f"etp={pins.etp} needs experts, and {graph.name} is a dense model")
    if pins.etp and pins.tp and pins.etp > pins.tp:
        problems.append(f"etp={pins.etp} exceeds tp={pins.tp}")
    if pins.vp and pins.vp > 1 and pins.pp == 1:
        problems.append(f"vp={pins.vp} needs pp > 1 (interleaving splits a pipeline rank's layers into chunks)")
    problems += _schedule_pin_problems(pins, global_batch)
    if (pins.pp or 1) * (pins.vp or 1) > most_chunks(graph.num_blocks):
        problems.append(f"{graph.num_blocks} layers, the embedding and the loss cannot fill pp*vp = "
                        f"{(pins.pp or 1) * (pins.vp or 1)} chunks")
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
    if pins.cp and pins.cp > 1 and graph.seq_len % (2 * pins.cp):
        problems.append(f"the sequence {graph.seq_len} does not split into 2*cp = {2 * pins.cp} causal chunks")
    if pins.dp and global_batch % (pins.dp * (pins.mbs or 1)):
        problems.append(f"global batch {global_batch} is not a multiple of dp*mbs = {pins.dp}*{pins.mbs or 1}")
    elif pins.dp and pins.mbs and pins.pp and pins.vp and pins.vp > 1 and pins.schedule != Schedule.dualpipev:
        micro = global_batch // (pins.dp * pins.mbs)
        if micro % pins.pp:
            problems.append(f"interleaving needs {micro} micro-batches divisible by pp={pins.pp}")
    elif pins.mbs and global_batch % pins.mbs:
        problems.append(f"global batch {global_batch} is not a multiple of mbs={pins.mbs}")
    return problems


def _schedule_pin_problems(pins: Pins, global_batch: int) -> list[str]:
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
            for pp in (p for p in divisors(num_devices // (tp * cp)) if p <= most_chunks(graph.num_blocks) and pins.allows("pp", p)):
                dp = num_devices // (tp * cp * pp)
                if pins.allows("dp", dp) and global_batch % dp == 0:
                    out.append(MeshShape(tp, cp, pp, dp))
    return out


@dataclass(frozen=True)
class ScheduleChoice:
    vp: int
    mbs: int
    dualpipev: bool = False


def schedule_choices(graph: ModelGraph, shape: MeshShape, global_batch: int, pins: Pins) -> list[ScheduleChoice]:
    """Virtual stages, micro-batch size and schedule: interleaving needs micro-batches divisible by pp.
    Virtual stages go up to 8, and beyond where they split the layers evenly (NeMo runs use up to 24).
    DualPipeV (vp = 2 as a V) where the stack runs it, with at least 2 pp micro-batches."""
    out = []
    blocks = graph.num_blocks
    # a chunk may hold just the embedding or the loss beside its layers (Megatron-Core, torchtitan)
    vps = [v for v in range(1, most_chunks(blocks) // shape.pp + 1)
           if v <= 8 or blocks % (shape.pp * v) == 0 or most_chunks(blocks) % (shape.pp * v) == 0]
    interleaved = pins.interleaved_schedule and pins.schedule in (None, Schedule.interleaved)
    for mbs in (b for b in (1, 2, 4, 8) if (global_batch // shape.dp) % b == 0 and pins.allows("mbs", b)):
        micro = global_batch // (shape.dp * mbs)
        for vp in (v for v in vps if (shape.pp > 1 or v == 1) and pins.allows("vp", v)):
            if vp == 1 and pins.schedule in (None, Schedule.one_f_one_b):
                out.append(ScheduleChoice(vp, mbs))
            elif vp > 1 and interleaved and micro % shape.pp == 0:
                out.append(ScheduleChoice(vp, mbs))
        if _dualpipev_allowed(graph, shape, micro, pins):
            out.append(ScheduleChoice(2, mbs, dualpipev=True))
    return sorted(out, key=lambda c: (c.dualpipev, c.vp, c.mbs))


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


def make_layout(shape: MeshShape, global_batch: int, pins: Pins, precision: str, *, vp: int = 1, mbs: int = 1,
                etp: int = 1, ep: int = 1, order: tuple[str, ...] = MEGATRON_ORDER, zero: int = 0,
                a2a_overlap: bool = False, dualpipev: bool = False) -> Layout:
    chosen = {key: getattr(pins, key) for key in ("sp", "grad_reduce", "fp8_recipe", "recompute", "recompute_modules",
                                                  "recompute_layers") if getattr(pins, key) is not None}
    chosen["a2a_overlap"] = a2a_overlap
    if dualpipev:
        chosen["schedule"] = Schedule.dualpipev
    return layout_from({"dp": shape.dp, "tp": shape.tp, "pp": shape.pp, "vp": vp, "cp": shape.cp, "ep": ep,
                        "etp": etp, "mbs": mbs, "gbs": global_batch, "zero": zero, "precision": precision,
                        "order": order, **chosen})


def candidate_layouts(graph: ModelGraph, num_devices: int, global_batch: int, pins: Pins,
                      precision: str, fast_domain: int) -> list[Layout]:
    """Every valid combination of degrees, micro-batch and ZeRO stage that the pins allow."""
    out = []
    for shape in mesh_shapes(graph, num_devices, global_batch, pins, fast_domain):
        placements = placement_choices(graph, shape, pins, fast_domain)
        for choice in schedule_choices(graph, shape, global_batch, pins):
            for etp, ep, order in placements:
                out.extend(make_layout(shape, global_batch, pins, precision, vp=choice.vp, mbs=choice.mbs, etp=etp,
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
