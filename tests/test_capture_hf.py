"""Real model code captured as nn.Modules: 15 transformers families built from their config.json on meta.

Each family's module (transformers' own class, `AutoModelForCausalLM.from_config`) is captured by
recording (planner/graph_capture/recording.py) and held to three truths nobody here wrote: the module's own
parameter count, the closed-form forward FLOPs from its weights and attention shapes, and the
reference decoder built from the same config.json (the path used where transformers is absent).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from planner.graph_capture.model_capture import capture
from planner.graph_capture.model_sources import config_from_hf
from planner.graph_capture.module_kinds import is_linear_like
from cost_models.records import MATMUL_KINDS

transformers = pytest.importorskip("transformers")

HF_DIR = Path(__file__).parent / "models" / "hf"
FAMILIES = sorted(p.stem for p in HF_DIR.glob("*.json"))
SEQ = 512
BF16 = 2


def raw_config(name: str) -> dict:
    return json.loads((HF_DIR / f"{name}.json").read_text())


def hf_module(name: str) -> torch.nn.Module:
    raw = raw_config(name)
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "_name_or_path")}
    config = transformers.AutoConfig.for_model(raw["model_type"], **fields)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    name = request.param
    module = hf_module(name)
    captured = capture(module, seq_len=SEQ, fused_kernels=True)
    reference = capture(config_from_hf(raw_config(name), name).model_copy(update={"hf_config": None}),
                        seq_len=SEQ, fused_kernels=True)
    return name, module, captured, reference


def forward_matmul_flops(graph) -> float:
    return sum(op.forward_flops for slot in graph.layers for op in graph.kind(slot.kind).ops
               if op.kind in MATMUL_KINDS)


def saved_bytes(graph) -> float:
    return sum(t.bytes for slot in graph.layers for t in graph.kind(slot.kind).saved)


def closed_form_forward_flops_per_token(module, raw: dict, seq: int = SEQ) -> float:
    """2 x the weights a token multiplies by (Linears, routers, the output layer; routed experts: k of E),
    plus the attention core,
    2 heads keys (d_qk + d_v) per layer (non-causal: the model-FLOPs convention), keys = s, or the window on a
    layer the config's layer_types make sliding (every layer where it has a window and no types); from the
    module's weights and the config's attention shapes, not from the captured graph."""
    cfg = module.config
    weights = 0.0
    for sub in module.modules():
        if isinstance(sub, torch.nn.Embedding):
            continue
        if is_linear_like(sub):
            weights += sub.weight.numel()
        for param in sub.parameters(recurse=False):
            if param.dim() == 3:  # stacked experts [E, ., .]: a token visits k of them
                weights += param.numel() * cfg.num_experts_per_tok / param.shape[0]
    heads = cfg.num_attention_heads
    if raw.get("kv_lora_rank"):
        d_qk, d_v = raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"], raw["v_head_dim"]
    else:
        d_qk = d_v = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    window = raw.get("sliding_window") if raw.get("use_sliding_window") is not False else None
    types = raw.get("layer_types") or getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers
    keys = [min(window, seq) if window and kind == "sliding_attention" else seq for kind in types]
    return 2 * weights + sum(2 * heads * k * (d_qk + d_v) for k in keys)


def test_parameters_are_the_modules_own(family):
    _, module, captured, _ = family
    assert captured.total_params == sum(p.numel() for p in module.parameters())


def test_forward_flops_match_the_closed_form(family):
    name, module, captured, _ = family
    want = closed_form_forward_flops_per_token(module, raw_config(name))
    assert forward_matmul_flops(captured) / SEQ == pytest.approx(want, rel=0.02)


def test_structure_is_recognised_from_the_graph(family):
    name, module, captured, reference = family
    cfg = module.config
    assert captured.front_end == "recorded"
    assert captured.attention_heads == cfg.num_attention_heads
    kv = raw_config(name).get("num_key_value_heads") or cfg.num_attention_heads
    assert captured.kv_groups == (cfg.num_attention_heads if raw_config(name).get("kv_lora_rank") else kv)
    assert captured.num_experts == reference.num_experts
    for mine, theirs in zip(captured.structures, reference.structures):
        assert (mine.num_experts, mine.router_topk) == (theirs.num_experts, theirs.router_topk)
        # the reference MoE is measured as one op, so pairs inside it (shared experts) are not in its graph
        outside = [p for p in mine.tp_pairs if not (mine.expert_container and p.row.startswith(mine.expert_container))]
        assert len(outside) == len(theirs.tp_pairs)
    assert captured.layer_counts() == reference.layer_counts()
    assert captured.capture_notes == ()
    # a sliding window as the config.json declares it (context parallelism and pipeline stages of recorded
    # models refuse it: runtime rules in planner/rules/stack.py)
    raw = raw_config(name)
    windowed = raw.get("sliding_window") is not None and raw.get("use_sliding_window") is not False
    assert any(s.sliding_window for s in captured.structures) == windowed


def test_config_path_agrees_with_the_module(family):
    """The reference decoder from the same config.json: parameters, FLOPs within 2%, and saved bytes
    within 2% where it models what transformers' code keeps; where it does not, the difference is
    exactly the named term."""
    name, module, captured, reference = family
    assert reference.total_params == pytest.approx(captured.total_params, rel=1e-4)
    assert forward_matmul_flops(reference) == pytest.approx(forward_matmul_flops(captured), rel=0.02)
    extra = saved_bytes(captured) - saved_bytes(reference)
    cfg, layers = module.config, module.config.num_hidden_layers
    if name in ("gpt-neox-20b", "phi3-mini"):
        # a fused QKV projection: V is a view of its output, so SDPA keeping V keeps all of q, k, v
        # alive beside the rotated q and k (the reference projects q, k, v separately): + q + k per layer
        assert extra == pytest.approx(layers * 2 * SEQ * cfg.hidden_size * BF16, rel=0.01)
    elif name == "gemma2-9b":
        # eager attention (softcapping) takes the softmax in fp32 and keeps a bf16 copy for probs @ v:
        # 4 + 2 bytes per score where the reference keeps 2
        assert extra == pytest.approx(layers * cfg.num_attention_heads * SEQ * SEQ * 4, rel=0.01)
    else:
        assert saved_bytes(reference) == pytest.approx(saved_bytes(captured), rel=0.02)


@pytest.mark.parametrize("name,cluster,batch,seq", [
    ("llama3.1-8b", "dgx-h100", 256, 4096), ("mixtral-8x7b", "dgx-h100", 256, 4096),
    ("gpt2", "dgx-a100", 64, 1024),
])
def test_a_module_plans_as_its_config_does(name, cluster, batch, seq):
    import planner
    from_module = planner.plan(hf_module(name), cluster, global_batch=batch, seq_len=seq)
    reference = config_from_hf(raw_config(name), name).model_copy(update={"hf_config": None})
    from_config = planner.plan(reference, cluster, global_batch=batch, seq_len=seq)
    assert from_module.to_layout() == from_config.to_layout()
    assert from_module.capture_front_end == "recorded"


def test_a_config_json_builds_the_transformers_class():
    graph = capture(str(HF_DIR / "qwen3-8b.json"), seq_len=SEQ)
    assert graph.model_class == "Qwen3ForCausalLM"
    assert graph.structures[0].tp_pairs[0].row == "self_attn.o_proj"


def test_learned_positions_refuse_a_longer_sequence():
    from hardware_profiles.errors import UserInputError
    with pytest.raises(UserInputError, match="1,024"):
        capture(str(HF_DIR / "gpt2.json"), seq_len=4096)
    with pytest.raises(UserInputError, match="1,024 rows"):
        capture(hf_module("gpt2"), seq_len=4096)


def test_torchtitan_llama3_is_captured_as_transformers_llama_is():
    """torchtitan's own Llama3Model (fused QKV, complex RoPE, varlen attention, layers in a ModuleDict),
    called as its trainer calls it: the same parameters, FLOPs and structure as transformers' Llama 3.1."""
    llama3 = pytest.importorskip("torchtitan.models.llama3")
    with torch.device("meta"):
        titan = llama3.llama3_configs["8B"](attn_backend="varlen").build()
    graph = capture(TrainerCall(titan.to(torch.bfloat16)), seq_len=SEQ, fused_kernels=True)
    reference = capture(hf_module("llama3.1-8b"), seq_len=SEQ, fused_kernels=True)
    assert graph.total_params == sum(p.numel() for p in titan.parameters()) == reference.total_params
    assert forward_matmul_flops(graph) == pytest.approx(forward_matmul_flops(reference), rel=1e-6)
    assert (graph.attention_heads, graph.kv_groups) == (32, 8)
    pairs = graph.structures[0].tp_pairs
    assert [p.row for p in pairs] == ["attention.wo", "feed_forward.w2"]
    assert pairs[0].fused_columns == ("attention.qkv_linear.wqkv",)   # [q | k | v] head groups: not tp-splittable as is


