"""Host time: the CPU issuing a layer's kernels. Capture's kernel count is checked against what transformers'
real layers launch on CPU; a pass the host is slower at takes the host's time, the closed form of the stack's
units times the node's CPU time per call; and a plan says where the host is not billed and why."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import planner
from cost_models.compute import ShardSpec
from cost_models.layer_costs import MeshCosts
from cost_models.layout_codec import layout_from
from hardware_profiles.loader import load_cluster, load_stack
from planner.job import capture_for
from planner.graph_capture.launches import GEMM_OPS, NOT_KERNELS

SEQ = 32
# a stack that runs the model's own code (its norms and activations as written), as the real layer runs
OWN_CODE = {"fused_kernels": False, "fused_gated_activation": False}


class _Kernels(TorchDispatchMode):
    """Every aten op the real layer runs that is a kernel on a GPU: not a view, allocation or metadata read."""

    def __init__(self):
        super().__init__()
        self.gemms = self.others = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if not func.is_view and packet not in NOT_KERNELS:
            if packet in GEMM_OPS:
                self.gemms += 1
            else:
                self.others += 1
        return func(*args, **(kwargs or {}))


def _real_layer_kernels(factory: str) -> _Kernels:
    """The kernels transformers' first decoder layer launches, forward, on CPU in bf16 with real values."""
    import models.hf_tiny as hf_tiny

    torch.manual_seed(0)
    model = getattr(hf_tiny, factory)().to(torch.bfloat16)
    layer, rope = model.model.model.layers[0], model.model.model.rotary_emb
    x = torch.randn(1, SEQ, 64, dtype=torch.bfloat16, requires_grad=True)
    rotary = rope(x, torch.arange(SEQ)[None])
    with _Kernels() as kernels:
        layer(x, position_embeddings=rotary, attention_mask=None)
    return kernels


def _captured_layer(factory: str, stack_name: str = "torchtitan"):
    stack = load_stack(stack_name).model_copy(update=OWN_CODE)
    graph = capture_for(f"tests/models/hf_tiny.py:{factory}", SEQ, (), stack)
    return graph, graph.kind(graph.blocks[0].kind), stack


@pytest.mark.parametrize("factory", ["llama_logits", "qwen3_logits"])
def test_capture_counts_the_kernels_the_real_layer_launches(factory):
    """Capture counts, on meta tensors, the kernels each node launches beside its GEMMs: as many as the real
    layer launches on CPU (its norms' casts and reductions, the rotary embedding, attention, the residuals)."""
    real = _real_layer_kernels(factory)
    _, kind, _ = _captured_layer(factory)
    assert sum(op.launches + op.expert_launches for op in kind.ops) == real.others
    assert sum(1 for op in kind.ops if op.kind.value == "gemm") == real.gemms


def test_capture_counts_a_moe_layers_kernels_within_a_tenth():
    """transformers' Mixtral layer: its routing takes data-dependent paths (sorting the routed tokens) that
    differ on meta by a few kernels; the count stays within 10% of the real layer's."""
    real = _real_layer_kernels("mixtral_logits")
    _, kind, _ = _captured_layer("mixtral_logits")
    counted = sum(op.launches + op.expert_launches for op in kind.ops)
    assert abs(counted - real.others) <= 0.1 * real.others


def test_a_pass_the_host_is_slower_at_takes_the_hosts_time():
    """A tiny layer on a GB200 node: the device finishes each kernel before the next is issued, so forward and
    backward take what the host spends issuing them. torchtitan's units: a Linear call 1 forward and 2 backward,
    every other kernel 0.47 each way, times 37.08 us per call (TransformerEngine issue 2053); the calls are the
    real layer's, counted on CPU."""
    real = _real_layer_kernels("llama_logits")
    graph, kind, stack = _captured_layer("llama_logits")
    cluster = load_cluster("gb200-nvl72").model_copy(update={"num_devices": 8})
    layout = layout_from({"tp": 1, "pp": 1, "dp": 8, "cp": 1, "ep": 1, "vp": 1, "mbs": 1, "zero": 1,
                          "recompute": "none"}, global_batch=8)
    cost = MeshCosts(graph.costs_record, cluster, layout, stack).layer(kind)
    unit = 37.08e-6
    forward = unit * (real.gemms * 1.0 + real.others * 0.47)
    backward = unit * (real.gemms * 2.0 + real.others * 0.47)
    assert cost.forward_s < forward and cost.backward_s < backward   # device-light: host-bound both ways
    assert cost.forward_s + cost.backward_s + cost.host_excess_s == pytest.approx(forward + backward, rel=1e-9)


