"""Software stacks as an input: the search stays inside what the named stack runs, a layout it cannot run
is refused with the rule, and the stack is recorded in the plan."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.layout import Layout
from hardware_profiles.errors import UserInputError
from hardware_profiles.loader import list_stacks, load_stack
from planner import api
from planner.graph_capture.model_capture import capture
from planner.graph_capture.model_sources import resolve_model
from planner.plans import Plan
from planner.rules.pins import pins_from
from planner.rules.stack import layout_stack_problems, stack_problems

BUILT_IN = {"megatron-lm-2021", "megatron-lm-2021-zero", "megatron-deepspeed-2021", "megatron-lm-2022", "megatron-core", "nemo", "nemo-2", "megatron-bridge", "torchtitan",
            "deepspeed", "llm-foundry", "mindspeed", "parallel-planner", "torchtitan-npu"}


def run(args):
    """`planner ARGS` in this process (tests/test_cli.py), whatever its exit status."""
    from tests.test_cli import run as run_cli
    return run_cli(args, check=False)


def test_built_in_stacks_load_and_list():
    assert BUILT_IN <= set(list_stacks())
    listed = run("stacks list")
    assert listed.returncode == 0 and all(name in listed.stdout for name in BUILT_IN)
    shown = json.loads(run("stacks show torchtitan --json").stdout)
    assert shown["zero_stages"] == [0, 2, 3] and shown["loss_gradient"] == "eager"
    assert "megatron-core" in run("plan --help").stdout   # the default is said


@pytest.mark.parametrize("stack,rule", [
    ("llm-foundry", lambda p: (p.layout.tp, p.layout.pp, p.layout.cp) == (1, 1, 1)),   # FSDP only
    ("deepspeed", lambda p: p.layout.vp == 1 and p.layout.tp == 1),                      # no interleaving, no TP
    ("torchtitan", lambda p: p.layout.zero != 1),                                          # FSDP2 or DDP
    ("megatron-lm-2021", lambda p: p.layout.recompute != "per-layer" and not p.layout.sp),
    ("megatron-lm-2021-zero", lambda p: p.layout.pp == 1 and p.layout.recompute != "per-layer"),   # ZeRO beside TP only
])
def test_search_stays_inside_the_stack(stack, rule):
    result = api.plan("llama3-8b", device="h100-sxm", num_devices=16, global_batch=64, stack=stack, time_limit_s=60)
    assert result.stack == stack
    assert rule(result)


def test_a_layout_the_stack_cannot_run_is_refused_with_the_rule():
    with pytest.raises(UserInputError, match="llm-foundry stack has no TP"):
        api.evaluate("llama3-8b", device="h100-sxm", num_devices=8, global_batch=64, stack="llm-foundry",
                     layout="tp=2,pp=1,dp=4,cp=1,ep=1,etp=1,vp=1,mbs=1,zero=3,recompute=none")
    with pytest.raises(UserInputError, match="ZeRO stages"):
        api.plan("llama3-8b", device="h100-sxm", num_devices=8, global_batch=64, stack="torchtitan", zero=1)
    proc = run("evaluate --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 64 --stack mindspeed "
               "--precision fp8 --layout tp=1,pp=1,dp=8,cp=1,ep=1,etp=1,vp=1,mbs=1,zero=1,recompute=none")
    assert proc.returncode == 2 and "no FP8 training" in proc.stderr and "Traceback" not in proc.stderr
    # combined 1F1B: only where the stack runs it (Megatron-Core 0.12 under NeMo 2 has none; the runtime's stack
    # neither: its refusal is this rule)
    with pytest.raises(UserInputError, match="no combined 1F1B"):
        api.evaluate("mixtral-8x7b", device="h100-sxm", num_devices=16, global_batch=64, stack="nemo-2",
                     layout="tp=1,pp=1,dp=16,cp=1,ep=8,etp=1,vp=1,mbs=1,zero=1,recompute=none,a2a_overlap=true")
    runtime_layout = Layout(dp=2, ep=2, global_batch=4, moe_a2a_overlap=True)
    assert any("no combined 1F1B" in p for p in layout_stack_problems(runtime_layout, load_stack("parallel-planner")))


def test_uniform_recomputation_stack_searches_each_method():
    """A stack that checkpoints every layer or none gets the better of the two uniform plans."""
    searched = api.plan("gpt3-175b", device="a100-80g", num_devices=64, global_batch=512, stack="megatron-lm-2021",
                        time_limit_s=60, tp=8, pp=8)
    each = []
    for method in ("none", "full"):
        try:
            each.append(api.plan("gpt3-175b", device="a100-80g", num_devices=64, global_batch=512,
                                 stack="megatron-lm-2021", time_limit_s=60, tp=8, pp=8, recompute=method).step_time_s)
        except UserInputError:
            pass
    assert each and searched.step_time_s == pytest.approx(min(each), rel=1e-9)
    assert searched.layout.recompute in ("none", "full")


def test_stack_is_recorded_in_the_plan_file(tmp_path):
    path = tmp_path / "plan.yaml"
    proc = run(f"plan --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 64 --stack torchtitan "
               f"--out {path}")
    assert proc.returncode == 0, proc.stderr
    assert Plan.load(path).stack == "torchtitan"
    assert "torchtitan" in proc.stdout


def refused_stack_file(tmp_path, **fields) -> str:
    """The one-paragraph refusal of the megatron-core stack with `fields` changed, written to a stack file
    and read as `--stack FILE` reads it (the CLI's exit status 2 for it: the unknown-field test below); its
    words joined by single spaces."""
    from hardware_profiles.loader import resolve_stack

    data = load_stack("megatron-core").model_dump()
    data.update(fields)
    path = tmp_path / "mine.yaml"
    path.write_text(json.dumps(data))
    with pytest.raises(UserInputError) as refused:
        resolve_stack(str(path))
    return " ".join(str(refused.value).split())


def test_a_stack_file_with_an_unknown_field_is_refused(tmp_path):
    data = load_stack("megatron-core").model_dump()
    data["tp_overlap"] = True
    path = tmp_path / "mine.yaml"
    path.write_text(json.dumps(data))
    proc = run(f"plan --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 64 --stack {path}")
    assert proc.returncode == 2 and "tp_overlap" in proc.stderr and "Traceback" not in proc.stderr
    assert "tp_overlap" in refused_stack_file(tmp_path, tp_overlap=True)


def test_bf16_moments_without_the_precision_aware_optimizer_are_refused_as_megatron_core_refuses_them(tmp_path):
    """Megatron-Core 0.16.1's OptimizerConfig asserts fp32 moments without --use-precision-aware-optimizer; a
    stack file asking for bf16 moments without it gets one paragraph naming the field, exit status 2."""
    import warnings

    import torch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "Transformer Engine and Apex are not installed"
        from megatron.core.optimizer import OptimizerConfig

    with pytest.raises(AssertionError, match="exp_avg_dtype can only be fp32"):
        OptimizerConfig(optimizer="adam", bf16=True, use_distributed_optimizer=True, exp_avg_dtype=torch.bfloat16)
    assert "adam_moment_bytes" in refused_stack_file(tmp_path, adam_moment_bytes=2)


def test_the_allgather_dispatcher_beside_the_a2a_overlap_is_refused_as_megatron_core_refuses_it(tmp_path):
    """Megatron-Core 0.16.1's TransformerConfig runs --overlap-moe-expert-parallel-comm with the alltoall and
    flex dispatchers only; a stack file asking for it with the allgather dispatcher is refused, naming it."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.transformer_config import TransformerConfig
        with pytest.raises(AssertionError, match="alltoall/flex token dispatcher"):
            TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=8,
                              moe_router_topk=2, expert_model_parallel_size=2, moe_token_dispatcher_type="allgather",
                              overlap_moe_expert_parallel_comm=True)
    assert "moe_a2a_overlap needs alltoall or deepep" in refused_stack_file(
        tmp_path, moe_dispatcher="allgather", moe_dispatchers=["allgather"], moe_a2a_overlap=True)
    # where the stack runs several, the rule is the layout's: pinned together they are refused, and the search
    # gives an allgather plan no combined 1F1B
    common = dict(device="h100-sxm", num_devices=16, global_batch=64, stack="megatron-core")
    layout = "tp=1,pp=1,vp=1,dp=16,cp=1,ep=8,etp=1,mbs=1,zero=1,recompute=none,dispatcher=allgather"
    with pytest.raises(UserInputError, match="a2a_overlap=true with dispatcher=allgather"):
        api.evaluate("mixtral-8x7b", layout=layout + ",a2a_overlap=true", **common)
    assert not api.evaluate("mixtral-8x7b", layout=layout, **common).layout.moe_a2a_overlap


