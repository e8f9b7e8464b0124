"""ZeRO-3 as DeepSpeed v0.3.15 ran it (the megatron-lm-2021-zero stack, Narayanan et al. 2021's ZeRO-3 arm): one
collective per parameter tensor, between compute rather than beside it. The tensors counted are checked against
code nobody here wrote (real transformers blocks, Megatron-Core's own layers); what the two settings do to a step
is checked for its direction over a small grid; Narayanan et al.'s measured order is tests/test_ranking.py's."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cost_models.data_parallel_comm import param_tensors_on_rank
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
