"""A user's own training loop on the runtime's library (run by tests/test_user_loop.py, one process or torchrun):
their model, their loss (cross-entropy over the positions their targets count, plus the model's router
load-balancing loss where it returns one), AdamW with two parameter groups (no weight decay on norms and
biases), a warmup-then-cosine schedule, gradient clipping, and their data through `rank_loader`. Each case
of CASES.json runs in turn; per step, rank 0 prints `case NAME step K loss X samples I,J,...` (the global
batch's sample indices) and every rank writes its gradients to DUMP/NAME/stepK-rankR.pt. The runtime's health
checks guard the optimizer step (`HealthMonitor.check`); a case may checkpoint its whole state into a directory
(`checkpoint_dir`, `save_every`: `Checkpointer.maybe_save` of a `LoopState`) or start from one's latest
(`resume_dir`), poison a gradient (`nan_at`: [step, rank]) or leave batches out by hand (`skip`: [steps]).

    python tests/user_loop.py CASES.json DUMP          # [{"name", "model", "layout", "steps", ...}]
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from cost_models.layout_codec import layout_from, parse_text  # noqa: E402
from planner.graph_capture.model_capture import capture  # noqa: E402
from planner.graph_capture.model_sources import ModelConfig, resolve_model  # noqa: E402
from planner.graph_capture.reference_model import build_model  # noqa: E402
from runtime import (Cadence, Checkpointer, HealthMonitor, HealthPolicy, LoopState, LossTerms, Step,  # noqa: E402
                     end_distributed, init_distributed, parallelize, rank_loader, settle)
from runtime.gemm_check import GemmFault  # noqa: E402
from runtime.health import InjectedProductFault  # noqa: E402
from runtime.step import IGNORE_INDEX, logits_of  # noqa: E402

SEQ, GLOBAL_BATCH, AUX_COEFFICIENT = 32, 8, 0.02


class TextWindows(torch.utils.data.Dataset):
    """Windows of a real text's bytes (the repository's LICENSE): the targets are the next bytes, the first
    four of each window masked (a prompt), and every third window padded after a byte-dependent length."""

    def __init__(self, seq: int = SEQ):
        data = torch.tensor(list((ROOT / "LICENSE").read_bytes()), dtype=torch.long)
        self.windows = data[: (len(data) - 1) // seq * seq + 1]
        self.seq = seq

    def __len__(self) -> int:
        return (len(self.windows) - 1) // self.seq

    def __getitem__(self, index: int):
        chunk = self.windows[index * self.seq: index * self.seq + self.seq + 1]
        inputs, targets = chunk[:-1].clone(), chunk[1:].clone()
        targets[:4] = IGNORE_INDEX
        if index % 3 == 0:   # padded: the tail is no text
            keep = 8 + int(chunk[0]) % (self.seq - 8)
            inputs[keep:], targets[keep:] = 0, IGNORE_INDEX
        return inputs, targets


def loss_with_aux(output, targets) -> LossTerms:
    """Cross-entropy summed over the counted positions, and the router's load-balancing loss where the model
    returns one (transformers' MoE models, output_router_logits=True)."""
    logits = logits_of(output)
    total = torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), targets.flatten(),
                                              ignore_index=IGNORE_INDEX, reduction="sum")
    aux = output.get("aux_loss") if isinstance(output, dict) else None
    return LossTerms(total, AUX_COEFFICIENT * aux if aux is not None else 0.0)


def warmup_cosine(steps: int, warmup: int = 2):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
    return factor


def groups(laid) -> list[dict]:
    """Weight decay on matrices, none on norms and biases (the usual two groups)."""
    decay, plain = [], []
    for name, param in laid.named_parameters():
        (plain if param.dim() < 2 or "norm" in name else decay).append(param)
    return [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}]


def build(spec: str):
    source = resolve_model(spec)
    torch.manual_seed(0)
    if isinstance(source, ModelConfig):
        return build_model(source, "cpu", torch.float32), capture(source, SEQ)
    return source.factory().float(), capture(spec, SEQ)


def run(case: dict, dump: Path) -> None:
    rank = dist.get_rank()
    model, graph = build(case["model"])
    values = parse_text(case["layout"])
    layout = layout_from(values, global_batch=GLOBAL_BATCH)
    laid = parallelize(model, graph, layout, "cpu", precision="fp32")
    optimizer = laid.optimizer(torch.optim.AdamW, groups(laid), lr=2e-3, betas=(0.9, 0.95))
    # the schedule spans the job (`schedule_steps`), which a case may stop early and another resume
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(case.get("schedule_steps", case["steps"])))
    step = Step(laid, loss_with_aux)
    loader = rank_loader(laid, TextWindows(), GLOBAL_BATCH, seed=1)
    wrong_at = case.get("wrong_product_at")   # [step, rank]: a backward product of that rank's step comes out wrong
    health = HealthMonitor.for_model(laid, HealthPolicy(gemm_every=1) if wrong_at else HealthPolicy())
    if wrong_at and wrong_at[1] == rank:
        health.gemm_fault = InjectedProductFault(wrong_at[0], GemmFault("backward", 1.0))
    state = LoopState(laid, optimizer, scheduler, loader)
    checkpointer = Checkpointer(case["checkpoint_dir"], Cadence(case["save_every"]), health=health) \
        if case.get("checkpoint_dir") else None
    (dump / case["name"]).mkdir(parents=True, exist_ok=True)
    first = 1
    if case.get("resume_dir"):   # the model, optimizer, schedule and data position, written under another layout
        first = Checkpointer(case["resume_dir"]).restore(state) + 1
    for index, (inputs, targets) in zip(range(first, case["steps"] + 1), loader):
        if index in case.get("skip", []):
            continue
        with health.watching(index):   # the step's matrix products, checked on a checked step
            loss = step.forward_backward(inputs, targets)
        if case.get("nan_at") == [index, rank]:
            next(p.grad for p in laid.params if p.grad is not None).view(-1)[0] = float("nan")
        torch.save(laid.gradients(), dump / case["name"] / f"step{index}-rank{rank}.pt")
        if health.check(index, loss, laid.params):   # the same verdict on every rank
            step.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            health.check_replicas(index, laid.params)
        optimizer.zero_grad()
        if checkpointer:
            checkpointer.maybe_save(index, state)
        if rank == 0:
            samples = loader.batch_sampler.batches.last
            print(f"case {case['name']} step {index} loss {loss:.10f} samples {','.join(map(str, samples))}",
                  flush=True)
    if checkpointer:
        checkpointer.finish()


def main() -> None:
    cases, dump = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    init_distributed("cpu")
    for case in cases:
        run(case, dump)
        settle()
    end_distributed()


if __name__ == "__main__":
    main()
