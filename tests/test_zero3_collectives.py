"""ZeRO-3 as DeepSpeed v0.3.15 ran it (the megatron-lm-2021-zero stack, Narayanan et al. 2021's ZeRO-3 arm): one
collective per parameter tensor, between compute rather than beside it. The tensors counted are checked against
code nobody here wrote (real transformers blocks, Megatron-Core's own layers); what the two settings do to a step
is checked for its direction over a small grid; Narayanan et al.'s measured order is tests/test_ranking.py's."""
import itertools
import json
import math
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cost_models.data_parallel_comm import param_tensors_on_rank, regathered_dense
from hardware_profiles.loader import load_stack
from planner.api import evaluate
from planner.graph_capture.model_capture import capture
from planner.graph_capture.model_config import ModelConfig

transformers = pytest.importorskip("transformers")

SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128, "n_embd": 64, "n_head": 4,
         "n_layer": 2, "num_local_experts": 4}


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "mixtral"])
def test_capture_counts_every_parameter_tensor_of_a_transformers_block(model_type):
    """Each block kind's parameter groups hold as many tensors as one such block of the transformers model has
    (GPT-2's Conv1D projections with biases, Llama's bias-free projections and RMSNorm scales, Mixtral's experts)."""
    base = transformers.AutoConfig.for_model(model_type)
    config = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in SMALL.items() if hasattr(base, k)})
    with torch.device("meta"):
        module = transformers.AutoModelForCausalLM.from_config(config)
    graph = capture(module, seq_len=32)
    blocks = max((m for m in module.modules() if isinstance(m, torch.nn.ModuleList)), key=len)
    slots = [slot for slot in graph.layers if slot.kind not in ("embedding", "head")]
    assert len(slots) == len(blocks)
    for slot, block in zip(slots, blocks):
        assert sum(group.tensors for group in graph.kind(slot.kind).params) == len(list(block.parameters()))


def test_per_tensor_collectives_are_megatron_cores_own_layer_tensors():
    """Megatron-Core's GPT layer (its local spec, built on CPU: tests/megatron_layer_tensors.py) holds 12 tensors
    GPT-3 style (fused QKV and biases, LayerNorm) and 6 Llama style: what a rank gathers one by one under a stack
    that fuses the projections reading one input, for the built-in GPT-3 175B and Llama 3 8B layers."""
    script = Path(__file__).with_name("megatron_layer_tensors.py")
    done = subprocess.run([sys.executable, str(script), "29641"], capture_output=True, text=True, timeout=300,
                          check=True)
    names = json.loads(done.stdout.strip().splitlines()[-1])
    assert param_tensors_on_rank(capture("gpt3-175b").kind("dense"), True, 1) == (len(names["gpt"]), 0) == (12, 0)
    assert param_tensors_on_rank(capture("llama3-8b").kind("dense"), True, 1) == (len(names["llama"]), 0) == (6, 0)


def test_blocking_and_per_tensor_zero3_never_predict_a_faster_step():
    """Over a small grid of ZeRO-3 layouts (data-parallel ranks, micro-batch, recomputation) of a small GPT on A100s:
    gathering tensor by tensor is never faster than gathering a layer at once, and traffic between compute never
    faster than beside it. Between compute the step pays all of the traffic, which at a fixed batch per rank grows
    with the ranks (a ring's steps, and from 64 ranks the links between nodes)."""
    model = ModelConfig(name="gpt-small", num_layers=4, hidden_size=1024, num_attention_heads=16,
                        ffn_hidden_size=4096, vocab_size=8192, seq_length=1024, activation="gelu",
                        normalization="layernorm", position_embedding="learned", tied_embeddings=True,
                        attention="mha", add_bias=True)
    base = load_stack("megatron-lm-2021-zero")
    stacks = [base.model_copy(update={"zero3_collectives": collectives, "zero3_traffic_hidden": hidden})
              for collectives, hidden in (("coalesced", True), ("per_tensor", True), ("per_tensor", False))]
    for mbs, recompute in ((1, "none"), (2, "full")):
        exposed = []
        for ranks in (8, 64, 512):
            layout = f"tp=1,pp=1,dp={ranks},cp=1,ep=1,mbs={mbs},zero=3,recompute={recompute}"
            plans = [evaluate(model, layout=layout, global_batch=ranks * mbs, device="a100-80g", num_devices=ranks,
                              precision="bf16", stack=stack, time_limit_s=10) for stack in stacks]
            steps = [plan.step_time_s for plan in plans]
            assert steps[0] <= steps[1] <= steps[2], (layout, steps)
            exposed.append(plans[2].breakdown["zero_comm_s"])
        assert 0 < exposed[0] < exposed[1] < exposed[2], (mbs, recompute, exposed)


def deepspeed_gathers(modules: list[tuple[int, int]], layers: int, reuse_distance: float) -> Counter:
    """DeepSpeed v0.3.15's ZeRO-3 module fetches over one step of `layers` layers under full recomputation, written
    here from its stage3.py: the trace runs every layer's modules forward, then from the last layer back each
    layer's recomputed forward and its backward (modules reversed); a module is gathered where its parameters are
    not available, and released after its turn unless fewer than `reuse_distance` parameters are fetched before its
    next turn (_keep_for_later; no next turn: released). `modules`: (parameters, tensors) of a layer's modules in
    forward order. Returns the gathers by (layer, module)."""
    trace = [(layer, m) for layer in range(layers) for m in range(len(modules))]
    for layer in reversed(range(layers)):
        trace += [(layer, m) for m in range(len(modules))] + [(layer, m) for m in reversed(range(len(modules)))]
    available, gathered = set(), Counter()
    for i, step in enumerate(trace):
        if step not in available:
            gathered[step] += 1
            available.add(step)
        following = next((j for j in range(i + 1, len(trace)) if trace[j] == step), None)
        distance = math.inf if following is None else sum(modules[trace[k][1]][0] for k in range(i + 1, following))
        if distance >= reuse_distance:
            available.discard(step)
    return gathered


