"""Graph-derived numbers against closed forms written independently here."""
from pathlib import Path

import pytest

from cost_models.layout import Layout, Recompute
from cost_models.memory import activation_bytes
from cost_models.records import OpKind
from cost_models.step_time import estimate
from hardware_profiles import UserInputError, cluster_from_device
from hardware_profiles.loader import load_stack
from planner.graph_capture.model_capture import capture
from planner.graph_capture.model_config import ModelConfig, MoEConfig
from planner.graph_capture.model_sources import config_from_hf, resolve_model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def gpt(l=2, h=1024, a=16, s=512, V=8192, impl="math", dropout=0.1):
    return ModelConfig(name=f"gpt-{l}-{h}-{impl}", num_layers=l, hidden_size=h, num_attention_heads=a,
                       ffn_hidden_size=4 * h, vocab_size=V, seq_length=s, activation="gelu",
                       normalization="layernorm", position_embedding="learned", tied_embeddings=True,
                       attention="mha", attention_impl=impl, add_bias=True, dropout=dropout)


def test_gpt_parameters_equal_narayanan_eq2():
    for l, h, V, s in [(2, 1024, 8192, 512), (4, 768, 50257, 1024), (3, 2048, 51200, 2048)]:
        graph = capture(gpt(l=l, h=h, a=16, s=s, V=V))
        eq2 = 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))  # SC21 Eq. 2
        final_norm = 2 * h  # the paper's count leaves out the final LayerNorm
        assert graph.total_params == round(eq2) + final_norm


@pytest.mark.parametrize("name,total,active", [
    ("llama3-405b", 405.0e9, None),       # Llama 3 Herd: 405B
    ("mixtral-8x7b", 46.7e9, 12.9e9),     # Mistral AI: 46.7B total, 12.9B active
    ("deepseek-v3", 671e9, 37e9),         # DeepSeek-V3: 671B total, 37B activated (main model, no MTP)
])
def test_published_parameter_counts_within_half_a_percent(name, total, active):
    graph = capture(name)
    assert graph.total_params == pytest.approx(total, rel=0.005)
    if active:
        assert graph.active_params == pytest.approx(active, rel=0.02 if name == "deepseek-v3" else 0.005)


def test_gpt_flops_equal_narayanan_eq3():
    l, h, s, V = 4, 1024, 1024, 51200
    graph = capture(gpt(l=l, h=h, s=s, V=V, impl="flash", dropout=0.0))
    B = 1
    exact = 72 * B * s * l * h * h * (1 + s / (6 * h)) + 6 * B * s * h * V  # layers x3 passes + logits
    assert graph.model_flops_per_sample() == pytest.approx(exact, rel=1e-9)
    big = capture("gpt3-175b")
    s, l, h, V = 2048, 96, 12288, 51200
    assert big.model_flops_per_sample() == pytest.approx(72 * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)),
                                                         rel=0.01)


S, H, A = 512, 1024, 16


@pytest.fixture(scope="module")
def gpt_layer():
    return capture(gpt(l=2, h=H, a=A, s=S)).kind("dense")


@pytest.mark.parametrize("tp,sp,recompute,formula", [
    (1, False, Recompute.none, lambda t: 34 + 5 * A * S / H),
    (4, False, Recompute.none, lambda t: 10 + 24 / t + 5 * A * S / (H * t)),
    (8, False, Recompute.none, lambda t: 10 + 24 / t + 5 * A * S / (H * t)),
    (4, True, Recompute.none, lambda t: 34 / t + 5 * A * S / (H * t)),
    (4, True, Recompute.selective, lambda t: 34 / t),
    (1, False, Recompute.full, lambda t: 2),
])
def test_activation_bytes_equal_korthikanti(gpt_layer, tp, sp, recompute, formula):
    # Korthikanti et al. 2022, Table 2 (b = 1): bytes per layer = s*b*h * formula
    got = activation_bytes(gpt_layer, recompute, tp, sp, 1, 1)
    assert got == pytest.approx(S * H * formula(tp), rel=0.02)


