"""What the in-step health checks cost (runtime/health.py, runtime/stragglers.py) on the tiny model: the same training
step with the checks off, at their defaults (non-finite test, spike statistics, a replica fingerprint every 10
steps, the straggler timer and its comparison every 10 steps, every matrix product checked by its checksums every
1000 steps, 16 elements of each tensor of a ZeRO-1 shard's update recomputed by another rank every 1000 steps),
without the product check, without the optimizer check, with the product check on every step (its cost is inside
the step, seen end to end only), without the straggler timer, with a fingerprint every step, and telemetry's
communication recorder (a dispatch mode) every 10th and every step. Results and the command: docs/benchmarks.md.

Every variant is its own model, built once; the steps are interleaved (step i of every variant, in an
order that rotates, before step i+1 of any), so that the machine's drift over minutes falls on every
variant alike. Two measures: the monitors' own time (every monitor method and the straggler timer's hooks
timed where they run, summed per step), and the end-to-end mean step against the unchecked variant's, with
the standard error of that difference (two ranks on a shared CPU vary by several ms a step, which the
first measure does not see and the second does). Means over the steps after the first quarter: the
fingerprint, the straggler timer and the recorder run on one step in N, and what they cost is their share
of every step, which a median of steps would not see. Run it on two ranks (data-parallel replicas,
ZeRO-1): on a world of one there are no replicas to fingerprint and no peers to compare, and those checks
do not run.

    .venv/bin/torchrun --nproc-per-node 2 benchmarks/health_overhead.py [--steps 200] [--batch 16]
    .venv/bin/python benchmarks/health_overhead.py [--steps 200]    # one process: less noise, fewer checks
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cost_models.layout_codec import layout_from, parse_text  # noqa: E402
from planner.graph_capture.model_capture import capture  # noqa: E402
from planner.graph_capture.model_sources import resolve_model  # noqa: E402
from planner.graph_capture.reference_model import build_model  # noqa: E402
from runtime import apply_plan  # noqa: E402
from runtime.health import HealthMonitor, HealthPolicy  # noqa: E402
from runtime.optimizer_check import OptimizerCheck  # noqa: E402
from runtime.stragglers import ComputeTimer, StragglerMonitor  # noqa: E402

TIMED = ((HealthMonitor, ("nonfinite_flag", "accept", "check_replicas", "settle", "products_right", "updates_right")),
         (OptimizerCheck, ("_take", "_verify")),
         (StragglerMonitor, ("before_step", "after_step")), (ComputeTimer, ("_start", "_stop")))


class MonitorClock:
    """Seconds spent inside the monitors' methods, and of those inside their all-gathers (the only
    all-gathers of a ZeRO-1 step), summed until read: the methods wrapped, class-wide."""

    def __init__(self):
        self.seconds = self.gathering = 0.0
        for cls, names in TIMED:
            for name in names:
                setattr(cls, name, self._timed(getattr(cls, name), "seconds"))
        dist.all_gather = self._timed(dist.all_gather, "gathering")

    def _timed(self, method, total: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                setattr(self, total, getattr(self, total) + time.perf_counter() - start)
        return timed

    def read(self) -> tuple[float, float]:
        seconds, gathering = self.seconds, self.gathering
        self.seconds = self.gathering = 0.0
        return seconds, gathering


@dataclass(frozen=True)
class Variant:
    name: str
    health: HealthPolicy | None
    comm_every: int = 0   # telemetry's exposed communication by kind (runtime/comm_telemetry.py)


VARIANTS = (Variant("checks off", None),
            Variant("checks at their defaults (non-finite test, spike statistics, fingerprint and straggler "
                    "comparison every 10 steps, matrix products checked every 1000, a ZeRO-1 update sample "
                    "recomputed by another rank every 1000)", HealthPolicy()),
            Variant("defaults less the product check", HealthPolicy(gemm_every=0)),
            Variant("defaults less the optimizer check", HealthPolicy(optimizer_every=0)),
            Variant("matrix products checked every step", HealthPolicy(gemm_every=1)),
            Variant("defaults less the straggler timer", HealthPolicy(straggler_every=0)),
            Variant("fingerprint every step", HealthPolicy(sdc_every=1)),
            Variant("checks off, communication recorder every 10th step (telemetry's default)", None, 10),
            Variant("checks off, communication recorder on every step", None, 1))


def build(variant: Variant, batch: int):
    torch.manual_seed(0)
    cfg = resolve_model("tiny-llama")
    graph = capture("tiny-llama", cfg.seq_length)
    dp = dist.get_world_size()
    layout = layout_from(parse_text(f"dp={dp},tp=1,pp=1,cp=1,mbs={batch // dp},zero=1"), global_batch=batch)
    parallel = apply_plan(build_model(cfg, "cpu"), graph, layout, "cpu", optimizer="adamw", lr=1e-4,
                          precision="fp32", health=variant.health)
    if variant.comm_every:
        parallel.record_communication(variant.comm_every)
    parallel.deferred_checks = True   # as the driver's Trainer runs it (settled after the last step)
    return parallel


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if "RANK" in os.environ:   # under torchrun
        dist.init_process_group("gloo")
    else:                       # one process: the non-finite test and the spike statistics only
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='health-bench-')}",
                                rank=0, world_size=1)
    models = [build(variant, args.batch) for variant in VARIANTS]
    cfg = resolve_model("tiny-llama")
    generator = torch.Generator().manual_seed(1)
    data = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_length + 1), generator=generator)
    times: list[list[float]] = [[] for _ in VARIANTS]
    inside: list[list[float]] = [[] for _ in VARIANTS]   # seconds in the monitors' own code, per step
    waits: list[list[float]] = [[] for _ in VARIANTS]    # of which in their all-gathers
    clock = MonitorClock()
    gc.collect()
    for step in range(args.steps):
        order = list(range(len(VARIANTS)))
        order = order[step % len(order):] + order[:step % len(order)]
        for index in order:
            dist.barrier()   # every variant's step starts with the ranks together
            clock.read()
            start = time.perf_counter()
            models[index].train_step(data[:, :-1], data[:, 1:])
            times[index].append(time.perf_counter() - start)
            own, gathering = clock.read()
            inside[index].append(own)
            waits[index].append(gathering)
    for model in models:
        model.settle()
    kept = slice(args.steps // 4, None)
    base = statistics.mean(times[0][kept])
    if dist.get_rank() == 0:
        print(f"tiny-llama, batch {args.batch}, {dist.get_world_size()} gloo rank(s) of 1 CPU thread, dp, ZeRO-1; "
              f"mean of steps {args.steps // 4 + 1}-{args.steps}, variants interleaved step by step (rank 0); "
              f"checks off: {base * 1e3:.2f} ms per step")
        for variant, runs, own, gathers in zip(VARIANTS[1:], times[1:], inside[1:], waits[1:]):
            extra = [a - b for a, b in zip(runs[kept], times[0][kept])]   # same step index, same data
            error = statistics.stdev(extra) / len(extra) ** 0.5
            monitors, gathering = statistics.mean(own[kept]), statistics.mean(gathers[kept])
            print(f"  {variant.name}: monitors' own time {monitors * 1e3:.3f} ms per step "
                  f"({monitors / base:.2%} of the step; in their all-gathers {gathering / base:.2%}); "
                  f"end to end {statistics.mean(runs[kept]) * 1e3:.2f} ms "
                  f"({statistics.mean(extra) / base:+.1%} +- {error / base:.1%})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
