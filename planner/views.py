"""Rich renderings of plans, reports, profiles and models for the CLI."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hardware_profiles.errors import UserInputError
from hardware_profiles.loader import list_clusters, list_devices, load_cluster, load_device, read_yaml_mapping

from cost_models.layout import Layout
from cost_models.layout_codec import FIELDS, text_of

from .explain import PART_NAMES
from .graph_capture.graph import ModelGraph
from .graph_capture.model_sources import list_builtin_models
from .plans import Plan

GB = 1e9


def within_band(result, step_time_s: float) -> bool:
    """An alternative closer to the plan than half its band's width: the model's error could reverse the order."""
    if not result.step_time_band_s:
        return False
    low, high = result.step_time_band_s
    return abs(step_time_s - result.step_time_s) < (high - low) / 2


def _differences(layout_text: str, plan: Plan) -> str:
    """'tp=1,pp=1,dp=16,cp=2,...' -> the fields that differ from the plan's layout, e.g. 'dp=16, cp=2'; a field
    the layout text leaves at its default (`text_of`: order, schedule, the overlaps, the dispatcher) compared as
    that default. The plan's recomputation is compared as the text writes its stages' (one method, Megatron's
    block method or per-layer), as the alternatives' text writes theirs."""
    best = plan.layout
    theirs = _pairs(layout_text)
    plan_text = _pairs(text_of(plan.to_layout()))
    plan_values = {**{key: str(value) for key, value in best.model_dump().items()}, "order": best.order,
                   "recompute": plan_text["recompute"]}
    changed = [f"{key}={value}" for key, value in theirs.items()
               if plan_values.get(key, plan_text.get(key, _default_text(key))) != value]
    changed += [f"{key}={_default_text(key)}" for key in plan_text if key not in theirs]
    return ", ".join(changed) or layout_text


def _pairs(layout_text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in layout_text.split(","))


def _default_text(key: str) -> str:
    """A layout key's default as the layout text writes it."""
    declared = FIELDS[key]
    return declared.field.domain.text(getattr(Layout(), declared.reads))


def _stage_summary(result: Plan) -> Table:
    table = Table(title="Stages")
    for column in ("stage", "rank", "layers", "recompute", "first module", "last module"):
        table.add_column(column)
    for stage in result.stages:
        counts = {(f"selective ({result.layout.recompute_modules.replace('+', ', ')})" if r == "selective" else r):
                  stage.recompute.count(r) for r in ("none", "selective", "full") if stage.recompute.count(r)}
        layers = f"{stage.layers[0]}-{stage.layers[-1]}" if stage.layers else "-"
        table.add_row(str(stage.index), str(stage.pipeline_rank), f"{layers} ({len(stage.layers)})",
                      ", ".join(f"{k} {v}" for k, v in counts.items()), stage.modules[0], stage.modules[-1])
    return table


