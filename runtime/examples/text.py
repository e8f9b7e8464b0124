"""A transformers model trained on real text by a user's own loop on the runtime: a tiny Llama (transformers'
class), the Apache License 2.0's text (shipped beside this file as corpus.txt) tokenised byte by byte, its
paragraphs packed into windows with the positions that cross a document boundary and the tail padding masked,
AdamW with weight decay on matrices only, warmup then cosine, clipping by the global norm, and an evaluation
pass every N steps on held-out windows.

    python -m runtime.examples.text --steps 20                                       # one process
    torchrun --nproc-per-node 2 -m runtime.examples.text --layout tp=2 --steps 20     # tp2 + SP, gloo
    torchrun --nproc-per-node 2 -m runtime.examples.text --layout pp=2 --steps 20     # two pipeline stages
    torchrun --nproc-per-node 8 -m runtime.examples.text --device cuda --layout dp=2,tp=2,pp=2   # NCCL

Installed, `planner-example` runs the same. Prints `step K loss X lr Y` and `eval step K loss X` from rank 0.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.distributed as dist

from cost_models.layout_codec import layout_from, parse_text
from planner.graph_capture.model_capture import capture

from . import Logits
from ..checkpoint import save_training
from ..data import rank_loader
from ..laid_out import parallelize
from ..process_group import end_distributed, init_distributed
from ..step import IGNORE_INDEX, Step, token_cross_entropy

CORPUS = Path(__file__).with_name("corpus.txt")
PAD, EOS, OFFSET = 0, 1, 2          # byte b is token b + OFFSET
VOCAB = 256 + OFFSET


def documents() -> list[list[int]]:
    """The corpus's paragraphs as token lists (bytes, offset past the special tokens)."""
    text = CORPUS.read_bytes()
    return [[b + OFFSET for b in part.strip()] for part in text.split(b"\n\n") if part.strip()]


class PackedWindows(torch.utils.data.Dataset):
    """Documents packed end to end (EOS between them) into windows of `seq` tokens: a target is masked where its
    input is an EOS (the next document is not predicted from the last) and in the padding after the last one."""

    def __init__(self, docs: list[list[int]], seq: int):
        stream = [token for doc in docs for token in doc + [EOS]]
        count = math.ceil((len(stream) - 1) / seq)
        stream += [PAD] * (count * seq + 1 - len(stream))
        self.stream, self.seq, self.count = torch.tensor(stream), seq, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        chunk = self.stream[index * self.seq: index * self.seq + self.seq + 1]
        inputs, targets = chunk[:-1].clone(), chunk[1:].clone()
        targets[(inputs == EOS) | (targets == PAD)] = IGNORE_INDEX
        return inputs, targets


def tiny_llama(seq: int) -> torch.nn.Module:
    import transformers
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=seq, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Logits(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                                attn_implementation="sdpa"))


def parameter_groups(model, weight_decay: float) -> list[dict]:
    """Weight decay on matrices; none on norms and biases."""
    decay, plain = [], []
    for name, param in model.named_parameters():
        (plain if param.dim() < 2 or "norm" in name else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def warmup_cosine(steps: int, warmup: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))
    return factor


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m runtime.examples.text", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", default="", help="layout text, e.g. tp=2 or pp=2,mbs=2 (dp fills the ranks)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--checkpoint", default=None, help="save the whole state here after the last step")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    init_distributed(args.device)
    values = parse_text(args.layout, "--layout")
    others = values.get("tp", 1) * values.get("pp", 1) * values.get("cp", 1)
    values.setdefault("dp", max(1, dist.get_world_size() // others))
    values.setdefault("zero", 0)
    layout = layout_from(values, global_batch=args.global_batch)
    model = tiny_llama(args.seq_len)
    laid = parallelize(model, capture(model, args.seq_len), layout, args.device, precision="fp32")
    optimizer = laid.optimizer(torch.optim.AdamW, parameter_groups(laid, 0.1), lr=args.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.steps, max(1, args.steps // 10)))
    docs = documents()
    held_out = max(1, len(docs) // 10)
    train, evaluation = PackedWindows(docs[held_out:], args.seq_len), PackedWindows(docs[:held_out], args.seq_len)
    loader = rank_loader(laid, train, args.global_batch, seed=0)
    step = Step(laid, token_cross_entropy)
    rank0 = dist.get_rank() == 0
    for index, (inputs, targets) in zip(range(1, args.steps + 1), loader):
        loss = step.forward_backward(inputs, targets)
        step.clip_grad_norm_(1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if rank0:
            print(f"step {index} loss {loss:.4f} lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
        if index % args.eval_every == 0 or index == args.steps:
            held = rank_loader(laid, evaluation, min(args.global_batch, len(evaluation)), shuffle=False)
            inputs, targets = next(iter(held))
            loss = step.evaluate(inputs, targets)
            if rank0:
                print(f"eval step {index} loss {loss:.4f}", flush=True)
    if args.checkpoint:
        save_training(args.checkpoint, laid, optimizer, args.steps, scheduler, loader)
    del step, scheduler, optimizer, loader, laid, model   # the layout's state goes while its groups still exist
    end_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
