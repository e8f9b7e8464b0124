"""The communication model against closed forms and the measured bus bandwidths in hardware-facts.md."""
import math

import pytest

from cost_models.communication import Collective, bus_bandwidth, collective_time, links_for
from hardware_profiles import MeshDim, load_cluster, place_mesh

GIB = 2 ** 30
MIB = 2 ** 20


def _group(cluster, size, stride_dims=()):
    dims = tuple(MeshDim(f"inner{i}", s) for i, s in enumerate(stride_dims)) + (MeshDim("x", size),)
    return place_mesh(dims, cluster).of("x")


def _busbw(cluster_name, n, size, allow_in_network=True, num_devices=None):
    cluster = load_cluster(cluster_name)
    if num_devices:
        cluster = cluster.with_devices(num_devices)
    t = collective_time(Collective.all_reduce, size, _group(cluster, n), cluster, allow_in_network=allow_in_network)
    return bus_bandwidth(Collective.all_reduce, size, t.seconds, n) / 1e9


def test_ring_all_reduce_is_textbook_alpha_beta():
    cluster = load_cluster("dgx-a100")
    group = _group(cluster, 8)
    links = links_for(group, cluster)
    size = 3 * GIB
    n = 8
    expected = 2 * (n - 1) / n * size / links.intra_ring_bps + links.base_latency_s + 2 * (n - 1) * links.intra_hop_s
    got = collective_time(Collective.all_reduce, size, group, cluster)
    assert got.algorithm == "ring"
    assert got.seconds == pytest.approx(expected, rel=1e-12)


def test_all_gather_and_reduce_scatter_are_half_an_all_reduce_in_bandwidth():
    cluster = load_cluster("dgx-a100")
    group = _group(cluster, 8)
    ar = collective_time(Collective.all_reduce, GIB, group, cluster)
    ag = collective_time(Collective.all_gather, GIB, group, cluster)
    rs = collective_time(Collective.reduce_scatter, GIB, group, cluster)
    assert ag.bandwidth_seconds == pytest.approx(ar.bandwidth_seconds / 2)
    assert rs.bandwidth_seconds == pytest.approx(ar.bandwidth_seconds / 2)


@pytest.mark.parametrize("cluster,in_network,measured", [
    ("dgx-a100", True, 234.89),    # 8x A100 all_reduce_bench 16 GiB (HF 2b)
    ("dgx-h100", True, 480.0),     # 8x H100 NVLS 4 GiB (HF 2b)
    ("dgx-h200", True, 482.26),    # 8x H200 NVLS 16 GiB
    ("dgx-h200", False, 367.2),    # 8x H200 ring, NCCL_NVLS_ENABLE=0, 16 GiB
    ("dgx-b200", True, 838.0),     # 8x B200 NVLS 8 GiB
    ("dgx-b200", False, 682.2),    # 8x B200 ring 8 GiB
])
def test_large_message_bus_bandwidth_within_10_percent(cluster, in_network, measured):
    predicted = _busbw(cluster, 8, 16 * GIB, allow_in_network=in_network)
    assert predicted == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize("size,measured", [(MIB, 39.93), (16 * MIB, 219.89), (GIB, 463.58)])
def test_h200_sweep_points(size, measured):
    tolerance = 0.10 if size >= GIB else 0.30
    assert _busbw("dgx-h200", 8, size) == pytest.approx(measured, rel=tolerance)


def test_four_b200_nodes_over_efa_within_10_percent():
    # 4 x 8 B200, 16 GiB all-reduce: busbw 381.80 GB/s (HF 2b, [^27])
    assert _busbw("p6-b200-efa", 32, 16 * GIB, num_devices=32) == pytest.approx(381.80, rel=0.10)


def test_hierarchical_beats_flat_ring_across_nodes_for_large_messages():
    cluster = load_cluster("dgx-h100")
    group = _group(cluster, 64)
    best = collective_time(Collective.all_reduce, 4 * GIB, group, cluster)
    links = links_for(group, cluster)
    flat = 2 * 63 / 64 * 4 * GIB / links.inter_bps
    assert "hier" in best.algorithm
    assert best.seconds < flat / 4


