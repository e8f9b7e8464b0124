"""Megatron-Bridge exports read back through Megatron-Bridge 0.3's own ConfigContainer: each plan's YAML merged by
its process_config_with_overrides into its pre-training container, then its runtime_config_update (mixed
precision resolved, data-parallel size computed, validate() with Megatron-Core's TransformerConfig checks), in a
process of its own (tests/bridge_readback.py says what stands in for a GPU node). Zero refused, and every degree,
batch, split, recomputation, dispatcher, overlap, ZeRO stage and precision reads back as the plan says."""
from __future__ import annotations

import importlib.util
from dataclasses import replace
import json
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron.bridge") is None:   # its import needs what bridge_readback.py stands in for
    pytest.skip("megatron-bridge (a test extra: make test installs it)", allow_module_level=True)

from hardware_profiles.loader import load_stack  # noqa: E402
from planner.api import evaluate  # noqa: E402
from planner.exports import bridge_yaml  # noqa: E402

HERE = Path(__file__).resolve().parent
FULL = "tp={tp},pp={pp},vp={vp},dp={dp},cp={cp},ep={ep},etp=1,mbs={mbs},zero={zero},recompute={rc}"
BRIDGE, MCORE = load_stack("megatron-bridge"), load_stack("megatron-core")
OVERLAP = BRIDGE.model_copy(update={"moe_a2a_overlap": True})


def layout(tp=1, pp=1, vp=1, dp=1, cp=1, ep=1, mbs=1, zero=1, rc="none", extra=""):
    return FULL.format(tp=tp, pp=pp, vp=vp, dp=dp, cp=cp, ep=ep, mbs=mbs, zero=zero, rc=rc) + extra


# (name, model, device, devices, global batch, layout, precision, stack)
PLANS = [
    ("8b-dp", "llama3-8b", "h100-sxm", 16, 64, layout(dp=16), "bf16", BRIDGE),
    ("8b-tp-pp-vp-selective", "llama3-8b", "h100-sxm", 16, 64, layout(tp=2, pp=2, vp=2, dp=4, rc="selective"),
     "bf16", BRIDGE),
    ("8b-cp", "llama3-8b", "h100-sxm", 16, 64, layout(tp=2, cp=2, dp=4), "bf16", BRIDGE),
    ("8b-fsdp-zero3", "llama3-8b", "h100-sxm", 16, 64, layout(dp=16, zero=3), "bf16", MCORE),
    ("8b-zero2", "llama3-8b", "h100-sxm", 16, 64, layout(dp=16, zero=2), "bf16", MCORE),
    ("8b-uneven", "llama3-8b", "h100-sxm", 16, 64, layout(pp=4, dp=4, extra=",stages=7-9-9-7"), "bf16", MCORE),
    ("8b-fp8-tensorwise", "llama3-8b", "h100-sxm", 16, 64, layout(tp=2, dp=8) + ",fp8_recipe=tensorwise", "fp8",
     BRIDGE),
    ("8b-fp8-delayed", "llama3-8b", "h100-sxm", 16, 64, layout(tp=2, dp=8) + ",fp8_recipe=delayed", "fp8", MCORE),
    ("8b-mxfp8", "llama3-8b", "b200", 16, 64, layout(pp=2, dp=8) + ",fp8_recipe=mxfp8", "fp8", BRIDGE),
    ("70b-tp-pp-full", "llama3-70b", "h100-sxm", 64, 128, layout(tp=8, pp=4, dp=2, rc="full"), "bf16", BRIDGE),
    ("70b-interleaved", "llama3-70b", "h100-sxm", 128, 128, layout(tp=8, pp=4, vp=5, dp=4), "bf16", BRIDGE),
    ("70b-cp-fp8-blockwise", "llama3-70b", "h100-sxm", 64, 64,
     layout(tp=4, cp=4, dp=4) + ",fp8_recipe=blockwise", "fp8", MCORE),
    ("405b", "llama3-405b", "h100-sxm", 512, 512, layout(tp=8, pp=16, vp=4, dp=4, rc="full"), "bf16", BRIDGE),
    ("qwen3-30b-ep", "qwen3-30b-a3b", "h100-sxm", 16, 64, layout(dp=16, ep=8), "bf16", BRIDGE),
    ("qwen3-30b-pp-ep-deepep", "qwen3-30b-a3b", "h100-sxm", 16, 64, layout(pp=2, dp=8, ep=8, extra=",dispatcher=deepep"),
     "bf16", BRIDGE),
    ("qwen3-30b-gb200-hybridep", "qwen3-30b-a3b", "gb200", 16, 64, layout(pp=2, dp=8, ep=8, extra=",dispatcher=deepep"),
     "bf16", BRIDGE),
    ("qwen3-30b-allgather", "qwen3-30b-a3b", "h100-sxm", 16, 64, layout(tp=2, dp=8, ep=4, extra=",dispatcher=allgather"),
     "bf16", MCORE),
    ("qwen3-30b-a2a-overlap", "qwen3-30b-a3b", "h100-sxm", 16, 64, layout(dp=16, ep=8), "bf16", OVERLAP),
    ("qwen3-235b", "qwen3-235b-a22b", "h100-sxm", 256, 1024, layout(tp=2, pp=8, dp=16, ep=32, rc="full"), "bf16",
     BRIDGE),
    ("qwen3-235b-vp-overlap", "qwen3-235b-a22b", "h100-sxm", 256, 1024, layout(tp=2, pp=4, vp=2, dp=32, ep=32),
     "bf16", OVERLAP),
    ("dsv3-pp-ep", "deepseek-v3", "h100-sxm", 256, 512, layout(pp=8, dp=32, ep=8, rc="full"), "bf16", BRIDGE),
    ("dsv3-deepep-fp8", "deepseek-v3", "h100-sxm", 256, 512, layout(pp=8, dp=32, ep=8, rc="full")
     + ",fp8_recipe=tensorwise,dispatcher=deepep", "fp8", BRIDGE),
    # Megatron FSDP on GB200 with activations offloaded to the Grace CPU (the Llama 3 70B GB200 recipe's way):
    # the whole layout without recomputation does not fit, so evaluate offloads the fewest layers that do
    ("70b-fsdp-offload-gb200", "llama3-70b", "gb200", 64, 256, layout(dp=64, mbs=2, zero=3)
     + ",fp8_recipe=tensorwise", "fp8", BRIDGE),
    ("dsv3-uneven", "deepseek-v3", "h100-sxm", 256, 512, layout(pp=4, dp=64, ep=16, rc="full",
                                                                 extra=",stages=15-16-16-14"), "bf16", BRIDGE),
]


