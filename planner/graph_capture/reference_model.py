"""The project's reference decoder: a real, trainable torch model built from a `ModelConfig`.

MHA/GQA/MLA attention on `scaled_dot_product_attention` (or an explicit "math" path that materialises
the attention matrix, as Megatron-LM's GPT did), GELU/SwiGLU/ReLU^2 MLPs, top-k routed MoE with shared
experts, RMSNorm/LayerNorm, tied or untied embeddings. Tensors are [batch, seq, hidden].
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    return nn.LayerNorm(dim) if cfg.normalization == "layernorm" else RMSNorm(dim)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    def __init__(self, dim: int, max_seq: int, base: float = 10000.0):
        super().__init__()
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        freqs = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x, offset: int = 0):
        # x: [b, heads, s, d]; offset lets a context-parallel shard use its global positions
        s = x.shape[-2]
        cos = self.cos[offset:offset + s].to(x.dtype)
        sin = self.sin[offset:offset + s].to(x.dtype)
        return x * cos + rotate_half(x) * sin


def sliding_mask(queries: int, keys: int, window: int, device) -> torch.Tensor:
    """True where query i may see key j: j <= i and j > i - window (transformers' sliding_window_overlay)."""
    ones = torch.ones(queries, keys, dtype=torch.bool, device=device)
    return ones.tril() & ~ones.tril(-window)


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v, causal. The unit that selective recomputation and CP replace."""

    def __init__(self, cfg: ModelConfig, window: int = 0):
        super().__init__()
        self.impl = cfg.attention_impl
        self.dropout = cfg.dropout
        self.softcap = cfg.attention_softcap
        self.kv_repeat = 1 if cfg.attention == "mla" else cfg.num_attention_heads // cfg.query_groups
        self.sliding_window = window or None   # keys each query sees, itself included (None: all before it)
        if self.impl == "math":
            allowed = sliding_mask(cfg.seq_length, cfg.seq_length, window or cfg.seq_length, None)
            self.register_buffer("causal_mask", ~allowed, persistent=False)

    def forward(self, q, k, v):
        if self.impl == "flash":  # GQA inside the kernel: kv heads are not materialised per query head
            if self.sliding_window:   # the window as a mask (capture bills the kernel's windowed work)
                mask = sliding_mask(q.shape[-2], k.shape[-2], self.sliding_window, q.device)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_repeat > 1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_repeat > 1)
        if self.kv_repeat > 1:  # every kv head serves kv_repeat query heads
            k = k.repeat_interleave(self.kv_repeat, dim=1)
            v = v.repeat_interleave(self.kv_repeat, dim=1)
        s = q.shape[-2]
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
        if self.softcap:  # Gemma 2: cap * tanh(scores / cap)
            scores = torch.tanh(scores / self.softcap) * self.softcap
        probs = torch.softmax(scores.masked_fill(self.causal_mask[:s, :s], float("-inf")), dim=-1)
        if self.dropout:
            probs = F.dropout(probs, self.dropout, self.training)
        return torch.matmul(probs, v)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int = 0):
        super().__init__()
        h, d = cfg.hidden_size, cfg.kv_channels
        self.heads, self.groups, self.head_dim = cfg.num_attention_heads, cfg.query_groups, d
        qkv_bias = cfg.add_bias or cfg.qkv_bias
        self.q_proj = nn.Linear(h, self.heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.groups * d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.groups * d, bias=qkv_bias)
        # Qwen3 / Gemma 3: an RMSNorm over each head's channels of q and k, before RoPE
        self.q_norm = make_norm(cfg, d) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, d) if cfg.qk_norm else None
        self.core = CoreAttention(cfg, window)
        self.o_proj = nn.Linear(self.heads * d, h, bias=cfg.add_bias)
        self.rotary = Rotary(d, cfg.seq_length) if cfg.position_embedding == "rope" else None

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        out = self.core(q, k, v).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)


class MLAttention(nn.Module):
    """Multi-head latent attention: low-rank compressed q and kv (DeepSeek-V2 section 2.1)."""

    def __init__(self, cfg: ModelConfig, window: int = 0):
        super().__init__()
        m, h = cfg.mla, cfg.hidden_size
        self.heads, self.m = cfg.num_attention_heads, m
        qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(m.q_lora_rank)
            self.q_b_proj = nn.Linear(m.q_lora_rank, self.heads * qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, self.heads * qk_dim, bias=False)
        self.kv_a_proj = nn.Linear(h, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, self.heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.core = CoreAttention(cfg, window)
        self.o_proj = nn.Linear(self.heads * m.v_head_dim, h, bias=False)
        self.rotary = Rotary(m.qk_rope_head_dim, cfg.seq_length)

    def forward(self, x):
        b, s, _ = x.shape
        m = self.m
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))) if m.q_lora_rank else self.q_proj(x)
        q = q.view(b, s, self.heads, -1).transpose(1, 2)
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        kv_a = self.kv_a_proj(x)
        kv_latent, k_rope = kv_a.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(kv_latent)).view(b, s, self.heads, -1).transpose(1, 2)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k_rope = self.rotary(k_rope.unsqueeze(1)).expand(b, self.heads, s, m.qk_rope_head_dim)
        q = torch.cat([q_nope, self.rotary(q_rope)], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        out = self.core(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


GATED = ("swiglu", "geglu")


def activate(activation: str, up, gate=None):
    """The MLP's non-linearity: gated (SwiGLU: silu(gate) * up; GeGLU: tanh-GELU(gate) * up, Gemma's
    `gelu_pytorch_tanh`) or not (GELU, squared ReLU)."""
    if activation == "swiglu":
        return F.silu(gate) * up
    if activation == "geglu":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "gelu":
        return F.gelu(up)
    return F.relu(up).square()


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ffn: int):
        super().__init__()
        h = cfg.hidden_size
        self.activation = cfg.activation
        if self.activation in GATED:
            self.gate_proj = nn.Linear(h, ffn, bias=cfg.add_bias)
        self.up_proj = nn.Linear(h, ffn, bias=cfg.add_bias)
        self.down_proj = nn.Linear(ffn, h, bias=cfg.add_bias)

    def forward(self, x):
        gate = self.gate_proj(x) if self.activation in GATED else None
        return self.down_proj(activate(self.activation, self.up_proj(x), gate))


class GroupedExperts(nn.Module):
    """All routed experts of a layer as stacked weights [experts, in, out] (as torchtitan and
    Megatron-Core's grouped GEMM hold them), so that expert parallelism shards dim 0."""

    def __init__(self, cfg: ModelConfig, num_experts: int, ffn: int):
        super().__init__()
        h = cfg.hidden_size
        self.activation = cfg.activation
        self.w_up = nn.Parameter(torch.empty(num_experts, h, ffn))
        self.w_gate = nn.Parameter(torch.empty(num_experts, h, ffn)) if cfg.activation in GATED else None
        self.w_down = nn.Parameter(torch.empty(num_experts, ffn, h))
        self.reset_parameters()

    def reset_parameters(self):
        for weight in (self.w_up, self.w_gate, self.w_down):
            # nothing to fill on meta, where torch runs normal_ through its Python reference decomposition
            if weight is not None and not weight.is_meta:
                nn.init.normal_(weight, std=weight.shape[1] ** -0.5)

    def expert_forward(self, e: int, x):
        """One expert on its tokens [n, h] (e is the local expert index)."""
        gate = x @ self.w_gate[e] if self.w_gate is not None else None
        return activate(self.activation, x @ self.w_up[e], gate) @ self.w_down[e]

    def forward(self, x):
        """Every expert on an equal share of tokens, batched: x is [experts, n, h]."""
        gate = torch.bmm(x, self.w_gate) if self.w_gate is not None else None
        return torch.bmm(activate(self.activation, torch.bmm(x, self.w_up), gate), self.w_down)


class MoE(nn.Module):
    """Top-k routed experts plus shared experts. Traced as a leaf: routing is data-dependent.

    On meta tensors (analysis) routing is balanced and static: every expert gets tokens*k/E tokens.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.num_experts, self.top_k = moe.num_experts, moe.router_topk
        self.n_group, self.topk_group = moe.router_num_groups, moe.router_group_topk
        self.router_fp32 = moe.router_fp32
        self.router = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = GroupedExperts(cfg, moe.num_experts, moe.moe_ffn_hidden_size)
        shared = moe.num_shared_experts * (moe.shared_expert_ffn_hidden_size or moe.moe_ffn_hidden_size)
        self.shared_experts = MLP(cfg, shared) if shared else None

    def route(self, tokens):
        # DeepSeek-V2/V3 score experts in fp32: the tokens and router weight are cast up for the GEMM
        logits = F.linear(tokens.float(), self.router.weight.float()) if self.router_fp32 else self.router(tokens)
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if self.n_group > 1:   # group-limited (DeepSeek-V3 3.2.2): a group scores by its two best experts
            grouped = scores.view(*scores.shape[:-1], self.n_group, -1)
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(-1)
            keep = torch.zeros_like(group_score).scatter(-1, group_score.topk(self.topk_group, dim=-1)[1], 1.0)
            scores = (grouped * keep.unsqueeze(-1)).reshape(scores.shape)
        weights, chosen = torch.topk(scores, self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(tokens.dtype)
        return weights, chosen

    def routed(self, tokens, weights, chosen):
        """Routed experts on real tensors, all experts local (expert parallelism replaces this)."""
        out = torch.zeros_like(tokens)
        for e in range(self.num_experts):
            rows, slot = torch.where(chosen == e)
            if rows.numel():
                out = out.index_add(0, rows, self.experts.expert_forward(e, tokens[rows]) * weights[rows, slot, None])
        return out

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, chosen = self.route(tokens)
        if tokens.is_meta:
            per_expert = max(1, tokens.shape[0] * self.top_k // self.num_experts)
            # dispatch materialises k copies of the tokens, which the first expert GEMM keeps for backward
            batched = tokens[:per_expert].expand(self.num_experts, per_expert, shape[-1]).contiguous()
            out = self.experts(batched).reshape(-1, shape[-1])[: tokens.shape[0]] * weights[:, :1]
        else:
            out = self.routed(tokens, weights, chosen)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.input_norm = make_norm(cfg, cfg.hidden_size)
        window = cfg.window_of(index)
        self.attention = MLAttention(cfg, window) if cfg.attention == "mla" else Attention(cfg, window)
        self.post_attention_norm = make_norm(cfg, cfg.hidden_size)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(index) else MLP(cfg, cfg.ffn_hidden_size)
        # Gemma 2/3: each sublayer's output is normalised again before its residual add
        self.attention_out_norm = make_norm(cfg, cfg.hidden_size) if cfg.sandwich_norm else None
        self.mlp_out_norm = make_norm(cfg, cfg.hidden_size) if cfg.sandwich_norm else None
        self.parallel_residual = cfg.parallel_residual
        self.dropout = cfg.dropout

    def _drop(self, x):
        return F.dropout(x, self.dropout, self.training) if self.dropout else x

    @staticmethod
    def _out(norm, x):
        return norm(x) if norm is not None else x

    def forward(self, x):
        attention = self._drop(self._out(self.attention_out_norm, self.attention(self.input_norm(x))))
        if self.parallel_residual:  # GPT-NeoX / GPT-J: attention and MLP both read the layer input
            return x + attention + self._drop(self._out(self.mlp_out_norm, self.mlp(self.post_attention_norm(x))))
        x = x + attention
        return x + self._drop(self._out(self.mlp_out_norm, self.mlp(self.post_attention_norm(x))))


class MultiTokenPrediction(nn.Module):
    """What one MTP module adds around its layer (DeepSeek-V3 2.2): the two norms, the 2h -> h projection
    and the norm before the shared output layer. Its layer sits in the decoder's layer list, after the
    model's own, so that capture counts it as a block and a pipeline places it last, as Megatron-Core does."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.hidden_norm = make_norm(cfg, cfg.hidden_size)
        self.embedding_norm = make_norm(cfg, cfg.hidden_size)
        self.projection = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.final_norm = make_norm(cfg, cfg.hidden_size)

    def forward(self, hidden, embedded):
        return self.projection(torch.cat((self.hidden_norm(hidden), self.embedding_norm(embedded)), dim=-1))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_positions = (nn.Embedding(cfg.seq_length, cfg.hidden_size)
                                if cfg.position_embedding == "learned" else None)
        # MTP layers are built like the model's last layer
        self.layers = nn.ModuleList(DecoderLayer(cfg, min(i, cfg.num_layers - 1))
                                    for i in range(cfg.num_layers + cfg.mtp_layers))
        self.final_norm = make_norm(cfg, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tied_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.mtp = nn.ModuleList(MultiTokenPrediction(cfg) for _ in range(cfg.mtp_layers)) if cfg.mtp_layers else None

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        if self.embed_positions is not None:
            x = x + self.embed_positions.weight[: tokens.shape[1]]
        if self.config.dropout:  # embedding dropout (GPT-2's embd_pdrop, Megatron's hidden dropout)
            x = F.dropout(x, self.config.dropout, self.training)
        for layer in self.layers[:self.config.num_layers]:
            x = layer(x)
        logits = self._logits(self.final_norm(x))
        if self.mtp is None:
            return logits
        # module k predicts token t+k+2 from position t: the tokens k+1 further ahead, embedded (Megatron's
        # roll_tensor; the wrapped-around tail is masked out of its loss)
        out = [logits]
        for k, module in enumerate(self.mtp):
            ahead = self.embed_tokens(torch.roll(tokens, shifts=-(k + 1), dims=1))
            x = self.layers[self.config.num_layers + k](module(x, ahead))
            out.append(self._logits(module.final_norm(x)))
        return tuple(out)

    def _logits(self, x):
        logits = self.lm_head(x)
        if self.config.logit_softcap:  # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / self.config.logit_softcap) * self.config.logit_softcap
        return logits


def build_model(cfg: ModelConfig, device: str | torch.device = "meta", dtype=torch.float32) -> Decoder:
    with torch.device(device):
        model = Decoder(cfg)
    return model.to(dtype=dtype)
