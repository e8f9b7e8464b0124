"""What-if capacity reports (`planner.whatif`): the best plan at each point of a sweep, time to train, device-hours, goodput."""
from __future__ import annotations

import html
from dataclasses import dataclass, replace
from pathlib import Path

from hardware_profiles.errors import UserInputError, clip

from cost_models.layout_codec import parse_text, parse_values

from .api import InfeasibleError, check_time_limit, pin_values, plan_job
from .goodput_report import plan_goodput
from .views import token_text
from .job import Job, job_of, resolve_cluster
from .region import job_outside_notes, outside_shapes, zero3_outside

SWEEP_KEYS = ("num-devices", "device", "inter-node-bandwidth-gbps", "seq-len", "global-batch")
TOKEN_SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


MAX_SWEEP_POINTS = 64          # each point is a whole search
MAX_SWEEP_VALUE = 1 << 24      # devices, sequence length, batch or Gbit/s
MAX_TOKENS = 1e18   # a million times Llama 3's 15T: beyond it a budget is a typo


def parse_tokens(text: str) -> float:
    text = str(text).strip().upper()
    expected = f"a positive number up to {MAX_TOKENS:.0e} with an optional K/M/B/T suffix, e.g. 15T"
    try:
        tokens = float(text[:-1]) * TOKEN_SUFFIXES[text[-1]] if text and text[-1] in TOKEN_SUFFIXES else float(text)
    except ValueError:
        raise UserInputError(f"'{clip(text)}' is not a token count", field="--tokens", expected=expected) from None
    if not 0 < tokens <= MAX_TOKENS:   # also nan, inf and 1e400 (inf)
        raise UserInputError(f"'{clip(text)}'", field="--tokens", expected=expected)
    return tokens


def parse_sweep(spec: str) -> tuple[str, list[str]]:
    if "=" not in spec:
        raise UserInputError(f"'{spec}' is not KEY=V1,V2,...", field="--sweep",
                             expected=f"one of {', '.join(SWEEP_KEYS)} with comma-separated values")
    key, values = spec.split("=", 1)
    key = key.strip()
    points = [v.strip() for v in values.split(",") if v.strip()]
    if key not in SWEEP_KEYS:
        raise UserInputError(f"unknown sweep key '{key}'", field="--sweep", expected=f"one of {', '.join(SWEEP_KEYS)}")
    if not points:
        raise UserInputError("no values", field="--sweep", expected="at least one value after '='")
    if len(points) > MAX_SWEEP_POINTS:
        raise UserInputError(f"{len(points)} points", field="--sweep", expected=f"at most {MAX_SWEEP_POINTS} points")
    if key != "device":
        for value in points:
            if not (value.isascii() and value.isdigit()) or not 0 < int(value) <= MAX_SWEEP_VALUE:
                raise UserInputError(f"{key}={clip(value)}", field="--sweep",
                                     expected=f"positive integers up to {MAX_SWEEP_VALUE:,} for {key}")
    return key, points


@dataclass(frozen=True)
class Row:
    point: str
    layout: str
    num_devices: int
    device: str
    step_time_s: float
    mfu: float
    tokens_per_s: float
    days_to_train: float
    device_hours: float
    ettr: float
    goodput: float
    interruptions_per_day: float
    checkpoint_interval_min: float
    note: str = ""
    placement: str = ""           # Cluster.placement_text of the point
    domain_change: str = ""       # said where this point's devices cross a scale-up domain boundary
    step_band_s: tuple[float, float] | None = None   # the plan's 90% band (Plan.step_time_band_s)
    extrapolates: str = ""        # the plan's shapes outside the measured region, and the best plan inside it

    @property
    def days_band(self) -> tuple[float, float] | None:
        """Days to train at the band's ends (days scale with the step time)."""
        if not self.step_band_s or not self.step_time_s:
            return None
        return tuple(self.days_to_train * end / self.step_time_s for end in self.step_band_s)