@pytest.mark.parametrize("tp,sp,recompute,formula", [
    (1, False, Recompute.none, lambda t: 27 + 5 * A * S / H),
    (4, False, Recompute.none, lambda t: 8 + 19 / t + 5 * A * S / (H * t)),
    (4, True, Recompute.selective, lambda t: 27 / t),
])
def test_fp8_keeps_weight_gemm_inputs_in_one_byte(gpt_layer, tp, sp, recompute, formula):
    # Table 2's terms with the inputs of the QKV, projection, fc1 (2sbh each) and fc2 (8sbh) GEMMs kept as
    # 1-byte FP8 copies (Transformer Engine): 34 - 7 = 27; replicated 10 - 2 = 8, tp-split 24 - 5 = 19
    got = activation_bytes(gpt_layer, recompute, tp, sp, 1, 1, precision="fp8")
    assert got == pytest.approx(S * H * formula(tp), rel=0.02)


@pytest.mark.parametrize("recompute,formula", [(Recompute.none, 34 + 5 * A), (Recompute.selective, 34)])
def test_hidden_states_as_wide_as_the_sequence_are_not_attention_matrices(recompute, formula):
    # s = h: a (b, s, h) tensor has the s x s shape, yet selective recomputation keeps it (Table 2, b = 1)
    layer = capture(gpt(l=2, h=H, a=A, s=H)).kind("dense")
    assert activation_bytes(layer, recompute, 1, False, 1, 1) == pytest.approx(H * H * formula, rel=0.02)


