"""What torch's mixed precision holds for backward, against torch: the bf16 copy of fp32 master parameters, and
the inputs torchao's FP8 linears keep.

Where the parameters are the fp32 master (`master_weights: parameters`: this runtime, torchtitan), a step
computes with bf16 copies: FSDP2's MixedPrecisionPolicy unshards each module into one, and torch.autocast
caches one per weight a GEMM reads. `cost_models.memory.copied_roles` says which layers' copies are still held
when backward starts (the activation peak); here torch itself shows it, on the reference decoder: after the
forward, FSDP2 leaves a module's unsharded bf16 parameters registered where it has not resharded them, and
autocast's copies are what backward's saved tensors hold.
"""
from __future__ import annotations

import socket

import pytest
import torch
from torch import nn
import torch.distributed as dist
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from cost_models.memory import MASTER_BYTES, StateSharding, copied_roles, model_state_bytes
from planner import api
from planner.graph_capture.model_capture import capture
from planner.graph_capture.model_sources import resolve_model
from planner.graph_capture.reference_model import build_model

MODEL, SEQ = "tiny-llama", 7   # a sequence length no parameter dimension equals: saved copies read unambiguously


@pytest.fixture(scope="module")
def one_rank_group():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def _decoder():
    torch.manual_seed(0)
    config = resolve_model(MODEL)
    graph = capture(config, SEQ)
    return build_model(config, "cpu", torch.float32), graph


def _role(name: str, graph) -> str:
    top = name.split(".")[0]
    if top in graph.embedding_modules:
        return "embedding"
    return "head" if top in graph.head_modules else "block"


def _predicted_copy_bytes(graph, roles: tuple[str, ...]) -> dict[str, float]:
    """Per role, what the memory model adds to the weights for the copy (one data-parallel rank, no tp)."""
    sharding = StateSharding(tp=1, ep=1, etp=1, dp_cp=1, expert_dp=1, zero=0, gradient_bytes=4,
                             fp32_parameters=True, copied_roles=roles)
    copies: dict[str, float] = {}
    for slot in graph.layers:
        kind = graph.kind(slot.kind)
        extra = model_state_bytes(kind, sharding).weights - MASTER_BYTES * kind.param_count
        copies[kind.role] = copies.get(kind.role, 0.0) + extra
    return {role: value for role, value in copies.items() if value}


def _forward(model) -> torch.Tensor:
    tokens = torch.randint(0, resolve_model(MODEL).vocab_size, (1, SEQ))
    return model(tokens).float().sum()


@pytest.mark.parametrize("zero,wrap", [
    (2, lambda module, mesh, policy: fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=False)),
    (0, lambda module, mesh, policy: replicate(module, mesh=mesh, mp_policy=policy)),
    (3, lambda module, mesh, policy: fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=True)),
], ids=["zero2-fully_shard", "zero0-replicate", "zero3-fully_shard"])
def test_fsdp2_holds_the_unsharded_copies_the_memory_model_bills(one_rank_group, zero, wrap):
    """Wrapped as this runtime wraps (each block, then the root): the bf16 parameters still registered after
    the forward are, by role and in bytes, the copy `copied_roles` bills (dp x cp > 1 for ZeRO-0's replicate)."""
    model, graph = _decoder()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for slot in graph.blocks:
        wrap(model.get_submodule(slot.module_name), one_rank_group, policy)
    wrap(model, one_rank_group, policy)
    _forward(model)
    held: dict[str, float] = {}
    for name, param in model.named_parameters():
        registered = model.get_parameter(name)
        if registered.dtype == torch.bfloat16:
            held[_role(name, graph)] = held.get(_role(name, graph), 0.0) + 2 * registered.numel()
    expected = _predicted_copy_bytes(graph, copied_roles(True, zero, dp_cp=2))
    assert held == pytest.approx(expected, rel=1e-9)
    assert set(held) == (set() if zero == 3 else {"embedding", "block", "head"})


def test_autocast_keeps_a_copy_of_each_gemm_weight_for_the_step():
    """torch.autocast over fp32 parameters (ZeRO-1's DDP, one data-parallel rank): the bf16 weight copies
    backward's saved tensors hold are the block and head GEMM weights, none of the embedding; the model bills
    them, and the few norm weights beside them that autocast runs in fp32 (within 2%)."""
    model, graph = _decoder()
    saved: list[torch.Tensor] = []
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _forward(model)
    copies = [t for t in saved if t.dtype == torch.bfloat16]
    held: dict[str, float] = {}
    for name, param in model.named_parameters():
        cast = param.detach().to(torch.bfloat16)
        if any(torch.equal(view, cast) for c in copies if c.numel() == cast.numel()
               for view in (c, c.T) if view.shape == cast.shape):
            held[_role(name, graph)] = held.get(_role(name, graph), 0.0) + 2 * param.numel()
    expected = _predicted_copy_bytes(graph, copied_roles(True, zero=1, dp_cp=2))
    assert set(held) == set(expected) == {"block", "head"}
    for role, value in expected.items():
        assert held[role] <= value <= 1.02 * held[role], role


