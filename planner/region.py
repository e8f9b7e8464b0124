"""Where a plan lies against the layouts published runs measured (planner/measured_region.yaml, written by
benchmarks/measured_region.py): the per-rank shapes a prediction's accuracy rests on. Outside the ranges the
runs covered the model is extrapolating (cp's per-chunk overheads at a few hundred tokens per rank, the skinny
GEMMs of a wide tp, many experts per rank), and the plan says so, shape by shape."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from hardware_profiles.parsing import parse_yaml, read_bounded_text

REGION_PATH = Path(__file__).resolve().parent / "measured_region.yaml"
WORDS = {"tokens_per_cp_rank": "tokens per context-parallel rank (sequence / cp)",
         "hidden_per_tp_rank": "hidden width per tensor-parallel rank (hidden / tp)",
         "experts_per_ep_rank": "routed experts per expert-parallel rank (experts / ep)"}


SHAPE_DEGREES = {"tokens_per_cp_rank": "cp", "hidden_per_tp_rank": "tp", "experts_per_ep_rank": "ep"}


@dataclass(frozen=True)
class ShapeBound:
    """A degree (user key) kept to where the per-rank shape it gives, `total // degree`, lies in [low, high]."""
    degree: str
    total: int
    low: int
    high: int

    def allows(self, value: int) -> bool:
        return self.low <= self.total // value <= self.high


def measured_bounds(seq_len: int, hidden_size: int, num_experts: int) -> tuple[ShapeBound, ...]:
    """The degrees' bounds that keep a layout inside what the published runs of the model's class measured."""
    ranges = _region().get("MoE" if num_experts else "dense", {})
    totals = {"tokens_per_cp_rank": seq_len, "hidden_per_tp_rank": hidden_size, "experts_per_ep_rank": num_experts}
    return tuple(ShapeBound(degree, totals[name], *ranges[name]) for name, degree in SHAPE_DEGREES.items()
                 if name in ranges and totals[name])


def reachable(bound: ShapeBound) -> bool:
    """Whether any degree gives a per-rank shape `total // degree` inside the bound (it only falls as the
    degree grows, so the look stops below `low`)."""
    for degree in range(1, bound.total + 1):
        value = bound.total // degree
        if value < bound.low:
            return False
        if value <= bound.high:
            return True
    return False


def job_outside_notes(seq_len: int, hidden_size: int, num_experts: int) -> list[str]:
    """Per-rank shapes no layout can bring inside the measured region: the job itself lies outside it (a
    sequence shorter than any published run's), so no plan inside exists to show."""
    kind = "MoE" if num_experts else "dense"
    runs = _region().get(kind, {}).get("runs")
    words = {degree: WORDS[name] for name, degree in SHAPE_DEGREES.items()}
    whole = {"cp": "the job's sequence", "tp": "the model's hidden width", "ep": "the model's routed experts"}
    return [f"the job itself lies outside the measured region: {words[b.degree]} is at most {b.total:,} at any "
            f"{b.degree} ({whole[b.degree]}), where the {runs} published {kind} runs measured "
            f"{b.low:,} to {b.high:,}; every layout extrapolates there, so no plan inside it is shown"
            for b in measured_bounds(seq_len, hidden_size, num_experts) if not reachable(b)]


def shapes(seq_len: int, hidden_size: int, num_experts: int, tp: int, cp: int, ep: int) -> dict[str, int]:
    """A layout's per-rank shapes, as the region records them."""
    measured = {"tokens_per_cp_rank": seq_len // cp, "hidden_per_tp_rank": hidden_size // tp}
    if num_experts:
        measured["experts_per_ep_rank"] = num_experts // ep
    return measured


@lru_cache(maxsize=1)
def _region() -> dict:
    if not REGION_PATH.exists():
        return {}
    return parse_yaml(read_bounded_text(REGION_PATH, "measured-region table", 1 << 16), str(REGION_PATH)) or {}


@dataclass(frozen=True)
class OutsideShape:
    """A per-rank shape of a layout outside the range the published runs of its class measured."""
    name: str      # a key of WORDS
    value: int
    low: int
    high: int

    @property
    def words(self) -> str:
        return f"{self.value:,} {WORDS[self.name]}"


def outside_shapes(seq_len: int, hidden_size: int, num_experts: int, tp: int, cp: int, ep: int) -> list[OutsideShape]:
    """The layout's per-rank shapes outside what the published runs of the model's class measured."""
    ranges = _region().get("MoE" if num_experts else "dense", {})
    return [OutsideShape(name, value, *ranges[name])
            for name, value in shapes(seq_len, hidden_size, num_experts, tp, cp, ep).items()
            if name in ranges and not ranges[name][0] <= value <= ranges[name][1]]


def zero3_ranks_max(num_experts: int) -> int | None:
    """The most ranks (dp x cp) a published run of the model's class sharded its parameters over (ZeRO-3, FSDP): 0
    where none did, None for a table without the figure."""
    return _region().get("MoE" if num_experts else "dense", {}).get("zero3_ranks_max")


def zero3_outside(num_experts: int, zero: int, sharded_ranks: int) -> bool:
    """Whether the layout shards its parameters (ZeRO-3) over more ranks than any published run of its class did."""
    most = zero3_ranks_max(num_experts)
    return zero >= 3 and sharded_ranks > 1 and most is not None and sharded_ranks > most


def zero3_note(num_experts: int, zero: int, sharded_ranks: int) -> list[str]:
    """Where the layout shards its parameters over more ranks than any published run of its class did: the model
    runs a layer's all-gathers at the fabric's full rate, which DeepSpeed's ZeRO-3 runs of Narayanan et al. 2021
    fell short of from 768 A100s, even billed as their v0.3.15 ran them (docs/ranking.md)."""
    if not zero3_outside(num_experts, zero, sharded_ranks):
        return []
    most = zero3_ranks_max(num_experts)
    kind = "MoE" if num_experts else "dense"
    runs = _region().get(kind, {}).get("runs")
    measured = f"at most {most:,}" if most else "none"
    return [f"outside the measured region: ZeRO-3 parameter sharding over {sharded_ranks:,} ranks (dp x cp), where "
            f"the {runs} published {kind} runs sharded over {measured}; the prediction extrapolates there (DeepSpeed's "
            "ZeRO-3 runs without model parallelism on 768 to 2,240 A100s, never fitted, ran up to 1.8 times as slow "
            "as this model predicts them: docs/ranking.md)"]


def measured_dispatchers(num_experts: int, device: str) -> tuple[str, ...]:
    """The MoE dispatchers the published MoE runs on `device` measured (their stacks' and launchers'), or, where
    none ran on it, those the runs on every device measured (a dispatcher's links and kernels differ by device:
    HybridEP inside an NVL72 rack is not DeepEP across InfiniBand nodes); () for a dense model or a table without
    them."""
    by_device = _region().get("MoE", {}).get("dispatchers", {}) if num_experts else {}
    if device in by_device:
        return tuple(by_device[device])
    return tuple(sorted(set.intersection(*map(set, by_device.values())))) if by_device else ()


def overlap_measured(num_experts: int, device: str) -> bool:
    """Whether a published MoE run on `device` ran combined 1F1B (or, where none ran on it, one on every device): its
    gain depends on the device's links and host (NVIDIA's DeepSeek-V3 GB200 guide found it a net loss while the host
    bound the step, Megatron-LM docs/discussions/deepseek-v3-gb200-optimization, 'Why didn't we use 1F1B AlltoAll
    overlap'; Megatron-Bridge's 26.08 GB200 recipes run it beside full-iteration CUDA graphs)."""
    moe = _region().get("MoE", {}) if num_experts else {}
    measured = moe.get("a2a_overlap_devices", [])
    devices = moe.get("dispatchers", {})
    return device in measured or (device not in devices and bool(devices) and set(devices) <= set(measured))


def overlap_ab_note(device: str, credited_saving: float) -> list[str]:
    """What the published A/Bs of combined 1F1B on `device` measured it saving (never fitted; measured_region.yaml
    `a2a_overlap_ab`) beside what the model credited at their layouts, and what it credits this plan (the model's
    credit rests on the two-stream schedule and the device's measured dispatch rate beside compute); where every A/B
    realised less, it says this credit may be too large."""
    found = _region().get("MoE", {}).get("a2a_overlap_ab", {}).get(device, [])
    if not found:
        return []
    each = "; ".join(f"{ab['job']} ({ab['source']}): {ab['measured_saving']:.1%} of the step measured, "
                     f"{ab['model_saving']:.1%} credited" + (f" (its source's Nsight comparison gives {ab['informs']})"
                                                              if ab.get("informs") else "") for ab in found)
    less = all(ab["measured_saving"] < ab["model_saving"] for ab in found)
    return [f"combined 1F1B saves {credited_saving:.1%} of this plan's step without it; published A/Bs on {device}, "
            f"their step times never fitted: {each}" + ("; runs realised less than the model credits, so this plan's "
                                                       "credit may be too large" if less else "")]


def outside_notes(seq_len: int, hidden_size: int, num_experts: int, tp: int, cp: int, ep: int,
                  dispatcher: str = "alltoall", offload_layers: int = 0, device: str = "",
                  a2a_overlap: bool = False, zero: int = 0, sharded_ranks: int = 1) -> list[str]:
    """One line per shape outside what the published runs of the model's class measured, the MoE dispatcher
    and combined 1F1B where none of them on the device ran so, ZeRO-3 over more ranks than any of them sharded
    over, and activation offloading, which none states."""
    kind = "MoE" if num_experts else "dense"
    runs = _region().get(kind, {}).get("runs")
    notes = [f"outside the measured region: {shape.words}, where the {runs} published {kind} runs measured "
             f"{shape.low:,} to {shape.high:,}; the prediction extrapolates there"
             for shape in outside_shapes(seq_len, hidden_size, num_experts, tp, cp, ep)]
    measured = measured_dispatchers(num_experts, device)
    if ep > 1 and measured and str(dispatcher) not in measured:
        notes.append(f"outside the measured region: the {dispatcher} MoE dispatcher on {device}, where the published "
                     f"MoE runs there dispatched with {', '.join(measured)}; the prediction extrapolates there")
    if a2a_overlap and not overlap_measured(num_experts, device):
        devices = ", ".join(_region().get("MoE", {}).get("a2a_overlap_devices", [])) or "no device"
        notes.append(f"outside the measured region: combined 1F1B (MoE all-to-all overlap) on {device}, where the "
                     f"published MoE runs ran it on {devices} only (runs never fitted that did: "
                     "docs/accuracy-plain.md); the prediction extrapolates there")
    notes += zero3_note(num_experts, zero, sharded_ranks)
    if offload_layers:
        notes.append(f"outside the measured region: activation offloading ({offload_layers} layers), which none of "
                     "the published runs the model was fitted on states (Megatron-Bridge's GB200 Megatron-FSDP "
                     "sweeps ran it, never fitted: docs/ranking.md); the prediction extrapolates there")
    return notes
