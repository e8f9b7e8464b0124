"""Clusters built from --device keep the device's scale-up domain (issue 22): closed forms by hand.

The truth here is the NCCL bus-bandwidth model (design-notes) evaluated with the profile's own figures:
all-reduce moves 2 (n-1)/n S per rank, all-to-all (n-1)/n S, each over the link it crosses.
"""
import pytest

from cost_models.communication import Collective, collective_time
from hardware_profiles import MeshDim, cluster_from_device, load_cluster, place_mesh
from planner.api import evaluate

GIB = 2 ** 30
US = 1e-6


def world_group(cluster):
    return place_mesh((MeshDim("x", cluster.num_devices),), cluster).of("x")


def nvl72(n):
    return cluster_from_device("gb200", n)


@pytest.mark.parametrize("n", [8, 64, 72])
def test_gb200_inside_one_nvlink_domain(n):
    """Up to 72 GB200 sit in one NVL72 rack: every collective runs at NVLink rates, never over IB."""
    cluster = nvl72(n)
    fabric = cluster.device.intra_node
    link = fabric.bandwidth_per_direction_gbytes_per_s * 1e9
    group = world_group(cluster)
    assert group.domains == 1 and "72-device nvswitch domain" in cluster.placement_text()
    assert "another" not in cluster.placement_text()
    a2a = collective_time(Collective.all_to_all, GIB, group, cluster)
    by_hand = (n - 1) / n * GIB / (link * fabric.all_to_all_fraction)
    latency = (fabric.base_latency_us + (n - 1) * fabric.hop_latency_us) * US
    assert a2a.seconds == pytest.approx(by_hand + latency, rel=1e-9)
    ring = 2 * (n - 1) / n * GIB / (link * fabric.ring_busbw_fraction) \
        + (fabric.base_latency_us + 2 * (n - 1) * fabric.hop_latency_us) * US
    nvls = GIB / (link * fabric.in_network_fraction) + (fabric.base_latency_us + 2 * fabric.hop_latency_us) * US
    all_reduce = collective_time(Collective.all_reduce, GIB, group, cluster)
    assert all_reduce.seconds == pytest.approx(min(ring, nvls), rel=1e-9)


def test_144_gb200_span_two_racks():
    """Two full racks: the all-to-all's off-rack half goes over the node's NICs, one per GPU, at NCCL's all-to-all
    share of their line rate."""
    cluster = nvl72(144)
    network = cluster.inter_node
    nic = network.nic_bandwidth_gbit_per_s / 8 * 1e9 * network.all_to_all_fraction * network.nics_per_node \
        / cluster.devices_per_node
    fabric = cluster.device.intra_node
    intra = fabric.bandwidth_per_direction_gbytes_per_s * 1e9 * fabric.all_to_all_fraction
    group = world_group(cluster)
    assert (group.ranks_per_domain, group.domains) == (72, 2)
    a2a = collective_time(Collective.all_to_all, GIB, group, cluster)
    assert a2a.bandwidth_seconds == pytest.approx(max(71 / 144 * GIB / intra, 72 / 144 * GIB / nic), rel=1e-9)
    # all-reduce: hierarchical, reduce inside each rack, across the two racks on S/72 per rank
    all_reduce = collective_time(Collective.all_reduce, GIB, group, cluster)
    ring_inside = 2 * 71 / 72 * GIB / (fabric.bandwidth_per_direction_gbytes_per_s * 1e9 * fabric.ring_busbw_fraction)
    nvls_inside = GIB / (fabric.bandwidth_per_direction_gbytes_per_s * 1e9 * fabric.in_network_fraction)
    across = 2 * (1 / 2) * (GIB / 72) / nic
    assert "hier" in all_reduce.algorithm
    assert all_reduce.bandwidth_seconds == pytest.approx(max(min(ring_inside, nvls_inside), across), rel=1e-9)


@pytest.mark.parametrize("n,domains", [(384, 1), (768, 2)])
def test_ascend_910c_supernodes(n, domains):
    cluster = cluster_from_device("ascend-910c", n)
    fabric = cluster.device.intra_node
    link = fabric.bandwidth_per_direction_gbytes_per_s * 1e9 * fabric.ring_busbw_fraction
    group = world_group(cluster)
    assert group.domains == domains and group.ranks_per_domain == 384
    all_reduce = collective_time(Collective.all_reduce, GIB, group, cluster)
    inside = 2 * 383 / 384 * GIB / link
    if domains == 1:
        latency = (fabric.base_latency_us + 2 * 383 * fabric.hop_latency_us) * US
        assert all_reduce.seconds == pytest.approx(inside + latency, rel=1e-9)
    else:
        network = cluster.inter_node
        nic = network.nic_bandwidth_gbit_per_s / 8 * 1e9 * network.busbw_fraction
        across = 2 * (1 / 2) * (GIB / 384) / nic
        assert all_reduce.bandwidth_seconds == pytest.approx(max(inside, across), rel=1e-9)


@pytest.mark.parametrize("device,cluster_name,n", [("gb200", "gb200-nvl72", 8), ("gb200", "gb200-nvl72", 64),
                                                   ("gb200", "gb200-nvl72", 144), ("ascend-910c", "ascend-910c-supernode", 16),
                                                   ("h100-sxm", "dgx-h100", 16)])
def test_device_and_cluster_flags_describe_the_same_hardware(device, cluster_name, n):
    built, named = cluster_from_device(device, n), load_cluster(cluster_name).with_devices(n)
    assert built.placement_domain_devices == named.placement_domain_devices
    for op in (Collective.all_reduce, Collective.all_to_all):
        assert collective_time(op, GIB, world_group(built), built) == \
            collective_time(op, GIB, world_group(named), named)