def test_megatron_issues_its_fused_projections_as_one_call():
    """Megatron builds q, k and v as one column-parallel GEMM and gate and up as another: 4 GEMM calls in a
    Llama layer where the model's own code makes 7."""
    from cost_models.host_time import layer_host_seconds
    from hardware_profiles.loader import load_device

    _, kind, _ = _captured_layer("llama_logits")
    device = load_device("gb200")
    spec = ShardSpec()
    separate = load_stack("megatron-core").model_copy(update={**OWN_CODE, "fused_projections": False})
    fused = separate.model_copy(update={"fused_projections": True})
    gemm_forward_s = separate.host_calls.gemm_forward * device.host_call_us * 1e-6
    saved = layer_host_seconds(kind, device, separate, spec).forward_s - layer_host_seconds(kind, device, fused, spec).forward_s
    assert saved == pytest.approx(3 * gemm_forward_s, rel=1e-9)


def test_a_plan_says_whether_the_host_keeps_up_and_where_it_is_not_billed():
    layout = "tp=1,pp=1,dp=8,cp=1,ep=1,vp=1,mbs=1,zero=2,recompute=none"
    common = dict(num_devices=8, global_batch=8, seq_len=512, stack="torchtitan")
    small = planner.evaluate("tiny-llama", layout=layout, device="gb200", **common)
    assert small.breakdown["host_s"] > 0
    assert any("host-bound" in reason for reason in small.reasons)
    unmeasured = planner.evaluate("tiny-llama", layout=layout, device="a100-80g", **common)
    assert unmeasured.breakdown["host_s"] == 0
    assert any("a100-80g profile gives no host CPU time" in reason for reason in unmeasured.reasons)
    graphs = load_stack("torchtitan").model_copy(update={"cuda_graphs": True})
    replayed = planner.evaluate("tiny-llama", layout=layout, device="gb200", **{**common, "stack": graphs})
    assert replayed.breakdown["host_s"] == 0 and any("CUDA graphs" in reason for reason in replayed.reasons)


def test_a_longer_micro_batch_leaves_the_host_behind():
    """The host issues the same kernels whatever their size: with more tokens per micro-batch the device's share
    grows and the step stops waiting for the host."""
    common = dict(device="gb200", num_devices=8, global_batch=64, stack="torchtitan")
    layout = "tp=1,pp=1,dp=8,cp=1,ep=1,vp=1,mbs={},zero=2,recompute=none"
    short = planner.evaluate("tiny-llama", layout=layout.format(1), seq_len=128, **common)
    long = planner.evaluate("tiny-llama", layout=layout.format(8), seq_len=2048, **common)
    assert short.breakdown["host_s"] / short.step_time_s > long.breakdown["host_s"] / long.step_time_s


def _per_op_seconds(kind, device, stack, spec):
    """Each op's host seconds (the stack's units, as host_time counts them) and device forward seconds."""
    from cost_models.compute import op_seconds
    from cost_models.host_time import _op_units
    from cost_models.records import OpKind, Sharding
    calls = stack.host_calls
    gemm, op_units = (calls.gemm_forward, calls.gemm_backward), (calls.op_forward, calls.op_backward)
    host, dev, projected = [], [], set()
    for op in kind.ops:
        host.append(_op_units(op, op.reads in projected, gemm, op_units, stack, spec)[0] * device.host_call_us * 1e-6)
        dev.append(op_seconds(op, device, spec)[0])
        if op.kind is OpKind.gemm and op.sharding is Sharding.tensor and op.reads:
            projected.add(op.reads)
    return host, dev


def _queued_forward_s(host, dev, sync_at):
    """An event replay of one forward: the host issues op i after its own time for it, the device runs it once
    issued and free; at the sync the host first waits for the device to finish everything queued."""
    issued = done = 0.0
    for i, (h, d) in enumerate(zip(host, dev)):
        if i == sync_at:
            issued = max(issued, done)
        issued += h
        done = max(done, issued) + d
    return done


