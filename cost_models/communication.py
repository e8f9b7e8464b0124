"""Collective communication time for a process group placed on the topology.

Bandwidth terms use the NCCL bus-bandwidth definitions (nccl-tests doc/PERFORMANCE.md): all-reduce moves
2(n-1)/n * S per rank, reduce-scatter / all-gather / all-to-all (n-1)/n * S, broadcast S. Latency terms
follow the alpha-beta model (Thakur, Rabenseifner, Gropp 2005): one alpha per algorithm step. As NCCL
and HCCL do, the cheapest algorithm for the size and placement is chosen (ring, tree, in-network
reduction, hierarchical). Every bandwidth and efficiency comes from the device and cluster profiles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from hardware_profiles.schema import Cluster, FabricKind
from hardware_profiles.topology import GroupPlacement

US = 1e-6
GB = 1e9
ACTIVATION_BYTES = 2       # bf16 activations on the wire


class Collective(str, Enum):
    all_reduce = "all_reduce"
    reduce_scatter = "reduce_scatter"
    all_gather = "all_gather"
    all_to_all = "all_to_all"
    send_recv = "send_recv"
    broadcast = "broadcast"


@dataclass(frozen=True)
class CollectiveCost:
    seconds: float
    algorithm: str
    bandwidth_seconds: float
    latency_seconds: float

    @staticmethod
    def free() -> "CollectiveCost":
        return CollectiveCost(0.0, "none", 0.0, 0.0)


@dataclass(frozen=True)
class Links:
    """Achievable per-rank bandwidths (B/s) and per-step latencies (s) for one group."""
    intra_ring_bps: float
    intra_in_network_bps: float | None
    intra_all_to_all_bps: float
    inter_bps: float
    inter_all_to_all_bps: float   # NCCL's pairwise all-to-all's share of `inter_bps`'s line rate
    base_latency_s: float
    intra_hop_s: float
    inter_hop_s: float
    in_network_min_ranks: int
    full_mesh: bool
    nccl_rings: bool = False      # NCCL (RCCL) rings and trees: `_across`


def links_for(group: GroupPlacement, cluster: Cluster) -> Links:
    fabric = cluster.device.intra_node
    intra = fabric.bandwidth_per_direction_gbytes_per_s * GB * group.intra_bandwidth_share
    network = cluster.inter_node
    line = network.nic_bandwidth_gbit_per_s / 8 * GB * group.nic_share_per_rank
    if group.spans_pods:
        line /= network.oversubscription_above_pod
    inter = line * network.busbw_fraction
    inter_all_to_all = line * (network.all_to_all_fraction or network.busbw_fraction)
    in_network = intra * fabric.in_network_fraction if fabric.in_network_reduction else None
    return Links(intra_ring_bps=intra * fabric.ring_busbw_fraction, intra_in_network_bps=in_network,
                 intra_all_to_all_bps=intra * fabric.all_to_all_fraction_for(group.size), inter_bps=inter,
                 inter_all_to_all_bps=inter_all_to_all,
                 base_latency_s=fabric.base_latency_us * US, intra_hop_s=fabric.hop_latency_us * US,
                 inter_hop_s=network.latency_us * US, in_network_min_ranks=fabric.in_network_min_ranks,
                 full_mesh=fabric.kind in (FabricKind.full_mesh, FabricKind.xgmi_mesh),
                 nccl_rings=cluster.device.collective_backend in ("nccl", "rccl"))


def ring_factor(op: Collective, n: int) -> float:
    """Bytes each rank moves per byte of the full buffer (nccl-tests bus-bandwidth factors)."""
    if n <= 1:
        return 0.0
    if op is Collective.all_reduce:
        return 2 * (n - 1) / n
    if op in (Collective.reduce_scatter, Collective.all_gather, Collective.all_to_all):
        return (n - 1) / n
    return 1.0


def ring_steps(op: Collective, n: int) -> int:
    """Algorithm steps of a ring: 2(n-1) for all-reduce, n-1 for the halves (Thakur et al. 2005)."""
    return 2 * (n - 1) if op is Collective.all_reduce else n - 1


def _cost(bandwidth_s: float, latency_s: float, name: str) -> CollectiveCost:
    return CollectiveCost(bandwidth_s + latency_s, name, bandwidth_s, latency_s)


def _intra(op: Collective, size: float, n: int, links: Links, allow_in_network: bool) -> list[CollectiveCost]:
    """Candidates inside one fast domain."""
    steps = 1 if links.full_mesh else ring_steps(op, n)  # HCCL mesh: all peers at once, O(1) steps
    if op is Collective.all_reduce and links.full_mesh:
        steps = 2
    bandwidth = links.intra_all_to_all_bps if op is Collective.all_to_all else links.intra_ring_bps
    options = [_cost(ring_factor(op, n) * size / bandwidth,
                     links.base_latency_s + steps * links.intra_hop_s, "mesh" if links.full_mesh else "ring")]
    if (op is Collective.all_reduce and allow_in_network and links.intra_in_network_bps
            and n >= links.in_network_min_ranks):
        # NVLS: each rank pushes S into the switch and pulls S reduced; two switch traversals
        options.append(_cost(size / links.intra_in_network_bps, links.base_latency_s + 2 * links.intra_hop_s,
                             "nvls"))
    return options


def _inter_steps(op: Collective, m: int, tree: bool) -> int:
    if tree:
        return 2 * max(1, math.ceil(math.log2(m))) if op is Collective.all_reduce else max(1, math.ceil(math.log2(m)))
    return ring_steps(op, m)


def _across(op: Collective, size: float, group: GroupPlacement, links: Links,
            allow_in_network: bool) -> list[CollectiveCost]:
    """Candidates for a group spanning m domains with k ranks in each."""
    n, k, m = group.size, group.ranks_per_domain, group.domains
    options = []
    # flat ring over all n ranks, one NIC per ring: the inter-domain edge carries the whole ring's traffic
    flat_latency = links.base_latency_s + ring_steps(op, n) * max(links.intra_hop_s, links.inter_hop_s)
    options.append(_cost(ring_factor(op, n) * size / links.inter_bps, flat_latency, "ring"))
    # hierarchical: inside each domain over k ranks, across domains over m ranks on S/k, pipelined
    for tree in (False, True):
        if tree and links.nccl_rings and op is not Collective.all_reduce:
            continue   # NCCL runs Tree for all-reduce only (NVIDIA/nccl src/graph/tuning.cc)
        inner = _intra(op, size, k, links, allow_in_network) if k > 1 else [CollectiveCost.free()]
        best_inner = min(inner, key=lambda c: c.seconds)
        outer_bw = ring_factor(op, m) * (size / k) / links.inter_bps
        bandwidth = max(best_inner.bandwidth_seconds, outer_bw)
        if links.nccl_rings and not tree:
            # NCCL's channels spread a ring's domain crossings over the NICs (the bandwidth above), but each ring
            # still passes every rank: n-1 steps (all-reduce 2(n-1)), m-1 (2(m-1)) of them between domains
            # (NVIDIA/nccl src/graph/tuning.cc, ring latencies)
            crossings = ring_steps(op, m)
            latency = links.base_latency_s + (ring_steps(op, n) - crossings) * links.intra_hop_s \
                + crossings * links.inter_hop_s
        else:
            inner_steps_latency = max(0.0, best_inner.latency_seconds - links.base_latency_s)
            latency = links.base_latency_s + inner_steps_latency + _inter_steps(op, m, tree) * links.inter_hop_s
        options.append(_cost(bandwidth, latency, ("tree" if tree else "ring") + ("+hier" if k > 1 else "")))
    return options


def _all_to_all(size: float, group: GroupPlacement, links: Links, imbalance: float) -> CollectiveCost:
    """Pairwise exchange: S/n to every peer; on-domain and off-domain parts run concurrently."""
    n, k = group.size, group.ranks_per_domain
    intra_bw = (k - 1) / n * size / links.intra_all_to_all_bps
    inter_bw = (n - k) / n * size / links.inter_all_to_all_bps
    latency = links.base_latency_s + (k - 1) * links.intra_hop_s + (n - k) * links.inter_hop_s / max(1, k)
    return _cost(max(intra_bw, inter_bw) * imbalance, latency, "pairwise")


def collective_time(op: Collective, size_bytes: float, group: GroupPlacement, cluster: Cluster,
                    *, imbalance: float = 1.0, allow_in_network: bool = True,
                    crossing_share: float | None = None) -> CollectiveCost:
    """Time of one collective over every group of a mesh dim, all groups running at once.

    `size_bytes` is the full buffer (nccl-tests' S): the all-reduced tensor, the gathered output,
    the scattered input, or what one rank sends in an all-to-all. `crossing_share`: for a send_recv, the
    share of the pipeline's hops that leave the scale-up domain (GroupPlacement.hop_crossing_share).
    """
    if group.size <= 1 or size_bytes <= 0:
        return CollectiveCost.free()
    links = links_for(group, cluster)
    if op is Collective.send_recv:
        # each hop pays the tier it crosses: a share of them leave the domain (all where not given)
        share = (1.0 if group.crosses_domains else 0.0) if crossing_share is None else crossing_share
        bandwidth_s = size_bytes * (share / links.inter_bps + (1 - share) / links.intra_ring_bps)
        hop = share * links.inter_hop_s + (1 - share) * links.intra_hop_s
        return _cost(bandwidth_s, links.base_latency_s + hop, "p2p")
    if op is Collective.all_to_all:
        return _all_to_all(size_bytes, group, links, imbalance)
    if op is Collective.broadcast:
        bandwidth = links.inter_bps if group.crosses_domains else links.intra_ring_bps
        steps = max(1, math.ceil(math.log2(group.size)))
        return _cost(size_bytes / bandwidth, links.base_latency_s + steps * links.inter_hop_s, "pipelined-tree")
    if group.crosses_domains:
        options = _across(op, size_bytes, group, links, allow_in_network)
    else:
        options = _intra(op, size_bytes, group.size, links, allow_in_network)
    return min(options, key=lambda c: c.seconds)


def bus_bandwidth(op: Collective, size_bytes: float, seconds: float, n: int) -> float:
    """nccl-tests busbw (B/s) of a measured or predicted time, for comparison with published tables."""
    return ring_factor(op, n) * size_bytes / seconds