def test_group_inside_a_node_never_costs_more_than_spread_over_nodes():
    cluster = load_cluster("dgx-h100")
    inside = _group(cluster, 8)
    spread = _group(cluster, 8, stride_dims=(8,))
    assert not inside.crosses_domains and spread.crosses_domains
    for op in Collective:
        for size in (MIB, 64 * MIB, 4 * GIB):
            assert (collective_time(op, size, inside, cluster).seconds
                    <= collective_time(op, size, spread, cluster).seconds)


def test_shared_nics_slow_a_group_by_the_sharing_factor():
    # 8 dp groups leave each node; with 4 NICs instead of 8, each rank gets half a NIC.
    full = load_cluster("dgx-h100")
    half = full.model_copy(update={"inter_node": full.inter_node.model_copy(update={"nics_per_node": 4})})
    dims = (MeshDim("tp", 8), MeshDim("dp", 16))
    g_full = place_mesh(dims, full).of("dp")
    g_half = place_mesh(dims, half).of("dp")
    assert g_half.nic_share_per_rank == pytest.approx(g_full.nic_share_per_rank / 2)
    t_full = collective_time(Collective.all_reduce, 8 * GIB, g_full, full)
    t_half = collective_time(Collective.all_reduce, 8 * GIB, g_half, half)
    assert t_half.bandwidth_seconds == pytest.approx(2 * t_full.bandwidth_seconds, rel=1e-9)


def test_oversubscription_above_pod_slows_groups_that_span_pods():
    cluster = load_cluster("dgx-h100").with_devices(8192)
    inside = place_mesh((MeshDim("tp", 8), MeshDim("dp", 256), MeshDim("pp", 4)), cluster)
    assert not inside.of("dp").spans_pods and inside.of("pp").spans_pods
    assert links_for(inside.of("pp"), cluster).inter_bps == pytest.approx(
        links_for(inside.of("dp"), cluster).inter_bps / 7)


def test_full_mesh_small_group_uses_only_its_links():
    # Ascend HCCS full mesh: a pair uses 1 of 7 links; MI300X measured 47.7 vs 312.9 GB/s (HF 2b)
    cluster = load_cluster("mi300x-cluster")
    two = _busbw("mi300x-cluster", 2, 4 * GIB)
    eight = _busbw("mi300x-cluster", 8, 4 * GIB)
    assert eight == pytest.approx(312.9, rel=0.10)
    assert two == pytest.approx(47.7, rel=0.10)
    assert cluster.device.intra_node.kind.value == "xgmi-mesh"


def test_all_to_all_imbalance_scales_bandwidth_term():
    cluster = load_cluster("h800-deepseek")
    group = _group(cluster, 64)
    even = collective_time(Collective.all_to_all, 256 * MIB, group, cluster)
    skewed = collective_time(Collective.all_to_all, 256 * MIB, group, cluster, imbalance=1.5)
    assert skewed.bandwidth_seconds == pytest.approx(1.5 * even.bandwidth_seconds)


def test_single_rank_group_is_free():
    cluster = load_cluster("dgx-h100")
    group = _group(cluster, 1)
    assert collective_time(Collective.all_reduce, GIB, group, cluster).seconds == 0.0


@pytest.mark.parametrize("op", [Collective.all_gather, Collective.reduce_scatter, Collective.all_reduce])
def test_nccl_rings_across_nodes_pass_every_rank_and_run_no_tree_for_gathers(op):
    """NCCL's tuning model (NVIDIA/nccl src/graph/tuning.cc): all-gather and reduce-scatter run on rings (PAT, NVLS,
    CollNet aside), never on Tree; a ring's latency counts every rank it passes, n - 1 steps (all-reduce 2(n - 1)),
    of which m - 1 (2(m - 1)) cross between the m nodes, the rest inside them. 1,536 ranks over 192 nodes: a tiny
    message costs the ring's steps alone, where a hierarchical count of (k - 1) + (m - 1) would give under a quarter."""
    cluster = load_cluster("dgx-a100").with_devices(1536)
    group = _group(cluster, 1536)
    links = links_for(group, cluster)
    n, m = 1536, 192
    steps, crossings = (2 * (n - 1), 2 * (m - 1)) if op is Collective.all_reduce else (n - 1, m - 1)
    ring = links.base_latency_s + (steps - crossings) * links.intra_hop_s + crossings * links.inter_hop_s
    got = collective_time(op, 1024, group, cluster)
    if op is Collective.all_reduce:
        assert got.algorithm.startswith("tree") and got.latency_seconds < ring   # NCCL's Tree: all-reduce only
    else:
        assert got.algorithm == "ring+hier"
        assert got.latency_seconds == pytest.approx(ring, rel=1e-12)
        assert got.latency_seconds > 4 * (links.base_latency_s + 7 * links.intra_hop_s + 191 * links.inter_hop_s)