class TrainerCall(torch.nn.Module):
    """A torchtitan model called as torchtitan's trainer calls it: positions, then the attention metadata."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
        return self.model(tokens, positions, self.model.get_attention_masks(positions))


def test_torchtitan_deepseek_v3_is_captured_with_its_experts():
    """torchtitan's own DeepSeekV3Model (MLA, a router module around its gate Linear, grouped experts,
    shared experts): its parameters, FLOPs within 1e-6 of the reference decoder's from DeepSeek-V3's
    config.json, 256 experts with top-8 from the graph; the router's fp32 autocast is named as not applied."""
    deepseek = pytest.importorskip("torchtitan.models.deepseek_v3")
    with torch.device("meta"):
        titan = deepseek.deepseekv3_configs["671B"](attn_backend="varlen", moe_comm_backend="standard").build()
    graph = capture(TrainerCall(titan.to(torch.bfloat16)), seq_len=SEQ, fused_kernels=True)
    reference = capture(config_from_hf(raw_config("deepseek-v3"), "deepseek-v3").model_copy(update={"hf_config": None}),
                        seq_len=SEQ, fused_kernels=True)
    assert graph.total_params == sum(p.numel() for p in titan.parameters())
    assert graph.total_params == pytest.approx(reference.total_params, rel=1e-6)
    assert forward_matmul_flops(graph) == pytest.approx(forward_matmul_flops(reference), rel=1e-6)
    assert graph.layer_counts() == {"embedding": 1, "dense": 3, "moe": 58, "head": 1}
    moe = graph.structure("moe")
    assert (moe.num_experts, moe.router_topk, moe.expert_container) == (256, 8, "moe")
    assert any("autocast" in note and "moe.router" in note for note in graph.capture_notes)


