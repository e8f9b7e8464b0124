"""Every shipped profile validates; malformed ones give one clear error naming file and field."""
import copy

import pytest
import yaml

from hardware_profiles import (UserInputError, cluster_from_device, list_clusters, list_devices, load_cluster,
                               load_device)
from hardware_profiles.loader import CLUSTER_DIR, DEVICE_DIR

EXPECTED_DEVICES = {"a100-40g", "a100-80g", "h100-sxm", "h800", "h200", "b200", "gb200", "mi300x",
                    "ascend-910b-376t", "ascend-910b-313t", "ascend-910c", "ascend-910c-die", "hygon-k100-ai", "cpu"}
EXPECTED_CLUSTERS = {"dgx-a100", "dgx-h100", "h800-deepseek", "dgx-h200", "dgx-b200", "gb200-nvl72",
                     "ascend-910b", "ascend-910c-supernode", "atlas-a3-superpod-dies", "hygon-k100-ai", "cpu-gloo"}


def test_all_builtins_present_and_valid():
    assert EXPECTED_DEVICES <= set(list_devices())
    assert EXPECTED_CLUSTERS <= set(list_clusters())
    for name in list_devices():
        device = load_device(name)
        assert device.peak_tflops.bf16 > 0
    for name in list_clusters():
        cluster = load_cluster(name)
        assert cluster.num_devices == cluster.devices_per_node * cluster.num_nodes


def test_dense_peaks_are_half_the_sparse_datasheet():
    # H100 datasheet BF16 1,979 TFLOPS is with sparsity (HF notes on Table 1)
    assert load_device("h100-sxm").peak_tflops.bf16 == pytest.approx(1979 / 2, rel=1e-3)


def test_fast_domain_sizes():
    assert load_cluster("gb200-nvl72").fast_domain_devices == 72
    assert load_cluster("ascend-910c-supernode").fast_domain_devices == 384
    assert load_cluster("dgx-h100").fast_domain_devices == 8


# DeepEP-Ascend normal kernels on an A3 SuperPoD (shared/reference/hardware-facts.md 2b, [^30]): GB/s per rank
DEEPEP_ASCEND = {8: (146, 125), 16: (107, 103), 32: (102, 95), 64: (81, 91), 128: (57, 81)}


def test_all_to_all_efficiency_follows_the_measured_curve_by_group_size():
    """The 910C die's all-to-all bandwidth at each measured EP size is the mean of DeepEP-Ascend's dispatch and
    combine, in between it moves monotonically, and outside it holds the end values."""
    fabric = load_device("ascend-910c-die").intra_node
    link = fabric.bandwidth_per_direction_gbytes_per_s
    for ranks, (dispatch, combine) in DEEPEP_ASCEND.items():
        assert fabric.all_to_all_fraction_for(ranks) * link == pytest.approx((dispatch + combine) / 2, rel=0.01)
    sizes = range(2, 300)
    fractions = [fabric.all_to_all_fraction_for(n) for n in sizes]
    assert all(a >= b for a, b in zip(fractions, fractions[1:]))
    assert fractions[0] == fabric.all_to_all_fraction_for(8) and fractions[-1] == fabric.all_to_all_fraction_for(128)
    assert load_device("h100-sxm").intra_node.all_to_all_fraction_for(64) == \
        load_device("h100-sxm").intra_node.all_to_all_fraction      # no curve: the one figure


def test_cluster_from_device_on_command_line():
    cluster = cluster_from_device("h100-sxm", 16384)
    assert cluster.num_devices == 16384 and cluster.devices_per_node == 8
    with pytest.raises(UserInputError, match="whole nodes"):
        cluster_from_device("h100-sxm", 12)
    with pytest.raises(UserInputError, match="unknown device"):
        cluster_from_device("h1000", 8)


def _device_data():
    return yaml.safe_load((DEVICE_DIR / "h100-sxm.yaml").read_text())


