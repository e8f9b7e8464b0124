"""A small GPT written independently of the planner's reference model, to show that capture works on
any torch module: fused QKV projection, explicit causal attention, GELU MLP, pre-norm blocks.

    planner models show examples/user_gpt.py:build --seq-len 256
"""
import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, fused_qkv: bool = True):
        super().__init__()
        self.heads = heads
        self.fused_qkv = fused_qkv
        if fused_qkv:  # one projection split in three: capture finds the pair, TP refuses to column-shard it
            self.qkv = nn.Linear(width, 3 * width)
        else:
            self.query, self.key, self.value = (nn.Linear(width, width) for _ in range(3))
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, s, w = x.shape
        if self.fused_qkv:
            q, k, v = self.qkv(x).split(w, dim=-1)
        else:
            q, k, v = self.query(x), self.key(x), self.value(x)
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, fused_qkv: bool = True):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads, fused_qkv)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 512, width: int = 128, depth: int = 4, heads: int = 4, context: int = 256,
                 fused_qkv: bool = True):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads, fused_qkv) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe.weight[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build() -> nn.Module:
    return TinyGPT()


def build_separate_qkv() -> nn.Module:
    """The same model with separate q, k, v projections: tensor parallel without model code."""
    return TinyGPT(fused_qkv=False)
