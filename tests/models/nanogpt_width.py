"""nanoGPT's attention idiom: the head width computed from the full hidden size (`C // n_head`), which
column-sharded projections break under tensor parallelism (the runtime must refuse it before step 1)."""
import sys
from pathlib import Path

import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from user_gpt import SelfAttention, TinyGPT  # noqa: E402


def _forward(self, x):
    b, s, c = x.shape
    q, k, v = self.query(x), self.key(x), self.value(x)
    q, k, v = (t.view(b, s, self.heads, c // self.heads).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class WidthFromHidden(SelfAttention):
    forward = _forward


def build():
    model = TinyGPT(fused_qkv=False)
    for block in model.blocks:
        block.attn.__class__ = WidthFromHidden
    return model