def test_a_fused_loss_keeps_the_bf16_logits_transformer_engines_cross_entropy_keeps():
    """Transformer Engine's parallel_cross_entropy (Megatron-Bridge: cross_entropy_fusion_impl 'te') saves its
    bf16 input logits and writes the gradient into them in place: the last stage holds s * b * V / tp bf16
    values and no more; Megatron-Core's vocab-parallel cross-entropy keeps the fp32 softmax and hands back a
    bf16 gradient copy (megatron/core/tensor_parallel/cross_entropy.py)."""
    layout = "tp=2,pp=1,vp=1,dp=4,cp=1,ep=1,etp=1,mbs=2,zero=1,recompute=none"
    logits = 2 * 8192 * 128256 / 2   # mbs * seq * vocab / tp
    for stack, kept, gradient in (("megatron-bridge", 2, 0), ("megatron-core", 4, 2)):
        plan = api.evaluate("llama3-8b", device="h100-sxm", num_devices=8, global_batch=64, stack=stack,
                            seq_len=8192, layout=layout)
        parts = plan.memory[0].parts
        assert parts["logits"] == pytest.approx(kept * logits) and parts["loss_gradient"] == pytest.approx(
            gradient * logits)


def test_fsdp2_states_match_the_torchtitan_stack():
    """Real FSDP2 with torchtitan's mixed-precision policy (bf16 compute, fp32 reduction) and AdamW, on one
    gloo rank: the bytes of its sharded parameters, gradients and optimizer state are what the torchtitan
    stack predicts for zero=3 (fp32 parameters as the master, no bf16 copy kept), and not what a stack with
    a separate bf16 copy predicts."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from planner.graph_capture.model_sources import resolve_model
    from planner.graph_capture.reference_model import build_model

    cfg = resolve_model("tiny-llama")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = build_model(cfg, device="cpu")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, cfg.vocab_size, (1, 33))
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()

        def nbytes(t):
            return t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
        measured = sum(nbytes(p) + nbytes(p.grad) for p in model.parameters())
        measured += sum(nbytes(v) for state in optimizer.state.values() for k, v in state.items() if k != "step")
    finally:
        dist.destroy_process_group()
    layout = "tp=1,pp=1,dp=1,cp=1,ep=1,etp=1,vp=1,mbs=1,zero=3,recompute=none"
    predicted = {}
    for stack in ("torchtitan", "megatron-core"):
        plan = api.evaluate(cfg, device="h100-sxm", num_devices=1, devices_per_node=1, global_batch=1,
                            seq_len=32, layout=layout, stack=stack)
        parts = plan.memory[0].parts
        predicted[stack] = parts["weights"] + parts["gradients"] + parts["optimizer"]
    assert predicted["torchtitan"] == pytest.approx(measured, rel=0.01)
    assert predicted["megatron-core"] > measured * 1.1


def test_the_runtime_stack_never_plans_what_the_runtime_refuses():
    """`--stack parallel-planner` (this project's runtime) keeps cp and ep at 1 for a model whose attention
    and experts the runtime cannot split; the runtime refuses the same layouts with the same rule
    (tests/test_runtime.py::test_bad_plans_fail_on_every_rank_before_collectives)."""
    user = "examples/user_gpt.py:build_separate_qkv"
    for count in (8, 16):
        result = api.plan(user, device="cpu", num_devices=count, global_batch=16, seq_len=32, stack="parallel-planner")
        assert result.layout.cp == 1 and result.layout.ep == 1
    with pytest.raises(UserInputError, match="reads wpe's weight directly"):
        api.plan(user, device="cpu", num_devices=8, global_batch=16, seq_len=32, stack="parallel-planner", cp=2)
    # the reference decoder's attention can be split: cp stays in the space
    api.evaluate("tiny-llama", device="cpu", num_devices=8, global_batch=16, stack="parallel-planner",
                 layout="tp=1,pp=1,dp=4,cp=2,ep=1,etp=1,vp=1,mbs=1,zero=1,recompute=none")


def test_the_runtime_stack_never_column_splits_a_fused_projection():
    """GPT-2's c_attn is cut into q | k | v by the model: the runtime refuses it under tp
    (tests/test_runtime.py, bad plans), so the planner on the runtime's stack never plans tp for it, and
    a pinned tp=2 names the rule; Megatron's stack shards fused QKV in its own layers and may plan it."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent / "models"))
    from hf_tiny import gpt2_logits
    from hardware_profiles.errors import UserInputError
    import planner
    common = dict(device="cpu", num_devices=2, devices_per_node=2, global_batch=8, seq_len=32)
    assert planner.plan(gpt2_logits(), stack="parallel-planner", **common).layout.tp == 1
    with pytest.raises(UserInputError, match="column-splits only separate projections"):
        planner.plan(gpt2_logits(), stack="parallel-planner", tp=2, **common)
    assert planner.evaluate(gpt2_logits(), layout="tp=2", stack="megatron-core", **common).layout.tp == 2
    # stages of a recorded model run its own forward over their blocks (runtime/sequential_stage.py, trained
    # in tests/test_runtime.py): pp is in this stack's space for transformers' classes too
    assert planner.evaluate(gpt2_logits(), layout="pp=2,mbs=1", stack="parallel-planner", **common).layout.pp == 2
    # a stack that cuts only torch.fx graphs refuses it, naming the rule
    traceable = load_stack("parallel-planner").model_copy(update={"pipeline_models": "traceable"})
    assert "cuts pipeline stages from a torch.fx trace" in " ".join(stack_problems(
        pins_from({"pp": 2}), traceable, "bf16", capture(gpt2_logits(), seq_len=32)))


def test_the_runtime_stack_refuses_sliding_windows_under_cp_and_recorded_pp():
    """A sliding window (Mistral's) masks what all-gathered K/V with a causal mask would attend to, and
    transformers picks each layer's mask by its place in the top-level loop, which a pipeline stage's
    shorter loop would shift: cp and pp are refused on the runtime's stack, naming the rule, and never
    planned; the same model without the window may have both."""
    transformers = pytest.importorskip("transformers")
    import torch

    def mistral(window):
        config = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                            max_position_embeddings=64, sliding_window=window)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    stack = load_stack("parallel-planner")
    windowed, plain = capture(mistral(16), seq_len=32), capture(mistral(None), seq_len=32)
    problems = " ".join(stack_problems(pins_from({"cp": 2, "pp": 2}), stack, "bf16", windowed))
    assert "causal scaled_dot_product_attention without a sliding window" in problems
    assert "picks sliding-window masks" in problems
    assert stack_problems(pins_from({"cp": 2, "pp": 2}), stack, "bf16", plain) == []
    common = dict(device="cpu", num_devices=8, devices_per_node=8, global_batch=8, seq_len=32, stack="parallel-planner")
    result = api.plan(mistral(16), **common)
    assert result.layout.cp == 1 and result.layout.pp == 1


