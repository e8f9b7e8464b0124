"""Selective recomputation of chosen modules (Megatron-Core --recompute-modules), checked against torch's own
checkpointing, closed forms of what each module keeps, and a brute force over the module sets."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

import planner
from hardware_profiles.errors import UserInputError
from cost_models.layout import Recompute, RecomputeModule
from cost_models.memory import activation_bytes
from planner.graph_capture.model_capture import capture
from planner.graph_capture.model_sources import resolve_model
from planner.graph_capture.reference_model import build_model

SEQ = 32


def _saved_bytes(block: torch.nn.Module, x: torch.Tensor) -> float:
    """Bytes of the distinct storages autograd keeps for backward, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return float(sum(seen.values()))


def _freed_by_torch_checkpoint(cfg, layer_index: int, submodule: str) -> float:
    """What torch's reentrant checkpoint of one submodule (Megatron's tensor_parallel.checkpoint keeps the
    input and runs the module without saving) frees in a block, measured on CPU."""
    torch.manual_seed(0)
    block = build_model(cfg, device="cpu", dtype=torch.bfloat16).layers[layer_index]
    x = torch.randn(1, SEQ, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    plain = _saved_bytes(block, x)
    inner = getattr(block, submodule)
    wrapped = type("Checkpointed", (torch.nn.Module,), {
        "forward": lambda self, h: checkpoint(inner, h, use_reentrant=True)})()
    setattr(block, submodule, wrapped)
    return plain - _saved_bytes(block, x)


def _freed_by_plan(kind, module: RecomputeModule) -> float:
    none = activation_bytes(kind, Recompute.none, 1, False, 1, 1)
    return none - activation_bytes(kind, Recompute.selective, 1, False, 1, 1, modules=(module,))


def _kind(graph, index: int):
    return graph.kind(graph.blocks[index].kind)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_a_checkpointed_mlp_frees_what_torch_checkpoint_frees(activation):
    cfg = resolve_model("tiny-llama").model_copy(update=dict(activation=activation))
    graph = capture(cfg, seq_len=SEQ)
    expected = _freed_by_torch_checkpoint(cfg, 0, "mlp")
    assert expected > 0
    assert _freed_by_plan(_kind(graph, 0), RecomputeModule.mlp) == pytest.approx(expected, rel=1e-6)


def test_moe_recomputation_keeps_the_expert_container_input_and_nothing_it_made():
    """Megatron's "moe" checkpoints the whole MoE layer; its "mlp" skips MoE layers. (Real routing on CPU
    saves other index tensors than capture's balanced routing, so torch cannot be the reference here.)"""
    graph = capture(resolve_model("tiny-moe"), seq_len=SEQ)
    dense, moe = (graph.structure(graph.blocks[i].kind) for i in (0, 1))
    assert RecomputeModule.mlp in dense.recompute_modules and RecomputeModule.moe not in dense.recompute_modules
    assert RecomputeModule.moe in moe.recompute_modules and RecomputeModule.mlp not in moe.recompute_modules
    kind = _kind(graph, 1)
    container_input = [t for t in kind.saved if RecomputeModule.moe in t.saver_modules and t.producer_module is None
                       or t.producer == "post_attention_norm" and t.saver_modules == {RecomputeModule.moe}]
    made_inside = sum(t.bytes for t in kind.saved if t.producer_module is RecomputeModule.moe)
    assert container_input and made_inside > 0
    assert _freed_by_plan(kind, RecomputeModule.moe) == pytest.approx(made_inside)


def test_layernorm_recomputation_frees_each_residual_norms_output_and_statistics():
    """Output-discarding checkpointing of the input and pre-MLP norms (fused kernels: each keeps its input
    and fp32 row statistics): both outputs (s x h bf16) and both statistics (s fp32) go."""
    cfg = resolve_model("tiny-llama")
    graph = capture(cfg, seq_len=SEQ, fused_kernels=True)
    expected = 2 * (SEQ * cfg.hidden_size * 2 + SEQ * 4)
    assert _freed_by_plan(_kind(graph, 0), RecomputeModule.layernorm) == pytest.approx(expected)


def _tiny_mla():
    base = resolve_model("deepseek-v3")
    mla = base.mla.model_copy(update=dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                                          qk_rope_head_dim=4, v_head_dim=8))
    moe = base.moe.model_copy(update=dict(num_experts=4, router_topk=2, moe_ffn_hidden_size=32,
                                          first_k_dense_layers=1, router_num_groups=2, router_group_topk=1))
    return base.model_copy(update=dict(name="tiny-mla", num_layers=2, hidden_size=64, num_attention_heads=4,
                                       ffn_hidden_size=96, vocab_size=128, seq_length=SEQ, mla=mla, moe=moe))


