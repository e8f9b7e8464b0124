"""Where the data-parallel x context-parallel gradient group sits, by the layout's order, against the
ranks themselves: the group holding rank 0 enumerated from the mesh coordinates (innermost dim first,
as Megatron-Core numbers ranks), its members counted per scale-up domain, node and pod."""
import itertools

import pytest

from hardware_profiles import MeshDim, load_cluster
from hardware_profiles.topology import place_dims_together


def enumerated(dims, members, cluster):
    """(members per domain, per node, domains touched, spans pods) of rank 0's group, by brute force."""
    strides, stride = {}, 1
    for dim in dims:
        strides[dim.name] = stride
        stride *= dim.size
    axes = [range(d.size) if d.name in members else (0,) for d in dims]
    ranks = {sum(c * strides[d.name] for c, d in zip(coords, dims)) for coords in itertools.product(*axes)}
    domain, node = cluster.placement_domain_devices, cluster.devices_per_node
    per_domain = max(sum(1 for r in ranks if r // domain == b) for b in {r // domain for r in ranks})
    per_node = max(sum(1 for r in ranks if r // node == b) for b in {r // node for r in ranks})
    pod = cluster.inter_node.pod_size_devices
    spans = bool(pod) and max(ranks) + 1 > pod
    return per_domain, per_node, len({r // domain for r in ranks}), spans


ORDERS = [("tp", "cp", "dp", "pp"), ("tp", "dp", "cp", "pp"), ("tp", "cp", "pp", "dp"), ("tp", "pp", "cp", "dp"),
          ("cp", "tp", "pp", "dp"), ("tp", "dp", "pp", "cp")]


@pytest.mark.parametrize("cluster_name,devices", [("dgx-h100", 1024), ("gb200-nvl72", 576)])
@pytest.mark.parametrize("order", ORDERS, ids=["-".join(o) for o in ORDERS])
@pytest.mark.parametrize("tp,cp,dp,pp", [(2, 2, 4, 4), (4, 2, 8, 2), (1, 4, 2, 8), (8, 2, 4, 2), (2, 8, 16, 2)])
def test_the_gradient_group_is_where_the_order_puts_dp_and_cp(cluster_name, devices, order, tp, cp, dp, pp):
    cluster = load_cluster(cluster_name).with_devices(devices)
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    dims = tuple(MeshDim(name, sizes[name]) for name in order)
    if tp * cp * dp * pp > cluster.num_devices:
        pytest.skip("mesh larger than the cluster")
    group = place_dims_together("dpcp", ("dp", "cp"), dims, cluster)
    per_domain, per_node, domains, spans = enumerated(dims, ("dp", "cp"), cluster)
    assert (group.size, group.ranks_per_domain, group.ranks_per_node, group.domains, group.spans_pods) == \
        (dp * cp, per_domain, per_node, domains, spans)


def test_dp_and_cp_apart_in_the_order_by_hand():
    """tp=2, cp=2, pp=4, dp=4 in the order tp-cp-pp-dp on nodes of 8: the gradient group is cp's ranks {0, 2}
    and dp's at a stride of 2*2*4 = 16: {0, 2, 16, 18, 32, 34, 48, 50}, two to a node on four nodes (folded
    where cp sits, as before, it was 8 consecutive even ranks: four to a node on two nodes)."""
    cluster = load_cluster("dgx-h100").with_devices(64)
    dims = (MeshDim("tp", 2), MeshDim("cp", 2), MeshDim("pp", 4), MeshDim("dp", 4))
    group = place_dims_together("dpcp", ("dp", "cp"), dims, cluster)
    assert (group.size, group.ranks_per_node, group.domains) == (8, 2, 4)


def test_a_group_over_a_72_device_domain_is_counted_where_it_lands():
    """16 ranks at a stride of 8 on GB200 NVL72: 0..64 (9 ranks) in the first domain, 72..120 (7) in the
    second; the old count divided 16 by 9 and said one domain."""
    cluster = load_cluster("gb200-nvl72").with_devices(144)
    group = place_dims_together("x", ("x",), (MeshDim("inner", 8), MeshDim("x", 16)), cluster)
    assert (group.ranks_per_domain, group.domains) == (9, 2)


def pipeline_chain(pp: int, stride: int, vp: int) -> list[int]:
    """The ranks a micro-batch visits in order: stage 0..pp-1, vp times over (interleaved chunks)."""
    return [stage * stride for _ in range(vp) for stage in range(pp)]


@pytest.mark.parametrize("cluster_name,devices,pp,stride,vp", [
    ("dgx-h100", 16, 4, 4, 1), ("dgx-h100", 16, 4, 4, 2), ("dgx-h100", 64, 8, 8, 3), ("dgx-h100", 32, 8, 2, 2),
    ("gb200-nvl72", 144, 4, 36, 2), ("gb200-nvl72", 144, 8, 18, 1), ("ascend-910c-supernode", 768, 16, 48, 4)])
def test_the_share_of_pipeline_hops_that_leave_a_domain(cluster_name, devices, pp, stride, vp):
    """Each hop of the chain a micro-batch travels, counted by hand: stage k to k+1 and, when interleaved,
    the last stage back to the first before the next chunk."""
    from hardware_profiles.topology import place_group
    cluster = load_cluster(cluster_name).with_devices(devices)
    chain = pipeline_chain(pp, stride, vp)
    domain = cluster.placement_domain_devices
    crossing = sum(a // domain != b // domain for a, b in zip(chain, chain[1:]))
    group = place_group("pp", pp, stride, cluster)
    assert group.hop_crossing_share(vp) == pytest.approx(crossing / (len(chain) - 1), rel=1e-12)


def test_a_pipeline_hop_pays_the_tier_it_crosses():
    """pp=4 at a stride of 4 on two DGX H100: stage 1 to 2 leaves the node, 0 to 1 and 2 to 3 do not. The
    hop time is the mean of one inter-node and two NVLink transfers (closed form with the profile's links)."""
    from cost_models.communication import Collective, collective_time, links_for
    from hardware_profiles.topology import place_group
    cluster = load_cluster("dgx-h100").with_devices(16)
    group = place_group("pp", 4, 4, cluster)
    links, size = links_for(group, cluster), 64e6
    share = group.hop_crossing_share(1)
    assert share == pytest.approx(1 / 3)
    by_hand = (size / links.inter_bps + links.inter_hop_s) / 3 \
        + 2 * (size / links.intra_ring_bps + links.intra_hop_s) / 3 + links.base_latency_s
    got = collective_time(Collective.send_recv, size, group, cluster, crossing_share=share)
    assert got.seconds == pytest.approx(by_hand, rel=1e-12)
    whole = collective_time(Collective.send_recv, size, group, cluster)   # every hop over the network
    assert whole.seconds == pytest.approx(size / links.inter_bps + links.inter_hop_s + links.base_latency_s, rel=1e-12)