@pytest.fixture(scope="module")
def read_back(tmp_path_factory) -> dict:
    """Every case's plan, and what Megatron-Bridge read from its export (one process for all)."""
    work = tmp_path_factory.mktemp("bridge")
    plans, cases = {}, []
    for name, model, device, count, batch, text, precision, stack in PLANS:
        plan = evaluate(model, device=device, num_devices=count, global_batch=batch, layout=text,
                        precision=precision, stack=stack)
        path = work / f"{name}.yaml"
        path.write_text(bridge_yaml(plan)[0])
        plans[name] = plan
        cases.append({"name": name, "model": model, "device": device, "world_size": count,
                      "overrides": str(path)})
    (work / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run([sys.executable, str(HERE / "bridge_readback.py"), str(work / "cases.json")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {row["name"]: (plans[row["name"]], row) for row in json.loads(proc.stdout.splitlines()[-1])}


@pytest.mark.parametrize("name", [case[0] for case in PLANS])
def test_megatron_bridge_reads_the_export_as_the_plan(read_back, name):
    plan, got = read_back[name]
    assert "refused" not in got, got.get("refused")
    lay = plan.layout
    assert (got["tp"], got["pp"], got["cp"], got["ep"], got["etp"]) == (lay.tp, lay.pp, lay.cp, lay.ep, lay.etp)
    assert got["vp"] == (lay.vp if lay.vp > 1 else None) and got["sp"] == (lay.sp and lay.tp > 1)
    assert got["dp"] == lay.dp and (got["gbs"], got["mbs"]) == (lay.gbs, lay.mbs)
    assert got["seq"] == [plan.seq_len, plan.seq_len] and got["num_layers"] == sum(len(s.layers) for s in plan.stages)
    counts = [len(stage.layers) for stage in plan.stages]
    if got["layers_per_chunk"] is not None:   # an uneven split, in Megatron-Core's own layout parser's reading
        assert got["layers_per_chunk"] == counts
    else:
        assert len(set(counts)) == 1
    kinds = {r for stage in plan.stages for r in stage.recompute}
    granularity, method, per_chunk, modules = got["recompute"]
    if kinds == {"selective"}:
        assert granularity == "selective" and modules == lay.recompute_modules.split("+")
    elif "full" in kinds:
        assert (granularity, method) == ("full", "block")
        assert per_chunk == max(stage.recompute.count("full") for stage in plan.stages)
    else:
        assert granularity is None
    if lay.ep > 1:
        assert got["dispatcher"] == {"alltoall": ["alltoall", None], "allgather": ["allgather", None],
                                     "deepep": ["flex", lay.flex_dispatcher_backend]}[lay.moe_dispatcher] or \
            got["dispatcher"][0] == lay.moe_dispatcher
        assert lay.moe_dispatcher != "deepep" or lay.flex_dispatcher_backend == (
            "hybridep" if plan.device_profile == "gb200" else "deepep")
        assert got["a2a_overlap"] == [lay.moe_a2a_overlap, lay.moe_a2a_overlap]
        assert got["shared_expert_overlap"] == lay.moe_shared_expert_overlap
    assert got["distributed_optimizer"] == [lay.zero >= 1, lay.zero >= 1]
    assert got["fsdp"] == [lay.zero >= 2, {2: "optim_grads", 3: "optim_grads_params"}.get(lay.zero, "no_shard")]
    bf16, fp8, recipe = got["precision"]
    assert bf16 and bool(fp8) == (lay.precision == "fp8") and recipe == (lay.fp8_recipe if fp8 else None)
    assert got["cuda_graphs"] == "none" and got["fused_loss"] == lay.fused_loss
    assert got["offload"] == [lay.offload_layers > 0, lay.offload_layers, False]
    assert name != "70b-fsdp-offload-gb200" or lay.offload_layers > 0


def test_cuda_connections_and_tp_overlap_follow_megatron_bridges_own_launcher(tmp_path):
    """The CUDA_DEVICE_MAX_CONNECTIONS the Megatron and Bridge exports ask for is what Megatron-Bridge's performance
    launcher sets (its PerfEnvPlugin, run on every tp, cp, pp, dp, DeepEP and combined-1F1B case of an H100 and a
    B200 job), and the search runs TP overlap on H100 exactly where that is one connection (its kernels queue in issue
    order there), on B200 wherever tp > 1; asked for beside combined 1F1B on H100, it is not in effect."""
    import itertools

    from hardware_profiles.loader import load_device
    from hardware_profiles.stack_overlaps import cuda_device_max_connections
    from cost_models.layout import Layout
    devices = {"h100-sxm": False, "b200": True}   # Bridge's gpu_sm100_or_newer
    grid = list(itertools.product(devices, (1, 2), (1, 2), (1, 4), (1, 8), (False, True), (False, True)))
    cases = [{"num_gpus": tp * cp * pp * dp, "tp": tp, "cp": cp, "pp": pp, "flex": flex, "sm100": devices[device],
              "a2a_overlap": a2a} for device, tp, cp, pp, dp, flex, a2a in grid]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run([sys.executable, str(HERE / "bridge_connections.py"), str(tmp_path / "cases.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    theirs = json.loads(proc.stdout.splitlines()[-1])
    ours = [cuda_device_max_connections(load_device(device), tp, cp, dp, pp, flex, a2a)
            for device, tp, cp, pp, dp, flex, a2a in grid]
    assert ours == theirs and {1, 8, 32} <= set(theirs)
    stack, checked = OVERLAP.model_copy(update={"tp_comm_overlap": True}), set()
    for (device, tp, cp, pp, dp, flex, a2a), connections in zip(grid, theirs):
        lay = Layout(tp=tp, cp=cp, pp=pp, vp=2 if pp > 1 else 1, dp=dp, ep=2, moe_a2a_overlap=a2a,
                     moe_dispatcher="deepep" if flex else "alltoall", global_batch=64 * dp)
        if tp == 1 or stack.hides_moe_a2a(lay) != a2a:   # (no TP to overlap; a layout the stack cannot pair)
            continue
        assert stack.tp_overlap_choice(lay, load_device(device)) == (devices[device] or connections == 1)
        assert stack.tp_overlap_in(replace(lay, tp_comm_overlap=True), load_device(device)) == \
            stack.tp_overlap_choice(lay, load_device(device)) and not stack.tp_overlap_in(lay, load_device(device))
        checked.add((device, a2a))
    assert checked == {(device, a2a) for device in devices for a2a in (False, True)}