@pytest.mark.parametrize("sync", ["never", "always"])
def test_a_dispatcher_host_sync_splits_the_forward_where_the_experts_begin(sync):
    """Megatron-Core's dropless alltoall dispatcher copies its split sizes to the host before the all-to-all
    (token_dispatcher.py, cuda_sync_point): the host cannot run ahead past the first routed op. A Mixtral layer
    on a GB200 node: with the sync the forward is billed as two stretches, each the longer of its host and
    device times (the per-op sums split at the first routed op); without it, as one. Either way an event replay
    of the same ops (host issuing, device running in order) takes at least as long: the bill is a lower bound,
    within the replay."""
    from cost_models.host_time import HostSeconds, host_excess_seconds, layer_host_seconds
    from cost_models.compute import layer_compute
    from hardware_profiles.loader import load_device
    _, kind, own = _captured_layer("mixtral_logits")
    stack = load_stack("megatron-core").model_copy(update={**OWN_CODE, "moe_dispatch_host_sync": sync})
    device, spec = load_device("gb200"), ShardSpec(ep=2)
    host, dev = _per_op_seconds(kind, device, stack, spec)
    first_routed = next(i for i, op in enumerate(kind.ops) if op.routed)
    billed = layer_host_seconds(kind, device, stack, spec)
    compute = layer_compute(kind, device, spec)
    forward_excess = host_excess_seconds(HostSeconds(billed.forward_s, 0.0, billed.before_sync_s), compute)
    if sync == "never":
        assert billed.before_sync_s is None
        expected = max(0.0, sum(host) - sum(dev))
    else:
        assert billed.before_sync_s == pytest.approx(sum(host[:first_routed]), rel=1e-9)
        expected = (max(0.0, sum(host[:first_routed]) - sum(dev[:first_routed]))
                    + max(0.0, sum(host[first_routed:]) - sum(dev[first_routed:])))
    assert forward_excess == pytest.approx(expected, rel=1e-9, abs=1e-12)
    replay = _queued_forward_s(host, dev, first_routed if sync == "always" else None)
    assert compute.forward_s + forward_excess <= replay * (1 + 1e-9)


def test_spread_syncs_only_with_experts_spread():
    """torchtitan's ExpertParallel reads the all-to-all's split sizes on the host (ep > 1); with every expert on
    the rank there is no all-to-all and no sync."""
    from cost_models.host_time import layer_host_seconds
    from hardware_profiles.loader import load_device
    _, kind, stack = _captured_layer("mixtral_logits")
    assert stack.moe_dispatch_host_sync == "spread"
    device = load_device("gb200")
    assert layer_host_seconds(kind, device, stack, ShardSpec(ep=1)).before_sync_s is None
    assert layer_host_seconds(kind, device, stack, ShardSpec(ep=2)).before_sync_s is not None


@pytest.mark.parametrize("factory,first_issued", [("mixtral_logits", "routed"), ("llama_logits", "mlp")])
def test_graphed_attention_and_router_leave_the_rest_to_the_host(factory, first_issued):
    """Megatron-Core's --cuda-graph-scope attn moe_router moe_preprocess replays each layer's attention and, in a
    MoE layer, the router and the dispatcher's preprocessing: the host issues the rest, from the first routed op
    (Mixtral) or the MLP (Llama), forward and backward; whole-layer graphs bill nothing."""
    from cost_models.host_time import layer_host_seconds
    from cost_models.layout import RecomputeModule
    from hardware_profiles.loader import load_device
    _, kind, _ = _captured_layer(factory)
    device, spec = load_device("gb200"), ShardSpec(ep=2)
    eager = load_stack("megatron-core").model_copy(update={**OWN_CODE, "moe_dispatch_host_sync": "never"})
    partial = eager.model_copy(update={"cuda_graphs": True, "cuda_graph_scope": "attention_and_router"})
    host, _ = _per_op_seconds(kind, device, eager, spec)
    start = next(i for i, op in enumerate(kind.ops)
                 if (op.routed if first_issued == "routed" else op.module is RecomputeModule.mlp))
    assert 0 < start < len(kind.ops)
    billed = layer_host_seconds(kind, device, partial, spec)
    assert billed.forward_s == pytest.approx(sum(host[start:]), rel=1e-9)
    assert 0 < billed.backward_s < layer_host_seconds(kind, device, eager, spec).backward_s
    whole = partial.model_copy(update={"cuda_graph_scope": "layers"})
    assert layer_host_seconds(kind, device, whole, spec).forward_s == 0


def test_graphs_of_attention_and_router_save_nothing_where_the_device_is_the_bound():
    """Megatron-Bridge's eager/graph A/B (docs/training/cuda-graphs.md @067f987d, PR #3868; never fitted): Qwen3
    30B-A3B on 16 H100, EP16, the alltoall dispatcher, Transformer Engine graphs of attention, router and the
    dispatcher's preprocessing: 41.36 s eager, 42.00 s graphed, no gain. Through `planner.evaluate`, the host keeps
    ahead of this layout's device in both arms, so the graphs save under 2% of the step, and each arm lies within
    25% of its measured step."""
    from benchmarks.setting_ab import AB, predict
    ab = next(ab for ab in AB if ab.stack_arms is not None)
    result = predict(ab)
    graphed = [any("replayed as CUDA graphs" in reason for reason in plan.reasons) for plan in (result.off, result.on)]
    assert graphed == [False, True]
    assert abs(result.saved_predicted_s) <= 0.02 * result.off.step_time_s
    assert result.off.step_time_s == pytest.approx(ab.measured_off_s, rel=0.25)
    assert result.on.step_time_s == pytest.approx(ab.measured_on_s, rel=0.25)