def show_plan(console: Console, result: Plan, goodput: dict | None = None) -> None:
    lay = result.layout
    head = Table(title=f"Plan: {result.model} on {result.num_devices} x {result.cluster}", show_header=False)
    head.add_row("stack", f"{result.stack} (planner stacks show {result.stack})")
    if result.placement:
        head.add_row("placement", result.placement)
    with_tp = [name for name, on in (("SP", lay.sp), ("TP overlap", lay.tp_comm_overlap)) if on]
    head.add_row("layout", f"dp={lay.dp} tp={lay.tp}{' (+' + ', '.join(with_tp) + ')' if with_tp else ''} pp={lay.pp} "
                 f"vp={lay.vp} cp={lay.cp} ep={lay.ep} etp={lay.etp}")
    head.add_row("batch", f"global {lay.gbs}, micro {lay.mbs}, {lay.gbs // (lay.dp * lay.mbs)} micro-batches, "
                 f"seq {result.seq_len}")
    if lay.offload_layers:
        head.add_row("offloading", f"the first {lay.offload_layers} layers' activations to host memory")
    head.add_row("optimizer", f"ZeRO-{lay.zero}, {lay.precision}, schedule {lay.schedule}"
                 f"{' (combined 1F1B: MoE all-to-alls overlapped)' if lay.moe_a2a_overlap else ''}, mesh {lay.order}")
    head.add_row("step time", f"{result.step_time_s:.3f} s   {result.tokens_per_s:,.0f} tokens/s")
    if result.step_time_band_s:
        low, high = result.step_time_band_s
        head.add_row("90% band", f"{low:.3f}-{high:.3f} s measured, from published runs like it")
    # the convention of every MFU here: model FLOPs with the full s^2 attention term (Megatron's and NVIDIA's
    # published figures count it so), over the BF16 dense peak whatever the precision trained
    head.add_row("utilisation", f"{result.tflops_per_device:.0f} TFLOP/s per device, MFU {result.mfu:.1%}, "
                 f"HFU {result.hfu:.1%}")
    head.add_row("MFU basis", "model FLOPs, attention not halved; BF16 dense peak")
    if goodput:
        head.add_row("goodput", f"ETTR {goodput['ettr']:.1%} -> goodput {goodput['goodput']:.1%}; "
                     f"{goodput['interruptions_per_day']:.2f} interruptions/day; checkpoint every "
                     f"{goodput['checkpoint_interval_min']:.1f} min")
        lost = sorted(goodput["lost_s_per_day"].items(), key=lambda item: -item[1])
        head.add_row("lost per day", ", ".join(f"{name} {seconds / 60:.1f} min" for name, seconds in lost
                                               if seconds >= 0.5))
        for note in goodput["notes"]:
            head.add_row("note", note)
    console.print(head)
    breakdown = Table(title="Step time breakdown")
    breakdown.add_column("part")
    breakdown.add_column("seconds", justify="right")
    breakdown.add_column("share", justify="right")
    for name, value in result.breakdown.items():
        if value > 0:
            breakdown.add_row(PART_NAMES.get(name, name), f"{value:.3f}", f"{value / result.step_time_s:.1%}")
    console.print(breakdown)
    memory = Table(title="Memory per pipeline rank (GB)")
    for column in ("stage", "weights", "grads", "optimizer", "activations", "other", "total", "usable"):
        memory.add_column(column, justify="right")
    for m in result.memory:
        p = m.parts
        other = p["logits"] + p.get("loss_gradient", 0.0) + p["recompute_working"] + p["comm_buffers"]
        memory.add_row(str(m.stage), *(f"{v / GB:.1f}" for v in (p["weights"], p["gradients"], p["optimizer"],
                                                                 p["activations"], other, m.total_bytes,
                                                                 m.capacity_bytes)))
    console.print(memory)
    console.print(_stage_summary(result))
    if result.alternatives:
        alt = Table(title="Next best")
        alt.add_column("differs from the plan in")
        alt.add_column("step s", justify="right")
        alt.add_column("MFU", justify="right")
        alt.add_column("loses")
        for a in result.alternatives:
            alt.add_row(_differences(a.layout, result), f"{a.step_time_s:.3f}"
                        + (" ~" if within_band(result, a.step_time_s) else ""), f"{a.mfu:.1%}", a.loses)
        console.print(alt)
        if any(within_band(result, a.step_time_s) for a in result.alternatives):
            console.print("~ within the plan's band: the prediction cannot order it before the plan")
    for note in result.outside_measured:
        console.print(f"- {note}")
    if result.inside_measured is not None:
        inside = result.inside_measured
        console.print(f"- the best plan inside the measured region: {inside.layout}, {inside.step_time_s:.3f} s, MFU "
                      f"{inside.mfu:.1%} ({inside.loses})")
    for reason in result.reasons:
        console.print(f"- {reason}")
    for note in result.capture_notes:
        console.print(f"- capture: {note}")
    if result.search:
        console.print(search_line(result.search))


def search_line(s) -> str:
    """The search's status in words: only a complete search says its plan is the best."""
    counts = (f"{s.candidates:,} candidates, {s.pruned_memory:,} pruned by memory, {s.pruned_bound:,} by bound, "
              f"{s.solved:,} solved in {s.wall_s:.1f} s ({s.cpu_s:.1f} CPU s)")
    if s.status == "complete":
        return f"search complete (every candidate bounded or solved to optimality): {counts}"
    if s.status == "time-limited":
        return (f"search TIME-LIMITED: {s.unexplored:,} candidates left unexplored by --time-limit; the plan is "
                f"the best found, not proven best: {counts}")
    return (f"search INCOMPLETE: {s.unproven_leaves:,} stage partitions stopped at the solver's work limit "
            f"unproven (gap {s.gap:.2%} on the plan's own); the plan is the best found, not proven best: {counts}")


@dataclass(frozen=True)
class Column:
    """A table column: numbers never wrap nor are cut; `drop` orders the columns left out first where the
    console is too narrow for all (None: always shown)."""
    name: str
    wraps: bool = False
    drop: int | None = None