@pytest.mark.parametrize("model,tp", [("gpt3-175b", 1), ("gpt3-175b", 8), ("mtnlg-530b", 1), ("mtnlg-530b", 8)])
def test_what_deepspeed_gathers_again_under_recomputation(model, tp):
    """Megatron-LM's GPT layer as modules with their parameters on a rank (closed forms: norms 2h, fused QKV 3h^2 +
    3h, the projection h^2 + h, the MLP 4h^2 + 4h and 4h^2 + h, tp splitting the four GEMMs' weights), run through
    DeepSpeed's fetch-and-release rule at its default reuse distance (1e9): what an early layer of eight gathers
    beyond two gathers per module is what the planner bills as gathered again, in parameters (its GEMM weights and
    norms: the biases, a few thousand, left out) and tensors (two per module)."""
    h = capture(model).hidden_size
    numels = [2 * h, (3 * h * h) // tp + 3 * h, (h * h) // tp + h, 2 * h, (4 * h * h) // tp + 4 * h,
              (4 * h * h) // tp + h]
    modules = [(n, 2) for n in numels]
    gathered = deepspeed_gathers(modules, layers=8, reuse_distance=1e9)
    middle = {m: gathered[(1, m)] for m in range(len(modules))}   # far from the last layers, which a shallow
    # model's short distances can keep from their forward to their recomputed one
    assert set(middle.values()) <= {2, 3}
    extra_params = sum((count - 2) * modules[m][0] for m, count in middle.items())
    extra_tensors = sum((count - 2) * modules[m][1] for m, count in middle.items())
    params, tensors = regathered_dense(capture(model).kind("dense"), 1e9, fused_projections=True, tp=tp)
    assert params == pytest.approx(extra_params, rel=1e-3) and tensors == extra_tensors
    assert tp > 1 or tensors == 10   # unsplit, every module but the layer's last is released: 5 of 6, 2 tensors each


@pytest.mark.parametrize("hidden", [True, False])
def test_the_search_weighs_deepspeed_style_zero3_as_the_enumeration(hidden):
    """ZeRO-3 gathered tensor by tensor, beside compute or between it, and gathered again under full recomputation
    past a reuse distance small enough to release most of a layer's modules: over a pinned layout of a model with
    dense and expert layers, in memory tight enough that recomputation trades against the split, the search's plan
    is the best of every stage split and per-layer recomputation (none or full), enumerated through `estimate`.
    (The search bounds the ZeRO traffic without the re-gathering, which only full recomputation pays.)"""
    from test_search import compositions, mixed_moe_model, small_cluster

    from cost_models.layer_costs import MeshCosts
    from cost_models.layout import Layout, MoeDispatcher, Recompute
    from cost_models.step_time import estimate
    from planner.rules.pins import Pins
    from planner.search.branch_and_bound import search

    stack = load_stack().model_copy(update={"zero3_collectives": "per_tensor", "zero3_traffic_hidden": hidden,
                                            "zero3_reuse_distance_params": 1e7})
    graph = capture(mixed_moe_model(seq=2048))
    choices = (Recompute.none, Recompute.full)
    base = Layout(dp=16, tp=1, pp=2, ep=2, global_batch=16, zero=3)
    roomy = small_cluster(32, 80)
    splits = list(compositions(graph.num_blocks, 2))
    least = [min(estimate(graph.costs(), roomy, replace(base, stage_layers=parts, recompute=r), stack=stack)
                 .peak_memory_bytes for parts in splits) for r in choices]
    reserve = roomy.device.memory_reserve
    tight = (least[0] + least[1]) / 2   # no split fits without recomputing some layers
    cluster = small_cluster(32, (tight / (1 - reserve.fragmentation_fraction) + reserve.runtime_context_bytes) / 1e9)
    costs = MeshCosts(graph.costs(), cluster, base, stack)
    assert any(costs.regather_s(kind) > 0 for kind in graph.costs().kinds)
    best = None
    for parts in splits:
        for rec in itertools.product(choices, repeat=graph.num_blocks):
            result = estimate(graph.costs(), cluster, replace(base, stage_layers=parts, layer_recompute=rec),
                              mesh_costs=costs)
            if result.fits and (best is None or result.step_time_s < best.step_time_s):
                best = result
    pins = Pins(dp=16, tp=1, pp=2, vp=1, cp=1, ep=2, etp=1, mbs=1, zero=3, dispatcher=MoeDispatcher.alltoall)
    outcome = search(graph.costs(), cluster, 16, pins, stack=stack, graph=graph, top_k=1, recompute_choices=choices)
    assert best is not None and outcome.unexplored == 0
    assert Recompute.full in best.layer_recompute   # the re-gathering is part of the answer
    assert outcome.ranked[0].estimate.step_time_s == pytest.approx(best.step_time_s, rel=1e-6)