def test_qwen3_moe_on_eight_gb200_uses_nvlink_for_its_all_to_all():
    """Issue 22's case: --device gb200 --num-devices 8 predicted 23.4 s (the all-to-all over IB); it is the
    same prediction as --cluster gb200-nvl72, with the expert all-to-all at NVLink rates."""
    shape = dict(layout="tp=1,pp=1,dp=8,cp=1,ep=8,etp=1,vp=1,mbs=4,zero=1,recompute=none", num_devices=8,
                 global_batch=512, seq_len=4096, precision="fp8")
    by_device = evaluate("qwen3-30b-a3b", device="gb200", **shape)
    by_cluster = evaluate("qwen3-30b-a3b", cluster="gb200-nvl72", **shape)
    assert by_device.step_time_s == by_cluster.step_time_s
    assert by_device.breakdown["ep_comm_s"] < 0.4 * by_device.step_time_s
    assert "8 of one 72-device nvswitch domain" == by_device.placement


def test_partly_used_domain_is_stated_and_never_straddled():
    """100 GB200: one full rack and 28 GPUs of a second. A 10-rank group of ranks 70-79 would straddle the
    racks, so placement works in 4-rank blocks (gcd of 100 and 72), which never do."""
    cluster = nvl72(100)
    assert cluster.placement_domain_devices == 4
    assert "1 full 72-device nvswitch domain and 28 devices of another" in cluster.placement_text()
    assert place_mesh((MeshDim("tp", 4), MeshDim("dp", 25)), cluster).of("tp").domains == 1
    assert place_mesh((MeshDim("tp", 10), MeshDim("dp", 10)), cluster).of("tp").domains > 1


def test_devices_per_node_must_be_positive():
    from hardware_profiles import UserInputError
    with pytest.raises(UserInputError, match="devices-per-node"):
        cluster_from_device("h100-sxm", 16, 0)


def test_whatif_says_where_a_sweep_crosses_a_domain_boundary():
    from planner.capacity import whatif
    report = whatif("tiny-llama", sweep="num-devices=36,72,144", device="gb200", global_batch=144,
                    time_limit_s=30)
    changes = [row.domain_change for row in report.rows]
    assert changes[:2] == ["", ""] and changes[2].startswith("crosses a scale-up domain boundary: 2 full")
    assert report.rows[0].placement == "36 of one 72-device nvswitch domain"


def test_equal_segments_keep_a_64_rank_group_in_one_rack():
    """256 GB200 as NVIDIA's launcher runs them (Slurm --segment 16 nodes): 64 GPUs in each of four racks.
    An all-to-all over the 64 ranks of a segment runs at NVLink rates, as inside one rack (the closed form
    of test_gb200_inside_one_nvlink_domain); filled in rank order the same group is costed across racks."""
    segmented, in_order = cluster_from_device("gb200", 256, None, 64), nvl72(256)
    assert segmented.placement_text() == "64 devices in each of 4 72-device nvswitch domains (equal segments)"
    ep = place_mesh((MeshDim("ep", 64), MeshDim("dp", 4)), segmented).of("ep")
    assert (ep.ranks_per_domain, ep.domains) == (64, 1)
    fabric = segmented.device.intra_node
    by_hand = 63 / 64 * GIB / (fabric.bandwidth_per_direction_gbytes_per_s * 1e9 * fabric.all_to_all_fraction) \
        + (fabric.base_latency_us + 63 * fabric.hop_latency_us) * US
    assert collective_time(Collective.all_to_all, GIB, ep, segmented).seconds == pytest.approx(by_hand, rel=1e-9)
    assert place_mesh((MeshDim("ep", 64), MeshDim("dp", 4)), in_order).of("ep").domains > 1


@pytest.mark.parametrize("segment,why", [(48, "does not divide"), (66, "whole nodes"), (76, "whole nodes")])
def test_a_segment_that_cannot_lay_out_the_job_is_refused(segment, why):
    from hardware_profiles import UserInputError
    from planner.job import resolve_cluster
    with pytest.raises(UserInputError, match=why) as caught:
        resolve_cluster(device="gb200", num_devices=256, segment_devices=segment)
    assert "--segment-devices" in str(caught.value)


def test_a_whole_domain_as_the_segment_states_packing():
    """72 on NVL72 racks: the job's ranks fill racks in order (72 + 72 + 72 + 40), as with no segment, but stated,
    so the search does not choose another placement; the plan exports no --segment."""
    from planner.job import resolve_cluster
    from planner.placement import placement_choices
    stated = resolve_cluster(device="gb200", num_devices=256, segment_devices=72)
    packed = resolve_cluster(device="gb200", num_devices=256)
    assert stated.domain_use == packed.domain_use and stated.placement_text() == packed.placement_text()
    assert placement_choices(stated) == [stated] and len(placement_choices(packed)) > 1


@pytest.mark.parametrize("nodes,segment_nodes", [(2, None), (18, None), (32, 16), (64, 16), (36, 18), (40, 10),
                                                 (19, 1), (256, 16)])
def test_the_megatron_bridge_launcher_segment_rule(nodes, segment_nodes):
    """NVIDIA-NeMo/Megatron-Bridge scripts/performance/utils/executors.py: up to 18 nodes one segment, else
    the largest node count of at most 18 that divides the job (cases worked by hand)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from published import launcher_segment_devices
    expected = None if segment_nodes is None else segment_nodes * 4
    assert launcher_segment_devices("mbridge-x", nodes * 4, 4) == expected
    assert launcher_segment_devices("nemo2407-x", nodes * 4, 4) is None   # only the launcher that asks for it