def test_torchao_float8_keeps_bf16_inputs_and_its_stacks_bill_them():
    """torchao's Float8Linear (this runtime's and torchtitan's FP8) saves the bf16 input and weight for backward,
    no FP8 copy: under those stacks FP8 activations are billed as bf16 ones, where Transformer Engine's stacks
    (Megatron-Core) bill 1-byte copies of the GEMM inputs."""
    from torchao.float8 import convert_to_float8_training
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False)).to(torch.bfloat16)
    convert_to_float8_training(layers)
    assert {type(layer).__name__ for layer in layers} == {"Float8Linear"}
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layers(torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)).sum().backward()
    assert saved and {t.dtype for t in saved} == {torch.bfloat16}
    common = dict(device="h100-sxm", num_devices=8, global_batch=8, seq_len=4096,
                  layout="tp=1,pp=1,dp=8,cp=1,mbs=1,zero=3,recompute=none")

    def activations(stack: str, precision: str) -> float:
        return api.evaluate("llama3-8b", stack=stack, precision=precision, **common).memory[0].parts["activations"]
    assert activations("torchtitan", "fp8") == activations("torchtitan", "bf16")
    assert activations("parallel-planner", "fp8") == activations("parallel-planner", "bf16")
    assert activations("megatron-core", "fp8") < activations("megatron-core", "bf16")