def test_experts_routed_by_a_loop_over_the_chosen_ones_are_measured_balanced():
    """Mixtral as transformers 4.x wrote it: a ModuleList of experts and a loop that reads which tokens
    each one got (torch.where on the router's top-k), which meta cannot run: measured with balanced
    routing, FLOPs exact against the closed form, and the plan's capture notes say so."""
    h, seq, experts, k, layers, vocab = 256, 128, 8, 2, 2, 1000
    model = LoopMoEModel(h, layers, vocab, experts, k)
    graph = capture(model, seq_len=seq)
    per_token = 2 * (layers * (4 * h * h + h * experts + k * 3 * h * 2 * h) + vocab * h) + layers * 4 * seq * h
    assert forward_matmul_flops(graph) / seq == pytest.approx(per_token, rel=1e-9)
    assert graph.total_params == sum(p.numel() for p in model.parameters())
    assert (graph.num_experts, graph.structures[0].router_topk) == (experts, k)
    assert any("balanced routing" in note for note in graph.capture_notes)


class LoopExpert(torch.nn.Module):
    def __init__(self, h, f):
        super().__init__()
        self.w1, self.w3 = torch.nn.Linear(h, f, bias=False), torch.nn.Linear(h, f, bias=False)
        self.w2 = torch.nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class LoopMoE(torch.nn.Module):
    def __init__(self, h, experts, k):
        super().__init__()
        self.gate, self.top_k = torch.nn.Linear(h, experts, bias=False), k
        self.experts = torch.nn.ModuleList(LoopExpert(h, 2 * h) for _ in range(experts))

    def forward(self, x):
        b, t, h = x.shape
        x = x.view(-1, h)
        weights, chosen = torch.topk(torch.softmax(self.gate(x), -1), self.top_k)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            if rows.numel():
                out.index_add_(0, rows, expert(x[rows]) * weights[rows, slot, None])
        return out.view(b, t, h)


