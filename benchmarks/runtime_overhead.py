"""A training step through `apply_plan` against the same step written by hand with torch.distributed
(FSDP2 `fully_shard` per block, or DTensor TP with `parallelize_module` and the heads localised by hand,
as torchtitan's per-model code does), same model, data, AdamW; median step times and their ratio.
Run with torchrun (gloo on CPU here; the result and the command: docs/benchmarks.md):

    .venv/bin/torchrun --nproc-per-node 2 benchmarks/runtime_overhead.py [--steps 12] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

from cost_models.layout_codec import layout_from, parse_text  # noqa: E402
from planner.graph_capture.model_capture import capture  # noqa: E402
from planner.graph_capture.model_config import ModelConfig  # noqa: E402
from planner.graph_capture.reference_model import build_model  # noqa: E402
from runtime import apply_plan  # noqa: E402

CONFIG = ModelConfig(name="bench-llama", num_layers=4, hidden_size=512, num_attention_heads=8, num_query_groups=8,
                     ffn_hidden_size=1536, vocab_size=4096, seq_length=256, activation="swiglu",
                     normalization="rmsnorm", attention="mha")


def batch(size: int, step: int):
    generator = torch.Generator().manual_seed(step)
    data = torch.randint(0, CONFIG.vocab_size, (size, CONFIG.seq_length + 1), generator=generator)
    return data[:, :-1], data[:, 1:]


def by_hand(kind: str, world: int):
    """The model laid out directly with torch.distributed, and its step function."""
    torch.manual_seed(0)
    model = build_model(CONFIG, "cpu")
    mesh = init_device_mesh("cpu", (world,))
    if kind == "fsdp":
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        rows = lambda t: t.chunk(world)[dist.get_rank()]   # noqa: E731  each rank its share of the batch
    else:
        for block in model.layers:
            plan = {f"attention.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
            plan.update({"attention.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                         "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
            parallelize_module(block, mesh, plan)
            block.attention.heads //= world    # the per-model edit torchtitan makes
            block.attention.groups //= world
        rows = lambda t: t   # noqa: E731  every TP rank sees the whole batch
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(tokens, targets):
        optimizer.zero_grad()
        logits = model(rows(tokens))
        F.cross_entropy(logits.float().flatten(0, -2), rows(targets).flatten()).backward()
        optimizer.step()
    return step


def planned(kind: str, world: int, graph, global_batch: int):
    torch.manual_seed(0)
    model = build_model(CONFIG, "cpu")
    text = f"dp={world},zero=3" if kind == "fsdp" else f"tp={world},sp=false"
    layout = layout_from(parse_text(text + f",mbs={global_batch // world if kind == 'fsdp' else global_batch}"),
                         global_batch=global_batch)
    parallel = apply_plan(model, graph, layout, "cpu", optimizer="adamw", lr=1e-4, precision="fp32", health=None)
    return parallel.train_step


def median_step_s(step, steps: int, global_batch: int) -> float:
    times = []
    for index in range(steps):
        tokens, targets = batch(global_batch, index)
        dist.barrier()
        start = time.perf_counter()
        step(tokens, targets)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])   # past the first steps' allocations


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=8)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    graph = capture(CONFIG, CONFIG.seq_length)
    lines = []
    for kind in ("fsdp", "tp"):
        ours, theirs = [], []
        for repeat in range(args.repeats):   # alternating which goes first
            order = [(ours, planned), (theirs, by_hand)]
            for times, build in (order if repeat % 2 else order[::-1]):
                step = build(kind, world, graph, args.global_batch) if build is planned else build(kind, world)
                times.append(median_step_s(step, args.steps, args.global_batch))
        a, b = statistics.median(ours), statistics.median(theirs)
        lines.append(f"{kind} x{world}: apply_plan {a * 1e3:.1f} ms, by hand {b * 1e3:.1f} ms, ratio {a / b:.3f}")
    if dist.get_rank() == 0:
        print(f"{CONFIG.name} ({CONFIG.num_layers} layers, hidden {CONFIG.hidden_size}, seq {CONFIG.seq_length}), "
              f"global batch {args.global_batch}, gloo on CPU, median of {args.repeats} x {args.steps} steps:")
        print("\n".join(lines))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