def test_pipelined_fsdp2_keeps_whole_gradients_until_the_step_reduces_them(one_rank_group):
    """torch.distributed.pipelining over FSDP2 (ZeRO-2 here): just before the stage's one reduction of the step
    (`perform_reduce_grad`, after the last micro-batch), every registered parameter is still the unsharded one
    with a whole gradient; after it, sharded. Stacks built on it (`pipeline_gradient_accumulation: unsharded`)
    bill ZeRO-2/3 gradients whole under pipelining, dp times what they bill otherwise."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.distributed.tensor import DTensor

    from cost_models.layout import Layout
    from hardware_profiles.loader import load_stack
    model, graph = _decoder()
    # fp32 throughout, so the whole gradient is the registered parameter's own (under a bf16 policy FSDP2
    # accumulates it in fp32 beside the parameter, `unsharded_accumulated_grad`, out of public reach)
    for slot in graph.blocks:
        fully_shard(model.get_submodule(slot.module_name), mesh=one_rank_group, reshard_after_forward=False)
    fully_shard(model, mesh=one_rank_group, reshard_after_forward=False)
    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    before: list[tuple[bool, bool]] = []
    reduce = stage.perform_reduce_grad

    def look_then_reduce(*args, **kwargs):
        for name, _ in model.named_parameters():
            param = model.get_parameter(name)
            before.append((isinstance(param, DTensor), param.grad is not None and param.grad.shape == param.shape))
        return reduce(*args, **kwargs)
    stage.perform_reduce_grad = look_then_reduce
    vocab = resolve_model(MODEL).vocab_size
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda logits, target: torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), target.flatten()))
    tokens = torch.randint(0, vocab, (2, SEQ))
    schedule.step(tokens, target=torch.randint(0, vocab, (2, SEQ)))
    assert before and all(not sharded and whole for sharded, whole in before)
    assert all(isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in model.parameters())

    runtime = load_stack("parallel-planner")
    per_micro_batch = runtime.model_copy(update={"pipeline_gradient_accumulation": "sharded"})
    layout = Layout(dp=4, pp=2, global_batch=16, zero=2)
    kind = graph.kind(graph.blocks[0].kind)
    whole, sharded = (model_state_bytes(kind, StateSharding.of(layout, stack)).gradients
                      for stack in (runtime, per_micro_batch))
    assert whole == pytest.approx(4 * sharded) and whole == pytest.approx(layout.gradient_bytes * kind.param_count)


def test_a_plan_says_what_torch_holds_beyond_zeros_shares():
    """Nothing silent: a plan for a torch stack names the bf16 copy and the whole gradients it billed; a
    Megatron plan, whose bf16 weights are the weights and whose gradients ZeRO shares as usual, names neither."""
    common = dict(device="h100-sxm", num_devices=16, global_batch=64, seq_len=4096, pp=2, zero=2, time_limit_s=20)
    torch_plan = api.plan("llama3-8b", stack="parallel-planner", **common)
    megatron = api.plan("llama3-8b", stack="megatron-core", **common)
    said = " ".join(torch_plan.reasons)
    assert "a bf16 copy of every layer's parameters" in said and "keeps the gradients whole" in said
    assert not any("bf16 copy" in line or "gradients whole" in line for line in megatron.reasons)


def test_ddp_buckets_are_the_gradients_from_step_to_step(one_rank_group):
    """ZeRO-1 in this runtime is DDP with gradient_as_bucket_view: each step's gradients are views into the same
    bucket, allocated once (rebuilt once after the first step; zero_grad(set_to_none) drops only the views), so
    they are held at the activation peak
    even in a step of one micro-batch, as the runtime stack bills them (`persistent_gradient_zero_stages`), where
    FSDP2's ZeRO-2 gradients are not."""
    from torch.nn.parallel import DistributedDataParallel

    from cost_models.layout import Layout
    from cost_models.step_time import estimate
    from hardware_profiles.loader import cluster_from_device, load_stack
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))
    ddp = DistributedDataParallel(layers, gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(layers.parameters(), lr=1e-3)
    storages = []   # DDP rebuilds its buckets once, after the first step, in the order gradients came
    for _ in range(3):
        ddp(torch.randn(4, 32)).sum().backward()
        storages.append({p.grad.untyped_storage().data_ptr() for p in layers.parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert len(storages[1]) == 1 and storages[1] == storages[2]

    runtime, graph = load_stack("parallel-planner"), capture(MODEL, SEQ)
    cluster = cluster_from_device("h100-sxm", 8)

    def held(zero: int) -> bool:   # one micro-batch a step: dp 8 x mbs 1 = the global batch
        layout = Layout(dp=8, global_batch=8, zero=zero)
        return estimate(graph.costs(), cluster, layout, runtime).stage_memory[0].gradients_held
    assert held(1) and not held(2)



def _gathers_per_module(blocks: nn.Sequential, step) -> list[int]:
    """How often each module's FSDP2 group all-gathers in one `step()` (the unshards that found it sharded),
    counted in a second step: the first also lazily initialises FSDP2's state."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    gathers: dict[int, int] = {}
    unshard = FSDPParamGroup.unshard

    def counted(group, *args, **kwargs):
        if group.is_sharded:
            gathers[id(group)] = gathers.get(id(group), 0) + 1
        return unshard(group, *args, **kwargs)
    FSDPParamGroup.unshard = counted
    try:
        for _ in range(2):
            gathers.clear()
            step()
    finally:
        FSDPParamGroup.unshard = unshard
    return [gathers.get(id(block._get_fsdp_state()._fsdp_param_group), 0) for block in blocks]


def _fsdp_linears(mesh, reshard_after_forward: bool) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(blocks, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return blocks


def test_pipelined_zero3_all_gathers_twice_per_micro_batch(one_rank_group):
    """FSDP2 resharding after forward (ZeRO-3) under torch's 1F1B, though the stage turns resharding after backward
    off: each module but the stage's last all-gathers in every forward and every backward (counted per FSDP
    group as the unshards that found it sharded; the last, whose backward comes first, keeps its parameters), so
    gradients accumulating whole do not change ZeRO-3's two all-gathers per micro-batch, which the runtime stack
    bills (and no per-micro-batch reduce-scatter there)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from cost_models.communication import Collective
    from cost_models.layer_costs import MeshCosts
    from cost_models.layout import Layout
    from hardware_profiles.loader import cluster_from_device, load_stack
    blocks, micro_batches = _fsdp_linears(one_rank_group, reshard_after_forward=True), 8
    schedule = Schedule1F1B(PipelineStage(blocks, 0, 1, torch.device("cpu")), n_microbatches=micro_batches,
                            loss_fn=lambda out, target: ((out - target) ** 2).mean())
    counts = _gathers_per_module(blocks, lambda: schedule.step(torch.randn(16, 16), target=torch.randn(16, 16)))
    assert counts == [2 * micro_batches + 1] * 3 + [micro_batches + 1]

    runtime, graph = load_stack("parallel-planner"), capture(MODEL, SEQ)
    costs = MeshCosts(graph.costs(), cluster_from_device("h100-sxm", 16), Layout(dp=8, pp=2, global_batch=64, zero=3),
                      runtime)
    params = float(graph.kind("dense").param_count)
    gather = costs.collective(Collective.all_gather, params * 2, "dpcp").seconds
    assert costs.sharded_dp_comm_s(graph.kind("dense")) == pytest.approx(2 * gather, rel=1e-12)


def test_zero2_all_gathers_per_micro_batch_unless_pipelined(one_rank_group):
    """FSDP2 without resharding after forward (ZeRO-2) reshards after backward: accumulating 8 micro-batches,
    every module all-gathers 8 times a step; under torch's 1F1B, which keeps the parameters to the step's end,
    once. The torch stacks bill one all-gather per micro-batch (beside the reduce-scatter) without pipelining,
    and the step's one after the optimizer with it."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from cost_models.communication import Collective
    from cost_models.layer_costs import MeshCosts
    from cost_models.layout import Layout
    from hardware_profiles.loader import cluster_from_device, load_stack
    accumulated = _fsdp_linears(one_rank_group, reshard_after_forward=False)
    assert _gathers_per_module(accumulated, lambda: [(accumulated(torch.randn(2, 16)) ** 2).mean().backward()
                                                     for _ in range(8)]) == [8] * 4
    pipelined = _fsdp_linears(one_rank_group, reshard_after_forward=False)
    schedule = Schedule1F1B(PipelineStage(pipelined, 0, 1, torch.device("cpu")), n_microbatches=8,
                            loss_fn=lambda out, target: ((out - target) ** 2).mean())
    assert _gathers_per_module(pipelined, lambda: schedule.step(torch.randn(16, 16), target=torch.randn(16, 16))) \
        == [1] * 4

    runtime, graph = load_stack("parallel-planner"), capture(MODEL, SEQ)
    cluster = cluster_from_device("h100-sxm", 16)
    params = float(graph.kind("dense").param_count)
    for layout, per_micro_batch in ((Layout(dp=16, global_batch=64, zero=2), True),
                                    (Layout(dp=8, pp=2, global_batch=64, zero=2), False)):
        costs = MeshCosts(graph.costs(), cluster, layout, runtime)
        gather = costs.collective(Collective.all_gather, params * 2, "dpcp").seconds
        reduce = costs.collective(Collective.reduce_scatter, params * layout.gradient_bytes, "dpcp").seconds
        billed = costs.sharded_dp_comm_s(graph.kind("dense"))
        assert billed == pytest.approx(gather + reduce if per_micro_batch else 0.0, rel=1e-12, abs=1e-15)
        assert runtime.gathers_per_micro_batch(layout) is per_micro_batch


def test_recomputation_runs_between_zero3s_gathers_and_hides_them(one_rank_group):
    """FSDP2 (ZeRO-3) under activation checkpointing: each block's recomputed forward runs inside the backward,
    after its pre-backward all-gather and before the previous block's (the forward pre-hook sees the recompute;
    FSDP2's `_pre_forward` returns early in PRE_BACKWARD), so recomputation gathers nothing more, two all-gathers
    a micro-batch still, and it is compute the next gather and this block's reduce-scatter run beside. The
    exposed ZeRO-3 traffic is what forward, backward and recomputation together do not hide."""
    from torch.utils.checkpoint import checkpoint
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from cost_models.layer_costs import MeshCosts
    from cost_models.layer_records import RECOMPUTE_ORDER
    from cost_models.layout import Layout
    from hardware_profiles.loader import cluster_from_device, load_stack
    blocks = _fsdp_linears(one_rank_group, reshard_after_forward=True)
    index = {id(block._get_fsdp_state()._fsdp_param_group): i for i, block in enumerate(blocks)}
    events: list[tuple[str, int]] = []
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda module, args, i=i: events.append(("forward", i)))
    pre_backward = FSDPParamGroup.pre_backward

    def logged(group, *args, **kwargs):
        events.append(("pre_backward", index[id(group)]))
        return pre_backward(group, *args, **kwargs)

    def step():
        events.clear()
        x = torch.randn(2, 16, requires_grad=True)
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False)
        (x ** 2).mean().backward()
    FSDPParamGroup.pre_backward = logged
    try:
        counts = _gathers_per_module(blocks, step)
    finally:
        FSDPParamGroup.pre_backward = pre_backward
    assert counts[:3] == [2] * 3 and counts[3] in (1, 2)   # the last block may keep its parameters into backward
    backward = events[events.index(("pre_backward", 3)):]
    assert backward == [event for i in (3, 2, 1, 0) for event in (("pre_backward", i), ("forward", i))]

    graph = capture(MODEL, SEQ)
    cluster = cluster_from_device("a100-80g", 64, devices_per_node=1)   # slow gathers: traffic beyond compute
    costs = MeshCosts(graph.costs(), cluster, Layout(dp=64, global_batch=64, zero=3), load_stack("torchtitan"))
    dense = graph.kind("dense")
    layer, parts = costs.layer(dense), costs.step_parts(dense)
    assert parts.zero_traffic_s > parts.compute_s + layer.forward_s > 0   # exposed under every method
    for method, repeated in zip(RECOMPUTE_ORDER, layer.recompute_s):
        assert layer.work_s(method) - layer.work_before_zero_s(method) == pytest.approx(
            parts.zero_traffic_s - layer.forward_s - layer.backward_s - repeated, rel=1e-12)