def test_a_swapped_optimizer_keeps_one_chunk_on_the_device_and_pays_the_host_link():
    """torchtitan-npu swaps AdamW's fp32 moments to host (swap_optimizer_times 16): the device holds one
    sixteenth of them, and the step pays their copy in and out over the host link (both directions at once),
    paced by the slower of copy and update, plus the first chunk's copy. Parameters counted on the torch
    module itself."""
    from planner.graph_capture.model_sources import resolve_model
    from planner.graph_capture.reference_model import build_model
    from hardware_profiles.loader import load_cluster

    cfg = resolve_model("llama3-8b")
    params = sum(p.numel() for p in build_model(cfg, device="meta").parameters())
    layout = "tp=1,pp=1,dp=16,cp=1,ep=1,etp=1,vp=1,mbs=1,zero=3,recompute=full"
    kept, swapped = (api.evaluate(cfg, "atlas-a3-superpod-dies", layout, num_devices=16, global_batch=16, stack=s)
                     for s in ("torchtitan", "torchtitan-npu"))
    moments = 8 * params / 16                       # fp32 m and v of this rank's shard
    assert kept.memory[0].parts["optimizer"] == pytest.approx(moments, rel=1e-3)
    assert swapped.memory[0].parts["optimizer"] == pytest.approx(moments / 16, rel=1e-3)
    copy_s = moments / (load_cluster("atlas-a3-superpod-dies").device.host_link_gbytes_per_s * 1e9)
    update_s = kept.breakdown["optimizer_s"]
    assert swapped.breakdown["optimizer_s"] == pytest.approx(max(update_s, copy_s) + copy_s / 16, rel=1e-3)
    assert swapped.step_time_s - kept.step_time_s == pytest.approx(
        swapped.breakdown["optimizer_s"] - update_s, rel=1e-6)