@dataclass(frozen=True)
class Report:
    model: str
    sweep_key: str
    tokens: float
    rows: tuple[Row, ...]

    def plot(self, path: str | Path) -> Path:
        """Utilisation (MFU and goodput on a 0-100% axis, where their gap is ETTR's), ETTR on its own axis, and
        days to train, against the sweep."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        good = [r for r in self.rows if not r.note]
        labels = [r.point for r in good]
        fig, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 4.2))
        left.plot(labels, [r.mfu * 100 for r in good], marker="o", label="MFU %")
        left.plot(labels, [r.goodput * 100 for r in good], marker="s", linestyle="--", label="goodput % (MFU x ETTR)")
        left.set_ylim(0, 100)
        left.set_title(f"{self.model}: utilisation")
        middle.plot(labels, [r.ettr * 100 for r in good], marker="^", color="tab:green", label="ETTR %")
        middle.set_title("effective training time ratio")
        right.plot(labels, [r.days_to_train for r in good], marker="o", color="tab:red", label="days to train")
        banded = [r for r in good if r.days_band]
        if banded:   # the 90% band of each prediction, as days
            right.fill_between([r.point for r in banded], [r.days_band[0] for r in banded],
                               [r.days_band[1] for r in banded], color="tab:red", alpha=0.15, label="90% band")
        right.set_ylabel(f"days for {token_text(self.tokens)} tokens")
        right.set_title("time to train")
        for axis, unit in ((left, "percent"), (middle, "percent"), (right, None)):
            axis.set_xlabel(self.sweep_key)
            if unit:
                axis.set_ylabel(unit)
            axis.legend()
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def to_html(self, path: str | Path, image: str | None = None) -> Path:
        head = ["point", "layout", "devices", "placement", "step s", "step s, 90% band", "MFU", "tokens/s", "days",
                "days, 90% band", "device-hours",
                "ETTR", "goodput", "interruptions/day", "ckpt every (min)"]
        notes = [" ".join(filter(None, (r.note, r.domain_change, r.extrapolates))) for r in self.rows]
        if any(notes):   # a column only where some point has something to say
            head.append("note")
        rows = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in (
                r.point, r.layout, r.num_devices, r.placement, f"{r.step_time_s:.3f}", _band_text(r.step_band_s, 3),
                f"{r.mfu:.1%}", f"{r.tokens_per_s:,.0f}", f"{r.days_to_train:.1f}", _band_text(r.days_band, 1),
                f"{r.device_hours:,.0f}", f"{r.ettr:.1%}", f"{r.goodput:.1%}",
                f"{r.interruptions_per_day:.2f}", f"{r.checkpoint_interval_min:.0f}", *([note] if any(notes) else []))) + "</tr>"
            for r, note in zip(self.rows, notes))
        picture = ""
        if image:
            import base64
            data = base64.b64encode(Path(image).read_bytes()).decode()
            picture = f'<img alt="what-if plot" src="data:image/png;base64,{data}">'
        page = (f"<!doctype html><html><head><meta charset='utf-8'><title>What-if: {html.escape(self.model)}</title>"
                "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
                "td,th{border:1px solid #999;padding:4px 8px;text-align:right}</style></head><body>"
                f"<h1>What-if: {html.escape(self.model)}, sweep over {html.escape(self.sweep_key)}</h1>"
                f"<p>Token budget {token_text(self.tokens)}. Generated by parallel-planner.</p>"
                f"<table><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr>{rows}</table>{picture}</body></html>")
        path = Path(path)
        path.write_text(page)
        return path


def whatif(model, *, sweep: str, global_batch: int, seq_len: int | None = None, tokens: str | float = "1T",
           cluster=None, device: str | None = None, num_devices: int | None = None,
           devices_per_node: int | None = None, segment_devices: int | None = None, time_limit_s: float = 30.0,
           stack=None, ep_imbalance: float = 1.0, **fix) -> Report:
    """Best plan at every sweep point: `whatif("llama3-70b", sweep="num-devices=512,1024", device="h100-sxm", ...)`."""
    key, points = parse_sweep(sweep)
    budget = parse_tokens(str(tokens))
    check_time_limit(time_limit_s)
    where = ClusterArguments(cluster, device, num_devices, devices_per_node, segment_devices)
    job = job_of(model, where.at(key, points[0]), global_batch=global_batch, seq_len=seq_len, stack=stack,
                 ep_imbalance=ep_imbalance, layout_values=pin_values(parse_values(fix, "fix")))
    return whatif_job(job, key, points, budget, where, time_limit_s)


@dataclass(frozen=True)
class ClusterArguments:
    """The cluster as the user named it, so that each sweep point resolves it again at its own value."""
    cluster: object = None
    device: str | None = None
    num_devices: int | None = None
    devices_per_node: int | None = None
    segment_devices: int | None = None

    def at(self, key: str, value: str):
        given = self
        if key == "num-devices":
            given = replace(self, num_devices=int(value))
        elif key == "device":
            given = replace(self, device=value, cluster=None)
        cluster = resolve_cluster(given.cluster, given.device, given.num_devices, given.devices_per_node,
                                  given.segment_devices)
        if key == "inter-node-bandwidth-gbps":
            network = cluster.inter_node.model_copy(update={"nic_bandwidth_gbit_per_s": float(value)})
            cluster = cluster.model_copy(update={"inter_node": network})
        return cluster


def whatif_job(job: Job, key: str, points: list[str], budget: float, where: ClusterArguments,
               time_limit_s: float = 30.0) -> Report:
    """The job's best plan at each point of the sweep `key` over `points`, and what it takes to train `budget`
    tokens there."""
    rows, crossed = [], None
    for value in points:
        point_cluster = where.at(key, value)
        crosses = point_cluster.domain_use.crosses_domains
        change = ""
        if crossed is not None and crosses != crossed:
            change = ("crosses a scale-up domain boundary: " if crosses else "fits one scale-up domain again: ") \
                + point_cluster.placement_text()
        crossed = crosses
        placed = dict(placement=point_cluster.placement_text(), domain_change=change)
        point = job.at(cluster=point_cluster, seq_len=int(value) if key == "seq-len" else None,
                       global_batch=int(value) if key == "global-batch" else None)
        try:
            result = plan_job(point, time_limit_s)
        except InfeasibleError as exc:
            rows.append(Row(value, "-", point_cluster.num_devices, point_cluster.device.name, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                            note=f"does not fit: {str(exc).split(':', 1)[-1][:120]}", **placed))
            continue
        good = plan_goodput(result, point_cluster, point.graph.total_params, job=point)
        days = budget / result.tokens_per_s / good.ettr / 86400
        rows.append(Row(value, _short(result.layout), point_cluster.num_devices, point_cluster.device.name,
                        result.step_time_s, result.mfu, result.tokens_per_s, days,
                        days * 24 * point_cluster.num_devices, good.ettr, good.goodput, good.interruptions_per_day,
                        good.interval_s / 60, **placed,
                        step_band_s=tuple(result.step_time_band_s) if result.step_time_band_s else None,
                        extrapolates=_extrapolation(result, point.graph)))
    return Report(job.graph.name, key, budget, tuple(rows))


def _extrapolation(result, graph) -> str:
    """What a point's plan says of the measured region (planner/region.py): its shapes outside it, and the best
    plan a search found inside it; "" where the plan is inside."""
    lay = result.layout
    outside = [shape.words for shape in outside_shapes(graph.seq_len, graph.hidden_size, graph.num_experts, lay.tp,
                                                       lay.cp, lay.ep)]
    if zero3_outside(graph.num_experts, lay.zero, lay.dp * lay.cp):
        outside.append(f"ZeRO-3 over {lay.dp * lay.cp:,} ranks")
    if not outside:
        return ""
    shapes = "; ".join(outside)
    inside = result.inside_measured
    if inside is None:
        job_itself = job_outside_notes(graph.seq_len, graph.hidden_size, graph.num_experts)
        why = "the job itself lies outside it, at any layout" if job_itself else "no plan inside it found"
        return f"outside the measured region ({shapes}); {why}"
    degrees = parse_text(inside.layout)
    best = " ".join(f"{key}{degrees[key]}" for key in ("tp", "pp", "dp", "cp", "ep") if key in degrees)
    return (f"outside the measured region ({shapes}); the best plan inside it: {best}, {inside.step_time_s:.2f} s "
            f"({inside.step_time_s / result.step_time_s - 1:+.1%})")


def _band_text(band, digits: int) -> str:
    return f"{band[0]:.{digits}f}-{band[1]:.{digits}f}" if band else "-"


def _short(layout) -> str:
    return f"tp{layout.tp} pp{layout.pp}x{layout.vp} dp{layout.dp} cp{layout.cp} ep{layout.ep} mbs{layout.mbs} z{layout.zero}"


def write_report(report: Report, out_dir: str | Path) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = report.plot(out / "whatif.png")
    page = report.to_html(out / "whatif.html", image=str(png))
    return png, page


__all__ = ["whatif", "Report", "Row", "write_report", "parse_sweep", "parse_tokens", "replace"]
