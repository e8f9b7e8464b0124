"""Why a plan: the reasons a person reads, and what each alternative loses."""
from __future__ import annotations

from cost_models.layout import Recompute
from cost_models.layout_codec import text_of
from cost_models.step_time import Estimate
from hardware_profiles.schema import Cluster

from .plans import Alternative
from .search.tree import six_digits

PART_NAMES = {
    "compute_s": "compute", "recompute_s": "recomputation", "tp_comm_s": "tensor-parallel communication",
    "cp_comm_s": "context-parallel communication", "ep_comm_s": "expert all-to-all",
    "zero_comm_s": "ZeRO-2/3 per-micro-batch communication", "pipeline_bubble_s": "pipeline bubble",
    "pp_comm_s": "pipeline sends", "dp_comm_s": "data-parallel gradient reduction",
    "optimizer_s": "optimizer step",
}


def _largest_loss(best: Estimate, other: Estimate) -> str:
    mine, theirs = best.breakdown.parts(), other.breakdown.parts()
    part = max(theirs, key=lambda name: theirs[name] - mine[name])
    return f"+{theirs[part] - mine[part]:.3f} s {PART_NAMES[part]}"


def _loses(best: Estimate, other: Estimate) -> str:
    if six_digits(other.step_time_s) == six_digits(best.step_time_s):  # the search's tie rule
        return "ties; the plan is the simpler layout"
    return f"{(other.step_time_s / best.step_time_s - 1) * 100:.1f}% slower: " + _largest_loss(best, other)


def alternatives(best: Estimate, others: list[Estimate]) -> list[Alternative]:
    return [Alternative(layout=text_of(other.layout), step_time_s=other.step_time_s, mfu=other.mfu,
                        loses=_loses(best, other)) for other in others]


def reasons(best: Estimate, cluster: Cluster, others: list[Estimate]) -> list[str]:
    lay = best.layout
    out = []
    if lay.tp > 1:
        inside = lay.tp <= cluster.fast_domain_devices
        out.append(f"tp={lay.tp}{' with sequence parallelism' if lay.sp else ''} "
                   + ("keeps tensor-parallel traffic inside the "
                      f"{cluster.fast_domain_devices}-device {cluster.device.intra_node.kind.value} domain"
                      if inside else "spans fast domains (pinned)"))
    parts = best.breakdown.parts()
    ranked = sorted(((v, k) for k, v in parts.items() if k != "compute_s" and v > 0), reverse=True)
    share = parts["compute_s"] / best.step_time_s * 100
    out.append(f"compute is {share:.0f}% of the step"
               + (f"; the largest overhead is {PART_NAMES[ranked[0][1]]} ({ranked[0][0]:.3f} s)" if ranked else ""))
    fullest = max(best.stage_memory, key=lambda s: s.total)
    out.append(f"fullest stage {fullest.stage} uses {fullest.total / 1e9:.1f} of {fullest.capacity / 1e9:.1f} GB usable")
    counts = {r: best.layer_recompute.count(r) for r in Recompute}
    if counts[Recompute.full] or counts[Recompute.selective]:
        out.append(f"recomputation on {counts[Recompute.full]} layers (full) and {counts[Recompute.selective]} "
                   "(selective) is the cheapest way to fit memory")
    if lay.pp > 1:
        uneven = len(set(best.stage_layers)) > 1
        out.append(f"{lay.pp} pipeline stages x {lay.vp} virtual, {lay.num_micro_batches} micro-batches"
                   + ("; layers split unevenly to balance the embedding and head" if uneven else ""))
    if others:
        out.append(f"the next best ({text_of(others[0].layout)}) {_loses(best, others[0])}")
    return out