def test_a_swapping_stack_on_a_device_without_a_host_link_is_refused():
    with pytest.raises(UserInputError) as info:
        api.plan("llama3-8b", device="ascend-910c", num_devices=16, global_batch=16, stack="torchtitan-npu")
    assert "host_link_gbytes_per_s" in str(info.value) and "ascend-910c" in str(info.value)
    refused = run("plan --model llama3-8b --device ascend-910c --num-devices 16 --global-batch 16 "
                  "--stack torchtitan-npu")
    assert refused.returncode == 2 and "host_link_gbytes_per_s" in refused.stderr and "Traceback" not in refused.stderr


def test_deepep_hidden_behind_compute_slows_that_compute_by_the_sms_it_holds():
    """Combined 1F1B hides DeepEP's dispatch behind another micro-batch's compute, which then runs on the SMs
    DeepEP leaves (DeepSeek-V3 3.2.2: 20 of the H800's 132): for every second of all-to-all hidden, which beside
    compute lasts 1/r s at the device's measured rate r, 20/132 / r s more (the compute beside it runs at 112/132
    of its speed while it lasts).
    Checked against the same plan without an SM count (nothing billed, and the plan says so) and without the
    overlap (nothing hidden)."""
    from hardware_profiles.loader import cluster_from_device
    stack = load_stack("megatron-core").model_copy(update={"moe_a2a_overlap": True, "moe_dispatcher": "deepep"})
    h100 = cluster_from_device("h100-sxm", 16)
    unknown = h100.model_copy(update={"device": h100.device.model_copy(update={"sm_count": None})})
    layout = "tp=4,pp=1,dp=4,cp=1,ep=4,etp=1,vp=1,mbs=1,zero=1,recompute=none,dispatcher=deepep,a2a_overlap={}"
    billed, unbilled, alone = (
        api.evaluate("mixtral-8x7b", cluster, layout.format(on), global_batch=64, stack=stack)
        for cluster, on in ((h100, "true"), (unknown, "true"), (h100, "false")))
    hidden = alone.breakdown["ep_comm_s"] - unbilled.breakdown["ep_comm_s"]
    assert hidden > 0
    rate = h100.device.flex_dispatch_rate_beside_compute
    assert billed.breakdown["ep_comm_s"] - unbilled.breakdown["ep_comm_s"] == pytest.approx(hidden * 20 / 132 / rate,
                                                                                            rel=1e-6)
    assert any("20 of 132 SMs" in r for r in billed.reasons)
    assert any("no SM count" in r for r in unbilled.reasons)


def test_nccl_all_to_all_hidden_behind_compute_holds_its_p2p_channels_sms():
    """NCCL's all-to-all runs one CTA per p2p channel, each on its own SM (NVIDIA/nccl ncclTopoComputeP2pChannels):
    NCCL logged 32 p2p channels on one 8 x H100 node and 16 across two. Hidden behind another micro-batch's
    compute by combined 1F1B, it slows that compute by 32/132 s per second hidden where the expert group stays
    in its node and 16/132 where it spans two; a profile without the count bills nothing and says so. (The
    network is made fast enough here that every all-to-all fits inside the compute beside it.)"""
    from hardware_profiles.loader import cluster_from_device
    stack = load_stack("megatron-core").model_copy(update={"moe_a2a_overlap": True})
    h100 = cluster_from_device("h100-sxm", 16)
    network = h100.inter_node
    fast = network.model_copy(update={"nic_bandwidth_gbit_per_s": 100 * network.nic_bandwidth_gbit_per_s})
    h100 = h100.model_copy(update={"inter_node": fast})
    unknown = h100.model_copy(update={"device": h100.device.model_copy(update={"nccl_p2p_sms": None})})
    layout = "tp=1,pp=1,dp=16,cp=1,ep={},etp=1,vp=1,mbs=1,zero=1,recompute=none,dispatcher=alltoall,a2a_overlap={}"
    for ep, held in ((8, 32), (16, 16)):
        billed, unbilled, alone = (
            api.evaluate("qwen3-30b-a3b", cluster, layout.format(ep, on), global_batch=64, stack=stack)
            for cluster, on in ((h100, "true"), (unknown, "true"), (h100, "false")))
        hidden = alone.breakdown["ep_comm_s"] - unbilled.breakdown["ep_comm_s"]
        assert hidden > 0
        assert billed.breakdown["ep_comm_s"] - unbilled.breakdown["ep_comm_s"] == \
            pytest.approx(hidden * held / 132, rel=1e-6)
    assert any("32 within a node, 16 across nodes) of 132 SMs" in r for r in billed.reasons)
    assert any("no NCCL p2p channel count" in r for r in unbilled.reasons)


def test_dualpipev_pairs_say_what_the_all_to_all_holds():
    """DualPipeV's overlapped pairs hide the all-to-alls as combined 1F1B does, and the plan says so."""
    stack = load_stack("torchtitan").model_copy(update={"dualpipev_hides_moe_a2a": True})
    plan_ = api.evaluate("qwen3-30b-a3b", device="h100-sxm", num_devices=16, global_batch=64, stack=stack,
                         layout="tp=1,pp=2,dp=8,cp=1,ep=8,etp=1,mbs=1,zero=2,recompute=full,schedule=dualpipev")
    assert any("of 132 SMs while DualPipeV's pairs hide them" in r for r in plan_.reasons)


@settings(max_examples=60, deadline=None)
@given(a2a=st.floats(0.01, 10), compute=st.floats(0.01, 10), held=st.integers(1, 100))
def test_an_all_to_all_beside_compute_exposes_what_sharing_the_sms_step_by_step_gives(a2a, compute, held):
    """The closed form max(a - c, a f) against a step-by-step run of the two kernels: the all-to-all at full
    speed, the compute at (1 - f) of it while the all-to-all lasts and at full speed after."""
    from cost_models.expert_comm import exposed_beside_compute
    share, step = held / 132, max(a2a, compute) / 4000
    t, comm_left, work_left = 0.0, a2a, compute
    while comm_left > 0 or work_left > 0:
        work_left -= step * ((1 - share) if comm_left > 0 else 1.0)
        comm_left -= step
        t += step
    assert t - compute == pytest.approx(exposed_beside_compute(a2a, compute, share), abs=3 * step)