def fitted_table(console: Console, title: str, columns: list[Column], rows: list[list[str]]) -> tuple[Table, list[str]]:
    """A table whose numbers stay whole at the console's width: optional columns are left out (named in the
    second value) until the rest fits, and text columns wrap."""
    kept = list(range(len(columns)))

    def need(index: int) -> int:
        cells = [row[index] for row in rows] + [columns[index].name]
        if columns[index].wraps:   # on at most about two lines
            return max(max(len(word) for cell in cells for word in (cell.split() or [""])),
                       (max(map(len, cells)) + 1) // 2)
        return max(max(len(row[index]) for row in rows) if rows else 0, max(map(len, columns[index].name.split())))

    droppable = sorted((c.drop, i) for i, c in enumerate(columns) if c.drop is not None)
    while sum(need(i) for i in kept) + 3 * len(kept) + 1 > console.width and droppable:
        kept.remove(droppable.pop(0)[1])
    table = Table(title=title)
    for i in kept:
        table.add_column(columns[i].name, justify="left" if columns[i].wraps else "right", no_wrap=not columns[i].wraps,
                         min_width=None if columns[i].wraps else need(i))
    for row in rows:
        table.add_row(*(row[i] for i in kept))
    return table, [c.name for i, c in enumerate(columns) if i not in kept]


# the step time's 90% band stays beside it (issue 43: the band beside every step time); narrower terminals lose the
# others first, each named under the table (goodput before tokens/s: it is MFU x ETTR)
WHATIF_COLUMNS = [Column("point"), Column("layout", wraps=True), Column("step s"), Column("step 90%", drop=5),
                  Column("MFU"), Column("tokens/s", drop=4), Column("days"), Column("days 90%", drop=0),
                  Column("device-hours", drop=2), Column("ETTR", drop=1),
                  Column("goodput", drop=3), Column("ckpt min", drop=0)]


def show_whatif(console: Console, report) -> None:
    rows = []
    for r in report.rows:
        if r.note:
            rows.append([r.point, r.note] + [""] * (len(WHATIF_COLUMNS) - 2))
            continue
        days_band = f"{r.days_band[0]:.1f}-{r.days_band[1]:.1f}" if r.days_band else "-"
        step_band = f"{r.step_band_s[0]:.2f}-{r.step_band_s[1]:.2f}" if r.step_band_s else "-"
        rows.append([r.point, r.layout, f"{r.step_time_s:.2f}", step_band, f"{r.mfu:.1%}", f"{r.tokens_per_s:,.0f}",
                     f"{r.days_to_train:.1f}", days_band, f"{r.device_hours:,.0f}", f"{r.ettr:.1%}", f"{r.goodput:.1%}",
                     f"{r.checkpoint_interval_min:.0f}"])
    table, left_out = fitted_table(console, f"What-if: {report.model}, {report.sweep_key}, "
                                   f"{token_text(report.tokens)} tokens", WHATIF_COLUMNS, rows)
    console.print(table)
    if left_out:
        console.print(f"- left out at {console.width} columns: {', '.join(left_out)} (--json, --out or a wider "
                      "terminal shows them)")
    for r in report.rows:
        for said in filter(None, (r.domain_change, r.extrapolates)):
            console.print(f"- {r.point}: {said}")


def token_text(tokens: float) -> str:
    """A token count as users write it: 15T, 1.5B, 300M (whatif --tokens' own suffixes)."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if tokens >= scale:
            return f"{tokens / scale:.4g}{suffix}"
    return f"{tokens:.4g}"


def profiles_summary() -> dict:
    """The built-in devices and clusters with their headline figures (`profiles list --json`)."""
    devices = [{"name": name, "display_name": d.display_name, "bf16_tflops": d.peak_tflops.bf16,
                "hbm_gbytes": d.hbm_bytes / GB, "hbm_tbytes_per_s": d.hbm_bandwidth_gbytes_per_s / 1000,
                "fabric": d.intra_node.kind.value,
                "gbytes_per_s_per_direction": d.intra_node.bandwidth_per_direction_gbytes_per_s,
                "backend": d.collective_backend} for name in list_devices() for d in [load_device(name)]]
    clusters = [{"name": name, "device": c.device.name, "devices": c.num_devices, "per_node": c.devices_per_node,
                 "fast_domain": c.fast_domain_devices, "network": c.inter_node.kind,
                 "nic_gbit_per_s": c.inter_node.nic_bandwidth_gbit_per_s, "nics_per_node": c.inter_node.nics_per_node}
                for name in list_clusters() for c in [load_cluster(name)]]
    return {"devices": devices, "clusters": clusters}


def show_profiles(console: Console) -> None:
    summary = profiles_summary()
    devices = Table(title="Devices")
    for column in ("name", "device", "bf16 TFLOP/s", "HBM GB", "HBM TB/s", "fabric", "GB/s per direction", "backend"):
        devices.add_column(column)
    for d in summary["devices"]:
        devices.add_row(d["name"], d["display_name"], f"{d['bf16_tflops']:g}", f"{d['hbm_gbytes']:.0f}",
                        f"{d['hbm_tbytes_per_s']:.2f}", d["fabric"], f"{d['gbytes_per_s_per_direction']:g}",
                        d["backend"])
    console.print(devices)
    clusters = Table(title="Clusters")
    for column in ("name", "device", "devices", "per node", "fast domain", "network", "Gb/s x NICs per node"):
        clusters.add_column(column)
    for c in summary["clusters"]:
        clusters.add_row(c["name"], c["device"], str(c["devices"]), str(c["per_node"]), str(c["fast_domain"]),
                         c["network"], f"{c['nic_gbit_per_s']:g} x {c['nics_per_node']}")
    console.print(clusters)


def _flatten(prefix: str, data: dict, table: Table) -> None:
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            _flatten(f"{name}.", value, table)
        else:
            table.add_row(name, str(value))


def load_profile(name: str):
    """A device or cluster profile by built-in name or YAML path."""
    if name in list_devices() or (name.endswith((".yaml", ".yml")) and "device" not in _peek(name)):
        return load_device(name)
    if name in list_clusters() or name.endswith((".yaml", ".yml")):
        return load_cluster(name)
    raise UserInputError(f"no device or cluster named '{name}'",
                         expected=f"one of {', '.join(list_devices() + list_clusters())}")


def show_profile(console: Console, profile) -> None:
    table = Table(title=f"{type(profile).__name__}: {profile.name}", show_header=False)
    _flatten("", profile.model_dump(mode="json"), table)
    console.print(table)


def _peek(path: str) -> dict:
    """The fields of a profile file, or {} when it cannot be read (show_profile then reports it)."""
    try:
        return read_yaml_mapping(Path(path))
    except UserInputError:
        return {}


def show_models(console: Console) -> None:
    table = Table(title="Built-in models")
    table.add_column("name")
    for name in list_builtin_models():
        table.add_row(name)
    console.print(table)


def model_summary(graph: ModelGraph) -> dict:
    return {"name": graph.name, "total_params": graph.total_params, "active_params": graph.active_params,
            "layers_by_kind": graph.layer_counts(), "flops_per_token": graph.model_flops_per_token(),
            "seq_len": graph.seq_len, "hidden_size": graph.hidden_size, "vocab_size": graph.vocab_size,
            "attention_heads": graph.attention_heads, "kv_groups": graph.kv_groups,
            "num_experts": graph.num_experts, "capture_seconds": round(graph.capture_seconds, 3),
            "tensor_parallel_pairs": {s.kind: [{"columns": list(p.columns), "row": p.row} for p in s.tp_pairs]
                                      for s in graph.structures},
            "capture_front_end": graph.front_end, "model_class": graph.model_class,
            "capture_notes": list(graph.capture_notes)}


def show_model(console: Console, graph: ModelGraph, summary: dict) -> None:
    table = Table(title=f"Model: {graph.name}", show_header=False)
    table.add_row("parameters", f"{graph.total_params / 1e9:.3f} B total, {graph.active_params / 1e9:.3f} B active")
    table.add_row("layers", ", ".join(f"{k} {v}" for k, v in summary["layers_by_kind"].items()))
    table.add_row("FLOPs per token", f"{summary['flops_per_token']:.4g} (forward + backward, seq {graph.seq_len})")
    table.add_row("attention", f"{graph.attention_heads} heads, {graph.kv_groups} kv groups")
    if graph.num_experts:
        table.add_row("experts", str(graph.num_experts))
    for kind, pairs in summary["tensor_parallel_pairs"].items():
        table.add_row(f"TP pairs ({kind})", "; ".join(f"{'+'.join(p['columns'])} -> {p['row']}" for p in pairs))
    table.add_row("captured by", _front_end_text(graph.front_end, graph.model_class))
    console.print(table)
    for note in graph.capture_notes:
        console.print(f"- capture: {note}")


def _front_end_text(front_end: str, model_class: str) -> str:
    how = "torch.fx symbolic trace" if front_end == "torch.fx" else "recording one eager run on meta tensors"
    return f"{how} of {model_class}" if model_class else how


def show_calibration(console: Console, result) -> None:
    """Predicted against measured per part, and what was refitted (planner/calibration.py)."""
    head = result.header
    table = Table(title=f"Telemetry: {head['model']} on {head['num_devices']} x {head['cluster'] or '(no plan)'}, "
                        f"{result.ranks} ranks, median of steps {result.steps_used[0]}-{result.steps_used[-1]}")
    for column in ("part", "predicted s", "measured s", "measured / predicted"):
        table.add_column(column)
    for part in result.parts:
        predicted = "-" if part.predicted_s is None else f"{part.predicted_s:.4f}"
        ratio = f"{part.measured_s / part.predicted_s:.2f}" if part.predicted_s else "-"
        name = {"pipeline_bubble_s": "pipeline_bubble_s + pp_comm_s",
                "compute_s": "compute_s + recompute_s"}.get(part.name, part.name)
        table.add_row(name, predicted, f"{part.measured_s:.4f}", ratio)
    console.print(table)
    for refit in result.refits:
        console.print(f"refit {head['device']} {refit.field}: {refit.old:.4g} -> {refit.new:.4g}")
    for note in result.notes:
        console.print(f"note: {note}")