class LoopMoEBlock(torch.nn.Module):
    def __init__(self, h, experts, k, heads=8):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.qkv, self.o = torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h)
        self.moe = LoopMoE(h, experts, k)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.n1(x)).split(h, -1))
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attended.transpose(1, 2).reshape(b, t, h))
        return x + self.moe(self.n2(x))


class LoopMoEModel(torch.nn.Module):
    def __init__(self, h, layers, vocab, experts, k):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, h)
        self.layers = torch.nn.ModuleList(LoopMoEBlock(h, experts, k) for _ in range(layers))
        self.head = torch.nn.Linear(h, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class NanoGPT(torch.nn.Module):
    """nanoGPT as Karpathy writes it: fused c_attn split in three, GELU MLP, learned positions, tied head."""

    def __init__(self, layers=4, width=256, heads=8, vocab=1024, block=512):
        super().__init__()
        self.heads = heads
        self.wte, self.wpe = torch.nn.Embedding(vocab, width), torch.nn.Embedding(block, width)
        self.h = torch.nn.ModuleList(NanoBlock(width, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)
        self.lm_head = torch.nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class NanoBlock(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.c_attn, self.c_proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.c_fc, self.mlp_proj = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(torch.nn.functional.gelu(self.c_fc(self.ln_2(x))))


def test_a_nanogpt_written_here_matches_its_closed_form():
    model = NanoGPT()
    graph = capture(model, seq_len=SEQ)
    layers, width, vocab = 4, 256, 1024
    assert graph.total_params == sum(p.numel() for p in model.parameters())
    # per token: 2 x (12 h^2 per layer + the tied output layer) + attention 4 s h per layer
    want = 2 * (layers * 12 * width ** 2 + vocab * width) + layers * 4 * SEQ * width
    assert forward_matmul_flops(graph) / SEQ == pytest.approx(want, rel=1e-6)
    pairs = graph.structures[0].tp_pairs
    assert {p.row for p in pairs} == {"c_proj", "mlp_proj"}
    assert next(p for p in pairs if p.row == "c_proj").fused_columns == ("c_attn",)


def test_a_module_capture_cannot_run_exits_2_with_advice_that_works(capsys, monkeypatch):
    import sys
    from planner import cli
    spec = str(Path(__file__).parent / "models" / "value_reading.py") + ":build"

    def show(*extra):
        monkeypatch.setattr(sys, "argv", ["planner", "models", "show", spec, "--seq-len", "64", *extra])
        try:
            cli.main()
            code = 0
        except SystemExit as exc:
            code = exc.code
        out, err = capsys.readouterr()
        return code, " ".join(out.split()), " ".join(err.split())
    code, _, err = show()
    assert code == 2 and "Traceback" not in err
    assert "module 'gate'" in err and "--leaf-modules gate" in err
    code, out, err = show("--leaf-modules", "gate")   # the advice, followed
    assert code == 0, err
    assert "capture: module 'gate' cannot run on meta tensors" in out
    code, _, err = show("--leaf-modules", "gate", "--strict-capture")
    assert code == 2 and "Traceback" not in err and "not exact" in err


def test_sliding_window_layers_past_their_window_are_captured():
    """Gemma 3 at 2,048 tokens, twice its 1,024-token window: transformers builds the sliding masks
    (too large to compute for real, they stay on meta) and the FLOPs still match the closed form."""
    module, seq = hf_module("gemma3-12b"), 2048
    graph = capture(module, seq_len=seq, fused_kernels=True)
    want = closed_form_forward_flops_per_token(module, raw_config("gemma3-12b"), seq)
    assert forward_matmul_flops(graph) / seq == pytest.approx(want, rel=0.02)