def test_nemo_2_runs_the_recipes_its_scripts_take():
    """NeMo 2's performance scripts take --fp8_recipe ds | cs | mxfp8 (Megatron-Core 0.12 has no blockwise):
    blockwise is refused naming the stack, and its --recompute_modules reach Megatron-Core's set."""
    layout = "tp=1,pp=1,dp=8,cp=1,ep=1,etp=1,vp=1,mbs=1,zero=1,recompute=none,fp8_recipe={}"
    with pytest.raises(UserInputError, match="nemo-2 stack has delayed, tensorwise, mxfp8"):
        api.evaluate("llama3-8b", device="h100-sxm", num_devices=8, global_batch=64, stack="nemo-2",
                     precision="fp8", layout=layout.format("blockwise"))
    assert api.evaluate("llama3-8b", device="h100-sxm", num_devices=8, global_batch=64, stack="nemo-2",
                        precision="fp8", layout=layout.format("tensorwise")).stack == "nemo-2"
    assert "mla_up_proj" in load_stack("nemo-2").recompute_modules


def _shared_expert_moe(hidden: int = 1024):
    from planner.graph_capture.model_config import ModelConfig, MoEConfig
    return ModelConfig(name="shared-moe", num_layers=2, hidden_size=hidden, num_attention_heads=8,
                       ffn_hidden_size=4 * hidden, vocab_size=4096, seq_length=4096,
                       moe=MoEConfig(num_experts=16, router_topk=2, moe_ffn_hidden_size=512, num_shared_experts=1,
                                     shared_expert_ffn_hidden_size=2048))


def test_shared_experts_beside_the_all_to_alls_expose_what_outlasts_each_projection():
    """--moe-shared-expert-overlap (Megatron-Core token_dispatcher.py): the shared experts' up-projection runs
    beside the dispatch and their down-projection beside the combine, forward and backward. Capture finds the
    two in the expert container by their shapes (gate and up from the hidden size, down to it): each pass's
    seconds are the GEMMs of those shapes. With the all-to-alls far slower (a 25 Gb/s network), each runs its
    projection beside it on the SMs it leaves, and so hides the whole projection."""
    from cost_models.compute import ShardSpec, layer_compute, op_seconds
    from cost_models.layer_costs import MeshCosts
    from cost_models.layout import Layout
    from hardware_profiles.loader import cluster_from_device
    from planner.graph_capture.model_capture import capture

    model = capture(_shared_expert_moe()).costs()
    kind = next(k for k in model.kinds if k.num_experts)
    cluster = cluster_from_device("h100-sxm", 16)
    slow = cluster.model_copy(update={"inter_node": cluster.inter_node.model_copy(
        update={"nic_bandwidth_gbit_per_s": 25})})
    layout = Layout(dp=16, ep=16, global_batch=16)
    plain = load_stack("megatron-core")
    overlap = plain.model_copy(update={"moe_shared_expert_overlap": True})
    shared = layer_compute(kind, cluster.device, ShardSpec.of(layout, plain)).shared_experts
    ops = [op for op in kind.ops if op.module == "moe" and op.kind == "gemm" and op.sharding == "tensor"]
    up = [op_seconds(op, cluster.device, ShardSpec.of(layout, plain)) for op in ops if op.gemm_mnk[2] == 1024]
    down = [op_seconds(op, cluster.device, ShardSpec.of(layout, plain)) for op in ops if op.gemm_mnk[1] == 1024]
    assert len(up) == 2 and len(down) == 1   # gate and up, down
    assert shared.up_forward_s == pytest.approx(sum(f for f, _, _ in up))
    assert shared.down_backward_s == pytest.approx(sum(bi + bw for _, bi, bw in down))
    costs = {name: MeshCosts(model, slow, layout, stack) for name, stack in (("plain", plain), ("overlap", overlap))}
    compute = layer_compute(kind, cluster.device, ShardSpec.of(layout, plain))
    dispatch, combine = costs["overlap"].ep_exchanges_s(kind)
    held = costs["overlap"].sm_share_held_by_dispatch()
    assert min(dispatch, combine) * (1 - held) > max(vars(shared).values())   # each projection fits beside
    hidden = costs["plain"].ep_comm_s(kind, compute) - costs["overlap"].ep_comm_s(kind, compute)
    assert hidden == pytest.approx(sum(vars(shared).values()))


def test_the_shared_expert_overlap_runs_with_the_dispatchers_megatron_core_runs_it_with(tmp_path):
    """Megatron-Core 0.16.1 runs --moe-shared-expert-overlap with the alltoall dispatcher only: a stack asking
    for it with DeepEP is refused as Megatron-Core's TransformerConfig refuses it; a plan with it exports the
    flag, which TransformerConfig accepts."""
    import warnings

    from planner.exports import megatron_args

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.transformer_config import TransformerConfig
        moe = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_router_topk=2,
                   moe_shared_expert_intermediate_size=128, moe_shared_expert_overlap=True)
        with pytest.raises(ValueError, match="only works with alltoall"):
            TransformerConfig(**moe, moe_token_dispatcher_type="flex")
        assert TransformerConfig(**moe, moe_token_dispatcher_type="alltoall").moe_shared_expert_overlap
    assert "moe_shared_expert_overlap needs" in refused_stack_file(tmp_path, moe_dispatcher="deepep",
                                                                  moe_dispatchers=["deepep"],
                                                                  moe_shared_expert_overlap=True)
    stack = load_stack("megatron-core").model_copy(update={"moe_shared_expert_overlap": True})
    plan = api.evaluate(_shared_expert_moe(), device="h100-sxm", num_devices=16, global_batch=16, stack=stack,
                        layout="tp=1,pp=1,vp=1,dp=16,cp=1,ep=16,etp=1,mbs=1,zero=1,recompute=none,dispatcher=alltoall")
    assert plan.layout.moe_shared_expert_overlap and "--moe-shared-expert-overlap" in megatron_args(plan)[0]
    flex = api.evaluate(_shared_expert_moe(), device="h100-sxm", num_devices=16, global_batch=16, stack=stack,
                        layout="tp=1,pp=1,vp=1,dp=16,cp=1,ep=16,etp=1,mbs=1,zero=1,recompute=none,dispatcher=deepep")
    assert not flex.layout.moe_shared_expert_overlap   # Megatron-Core runs it with the alltoall dispatcher only
    assert any("SMs while the shared experts run beside them" in r for r in plan.reasons)