def test_mla_up_projection_recomputation_frees_the_query_key_and_value_heads():
    """DeepSeek-V3's mla_up_proj (output-discarding): the attention core's q and k (nope + rope dims per head)
    and the up-projected key-value heads (nope + v dims, v a view of them) are remade in backward."""
    cfg = _tiny_mla()
    graph = capture(cfg, seq_len=SEQ)
    m, heads = cfg.mla, cfg.num_attention_heads
    q = k = SEQ * heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) * 2
    kv = SEQ * heads * (m.qk_nope_head_dim + m.v_head_dim) * 2
    for index in (0, 1):
        assert RecomputeModule.mla_up_proj in graph.structure(graph.blocks[index].kind).recompute_modules
        assert _freed_by_plan(_kind(graph, index), RecomputeModule.mla_up_proj) == pytest.approx(q + k + kv)


def test_mla_up_proj_is_refused_for_a_model_without_latent_attention():
    with pytest.raises(UserInputError, match="recompute_modules=mla_up_proj: no block of tiny-llama"):
        planner.evaluate("tiny-llama", device="h100-sxm", num_devices=8, global_batch=8,
                         layout="tp=1,pp=1,dp=8,cp=1,ep=1,etp=1,vp=1,mbs=1,zero=1,recompute=selective,"
                                "recompute_modules=mla_up_proj")


def test_a_stack_without_module_recomputation_refuses_it():
    with pytest.raises(UserInputError, match="the torchtitan stack recomputes selectively only core_attn"):
        planner.evaluate("tiny-llama", device="h100-sxm", num_devices=8, global_batch=8, stack="torchtitan",
                         layout="tp=1,pp=1,dp=8,cp=1,ep=1,etp=1,vp=1,mbs=1,zero=1,recompute=selective,"
                                "recompute_modules=mlp")


def test_the_solver_chooses_the_best_module_set_a_brute_force_finds():
    """Where memory forces recomputation, the search's free choice of modules (one set for every layer, and
    then no layer recomputed fully, as Megatron-Core runs it) is as fast as the best of every set pinned in
    turn, and takes a set other than the default."""
    common = dict(device="h100-sxm", num_devices=8, global_batch=64, seq_len=4096, time_limit_s=60,
                  tp=1, pp=1, cp=1, ep=1, mbs=2, zero=1)
    free = planner.plan("llama3-8b", **common)
    choices = (RecomputeModule.core_attn, RecomputeModule.mlp, RecomputeModule.layernorm)
    pinned = {}
    for size in range(1, len(choices) + 1):
        for subset in itertools.combinations(choices, size):
            text = "+".join(map(str, subset))
            pinned[text] = planner.plan("llama3-8b", **common, recompute_modules=text).step_time_s
    best = min(pinned, key=pinned.get)
    assert free.step_time_s == pytest.approx(pinned[best], rel=1e-5)
    assert free.layout.recompute_modules != "core_attn" and free.layout.recompute == "selective"
    assert pinned[free.layout.recompute_modules] == pytest.approx(free.step_time_s, rel=1e-5)


def test_one_rule_set_refuses_what_a_stack_cannot_recompute():
    """This runtime recomputes the attention core only (its stack, checked before step 1 by ParallelModel);
    Megatron-Core's selective recomputation is one switch for every layer, so a plan file mixing it with
    other methods is refused there and accepted by the runtime, which checkpoints each block on its own."""
    from cost_models.layout import Layout
    from hardware_profiles.loader import load_stack
    from hardware_profiles.stack import RUNTIME_STACK
    from planner.rules.stack import layout_stack_problems

    graph = capture(resolve_model("tiny-llama"), seq_len=SEQ)
    runtime, megatron = load_stack(RUNTIME_STACK), load_stack("megatron-core")
    modules = Layout(dp=8, recompute=Recompute.selective, recompute_modules=(RecomputeModule.mlp,))
    assert any("recomputes selectively only core_attn" in p for p in layout_stack_problems(modules, runtime, graph))
    assert not layout_stack_problems(modules, megatron, graph)
    mixed = Layout(dp=8, layer_recompute=(Recompute.selective, Recompute.none, Recompute.full, Recompute.none))
    assert any("every layer or none" in p for p in layout_stack_problems(mixed, megatron, graph))
    assert not layout_stack_problems(mixed, runtime, graph)


