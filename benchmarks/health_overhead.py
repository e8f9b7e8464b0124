"""What the in-step health checks cost (runtime/health.py, runtime/stragglers.py): steps of the tiny model on
one CPU process with the checks off, at their defaults (non-finite test, spike statistics, a replica
fingerprint every 10 steps, the straggler timer on every leaf module), without the straggler timer, with
a fingerprint every step, and telemetry's communication recorder (a dispatch mode) every 10th and every step,
alternating runs; the median step time of each and the ratio. Results and the command: docs/benchmarks.md.

    .venv/bin/python benchmarks/health_overhead.py [--steps 40] [--repeats 5]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cost_models.layout_codec import layout_from, parse_text  # noqa: E402
from planner.capture.model_capture import capture  # noqa: E402
from planner.capture.model_sources import resolve_model  # noqa: E402
from planner.capture.reference_model import build_model  # noqa: E402
from runtime import apply_plan  # noqa: E402
from runtime.health import HealthPolicy  # noqa: E402


def step_seconds(health: HealthPolicy | None, steps: int, batch: int, comm_every: int = 0) -> float:
    gc.collect()   # the previous run's model and monitors (reference cycles) would otherwise slow this one
    torch.manual_seed(0)
    cfg = resolve_model("tiny-llama")
    model = build_model(cfg, "cpu")
    graph = capture("tiny-llama", cfg.seq_length)
    layout = layout_from(parse_text("dp=1,tp=1,pp=1,cp=1,mbs=4"), global_batch=batch)
    parallel = apply_plan(model, graph, layout, "cpu", optimizer="adamw", lr=1e-3, precision="fp32", health=health)
    if comm_every:   # telemetry's exposed communication by kind (runtime/comm_telemetry.py)
        parallel.record_communication(comm_every)
    data = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length + 1))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        parallel.train_step(data[:, :-1], data[:, 1:])
        times.append(time.perf_counter() - start)
    # the mean past the first steps' allocations: the straggler timer and the communication recorder run on
    # one step in N, and what they cost is their share of every step, which a median would not see
    return statistics.mean(times[steps // 4:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    store = tempfile.mktemp(prefix="health-bench-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    step_seconds(None, args.steps, args.batch)   # warm-up: first-call costs belong to neither
    variants = {"without the checks": (None, 0),
                "at their defaults (fingerprint every 10 steps, straggler timer)": (HealthPolicy(), 0),
                "at their defaults less the straggler timer": (HealthPolicy(straggler_every=0), 0),
                "with a fingerprint every step": (HealthPolicy(sdc_every=1), 0),
                "checks off, telemetry's communication recorder every 10th step (its default)": (None, 10),
                "checks off, the communication recorder on every step": (None, 1)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.repeats):   # rotating which goes first
        names = list(variants)
        names = names[repeat % len(names):] + names[:repeat % len(names)]
        for name in names:
            health, comm_every = variants[name]
            times[name].append(step_seconds(health, args.steps, args.batch, comm_every))
    dist.destroy_process_group()
    base = statistics.median(times["without the checks"])
    print(f"tiny-llama, batch {args.batch}, 1 CPU thread, median of {args.repeats} runs of the mean of "
          f"{args.steps} steps:")
    for name, runs in times.items():
        value = statistics.median(runs)
        print(f"  {name}: {value * 1e3:.2f} ms per step ({value / base - 1:+.1%})")
    os.remove(store) if os.path.exists(store) else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