def test_each_routed_copy_of_a_token_keeps_its_expert_activations():
    # per extra top-k copy, SwiGLU experts keep: the dispatched token (h), gate, up, silu(gate) and the
    # product (4 f), and the expert output weighted by its router probability (h); 2 bytes each
    h, f, s = 256, 128, 128

    def moe_layer(topk):
        cfg = ModelConfig(name=f"moe-k{topk}", num_layers=2, hidden_size=h, num_attention_heads=4,
                          ffn_hidden_size=4 * h, vocab_size=512, seq_length=s,
                          moe=MoEConfig(num_experts=4, router_topk=topk, moe_ffn_hidden_size=f))
        return capture(cfg).kind("moe")

    one, two = (activation_bytes(moe_layer(k), Recompute.none, 1, False, 1, 1) for k in (1, 2))
    assert two - one == pytest.approx(s * (2 * h + 4 * f) * 2, rel=0.03)
    # where the stack multiplies the routing probabilities into the experts' activation (Megatron-Core 0.12.1+,
    # weighted SwiGLU), the experts' h-wide output is not kept for their gradient: h bf16 values fewer per
    # routed token, the rest unchanged
    for k in (1, 2):
        kind = moe_layer(k)
        kept = activation_bytes(kind, Recompute.none, 1, False, 1, 1)
        weighted = activation_bytes(kind, Recompute.none, 1, False, 1, 1, probs_in_expert_activation=True)
        assert kept - weighted == pytest.approx(s * k * h * 2, rel=1e-9)
        assert sum(t.routed_output_for_probs for t in kind.saved) == 1
    # the installed Megatron-Core multiplies them in its experts' activation and unpermutes without them; the
    # nemo-2 stack's runs (Megatron-LM 7094270c, 64cb6bd7: after core_v0.12.1) already did
    import inspect
    from megatron.core.transformer.moe import experts, token_dispatcher
    assert "activation_func_with_probs" in inspect.getsource(experts)
    unpermute = inspect.getsource(token_dispatcher.MoEAlltoAllTokenDispatcher).split("unpermute(")[1].split(")")[0]
    assert "probs" not in unpermute
    assert all(load_stack(name).moe_probs_in_expert_activation for name in ("megatron-core", "nemo-2"))


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_expert_activation_moves_what_the_experts_own_ops_move(activation):
    """The activation between an expert's GEMMs is billed per routed token as the bytes the experts' own
    non-GEMM ops read and write, counted op by op under a dispatch mode on meta tensors (SwiGLU: silu reads and
    writes f, the product reads 2f and writes f; GELU: f and f)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from planner.graph_capture.op_costs import expert_activation_elements
    from planner.graph_capture.reference_model import GroupedExperts
    h, f, experts, per_expert = 256, 96, 4, 32
    cfg = ModelConfig(name="moe", num_layers=1, hidden_size=h, num_attention_heads=4, ffn_hidden_size=4 * h,
                      vocab_size=512, seq_length=128, activation=activation,
                      moe=MoEConfig(num_experts=experts, router_topk=2, moe_ffn_hidden_size=f))
    module = GroupedExperts(cfg, experts, f).to(device="meta", dtype=torch.bfloat16)

    class Moved(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if "bmm" not in func.__name__:
                tensors = [a for a in (*args, out) if isinstance(a, torch.Tensor)]
                Moved.total += sum(t.numel() * t.element_size() for t in tensors)
            return out

    tokens = torch.empty(experts, per_expert, h, device="meta", dtype=torch.bfloat16)
    with Moved():
        module(tokens)
    gemms = tuple((p.shape[1], p.shape[2]) for p in module.parameters())
    _, moved = expert_activation_elements(gemms, h)
    assert Moved.total == moved * experts * per_expert * 2


def test_megatron_stacks_bill_the_sorts_megatron_cores_dispatcher_makes():
    """Megatron-Core's all-to-all dispatcher (run on CPU in a process of its own,
    tests/megatron_dispatcher_copies.py) sorts the received tokens by local expert and back: each step reads
    and writes the k routed copies of every token once. The Megatron stacks bill `moe_sort_copies` (2) of
    the copy a MoE leaf's capture records, the others none."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from hardware_profiles.loader import list_stacks, load_stack
    from planner.graph_capture.model_capture import capture
    tokens, h, experts, topk = 64, 32, 8, 2
    script = Path(__file__).with_name("megatron_dispatcher_copies.py")
    done = subprocess.run([sys.executable, str(script), *map(str, (tokens, h, experts, topk))], capture_output=True,
                          text=True, timeout=300, check=True)
    moved = json.loads(done.stdout.strip().splitlines()[-1])
    fp32_copy = 2 * tokens * topk * h * 4
    assert moved["sort"] == moved["unsort"] == fp32_copy
    cfg = ModelConfig(name="moe", num_layers=1, hidden_size=h, num_attention_heads=4, ffn_hidden_size=4 * h,
                      vocab_size=512, seq_length=tokens, moe=MoEConfig(num_experts=experts, router_topk=topk,
                                                                       moe_ffn_hidden_size=16))
    copy = next(op for op in capture(cfg).kind("moe").ops if op.kind == "token-copy")
    assert copy.bytes_accessed == fp32_copy / 2   # the same tensors in bf16
    sorts = {name: load_stack(name).moe_sort_copies for name in list_stacks()}
    assert {name for name, n in sorts.items() if n} == {"megatron-core", "nemo", "nemo-2", "megatron-bridge"}
    assert set(sorts.values()) == {0, (moved["sort"] + moved["unsort"]) // fp32_copy}


def test_flash_attention_removes_the_attention_matrix_term():
    layer = capture(gpt(l=2, h=H, a=A, s=S, impl="flash", dropout=0.0)).kind("dense")
    got = activation_bytes(layer, Recompute.none, 1, False, 1, 1)
    assert not any(t.attention_matrix for t in layer.saved)
    # without dropout masks (2 x sbh x 1 byte) and with flash's saved output/logsumexp instead of s x s
    assert got < S * H * 40
    assert got > S * H * 30


@pytest.mark.parametrize("fused,dropout,passes", [(False, 0.0, 3), (True, 0.0, 1), (True, 0.1, 2)])
def test_a_fused_softmax_passes_over_the_scores_once(fused, dropout, passes):
    # bf16 bytes moved over the b a s^2 scores by the ops between the two attention GEMMs: one read and one write
    # per pass (4 bytes); separate ops make three passes (scale, mask, softmax), Megatron's FusedScaleMaskSoftmax
    # one, and the attention dropout one more of its own
    layer = capture(gpt(l=2, h=H, a=A, s=S, impl="math", dropout=dropout), fused_kernels=fused).kind("dense")
    moved = sum(op.bytes_accessed for op in layer.ops if op.kind is OpKind.attention_elementwise)
    assert moved == pytest.approx(passes * 4 * A * S * S, rel=0.01)


def test_capture_work_does_not_grow_with_hidden_size():
    """Capture traces each layer kind once on meta tensors: a 16x wider model has the same ops (only their
    sizes grow), so its capture does the same work (the timings: benchmarks/capture_speed.py)."""
    small = capture(gpt(l=2, h=1024, s=512, impl="flash", dropout=0.0))
    large = capture(gpt(l=2, h=16384, s=512, impl="flash", dropout=0.0))
    for a, b in zip(small.costs().kinds, large.costs().kinds):
        assert [op.name for op in a.ops] == [op.name for op in b.ops]
        assert sum(op.forward_flops for op in b.ops) > 8 * sum(op.forward_flops for op in a.ops)


def test_user_module_is_captured_with_its_tp_pairs():
    graph = capture(f"{EXAMPLES / 'user_gpt.py'}:build", seq_len=256)
    assert graph.num_blocks == 4
    pairs = {(p.columns, p.row) for p in graph.structures[0].tp_pairs}
    assert (("attn.qkv",), "attn.proj") in pairs and (("fc",), "out") in pairs
    assert graph.attention_heads == 4


def test_moe_experts_and_gqa_found_in_graph():
    graph = capture("mixtral-8x7b")
    structure = graph.structure("moe")
    assert structure.num_experts == 8 and structure.router_topk == 2
    assert structure.expert_container == "mlp"
    assert graph.attention_heads == 32 and graph.kv_groups == 8


def test_hf_config_mapping():
    qwen_moe = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_attention_heads": 32,
                "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48, "intermediate_size": 6144,
                "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                "vocab_size": 151936, "max_position_embeddings": 40960}
    cfg = config_from_hf(qwen_moe)
    assert cfg.moe.num_experts == 128 and cfg.kv_channels == 128 and cfg.query_groups == 4
    graph = capture(cfg, seq_len=4096)
    assert graph.total_params == pytest.approx(30.5e9, rel=0.01)  # Qwen3-30B-A3B: 30.5B total
    assert graph.active_params == pytest.approx(3.3e9, rel=0.03)  # 3.3B activated


@pytest.mark.parametrize("text,needle", [
    ("num_layers: 2\nhidden_size: 100\nnum_attention_heads: 3\nffn_hidden_size: 8\nvocab_size: 10\nseq_length: 8\n",
     "does not divide"),
    ("hidden_size: 64\nnum_attention_heads: 4\nffn_hidden_size: 8\nvocab_size: 10\nseq_length: 8\n", "num_layers"),
    ("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nffn_hidden_size: 8\nvocab_size: 10\nseq_length: 8\n"
     "activation: tanh\n", "activation"),
    ("num_layers: two\nhidden_size: 64\nnum_attention_heads: 4\nffn_hidden_size: 8\nvocab_size: 10\nseq_length: 8\n",
     "num_layers"),
    ("num_layers: [oops", "not valid YAML"),
])
def test_bad_model_files(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UserInputError, match=needle) as info:
        resolve_model(str(path))
    assert str(path) in str(info.value)


def test_untraceable_module_names_the_module(tmp_path):
    path = tmp_path / "bad_model.py"
    path.write_text(
        "import torch\nfrom torch import nn\n"
        "class Gate(nn.Module):\n"
        "    def forward(self, x):\n"
        "        if x.sum() > 0:\n            return x\n        return -x\n"
        "class Block(nn.Module):\n"
        "    def __init__(self):\n        super().__init__(); self.lin = nn.Linear(8, 8); self.gate = Gate()\n"
        "    def forward(self, x):\n        return self.gate(self.lin(x))\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__(); self.emb = nn.Embedding(10, 8)\n"
        "        self.layers = nn.ModuleList(Block() for _ in range(2)); self.out = nn.Linear(8, 10)\n"
        "    def forward(self, t):\n        x = self.emb(t)\n        for l in self.layers:\n            x = l(x)\n"
        "        return self.out(x)\n"
        "def build():\n    return M()\n")
    with pytest.raises(UserInputError, match="gate") as info:
        capture(f"{path}:build", seq_len=16)
    assert "leaf" in str(info.value)
    graph = capture(f"{path}:build", seq_len=16, leaf_modules=("gate",))
    assert graph.num_blocks == 2


def test_unknown_model_and_missing_factory(tmp_path):
    with pytest.raises(UserInputError, match="unknown model"):
        resolve_model("gpt-9000")
    path = tmp_path / "m.py"
    path.write_text("x = 1\n")
    with pytest.raises(UserInputError, match="no callable"):
        resolve_model(f"{path}:build")


def test_full_recomputation_flops_equal_narayanan_96_form():
    """SC21 Eq. 3 counts the recomputed forward: 96 B s l h^2 (1 + s/(6h)) + 6 B s h V (logits not redone)."""
    from cost_models.layout import Layout
    from cost_models.step_time import estimate
    from hardware_profiles import cluster_from_device
    l, h, s, V, B = 4, 1024, 1024, 51200, 8
    graph = capture(gpt(l=l, h=h, s=s, V=V, impl="flash", dropout=0.0))
    result = estimate(graph.costs(), cluster_from_device("a100-80g", 8),
                      Layout(dp=8, micro_batch=1, global_batch=B, recompute=Recompute.full))
    hardware_flops = graph.model_flops_per_sample() * B * result.hfu / result.mfu
    assert hardware_flops == pytest.approx(96 * B * s * l * h * h * (1 + s / (6 * h)) + 6 * B * s * h * V, rel=1e-9)


def test_moonlight_counts_the_parameters_its_report_gives():
    """Moonshot AI's technical report (Liu et al. 2025, arXiv 2502.16982) gives Moonlight-16B-A3B 15.29B parameters,
    2.24B activated, counted without the untied input and output embeddings (2 x 163,840 x 2,048): the built-in
    model's counts less those, within their rounding."""
    graph = capture("moonlight-16b-a3b")
    embeddings = 2 * 163840 * 2048
    assert graph.total_params - embeddings == pytest.approx(15.29e9, abs=0.005e9)
    assert graph.active_params - embeddings == pytest.approx(2.24e9, abs=0.005e9)


def test_published_gpt_configurations_are_built_in():
    from planner.graph_capture.model_sources import list_builtin_models
    names = set(list_builtin_models())
    assert {"narayanan21-1t", "korthikanti22-22b", "bloom-176b", "nemo2407-gpt3-175b"} <= names
    graph = capture("narayanan21-145b")
    l, h, V, s = 80, 12288, 51200, 2048
    assert graph.total_params == round(12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))) + 2 * h