def test_combined_1f1b_beside_multi_token_prediction_as_megatron_core_allows_it():
    """Megatron-Core's TransformerConfig refuses --overlap-moe-expert-parallel-comm beside a multi-token
    prediction module without a pipeline (and beside more than one module): pinned there it is refused with the
    rule; left out, neither evaluate nor the search runs it; with pp 2 and virtual stages it may run.
    (tests/test_exports_megatron.py builds Megatron-Core's own config from such plans.)"""
    mtp = resolve_model("mixtral-8x7b").model_copy(update={"mtp_layers": 1, "num_layers": 8})
    common = dict(device="h100-sxm", num_devices=16, global_batch=64, stack="megatron-core", time_limit_s=60)
    whole = "tp=1,pp={pp},dp={dp},cp=1,ep=8,etp=1,vp={vp},mbs=1,zero=1,recompute=none"
    with pytest.raises(UserInputError, match="multi-token prediction module.*only with pp > 1"):
        api.evaluate(mtp, layout=whole.format(pp=1, dp=16, vp=1) + ",a2a_overlap=true", **common)
    assert api.evaluate(mtp, layout=whole.format(pp=1, dp=16, vp=1), **common).layout.moe_a2a_overlap is False
    assert api.plan(mtp, pp=1, ep=8, **common).layout.moe_a2a_overlap is False
    piped = whole.format(pp=2, dp=8, vp=2)
    on, off = (api.evaluate(mtp, layout=f"{piped},a2a_overlap={flag}", **common) for flag in ("true", "false"))
    assert on.layout.moe_a2a_overlap is True and off.layout.moe_a2a_overlap is False
    two = mtp.model_copy(update={"mtp_layers": 2})
    with pytest.raises(UserInputError, match="beside one at most"):
        api.evaluate(two, layout=f"{piped},a2a_overlap=true", **common)


def test_tp_overlap_stays_off_beside_combined_1f1b_on_hopper_as_megatron_bridges_h100_recipes_run_it(tmp_path):
    """Megatron-LM's combined-1F1B guide: on Hopper and earlier TP overlap wants CUDA_DEVICE_MAX_CONNECTIONS=1 and
    combined 1F1B more; Megatron-Bridge's H100 Qwen3-235B recipes with combined 1F1B set tp_comm_overlap=False
    (its launcher: 8 connections). On H100 such a plan bills its TP collectives whole, as the same layout under a
    stack without TP overlap does, records and exports TP overlap off and says why; on B200 (Blackwell: no such
    conflict) and without combined 1F1B it keeps TP overlap, but not without sequence parallelism."""
    bridge = load_stack("megatron-bridge")
    assert bridge.tp_comm_overlap and bridge.moe_a2a_overlap
    layout = "tp=2,pp=2,vp=2,dp=8,cp=1,ep=8,mbs=1,zero=1,recompute=none,dispatcher=alltoall,a2a_overlap={}"

    def evaluated(device, overlap, stack=bridge):
        return api.evaluate("qwen3-30b-a3b", layout=layout.format(overlap), device=device, num_devices=32,
                            global_batch=256, seq_len=4096, precision="bf16", stack=stack)
    hopper = evaluated("h100-sxm", "true")
    assert hopper.layout.moe_a2a_overlap and not hopper.layout.tp_comm_overlap
    without = evaluated("h100-sxm", "true", bridge.model_copy(update={"tp_comm_overlap": False}))
    assert without.breakdown["tp_comm_s"] > 0
    assert hopper.breakdown["tp_comm_s"] == pytest.approx(without.breakdown["tp_comm_s"])
    assert any("TP communication overlap is off beside combined 1F1B" in r for r in hopper.reasons)
    path = tmp_path / "plan.json"
    path.write_text(hopper.model_dump_json())
    assert "--tp-comm-overlap" not in run(f"export {path} --to megatron").stdout
    blackwell, alone = evaluated("b200", "true"), evaluated("h100-sxm", "false")
    assert blackwell.layout.tp_comm_overlap and alone.layout.tp_comm_overlap
    assert not any("TP communication overlap is off" in r for r in blackwell.reasons + alone.reasons)
    assert alone.breakdown["tp_comm_s"] < without.breakdown["tp_comm_s"]
    # nor without sequence parallelism, as Megatron-Bridge's CommOverlapConfig turns it off there
    layout += ",sp=false"
    unsharded = evaluated("b200", "false")
    assert not unsharded.layout.tp_comm_overlap and unsharded.breakdown["tp_comm_s"] == pytest.approx(
        evaluated("b200", "false", bridge.model_copy(update={"tp_comm_overlap": False})).breakdown["tp_comm_s"])