def _mixed_moe_leaf(pp: int, vp: int, dp: int, ep: int):
    """The mixed dense/MoE test model under Megatron-Core on 32 devices: its costs, the modules it can recompute,
    a layout of these degrees, and `squeezed(share)`: a cluster whose devices hold that share of the memory the
    layout needs without recomputation."""
    from cost_models.layout import Layout
    from hardware_profiles.loader import load_stack
    from planner.search.bounds import Bounds
    from tests.test_search import GB, mixed_moe_model, small_cluster

    stack = load_stack("megatron-core")
    graph = capture(mixed_moe_model(seq=4096), fused_kernels=True)
    model = graph.costs()
    choices = tuple(m for m in RecomputeModule if any(m in s.recompute_modules for s in graph.structures))
    base = Layout(dp=dp, tp=32 // (pp * dp), pp=pp, vp=vp, ep=ep, global_batch=64, zero=1)
    roomy = small_cluster(32, 80)
    floor = Bounds(model, roomy, stack, (Recompute.none,), choices)._floor(base, Recompute.none).bytes
    reserve = roomy.device.memory_reserve

    def squeezed(share: float):
        return small_cluster(32, (share * floor / (1 - reserve.fragmentation_fraction)
                                  + reserve.runtime_context_bytes) / GB)
    return stack, model, choices, base, squeezed


@pytest.mark.parametrize("pp,vp,dp,ep", [(2, 1, 16, 2), (2, 2, 8, 4), (4, 1, 8, 8)])
def test_the_leaf_bound_stays_below_the_best_plan_when_modules_are_chosen(pp, vp, dp, ep):
    """The search prunes a leaf by a bound that adds the recomputation memory forces; with Megatron's one
    switch (every layer selective with one module set, or none/full per layer) the bound takes the
    cheaper route, the selective one as the cheapest module subset that frees the deficit. At several
    memory sizes that force recomputation, it never exceeds the estimate of the solver's proven optimum
    (the solver's own optimality is checked by the brute force above)."""
    from dataclasses import replace

    from cost_models.layer_costs import MeshCosts
    from cost_models.step_time import estimate
    from planner.search.bounds import Bounds, balanced_bound
    from planner.search.partition import solve_partition

    stack, model, choices, base, squeezed = _mixed_moe_leaf(pp, vp, dp, ep)
    allowed = (Recompute.none, Recompute.selective, Recompute.full)
    assert len(choices) >= 3
    solved = selective = 0
    for share in (0.99, 0.9, 0.75):
        cluster = squeezed(share)
        costs = MeshCosts(model, cluster, base, stack)
        forced = Bounds(model, cluster, stack, allowed, choices).forced_recompute_s(base, costs)
        assert forced > 0
        result = solve_partition(costs, allowed, module_choices=choices)
        if not result.stage_layers:
            assert result.status == "INFEASIBLE"
            continue
        assert result.status == "OPTIMAL"
        best = estimate(model, cluster, replace(base, stage_layers=result.stage_layers,
                                                layer_recompute=result.layer_recompute,
                                                recompute_modules=result.recompute_modules or base.recompute_modules),
                        stack)
        assert best.fits
        assert balanced_bound(costs, base, Recompute.none, forced) <= best.step_time_s * (1 + 1e-9)
        solved += 1
        selective += Recompute.selective in result.layer_recompute
    assert solved >= 2 and selective


@pytest.mark.parametrize("pp,vp,dp,ep", [(2, 2, 8, 4), (4, 1, 8, 8), (2, 1, 16, 2)])
def test_a_leaf_with_kinds_in_runs_chooses_the_module_set_the_enumeration_finds(pp, vp, dp, ep):
    """The leaf's free module choice, with dense and MoE blocks in runs over several ranks, answers what solving
    the leaf once per valid module set pinned and keeping the fastest answers: the same step, at each memory
    size that forces recomputation; and the bound by which it leaves sets unsolved is below each set's own
    optimum."""
    from dataclasses import replace

    from cost_models.layer_costs import MeshCosts
    from cost_models.layout import nested_modules
    from planner.search.partition import ModuleSets, solve_partition

    stack, model, choices, base, squeezed = _mixed_moe_leaf(pp, vp, dp, ep)
    assert len({kind for kind in model.blocks}) >= 2
    allowed = (Recompute.none, Recompute.selective, Recompute.full)
    subsets = [subset for size in range(1, len(choices) + 1) for subset in itertools.combinations(choices, size)
               if not nested_modules(subset)]
    compared = bounded = 0
    for share in (0.95, 0.9, 0.85):
        cluster = squeezed(share)
        free = solve_partition(MeshCosts(model, cluster, base, stack), allowed, module_choices=choices)
        pinned = [solve_partition(MeshCosts(model, cluster, replace(base, recompute_modules=subset), stack),
                                  allowed) for subset in subsets]
        assert free.status in ("OPTIMAL", "INFEASIBLE") and all(p.status in ("OPTIMAL", "INFEASIBLE") for p in pinned)
        found = [p.objective_s for p in pinned if p.stage_layers]
        assert bool(free.stage_layers) == bool(found)
        if found:
            assert free.objective_s == pytest.approx(min(found), rel=1e-9)
            compared += Recompute.selective in free.layer_recompute
        # the sets the leaf leaves unsolved are those whose bound reaches the best: each set's bound is at or
        # below its own optimum, every block recomputing it
        costs = MeshCosts(model, cluster, base, stack)
        for bound, set_costs in ModuleSets(costs, choices):
            alone = solve_partition(set_costs, (Recompute.selective,))
            assert alone.status in ("OPTIMAL", "INFEASIBLE")
            if alone.stage_layers:
                assert bound <= alone.objective_s * (1 + 1e-9)
                bounded += 1
    assert compared and bounded >= 4


@pytest.mark.parametrize("pp,vp,dp,ep", [(2, 2, 8, 4), (4, 1, 8, 8)])
def test_the_module_sets_come_in_the_order_of_every_sets_bound_sorted(pp, vp, dp, ep):
    """The leaf walks its module sets lazily, best first over the lattice of subsets: in the order that computing
    every valid set's balanced bound and sorting them gives (ties: fewer modules first), every set once."""
    from cost_models.layer_costs import MeshCosts
    from cost_models.layout import nested_modules
    from planner.search.bounds import balanced_bound
    from planner.search.partition import ModuleSets, _hops_s

    stack, model, choices, base, squeezed = _mixed_moe_leaf(pp, vp, dp, ep)
    costs = MeshCosts(model, squeezed(0.9), base, stack)
    subsets = [subset for size in range(1, len(choices) + 1) for subset in itertools.combinations(choices, size)
               if not nested_modules(subset)]
    every = sorted(((balanced_bound(c, c.layout, Recompute.selective) - _hops_s(costs), index, subset)
                    for index, subset in enumerate(subsets) for c in [costs.with_recompute_modules(subset)]))
    walked = ModuleSets(costs, choices)
    assert walked.least_s == every[0][0]
    assert [(bound, c.layout.recompute_modules) for bound, c in walked] == [(b, s) for b, _, s in every]
    assert len({s for _, _, s in every}) == len(subsets) >= 5


# (model, hidden, the experts' down-projection input width f, top-k): a reference model whose expert container
# capture runs as one node (with a shared expert beside the routed ones), and transformers' own classes, whose
# grouped GEMMs the graph runs node by node
MOE_ACT_MODELS = [("tiny-moe", 64, 2), ("tests/models/hf_tiny.py:qwen3_moe_logits", 64, 2),
                  ("tests/models/hf_tiny.py:mixtral_logits", 128, 2)]


@pytest.mark.parametrize("model,f,topk", MOE_ACT_MODELS, ids=["reference", "hf-qwen3-moe", "hf-mixtral"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-swiglu", "unfused"])
def test_moe_act_recomputation_frees_what_the_experts_activation_made(model, f, topk, fused):
    """Megatron-Core's moe_act (output-discarding checkpoint of the routed experts' activation, experts.py):
    the down-projection's input, SEQ x k routed rows of f bf16 values, goes; where the activation is not one
    fused kernel, act(gate) kept by the gating multiply goes too. The shared expert's activation stays (another
    module, Megatron's shared_experts), as does the up-projection's output (the checkpoint's input)."""
    from planner.job import capture_for
    from hardware_profiles.loader import load_stack

    stack = load_stack("megatron-core").model_copy(update={"fused_gated_activation": fused})
    graph = capture_for(model, SEQ, (), stack)
    moe = next(b.kind for b in graph.blocks if graph.structure(b.kind).num_experts)
    assert RecomputeModule.moe_act in graph.structure(moe).recompute_modules
    dense = [b.kind for b in graph.blocks if not graph.structure(b.kind).num_experts]
    assert all(RecomputeModule.moe_act not in graph.structure(kind).recompute_modules for kind in dense)
    down_input = SEQ * topk * f * 2
    expected = down_input if fused else 2 * down_input
    assert _freed_by_plan(graph.kind(moe), RecomputeModule.moe_act) == pytest.approx(expected)


def test_moe_act_repeats_the_experts_activation_and_what_moe_covers_is_not_asked_twice():
    """Its recomputation repeats the activation's forward, less than recomputing the whole MoE layer, in the
    step's recompute part; moe with moe_act is refused (moe recomputes the activation already)."""
    common = dict(device="h100-sxm", num_devices=8, global_batch=16, seq_len=4096)
    layout = "tp=1,pp=1,dp=8,cp=1,ep=8,etp=1,vp=1,mbs=1,zero=1,recompute=selective,recompute_modules="
    act, whole = (planner.evaluate("mixtral-8x7b", layout=layout + m, **common).breakdown["recompute_s"]
                  for m in ("moe_act", "moe"))
    assert 0 < act < whole / 10
    with pytest.raises(UserInputError, match="moe recomputes moe_act with the rest of the MoE layer"):
        planner.evaluate("mixtral-8x7b", layout=layout + "moe+moe_act", **common)


# (model, the shared experts' width, what outside them keeps their output): the reference model's expert container
# captured as one node, and transformers' Qwen2-MoE run node by node, whose shared expert's sigmoid gate multiplies
# the shared output outside the shared expert module (so that output stays)
SHARED_MODELS = [("tiny-moe", 64), ("tests/models/hf_tiny.py:qwen2_moe_logits", 96)]


@pytest.mark.parametrize("model,f", SHARED_MODELS, ids=["reference", "hf-qwen2-moe"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-swiglu", "unfused"])
def test_shared_experts_recomputation_frees_what_the_shared_expert_makes_and_keeps(model, f, fused):
    """Megatron-Core's shared_experts (a checkpoint of SharedExpertMLP, its input kept): the gate and up
    projections' outputs and the down-projection's input, SEQ rows of f bf16 values each, and act(gate) where the
    activation is not one fused kernel; neither the routed experts' tensors nor the router's."""
    from planner.job import capture_for
    from hardware_profiles.loader import load_stack

    stack = load_stack("megatron-core").model_copy(update={"fused_gated_activation": fused})
    graph = capture_for(model, SEQ, (), stack)
    moe = next(b.kind for b in graph.blocks if graph.structure(b.kind).num_experts)
    assert RecomputeModule.shared_experts in graph.structure(moe).recompute_modules
    expected = (3 if fused else 4) * SEQ * f * 2
    assert _freed_by_plan(graph.kind(moe), RecomputeModule.shared_experts) == pytest.approx(expected)


def test_models_without_shared_experts_do_not_offer_their_recomputation():
    from planner.job import capture_for
    from hardware_profiles.loader import load_stack

    for model in ("tests/models/hf_tiny.py:qwen3_moe_logits", "tests/models/hf_tiny.py:mixtral_logits"):
        graph = capture_for(model, SEQ, (), load_stack("megatron-core"))
        assert all(RecomputeModule.shared_experts not in s.recompute_modules for s in graph.structures)


def test_shared_experts_beside_their_overlap_is_refused_as_megatron_core_refuses_it():
    import warnings

    from hardware_profiles.loader import load_stack
    from megatron.core.transformer.transformer_config import TransformerConfig

    overlapped = load_stack("megatron-core").model_copy(update={"moe_shared_expert_overlap": True})
    with pytest.raises(UserInputError, match="which Megatron-Core does not recompute"):
        planner.evaluate("tiny-moe", device="h100-sxm", num_devices=8, global_batch=8, stack=overlapped,
                         layout="tp=1,pp=1,dp=8,cp=1,ep=4,etp=1,vp=1,mbs=1,zero=1,recompute=selective,"
                                "recompute_modules=shared_experts")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="shared_experts recompute cannot work with --moe-shared-expert-overlap"):
            TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                              moe_router_topk=2, moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True,
                              moe_token_dispatcher_type="alltoall", recompute_granularity="selective",
                              recompute_modules=["shared_experts"])


def test_recomputed_shared_experts_count_their_gemms_in_the_hardware_flops():
    """HFU counts what recomputation repeats: with shared_experts, the shared expert's three GEMMs (gate, up,
    down: 2 x SEQ x h x f FLOPs each, h = f = 64) in each of tiny-moe's 3 MoE layers, for each of 8 samples."""
    from hardware_profiles.loader import load_device

    plan = planner.evaluate("tiny-moe", device="h100-sxm", num_devices=8, global_batch=8,
                            layout="tp=1,pp=1,dp=8,cp=1,ep=4,etp=1,vp=1,mbs=1,zero=1,recompute=selective,"
                                   "recompute_modules=shared_experts")
    peak = load_device("h100-sxm").peak_flops("bf16") * 8
    recomputed = (plan.hfu - plan.mfu) * plan.step_time_s * peak
    assert recomputed == pytest.approx(3 * 3 * 2 * 32 * 64 * 64 * 8, rel=1e-9)


def _freed_by_checkpointing_the_mlp(factory) -> float:
    """What torch's reentrant checkpoint of a transformers decoder layer's `mlp` (its MoE block) frees, the
    layer run on CPU in bf16 on SEQ tokens with the model's real routing."""
    import models.hf_tiny as hf_tiny

    torch.manual_seed(0)
    model = getattr(hf_tiny, factory)().to(torch.bfloat16)
    layer, rope = model.model.model.layers[0], model.model.model.rotary_emb
    x = torch.randn(1, SEQ, layer.mlp.gate.weight.shape[1], dtype=torch.bfloat16, requires_grad=True)
    rotary = rope(x, torch.arange(SEQ)[None])

    def saved() -> float:
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        seen: dict[int, int] = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with saved_tensors_hooks(pack, lambda t: t):
            layer(x, position_embeddings=rotary, attention_mask=None)
        return float(sum(seen.values()))

    plain, moe = saved(), layer.mlp
    layer.mlp = type("Checkpointed", (torch.nn.Module,), {
        "forward": lambda self, h: checkpoint(moe, h, use_reentrant=True)})()
    return plain - saved()


@pytest.mark.parametrize("factory", ["qwen3_moe_logits", "qwen2_moe_logits", "mixtral_logits"])
def test_moe_recomputation_of_a_recorded_moe_block_frees_what_torch_checkpoint_frees(factory):
    """transformers' MoE blocks, which capture records node by node: the nodes the recording made while the
    block ran form Megatron's "moe" module, and recomputing it frees exactly what torch's checkpoint of the
    block frees on the real model (the model's own code: no fused kernels stood in)."""
    from planner.job import capture_for
    from hardware_profiles.loader import load_stack

    own_code = load_stack("megatron-core").model_copy(update={"fused_kernels": False, "fused_gated_activation": False})
    graph = capture_for(f"tests/models/hf_tiny.py:{factory}", SEQ, (), own_code)
    kind = graph.blocks[0].kind
    assert RecomputeModule.moe in graph.structure(kind).recompute_modules
    assert _freed_by_plan(graph.kind(kind), RecomputeModule.moe) == pytest.approx(
        _freed_by_checkpointing_the_mlp(factory))
