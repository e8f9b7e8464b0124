"""Where a job's devices sit in scale-up domains that span nodes (NVL72 racks, Ascend supernodes): packed (whole
domains first, the rest in a last one) or in equal segments of whole nodes per domain (Slurm's `--segment`, which
NVIDIA's Megatron-Bridge launcher asks for on 4-GPU nodes). The planner chooses it per plan where the user gives
none: an expert or tensor group that fits a segment stays on NVLink, while packing gives larger domains to more
of the job. Each choice is searched; the plan says which won and what the others cost."""
from __future__ import annotations

from hardware_profiles.schema import Cluster

SEGMENT_CHOICES = 2   # the largest equal segments tried beside packing (smaller ones only cut NVLink groups)


def placement_choices(cluster: Cluster) -> list[Cluster]:
    """The cluster as given where its placement is stated or has no choice; else packed, then the largest
    equal segments of whole nodes that divide the job's nodes."""
    domain_nodes = cluster.fast_domain_devices // cluster.devices_per_node
    if cluster.segment_devices is not None or domain_nodes <= 1 or cluster.num_devices <= cluster.fast_domain_devices \
            or cluster.num_nodes % domain_nodes == 0:   # whole domains: packing is already equal segments
        return [cluster]
    sizes = [k for k in range(domain_nodes - 1, 0, -1) if cluster.num_nodes % k == 0][:SEGMENT_CHOICES]
    return [cluster] + [cluster.model_copy(update={"segment_devices": k * cluster.devices_per_node}) for k in sizes]


def placement_words(cluster: Cluster) -> str:
    if cluster.segment_devices is None:
        return "packed domains"
    return f"segments of {cluster.segment_devices} devices per domain (--segment {cluster.segment_devices // cluster.devices_per_node} nodes)"


def placement_reason(chosen: Cluster, tried: list[tuple[Cluster, float | None]]) -> str:
    """What the plan says of the placement it chose, beside what each other one gave."""
    others = "; ".join(f"{placement_words(c)}: " + (f"{s:.3f} s" if s is not None else "no plan")
                       for c, s in tried if c is not chosen)
    return f"placement chosen by the search: {placement_words(chosen)} ({others})"