def test_tp_overlap_is_a_plan_field_chosen_where_it_runs_pinned_and_refused_by_one_rulebook(tmp_path):
    """TP communication overlap (`tp_overlap` in the layout, `tp_comm_overlap` in the plan): evaluate takes it on
    where the stack runs it and leaves it out, a pin off is kept and the plan says what it would hide (the same
    as the plan evaluated with it on), and a pin on is refused where it cannot run (a stack without it, tp = 1,
    without sequence parallelism, beside a pinned combined 1F1B at tp > 1 on H100), as is a hand-edited plan file
    that claims it there."""
    bridge = load_stack("megatron-bridge")
    layout = "tp=2,pp=2,vp=2,dp=8,cp=1,ep=8,mbs=1,zero=1,recompute=none,dispatcher=alltoall,a2a_overlap=false"
    common = dict(device="h100-sxm", num_devices=32, global_batch=256, seq_len=4096, precision="bf16")

    def evaluated(extra="", stack=bridge, device="h100-sxm"):
        return api.evaluate("qwen3-30b-a3b", layout=layout + extra, **{**common, "device": device}, stack=stack)
    chosen, off = evaluated(), evaluated(",tp_overlap=false")
    assert chosen.layout.tp_comm_overlap and not off.layout.tp_comm_overlap
    pinned = evaluated(",tp_overlap=true")
    assert chosen.step_time_s < off.step_time_s and (chosen.step_time_s, chosen.layout) == (pinned.step_time_s,
                                                                                           pinned.layout)
    hidden = off.breakdown["tp_comm_s"] - chosen.breakdown["tp_comm_s"]
    assert any(f"on, it would hide {hidden:.3f} s" in r for r in off.reasons)
    assert any(f"hides {hidden:.3f} s of tensor-parallel communication" in r for r in chosen.reasons)
    from cost_models.layout_codec import layout_from, text_of
    assert "tp_overlap=true" in text_of(layout_from(chosen.layout.layout_values()))
    assert any("has no TP communication overlap" in p
               for p in stack_problems(pins_from({"tp_overlap": True}), load_stack("deepspeed"), "bf16"))
    assert any("tp=1" in p for p in stack_problems(pins_from({"tp_overlap": True, "tp": 1}), bridge, "bf16"))
    assert any("sequence parallelism" in p for p in stack_problems(pins_from({"tp_overlap": True, "sp": False}),
                                                                   bridge, "bf16"))
    with pytest.raises(UserInputError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        api.evaluate("qwen3-30b-a3b", layout=layout.replace("a2a_overlap=false", "a2a_overlap=true")
                     + ",tp_overlap=true", **common, stack=bridge)
    blackwell = api.evaluate("qwen3-30b-a3b", layout=layout.replace("a2a_overlap=false", "a2a_overlap=true")
                             + ",tp_overlap=true", **{**common, "device": "b200"}, stack=bridge)
    assert blackwell.layout.tp_comm_overlap and blackwell.layout.moe_a2a_overlap
    with pytest.raises(UserInputError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        api.plan("qwen3-30b-a3b", **common, stack=bridge, tp=2, tp_overlap=True, a2a_overlap=True, time_limit_s=30)
    # hand-edited plan files: TP overlap where there is no TP, and beside combined 1F1B on H100
    record = json.loads(chosen.model_dump_json())
    flat = dict(record, layout=dict(record["layout"], tp_comm_overlap=True, tp=1, dp=16))
    path = tmp_path / "flat.json"
    path.write_text(json.dumps(flat))
    refused = run(f"export {path} --to megatron")
    assert refused.returncode == 2 and "tp_comm_overlap with tp=1" in refused.stderr
    paired = json.loads(evaluated().model_dump_json())
    hopper = dict(paired, layout=dict(paired["layout"], moe_a2a_overlap=True))
    path = tmp_path / "paired.json"
    path.write_text(json.dumps(hopper))
    refused = run(f"export {path} --to megatron")
    assert refused.returncode == 2 and "CUDA_DEVICE_MAX_CONNECTIONS" in refused.stderr


def test_the_fp8_recipe_is_kept_and_each_other_one_the_device_runs_is_costed_beside_it():
    """The FP8 recipe sets the scaling numerics: a plan keeps the stack's default (or the pin) and says what each
    other recipe the stack runs on the device would cost, the same figure as `evaluate` of the layout with that
    recipe pinned; MXFP8 only where the device has its block-scaled tensor cores."""
    layout = "tp=4,pp=2,dp=8,cp=1,ep=1,etp=1,vp=1,mbs=1,zero=1,recompute=selective"
    common = dict(num_devices=64, global_batch=128, seq_len=4096, precision="fp8", stack="megatron-bridge")
    for device, recipes in (("b200", {"delayed", "mxfp8", "blockwise"}), ("h100-sxm", {"delayed", "blockwise"})):
        result = api.evaluate("llama3-70b", layout=layout, device=device, **common)
        assert result.layout.fp8_recipe == load_stack("megatron-bridge").fp8_recipes[0]
        line = next(r for r in result.reasons if r.startswith("FP8 recipe"))
        named = {r for r in ("delayed", "tensorwise", "mxfp8", "blockwise") if f"; {r} " in line or f"recomputation {r} " in line}
        assert named == recipes
        for recipe in recipes:
            pinned = api.evaluate("llama3-70b", layout=f"{layout},fp8_recipe={recipe}", device=device, **common)
            change = pinned.step_time_s / result.step_time_s - 1
            assert (f"{recipe} {change * 100:.1f}% slower" in line if change >= 0
                    else f"{recipe} {-change * 100:.1f}% faster" in line)
    bf16 = api.evaluate("llama3-70b", layout=layout, device="b200", **{**common, "precision": "bf16"})
    assert not any(r.startswith("FP8 recipe") for r in bf16.reasons)


def test_a_cluster_without_an_all_to_all_share_is_said_where_the_expert_all_to_all_crosses_nodes():
    """A cluster profile with no `inter_node.all_to_all_fraction` bills NCCL's all-to-all at the rings' share
    of the line rate: the plan says so where its expert all-to-all leaves a node, and not inside one node or
    where the profile gives the figure; with the figure the all-to-all is slower, as fitted."""
    from planner.job import resolve_cluster
    given = resolve_cluster(device="h100-sxm", num_devices=16)
    unknown = given.model_copy(update={"inter_node": given.inter_node.model_copy(
        update={"all_to_all_fraction": None})})
    layout = "tp=1,pp=1,vp=1,dp=16,cp=1,ep={},etp=1,mbs=1,zero=1,recompute=none,dispatcher=alltoall,a2a_overlap=false"
    def reasons(cluster, ep):
        plan = api.evaluate(_shared_expert_moe(), cluster, layout.format(ep), global_batch=16,
                            stack="megatron-core")
        return plan, [r for r in plan.reasons if "all_to_all_fraction" in r]
    across, said = reasons(unknown, 16)
    assert len(said) == 1 and f"busbw_fraction ({given.inter_node.busbw_fraction:g})" in said[0]
    assert not reasons(unknown, 8)[1]     # eight ranks of one node
    fitted, quiet = reasons(given, 16)
    assert not quiet
    assert given.inter_node.all_to_all_fraction < given.inter_node.busbw_fraction
    assert fitted.breakdown["ep_comm_s"] > across.breakdown["ep_comm_s"]


def test_the_flex_dispatchers_sms_are_those_of_the_backend_the_device_runs():
    """The flex dispatcher's kernels hold DeepEP's `deepep_sms`, or, on a device that runs them as HybridEP (GB200),
    `hybridep_sms`: unset, DeepEP's count, as Megatron-Core's moe_hybridep_num_sms None leaves it; Megatron-Bridge's
    performance setup sets 32. The share the compute beside them loses follows, and so does what the plan says; a
    count leaving no SM to compute is refused, naming its field."""
    from cost_models.layer_costs import MeshCosts
    from hardware_profiles.loader import cluster_from_device, load_device

    bridge, core = load_stack("megatron-bridge"), load_stack("megatron-core")
    h100, gb200 = load_device("h100-sxm"), load_device("gb200")
    assert (bridge.flex_dispatcher_sms(h100), bridge.flex_dispatcher_sms(gb200)) == (20, 32)
    assert (core.flex_dispatcher_sms(h100), core.flex_dispatcher_sms(gb200)) == (20, 20)
    model = capture(resolve_model("tiny-moe")).costs()
    layout = Layout(dp=8, ep=4, global_batch=8, moe_dispatcher="deepep", moe_a2a_overlap=True)
    held = MeshCosts(model, cluster_from_device("gb200", 8), layout, bridge).sm_share_held_by_dispatch()
    assert held == pytest.approx(32 / 148)
    pinned = dict(device="gb200", num_devices=8, global_batch=8, stack=bridge,
                  layout="tp=1,pp=1,vp=1,dp=8,cp=1,ep=4,etp=1,mbs=1,zero=1,recompute=none,dispatcher=deepep,"
                         "a2a_overlap=true")
    plan = api.evaluate("tiny-moe", **pinned)
    assert any(r.startswith("HybridEP's kernels hold 32 of 148 SMs") for r in plan.reasons)
    with pytest.raises(UserInputError, match="hybridep_sms 148 leaves none"):
        api.evaluate("tiny-moe", **{**pinned, "stack": bridge.model_copy(update={"hybridep_sms": 148})})


def test_the_dispatch_rate_beside_compute_is_the_nsight_comparisons_and_slows_deepep_only():
    """`Device.flex_dispatch_rate_beside_compute` on H100 is what Megatron-Bridge's Nsight comparison gives
    (skills/nemo-mbridge-perf-expert-parallel-overlap/SKILL.md @067f987d: communication concurrent with compute
    9.079 ms = 0.11% of it without combined 1F1B, 3,958.997 ms = 36.55% with it; the same kernels' work, the part
    run alone at full speed): combined 1F1B then hides less of DeepEP's all-to-alls than at full speed, and the plan
    says at what rate; NCCL's all-to-all, which no profile measured beside compute, and a device without the figure
    are billed at full speed, and the plan says that instead."""
    from hardware_profiles.loader import load_device
    from planner.job import resolve_cluster
    off_s, on_s, beside_s = 9.079e-3 / 0.0011, 3958.997e-3 / 0.3655, 3958.997e-3
    assert load_device("h100-sxm").flex_dispatch_rate_beside_compute == pytest.approx(
        (off_s - (on_s - beside_s)) / beside_s, abs=5e-4)
    assert load_device("b200").flex_dispatch_rate_beside_compute is None
    layout = "tp=1,pp=1,vp=1,dp=16,cp=1,ep=4,etp=1,mbs=1,zero=1,recompute=none,dispatcher={},a2a_overlap=true"
    def plan(device, dispatcher, rate="keep"):
        cluster = resolve_cluster(device=device, num_devices=16)
        if rate != "keep":
            cluster = cluster.model_copy(update={"device": cluster.device.model_copy(
                update={"flex_dispatch_rate_beside_compute": rate})})
        return api.evaluate("tiny-moe", cluster, layout.format(dispatcher), global_batch=128, stack="megatron-core")
    measured, full = plan("h100-sxm", "deepep"), plan("h100-sxm", "deepep", None)
    assert measured.breakdown["ep_comm_s"] > full.breakdown["ep_comm_s"]
    assert any("progress at 35% of full speed" in r for r in measured.reasons)
    assert any("billed at full speed" in r and "DeepEP-style kernels" in r for r in full.reasons)
    nccl = plan("h100-sxm", "alltoall")
    assert nccl.breakdown["ep_comm_s"] == plan("h100-sxm", "alltoall", None).breakdown["ep_comm_s"]
    assert any("billed at full speed" in r and "NCCL's all-to-all" in r for r in nccl.reasons)