def test_tree_latency_grows_with_log_of_nodes():
    cluster = load_cluster("dgx-h100").with_devices(16384)
    small = collective_time(Collective.all_reduce, 1024, _group(cluster, 2048, (8,)), cluster)
    assert small.algorithm.startswith("tree")
    assert small.latency_seconds < 2 * 2047 * links_for(_group(cluster, 2048, (8,)), cluster).inter_hop_s
    assert math.isfinite(small.seconds)


def _simulated_remote_domains(experts, topk, domains, groups, group_topk, samples=20000, seed=0):
    """Random routing, drawn here: a token on domain 0 picks `group_topk` groups, then `topk` experts among
    their experts (uniformly, without replacement); count the other domains it reaches."""
    import random
    rng = random.Random(seed)
    per_domain, per_group = experts // domains, experts // groups
    total = 0
    for _ in range(samples):
        chosen = rng.sample(range(groups), group_topk) if groups > 1 else [0]
        pool = [g * per_group + i for g in chosen for i in range(per_group)] if groups > 1 else range(experts)
        hit = {expert // per_domain for expert in rng.sample(list(pool), topk)}
        total += len(hit - {0})
    return total / samples


@pytest.mark.parametrize("experts,topk,domains,groups,group_topk", [
    (256, 8, 8, 1, 1),     # DeepSeek-V3 experts over 8 nodes, routing unlimited
    (256, 8, 8, 8, 4),     # ... node-limited: 8 groups (one per node), 4 per token
    (64, 6, 4, 8, 3),      # two groups per domain
    (256, 8, 16, 8, 4),    # DeepSeek-V3 over 16 nodes (tp2 beside ep64): each group spans two
    (160, 6, 20, 1, 1),    # DeepSeek-V2-like, many domains
])
def test_deduplicated_dispatch_reaches_the_domains_random_routing_reaches(experts, topk, domains, groups, group_topk):
    from cost_models.expert_dispatch import remote_domains
    want = _simulated_remote_domains(experts, topk, domains, groups, group_topk)
    assert remote_domains(experts, topk, domains, groups, group_topk) == pytest.approx(want, rel=0.02)


def test_deduplicated_dispatch_inside_one_domain_is_the_plain_all_to_all():
    """Within one NVLink domain nothing is deduplicated: the DeepEP-style exchange costs what the pairwise
    all-to-all of the same top-k copies costs; across nodes it sends fewer bytes over the scale-out links."""
    from cost_models.expert_dispatch import deduplicated_exchange
    from planner.job import resolve_cluster
    cluster = resolve_cluster(device="h100-sxm", num_devices=64)
    inside = _group(cluster, 8)
    tokens, hidden, topk = 4096, 7168, 8
    plain = collective_time(Collective.all_to_all, tokens * topk * hidden * 2, inside, cluster)
    dedup = deduplicated_exchange(tokens, hidden * 2, topk, 256, inside, cluster)
    assert dedup.bandwidth_seconds == pytest.approx(plain.bandwidth_seconds, rel=1e-9)
    across = _group(cluster, 64)
    plain = collective_time(Collective.all_to_all, tokens * topk * hidden * 2, across, cluster)
    dedup = deduplicated_exchange(tokens, hidden * 2, topk, 256, across, cluster, groups=8, group_topk=4)
    # a remote node is among the token's 4 groups with probability 4/8 and then gets one of its 8 experts
    # unless all 8 fall in the other 3 chosen groups: 7 * 0.5 * (1 - C(96, 8)/C(128, 8)) = 3.17 copies
    # over the scale-out links instead of the plain all-to-all's 7 (8 x 56/64)
    copies = 7 * 0.5 * (1 - math.comb(96, 8) / math.comb(128, 8))
    # and at the rings' share of the line rate (DeepEP's RDMA kernels: 43-51 GB/s of CX7's 50, hardware-facts.md),
    # where NCCL's pairwise all-to-all keeps the cluster's all-to-all share
    network = cluster.inter_node
    rings_over_pairwise = network.busbw_fraction / network.all_to_all_fraction
    assert dedup.bandwidth_seconds == pytest.approx(plain.bandwidth_seconds * copies / 7 / rings_over_pairwise,
                                                    rel=0.01)


@pytest.mark.parametrize("fraction", [None, 0.5, 0.61])
def test_pairwise_all_to_all_across_nodes_runs_at_the_clusters_all_to_all_share(fraction):
    """NCCL's all-to-all across n ranks, k per node: each rank's (n - k)/n remote share leaves through its own
    NIC (nccl-tests issue 130: "the portion that's going through the network will determine the global time")
    at the profile's all-to-all share of the line rate, or the rings' where the profile gives none."""
    from planner.job import resolve_cluster
    cluster = resolve_cluster(device="h100-sxm", num_devices=64)
    network = cluster.inter_node.model_copy(update={"all_to_all_fraction": fraction})
    cluster = cluster.model_copy(update={"inter_node": network})
    size = 256 * MIB
    line = network.nic_bandwidth_gbit_per_s / 8 * 1e9
    share = network.busbw_fraction if fraction is None else fraction
    got = collective_time(Collective.all_to_all, size, _group(cluster, 64), cluster)
    assert got.bandwidth_seconds == pytest.approx(56 / 64 * size / (line * share), rel=1e-9)
    # an all-reduce's rings keep their own share whatever the all-to-all's
    ring = collective_time(Collective.all_reduce, size, _group(cluster, 64), cluster)
    assert ring.seconds == pytest.approx(collective_time(Collective.all_reduce, size, _group(
        resolve_cluster(device="h100-sxm", num_devices=64), 64), resolve_cluster(device="h100-sxm", num_devices=64))
        .seconds, rel=1e-12)


def test_the_allgather_dispatcher_bills_the_buffers_megatron_cores_moves():
    """Megatron-Core 0.16.1's MoEAllGatherTokenDispatcher on two gloo ranks (tests/megatron_allgather_dispatch.py,
    a process of its own): it all-gathers each token's routing map, probabilities and hidden state over the
    expert tp x ep group and reduce-scatters the outputs back. The allgather stack bills one all-gather of
    those three buffers together and one reduce-scatter of the outputs, on the same group, and holds the gathered
    buffers in memory at the layer's peak."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from cost_models.layer_costs import MeshCosts
    from cost_models.layout import Layout
    from hardware_profiles.loader import cluster_from_device, load_stack
    from planner.graph_capture.model_capture import capture
    from planner.graph_capture.model_config import ModelConfig, MoEConfig

    tokens, hidden, experts, topk = 64, 32, 8, 2
    script = Path(__file__).with_name("megatron_allgather_dispatch.py")
    done = subprocess.run([sys.executable, str(script), *map(str, (tokens, hidden, experts, topk, 29633))],
                          capture_output=True, text=True, timeout=300, check=True)
    made = json.loads(done.stdout.strip().splitlines()[-1])
    cfg = ModelConfig(name="moe", num_layers=1, hidden_size=hidden, num_attention_heads=4, ffn_hidden_size=4 * hidden,
                      vocab_size=512, seq_length=tokens, moe=MoEConfig(num_experts=experts, router_topk=topk,
                                                                       moe_ffn_hidden_size=16))
    costs = MeshCosts(capture(cfg).costs(), cluster_from_device("h100-sxm", 2, 2),
                      Layout(dp=2, ep=2, global_batch=2, moe_dispatcher="allgather"), load_stack("megatron-core"))
    billed = []
    original = costs.collective

    def collective(op, size, dim, **kwargs):
        billed.append([op.value, size, dim])
        return original(op, size, dim, **kwargs)

    costs.collective = collective
    costs.ep_exchanges_s(next(kind for kind in capture(cfg).costs().kinds if kind.num_experts))
    gathered = sum(size for op, size in made if op == "all_gather")
    assert billed == [["all_gather", gathered, "etpep"], ["reduce_scatter", made[-1][1], "etpep"]]
    # and the memory the gathered buffers hold at the layer's peak is those bytes, beside the rest of the stage's
    assert costs.dispatch_buffer_bytes() == pytest.approx(gathered)
    assert costs.comm_buffer_bytes == pytest.approx(2 * costs.activation_message_bytes + gathered)
    assert [op for op, _ in made] == ["all_gather"] * 3 + ["reduce_scatter"]
    # and its combine writes that reduce-scattered buffer, all the group's token rows where another dispatcher
    # writes the rank's own: each pass's compute carries those writes beyond the rank's rows, at HBM speed
    from dataclasses import replace

    from cost_models.compute import layer_compute, memory_seconds
    kind = next(kind for kind in capture(cfg).costs().kinds if kind.num_experts)
    device = costs.cluster.device
    assert costs.spec.gathered_ranks == 2
    alone = layer_compute(kind, device, replace(costs.spec, gathered_ranks=1))
    gathered = layer_compute(kind, device, costs.spec)
    beyond = memory_seconds(device, made[-1][1] - tokens * hidden * 2)
    assert gathered.forward_s - alone.forward_s == pytest.approx(beyond, rel=1e-9)
    assert gathered.backward_input_s - alone.backward_input_s == pytest.approx(beyond, rel=1e-9)
    assert gathered.backward_weight_s == alone.backward_weight_s


def test_megatron_cores_deduplicated_dispatch_sends_bf16_tokens_when_training_in_fp8():
    """Megatron-Core 0.16.1's DeepEP dispatch takes the hidden states as they are (FusedDispatch has no FP8
    argument) and HybridEP's sets fp8_dispatch False: its stacks' DeepEP-style dispatch is billed in BF16 bytes
    in FP8 training, as the combine is; a stack that sends FP8 tokens (DeepSeek-V3 3.3.2: one byte a channel,
    an fp32 scale per 128) halves the dispatch's scale-out bytes, and only the dispatch's."""
    import inspect
    import warnings

    from cost_models.layer_costs import MeshCosts
    from cost_models.layout import Layout
    from hardware_profiles.loader import load_stack
    from planner.graph_capture.model_config import ModelConfig, MoEConfig
    from planner.graph_capture.model_capture import capture
    from planner.job import resolve_cluster

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.moe import fused_a2a
    assert not [name for name in inspect.signature(fused_a2a.FusedDispatch.forward).parameters if "fp8" in name]
    assert "fp8_dispatch = False  # Currently, we do not support fp8 dispatch" in inspect.getsource(fused_a2a)

    cfg = ModelConfig(name="moe", num_layers=1, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096,
                      vocab_size=512, seq_length=4096, moe=MoEConfig(num_experts=64, router_topk=8,
                                                                     moe_ffn_hidden_size=512))
    model = capture(cfg).costs()
    kind = next(k for k in model.kinds if k.num_experts)
    cluster = resolve_cluster(device="h100-sxm", num_devices=32)
    stack = load_stack("megatron-core")

    def exchanges(precision: str, fp8_dispatch: bool) -> tuple[float, float]:
        layout = Layout(dp=32, ep=32, global_batch=32, moe_dispatcher="deepep", precision=precision)
        return MeshCosts(model, cluster, layout, stack.model_copy(update={"moe_fp8_dispatch": fp8_dispatch})
                         ).ep_exchanges_s(kind)

    assert not stack.moe_fp8_dispatch and not load_stack("megatron-bridge").moe_fp8_dispatch
    assert exchanges("fp8", False) == pytest.approx(exchanges("bf16", False), rel=1e-12)
    dispatch, combine = exchanges("fp8", True)
    assert combine == pytest.approx(exchanges("bf16", False)[1], rel=1e-12)
    assert dispatch < 0.6 * combine   # (1 + 4/128) / 2 of the bytes, plus the same latency
