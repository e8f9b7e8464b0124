"""Where each dim of a device mesh lands on the cluster: which scale-up domains, nodes and pods a group spans.

Ranks are numbered as Megatron-Core does: the first mesh dim is innermost (fastest varying), so with
the order tp-cp-ep-dp-pp a tp group is a run of consecutive ranks and sits inside one node.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .schema import Cluster, FabricKind


@dataclass(frozen=True)
class MeshDim:
    name: str
    size: int


@dataclass(frozen=True)
class GroupPlacement:
    """Where the process groups of one mesh dim sit on the cluster."""
    dim: str
    size: int                     # ranks per group
    ranks_per_domain: int         # members of one group inside one fast (NVLink/HCCS) domain
    domains: int                  # fast domains one group spans
    ranks_per_node: int           # members of one group on one node
    intra_bandwidth_share: float  # share of a device's fast-domain bandwidth the group can use
    nic_share_per_rank: float     # NICs per rank of this group leaving its node (contention < 1)
    spans_pods: bool              # extends beyond one full-bisection pod
    # of the size-1 hops between members next in rank order (pipeline stage k to k+1), those that leave the
    # scale-up domain; and whether the hop from the last member back to the first does (interleaved stages)
    neighbour_hops_crossing: int = 0
    wrap_hop_crosses: bool = False

    @property
    def crosses_domains(self) -> bool:
        return self.domains > 1

    def hop_crossing_share(self, chunks_per_member: int) -> float:
        """The share of a pipeline's hops that leave the scale-up domain: each of `chunks_per_member` passes
        over the members makes the size-1 neighbour hops, and every pass but the last the wrap-around hop
        (the interleaved schedule's last stage back to the first)."""
        hops = chunks_per_member * (self.size - 1) + chunks_per_member - 1
        if hops <= 0:
            return 0.0
        crossing = chunks_per_member * self.neighbour_hops_crossing + (chunks_per_member - 1) * self.wrap_hop_crosses
        return crossing / hops


@dataclass(frozen=True)
class MeshPlacement:
    dims: tuple[MeshDim, ...]
    groups: tuple[GroupPlacement, ...]

    def of(self, dim: str) -> GroupPlacement:
        for group in self.groups:
            if group.dim == dim:
                return group
        raise KeyError(f"mesh has no dim '{dim}' (dims: {[d.name for d in self.dims]})")


def place_group(dim: str, size: int, stride: int, cluster: Cluster) -> GroupPlacement:
    """Placement of the group that holds rank 0 along a dim with this stride; all groups are alike."""
    return place_factors(dim, ((size, stride),), cluster)


def place_factors(dim: str, factors: tuple[tuple[int, int], ...], cluster: Cluster) -> GroupPlacement:
    """Placement of the group that holds rank 0 and spans one or more mesh dims at once, each a (size,
    stride) factor: its ranks are enumerated and counted per scale-up domain and node (exact where a
    domain is not a power of two, as GB200 NVL72's 72, and where the dims lie apart in the mesh order)."""
    per_node = cluster.devices_per_node
    size, k_domain, k_node, domains, extent, hops_crossing, wrap_crosses = _count_ranks(
        factors, cluster.placement_domain_devices, per_node)
    fabric = cluster.device.intra_node
    physical_domain = cluster.fast_domain_devices
    if fabric.kind in (FabricKind.full_mesh, FabricKind.xgmi_mesh) and physical_domain > 1:
        # a point-to-point mesh gives each peer 1/(D-1) of a device's links: a small group uses few of them
        share = (k_domain - 1) / (physical_domain - 1) if k_domain > 1 else 1.0
    else:
        share = 1.0
    # every device of a node belongs to one group of this dim; the node's NICs are shared by all of them
    nic_share = cluster.inter_node.nics_per_node / per_node
    pod = cluster.inter_node.pod_size_devices
    return GroupPlacement(dim=dim, size=size, ranks_per_domain=k_domain, domains=domains,
                          ranks_per_node=k_node, intra_bandwidth_share=share,
                          nic_share_per_rank=min(1.0, nic_share), spans_pods=bool(pod and extent > pod),
                          neighbour_hops_crossing=hops_crossing, wrap_hop_crosses=wrap_crosses)


@lru_cache(maxsize=65536)
def _count_ranks(factors: tuple[tuple[int, int], ...], domain: int, node: int
                 ) -> tuple[int, int, int, int, int, int, bool]:
    """(size, most members in one domain, most in one node, domains touched, rank extent, neighbour hops
    leaving a domain, whether the wrap-around hop does) of the group that holds rank 0, its members in rank
    order; a search asks for the same few thousand groups again and again."""
    ranks = np.zeros(1, dtype=np.int64)
    for count, stride in factors:
        ranks = np.add.outer(np.arange(count, dtype=np.int64) * stride, ranks).ravel()
    ranks = np.sort(ranks)
    domain_of = ranks // domain
    return (int(ranks.size), int(np.bincount(domain_of).max()), int(np.bincount(ranks // node).max()),
            int(np.unique(domain_of).size), int(ranks.max()) + 1, int(np.count_nonzero(np.diff(domain_of))),
            bool(domain_of[-1] != domain_of[0]))


def place_dims_together(name: str, members: tuple[str, ...], dims: tuple[MeshDim, ...], cluster: Cluster
                        ) -> GroupPlacement:
    """The group of the ranks that differ only along `members` of an ordered mesh (innermost first): the
    data-parallel x context-parallel gradient group, wherever the layout's order puts dp and cp."""
    factors, stride = [], 1
    for dim in dims:
        if dim.name in members:
            factors.append((dim.size, stride))
        stride *= dim.size
    return place_factors(name, tuple(factors), cluster)


def place_mesh(dims: tuple[MeshDim, ...], cluster: Cluster) -> MeshPlacement:
    """Map an ordered mesh (innermost first) onto the cluster and place every dim's groups."""
    world = 1
    for dim in dims:
        world *= dim.size
    if world > cluster.num_devices:
        raise ValueError(f"mesh of {world} ranks does not fit {cluster.num_devices} devices")
    groups = []
    stride = 1
    for dim in dims:
        groups.append(place_group(dim.name, dim.size, stride, cluster))
        stride *= dim.size
    return MeshPlacement(dims=tuple(dims), groups=tuple(groups))
