"""Activation offloading (`offload_layers`, Megatron-Core --cpu-offloading-num-layers): chosen per pp = 1 layout as
the fewest layers that fit where it beats recomputation, bounded by host memory, refused by the one rulebook where
Megatron-Core's TransformerConfig refuses it, noted where a target framework cannot express it. The search's
optimum against an enumeration of every count is tests/test_search.py's; the exports read back by Megatron-Core's
and Megatron-Bridge's own configuration classes are tests/test_exports_megatron.py's and test_exports_bridge.py's."""
import json
import subprocess
import sys

import pytest

from cost_models.layout import Layout
from hardware_profiles import cluster_from_device
from hardware_profiles.errors import UserInputError
from hardware_profiles.loader import load_stack
from planner import api
from planner.api import InfeasibleError
from planner.exports import export
from planner.graph_capture.model_capture import capture
from planner.rules.pins import pins_from
from planner.rules.stack import layout_stack_problems, stack_problems

# Megatron-Bridge's Llama 3 70B GB200 FSDP recipe shape (64 GPUs, MBS 2, GBS 256, FP8 current scaling)
FSDP = "tp=1,pp=1,dp=64,cp=1,ep=1,mbs=2,zero=3,fp8_recipe=tensorwise"
JOB = dict(num_devices=64, global_batch=256, seq_len=8192, precision="fp8", stack="megatron-bridge")


@pytest.fixture(scope="module")
def gb200_plan():
    return api.evaluate("llama3-70b", layout=FSDP, device="gb200", **JOB)


def test_the_plan_offloads_the_fewest_layers_that_fit_and_says_what_recomputing_would_cost(gb200_plan):
    chosen = gb200_plan.layout.offload_layers
    assert chosen > 0 and gb200_plan.fits and set(gb200_plan.stages[0].recompute) == {"none"}
    with pytest.raises(InfeasibleError, match="does not fit"):
        api.evaluate("llama3-70b", layout=FSDP + f",recompute=none,offload_layers={chosen - 1}", device="gb200", **JOB)
    more = api.evaluate("llama3-70b", layout=FSDP + f",recompute=none,offload_layers={chosen + 1}", device="gb200",
                        **JOB)
    assert more.fits and more.step_time_s >= gb200_plan.step_time_s
    # a whole layout without recomputation that leaves the count out takes it as the search does
    whole = api.evaluate("llama3-70b", layout=FSDP + ",vp=1,etp=1,recompute=none", device="gb200", **JOB)
    assert (whole.layout.offload_layers, whole.step_time_s) == (chosen, pytest.approx(gb200_plan.step_time_s))
    # the reason's alternative is the plan the search makes with offloading ruled out
    recomputed = api.evaluate("llama3-70b", layout=FSDP + ",offload_layers=0", device="gb200", **JOB)
    assert recomputed.layout.offload_layers == 0 and "full" in recomputed.stages[0].recompute
    slower = (recomputed.step_time_s / gb200_plan.step_time_s - 1) * 100
    assert any(f"first {chosen} of 80 layers" in r and f"recomputing instead, the plan {slower:.1f}% slower" in r
               for r in gb200_plan.reasons)
    # the device holds every layer's activations but the offloaded ones, and one of those in flight
    parts = gb200_plan.memory[0].parts
    assert parts["offload_in_flight"] > 0 and gb200_plan.breakdown["offload_s"] >= 0
    # no run the model was fitted on states offloading: the plan says it extrapolates
    assert any("activation offloading" in note for note in gb200_plan.outside_measured)


def test_host_memory_bounds_offloading():
    """Over H100's PCIe the fewest layers that fit would overfill the node's host memory (2 TB for 8 GPUs): the plan
    recomputes and says why; with eight times the host memory it offloads."""
    layout = "tp=1,pp=1,dp=64,cp=1,ep=1,mbs=2,zero=3"
    job = dict(num_devices=64, global_batch=256, seq_len=8192, precision="bf16", stack="megatron-core")
    recomputing = api.evaluate("llama3-70b", layout=layout, device="h100-sxm", **job)
    assert recomputing.layout.offload_layers == 0
    assert any("cannot fit the layout" in r and "256 GB of host memory" in r for r in recomputing.reasons)
    cluster = cluster_from_device("h100-sxm", 64)
    roomy = cluster.model_copy(update={"device": cluster.device.model_copy(update={"host_memory_bytes": 2048 * 10**9})})
    offloading = api.evaluate("llama3-70b", roomy, layout=layout, **{k: v for k, v in job.items()
                                                                      if k != "num_devices"})
    assert offloading.layout.offload_layers > 0
    # a whole layout that offloads more than the host holds is predicted, does not fit, and says why
    overfull = api.evaluate("llama3-70b", layout="tp=1,pp=1,vp=1,dp=64,cp=1,ep=1,etp=1,mbs=2,zero=3,recompute=none,"
                            "offload_layers=79", device="h100-sxm", **job)
    assert not overfull.fits and overfull.reasons[0].startswith("does not fit host memory")


def test_the_rulebook_refuses_offloading_where_megatron_core_does():
    bridge = load_stack("megatron-bridge")
    assert any("has no activation offloading" in p
               for p in stack_problems(pins_from({"offload_layers": 4}), load_stack("torchtitan"), "bf16"))
    assert any("pipeline" in p for p in stack_problems(pins_from({"offload_layers": 4, "pp": 2}), bridge, "bf16"))
    assert any("recomputation" in p
               for p in stack_problems(pins_from({"offload_layers": 4, "recompute": "full"}), bridge, "bf16"))
    assert any("CUDA graphs" in p for p in stack_problems(pins_from({"offload_layers": 4}),
                                                          bridge.model_copy(update={"cuda_graphs": True}), "bf16"))
    graph = capture("llama3-8b")
    assert any("fewer layers than the model's 32" in p
               for p in stack_problems(pins_from({"offload_layers": 32}), bridge, "bf16", graph))
    # this project's runtime runs the parallel-planner stack, which has none: a plan that offloads is refused there
    layout = Layout(dp=8, offload_layers=4, global_batch=64)
    assert any("offload_layers=4" in p for p in layout_stack_problems(layout, load_stack("parallel-planner"), graph))
    with pytest.raises(UserInputError, match="host_link_gbytes_per_s"):
        api.plan("llama3-8b", device="h800", num_devices=8, global_batch=64, stack="megatron-core", offload_layers=4)


def test_targets_without_offloading_say_so_and_a_hand_edited_pipeline_is_refused(gb200_plan, tmp_path):
    for target in ("torchtitan", "deepspeed"):
        notes = export(gb200_plan, target, "plan.yaml").notes
        assert any(f"first {gb200_plan.layout.offload_layers} layers' activations" in n for n in notes)
    record = json.loads(gb200_plan.model_dump_json())
    record["layout"].update(recompute="full")
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(record))
    refused = subprocess.run([sys.executable, "-m", "planner.cli", "export", str(path), "--to", "megatron"],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "offload_layers" in refused.stderr and "Traceback" not in refused.stderr