def test_capturing_a_module_object_leaves_its_weights_alone():
    import importlib.util
    spec = importlib.util.spec_from_file_location("user_gpt", EXAMPLES / "user_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.build()
    before = model.wte.weight.detach().clone()
    graph = capture(model, seq_len=64)
    assert graph.num_blocks == 4 and graph.total_params == sum(p.numel() for p in model.parameters())
    assert model.wte.weight.device.type == "cpu" and bool((model.wte.weight == before).all())


# Korthikanti et al. 2022, Table 3: the four models they measure (s = 2048, t = 8, micro-batch 1)
KORTHIKANTI_MODELS = [  # (name, layers, hidden, heads, pipeline stages)
    ("22B", 48, 6144, 64, 1), ("175B", 96, 12288, 96, 8), ("530B", 105, 20480, 128, 35), ("1T", 128, 25600, 160, 64)]


@pytest.mark.parametrize("name,layers,hidden,heads,pp", KORTHIKANTI_MODELS)
@pytest.mark.parametrize("recompute", [Recompute.none, Recompute.selective])
def test_first_stage_activation_memory_of_korthikanti_models(name, layers, hidden, heads, pp, recompute):
    """Section 4.2.3: the first 1F1B stage holds p micro-batches of L/p layers, i.e. L layers' worth:
    s b h L (34/t + 5 a s/(h t)) with sequence parallelism, s b h L 34/t with selective recomputation."""
    s, t = 2048, 8
    graph = capture(gpt(l=layers, h=hidden, a=heads, s=s, V=51200))
    per_stage = layers // pp + (layers % pp > 0)
    stages = tuple([per_stage] * (layers // per_stage) + ([layers % per_stage] if layers % per_stage else []))
    layout = Layout(tp=t, pp=len(stages), dp=1, micro_batch=1, global_batch=4 * len(stages), zero=1,
                    stage_layers=stages, recompute=recompute)
    first = estimate(graph.costs(), cluster_from_device("a100-80g", t * len(stages)), layout).stage_memory[0]
    attention = 5 * heads * s / (hidden * t) if recompute is Recompute.none else 0.0
    paper = s * hidden * per_stage * len(stages) * (34 / t + attention)
    assert first.activations == pytest.approx(paper, rel=0.05)


def _megatron_gated_kernel_saves_less(tokens: int, ffn: int) -> int:
    """Bytes Megatron-Core's fused SwiGLU (bias_swiglu_impl) keeps below the same SwiGLU run as separate
    ops (its unfused path: chunk, silu, multiply), measured with saved_tensors_hooks in fp32 on CPU."""
    import warnings

    import torch
    import torch.nn.functional as F
    from torch.autograd.graph import saved_tensors_hooks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    hidden = 8
    fc1, fc2 = torch.nn.Linear(hidden, 2 * ffn, bias=False), torch.nn.Linear(ffn, hidden, bias=False)
    weights = {p.untyped_storage().data_ptr() for p in (fc1.weight, fc2.weight)}

    def kept(activation) -> int:
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        x = torch.randn(tokens, 1, hidden, requires_grad=True)
        with saved_tensors_hooks(pack, lambda t: t):
            fc2(activation(fc1(x))).sum().backward()
        return sum(storages.values())

    def unfused(u):
        gate, up = torch.chunk(u, 2, dim=-1)
        return F.silu(gate) * up
    return kept(unfused) - kept(lambda u: bias_swiglu_impl(u, None))


def test_a_fused_gated_activation_keeps_what_megatron_cores_kernel_keeps():
    """Megatron-Core's fused SwiGLU keeps one tokens x ffn tensor less than the separate ops (silu(gate),
    which it recomputes); capture under `fused_gated_activation` (the Megatron stacks) keeps exactly that
    much less per SwiGLU layer, and nothing less for a GELU MLP."""
    tokens, ffn = 16, 24
    assert _megatron_gated_kernel_saves_less(tokens, ffn) == tokens * ffn * 4   # fp32 there
    for name, gated in (("tiny-llama", True), ("narayanan21-1p7b", False)):
        cfg = resolve_model(name)
        plain, fused = (capture(cfg, seq_len=64, fused_kernels=True, fused_gated_activation=flag)
                        for flag in (False, True))
        for before, after in zip(plain.costs_record.kinds, fused.costs_record.kinds):
            dropped = sum(s.bytes for s in before.saved) - sum(s.bytes for s in after.saved)
            expected = 64 * cfg.ffn_hidden_size * 2 if gated and before.role == "block" else 0   # bf16 here
            assert dropped == expected, (name, before.name)


def test_a_fused_gated_activation_inside_an_expert_leaf_keeps_what_megatron_cores_kernel_keeps():
    """Inside an expert container, which capture runs as one leaf, the fused rule holds for every routed
    token: per MoE layer, Megatron-Core's kernel on T k routed tokens keeps T k f fewer elements than the
    separate ops (measured on the kernel), and capture under the flag keeps exactly that much less; plain
    GELU experts keep all they kept."""
    tokens, topk, f = 128, 2, 96
    per_element = _megatron_gated_kernel_saves_less(tokens * topk, f) / (tokens * topk * f)   # 4: fp32 there
    for activation, gated in (("swiglu", True), ("gelu", False)):
        cfg = ModelConfig(name="moe", num_layers=2, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024,
                          vocab_size=512, seq_length=tokens, activation=activation,
                          moe=MoEConfig(num_experts=4, router_topk=topk, moe_ffn_hidden_size=f))
        plain, fused = (capture(cfg, fused_kernels=True, fused_gated_activation=flag).kind("moe")
                        for flag in (False, True))
        dropped = sum(s.bytes for s in plain.saved) - sum(s.bytes for s in fused.saved)
        assert dropped == (tokens * topk * f * per_element / 2 if gated else 0)   # bf16 here