def _cluster_data():
    return yaml.safe_load((CLUSTER_DIR / "dgx-h100.yaml").read_text())


def _set(data, path, value):
    keys = path.split(".")
    node = data
    for key in keys[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return data


_DELETE = object()

BAD_DEVICES = [
    ("hbm_bytes", _DELETE, "hbm_bytes"),
    ("hbm_bytes", "eighty gigabytes", "hbm_bytes"),
    ("hbm_bytes", -1, "hbm_bytes"),
    ("hbm_bandwidth_gbytes_per_s", 0, "hbm_bandwidth_gbytes_per_s"),
    ("peak_tflops.bf16", _DELETE, "peak_tflops.bf16"),
    ("peak_tflops.bf16", "fast", "peak_tflops.bf16"),
    ("peak_tflops.fp8", -5, "peak_tflops.fp8"),
    ("gemm.peak_fraction", 1.5, "gemm.peak_fraction"),
    ("gemm.half_work_gflop", -1, "gemm.half_work_gflop"),
    ("gemm.fp8_half_work_gflop", "large", "gemm.fp8_half_work_gflop"),
    ("intra_node.kind", "token-ring", "intra_node.kind"),
    ("intra_node.bandwidth_per_direction_gbytes_per_s", -450, "intra_node.bandwidth_per_direction_gbytes_per_s"),
    ("intra_node.in_network_fraction", _DELETE, "in_network_fraction"),
    ("collective_backend", "mpi", "collective_backend"),
    ("vendor", "intel", "vendor"),
    ("intra_node.nvlink_speed", 9, "nvlink_speed"),
    ("memory_reserve.fragmentation_fraction", 2, "fragmentation_fraction"),
    ("intra_node.all_to_all_fraction_by_ranks", {1: 0.5}, "all_to_all_fraction_by_ranks"),
    ("intra_node.all_to_all_fraction_by_ranks", {8: 1.5}, "all_to_all_fraction_by_ranks"),
    ("host_link_gbytes_per_s", 0, "host_link_gbytes_per_s"),
]


@pytest.mark.parametrize("path,value,named", BAD_DEVICES)
def test_malformed_device_files(tmp_path, path, value, named):
    data = _set(copy.deepcopy(_device_data()), path, value)
    bad = tmp_path / "bad-device.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(UserInputError) as info:
        load_device(str(bad))
    message = str(info.value)
    assert str(bad) in message and named in message
    assert "\n" not in message


BAD_CLUSTERS = [
    ("device", "h1000", "device"),
    ("device", _DELETE, "device"),
    ("devices_per_node", 0, "devices_per_node"),
    ("devices_per_node", "eight", "devices_per_node"),
    ("num_nodes", -2, "num_nodes"),
    ("fast_domain_devices", 3, "fast_domain_devices"),
    ("inter_node.nic_bandwidth_gbit_per_s", -400, "inter_node.nic_bandwidth_gbit_per_s"),
    ("inter_node.nic_bandwidth_gbit_per_s", "400Gb", "inter_node.nic_bandwidth_gbit_per_s"),
    ("inter_node.kind", "carrier-pigeon", "inter_node.kind"),
    ("inter_node.oversubscription_above_pod", 0.5, "oversubscription_above_pod"),
    ("storage.checkpoint_write_gbytes_per_s", 0, "checkpoint_write_gbytes_per_s"),
    ("reliability", _DELETE, "reliability"),
    ("reliability.node_failures_per_1000_node_days", -1, "node_failures_per_1000_node_days"),
]


@pytest.mark.parametrize("path,value,named", BAD_CLUSTERS)
def test_malformed_cluster_files(tmp_path, path, value, named):
    data = _set(copy.deepcopy(_cluster_data()), path, value)
    bad = tmp_path / "bad-cluster.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(UserInputError) as info:
        load_cluster(str(bad))
    message = str(info.value)
    assert str(bad) in message and named in message


@pytest.mark.parametrize("text,named", [
    ("name: [unclosed", "not valid YAML"),
    ("- just\n- a list\n", "mapping"),
    ("", "mapping"),
])
def test_unparseable_files(tmp_path, text, named):
    bad = tmp_path / "broken.yaml"
    bad.write_text(text)
    with pytest.raises(UserInputError, match=named):
        load_cluster(str(bad))


def test_a_profile_rewritten_between_reads_is_read_again_and_no_caller_shares_its_data(tmp_path):
    """Small YAML texts are parsed once per process (hardware_profiles.parsing): the parse is kept by the text
    itself, so a file rewritten in place, even to the same size within one clock tick, reads as written, and a
    caller that changes what it was given changes nothing another caller gets."""
    from hardware_profiles.parsing import parse_yaml
    text = (DEVICE_DIR / "h100-sxm.yaml").read_text()
    assert "bf16: 989.4" in text   # rewritten below to a figure of the same width
    path = tmp_path / "device.yaml"
    path.write_text(text)
    assert load_device(str(path)).peak_tflops.bf16 == 989.4
    path.write_text(text.replace("bf16: 989.4", "bf16: 777.7", 1))
    assert load_device(str(path)).peak_tflops.bf16 == 777.7
    first = parse_yaml(text, "first")
    first["name"] = "changed"
    first["gemm"]["peak_fraction"] = -1
    again = parse_yaml(text, "again")
    assert again["name"] == "h100-sxm" and again["gemm"]["peak_fraction"] > 0


def test_missing_file_and_unknown_name():
    with pytest.raises(UserInputError, match="file not found"):
        load_cluster("/nonexistent/cluster.yaml")
    with pytest.raises(UserInputError, match="unknown cluster"):
        load_cluster("dgx-z9000")


def test_a_plan_names_the_profile_files_it_was_made_on(tmp_path):
    """A user's device file named like a built-in (`name: h100-sxm`) with another peak: the plan names the
    file, and what reads the plan again (replan, the runtime, calibration) loads that file, not the built-in."""
    from planner.api import evaluate, replan
    from planner.job import plan_cluster, plan_device
    from planner.plans import Plan
    data = yaml.safe_load((DEVICE_DIR / "h100-sxm.yaml").read_text())
    data["peak_tflops"]["bf16"] = 500.0
    mine = tmp_path / "my-h100.yaml"
    mine.write_text(yaml.safe_dump(data))
    shape = dict(global_batch=16, seq_len=512, layout="tp=1,pp=1,dp=8,cp=1,mbs=1,zero=1,recompute=none")
    made = evaluate("tiny-llama", device=str(mine), num_devices=8, **shape)
    assert made.device_profile == str(mine.resolve()) and made.cluster_profile == ""
    made.save(tmp_path / "plan.yaml")
    again = Plan.load(str(tmp_path / "plan.yaml"))
    assert plan_device(again) == str(mine.resolve())
    assert plan_cluster(again).device.peak_tflops.bf16 == 500.0
    assert replan(again, 16, time_limit_s=10).device_profile == str(mine.resolve())
    builtin = evaluate("tiny-llama", cluster="dgx-h100", num_devices=8, **shape)
    assert (builtin.cluster_profile, builtin.device_profile) == ("dgx-h100", "h100-sxm")
    assert plan_cluster(builtin).num_devices == 8


def test_a_plan_keeps_its_segments():
    from planner.api import evaluate
    from planner.job import plan_cluster
    made = evaluate("tiny-llama", device="gb200", num_devices=128, segment_devices=64, global_batch=128,
                    seq_len=512, layout="tp=1,pp=1,dp=128,cp=1,mbs=1,zero=1,recompute=none")
    assert made.segment_devices == 64 and made.placement == plan_cluster(made).placement_text()
    assert "64 devices in each of 2" in made.placement
