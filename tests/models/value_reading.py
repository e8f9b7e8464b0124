"""A model whose code reads a tensor's value (a data-dependent branch): capture cannot run it on meta."""
import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.score = nn.Linear(width, width)

    def forward(self, x):
        if self.score(x).sum() > 0:   # a branch on data: meta tensors hold none
            return x * 2
        return x


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm, self.gate = nn.LayerNorm(width), Gate(width)
        self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x, *, scale=None):
        return x + self.proj(torch.relu(self.fc(self.norm(self.gate(x)))))


class Model(nn.Module):
    def __init__(self, width=64, vocab=128, layers=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, scale=torch.ones(1))
        return self.head(x)


def build():
    return Model()
