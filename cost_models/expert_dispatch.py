"""MoE token dispatch and combine with one copy per destination domain (DeepEP), and routing limited to
a few expert groups (DeepSeek-V3's node-limited routing).

A plain all-to-all sends a token once per chosen expert (top-k copies). DeepEP's normal kernels send it
once per *scale-up domain* that holds one of its experts, over the scale-out network (RDMA), and forward it
inside that domain over NVLink to the GPUs holding the experts (DeepSeek-V3, arXiv 2412.19437, 3.2.2:
"each token is dispatched to at most M nodes", M = 4; 2.1.2 / DeepEP's README: IB to the same-index GPU,
then NVLink). The combine goes back the same way. DeepSeek-V3 dispatches in FP8 (with one fp32 scale per
128 channels) and combines in BF16 (3.3.2).

Experts are laid out contiguously over the ep ranks (E/n per rank), so a domain of k ranks holds E*k/n
experts, and with G groups of E/G experts, G*k/n whole groups where G*k/n >= 1. Routing is taken as
uniform over the experts a token may use: the expected number of *remote* domains one token reaches is
then a sum over hypergeometric draws (below), checked against a simulation of random routing in
tests/test_communication.py.
"""
from __future__ import annotations

from math import comb

from hardware_profiles.schema import Cluster
from hardware_profiles.topology import GroupPlacement

from .communication import CollectiveCost, links_for

FP8_SCALE_CHANNELS = 128   # one fp32 scale per 128 channels (DeepSeek-V3 3.3.2, fine-grained quantisation)


def _miss(population: int, excluded: int, draws: int) -> float:
    """P(no draw lands in `excluded` of `population`), drawing `draws` without replacement."""
    if draws > population:
        return 0.0
    return comb(population - excluded, draws) / comb(population, draws)


def remote_domains(experts: int, topk: int, domains: int, groups: int = 1, group_topk: int = 1) -> float:
    """Expected number of scale-up domains other than its own that one token's top-k experts sit in.

    Without groups: each of the D - 1 remote domains (E/D experts each) is missed by all k draws with
    probability C(E - E/D, k) / C(E, k). With groups, the token first takes M = `group_topk` of G groups,
    then k experts among those groups' M*E/G experts. Groups spanning several domains (D a multiple of G):
    a domain's group is chosen with probability M/G, and its E/D experts are then missed with probability
    C(M*E/G - E/D, k) / C(M*E/G, k). Domains holding several groups (G a multiple of D): a domain holding j
    of the chosen groups is missed with probability C(M*E/G - j*E/G, k) / C(M*E/G, k), j hypergeometric."""
    if domains <= 1:
        return 0.0
    per_group = experts // groups
    pool = group_topk * per_group   # the experts of the chosen groups
    if groups > 1 and group_topk < groups and domains % groups == 0:
        return (domains - 1) * group_topk / groups * (1 - _miss(pool, experts // domains, topk))
    if groups <= 1 or groups % domains or group_topk >= groups:
        return (domains - 1) * (1 - _miss(experts, experts // domains, topk))
    per_domain = groups // domains
    hit = 0.0
    for held in range(0, min(per_domain, group_topk) + 1):   # chosen groups inside one given domain
        chance = comb(per_domain, held) * comb(groups - per_domain, group_topk - held) / comb(groups, group_topk)
        hit += chance * (1 - _miss(pool, held * per_group, topk))
    return (domains - 1) * hit


def fp8_token_bytes(hidden: int) -> float:
    """One token dispatched in FP8: a byte per channel and an fp32 scale per FP8_SCALE_CHANNELS."""
    return hidden * (1 + 4 / FP8_SCALE_CHANNELS)


def deduplicated_exchange(tokens: float, token_bytes: float, topk: int, experts: int, group: GroupPlacement,
                          cluster: Cluster, groups: int = 1, group_topk: int = 1,
                          imbalance: float = 1.0) -> CollectiveCost:
    """One dispatch (or combine) of `tokens` per rank over the ep group, DeepEP-style: one copy per remote
    domain over the scale-out links, the top-k copies forwarded inside the domains over the scale-up ones;
    both run at once, as in `collective_time`'s pairwise all-to-all."""
    if group.size <= 1 or tokens <= 0:
        return CollectiveCost.free()
    links = links_for(group, cluster)
    n, k = group.size, group.ranks_per_domain
    domains = max(1, n // k)
    # inside the domains: each (token, expert) pair whose expert is on another GPU of the domain
    intra_s = tokens * topk * token_bytes * (k - 1) / k / links.intra_all_to_all_bps
    inter_s = tokens * remote_domains(experts, topk, domains, groups, group_topk) * token_bytes / links.inter_bps
    latency = links.base_latency_s + (k - 1) * links.intra_hop_s + (domains - 1) * links.inter_hop_s
    bandwidth = max(intra_s, inter_s) * imbalance
    return CollectiveCost(seconds=bandwidth + latency, bandwidth_seconds=bandwidth, latency_seconds=latency,
                          algorithm="deduplicated")
