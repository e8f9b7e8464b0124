"""The runtime's training driver: a model trained under a plan, or as the single-process reference, by the
Trainer (runtime/trainer.py) with the flags' settings.

    python -m runtime.train --model tiny-llama --steps 5                      # reference
    torchrun --nproc-per-node 8 -m runtime.train --model tiny-llama --layout dp=2,tp=2,pp=2 --steps 5
    torchrun --nproc-per-node 8 -m runtime.train --model tiny-llama --plan plan.yaml

Prints `step K loss X` from rank 0. Same seed and data on every layout, fp32 on CPU (gloo).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from cost_models.layout import Layout
from cost_models.layout_codec import layout_from, parse_text, text_of
from hardware_profiles.errors import UserInputError
from hardware_profiles.loader import load_stack
from hardware_profiles.stack import RUNTIME_STACK
from planner.graph_capture.model_capture import capture
from planner.graph_capture.model_sources import ModelConfig, resolve_model
from planner.plans import Plan
from planner.graph_capture.reference_model import build_model
from . import faults
from .checkpointing import Cadence
from .dims import PlanError
from .elastic import plan_for_ranks
from .health import HealthPolicy
from .laid_out import device_type_of
from .parallel_model import apply_plan
from .telemetry import TelemetryHeader
from .process_group import end_distributed, init_distributed, settle
from .train_args import parse_args
from .trainer import STOPPED, Trainer, TrainerConfig
from .watchdog import Watchdog


def build(spec: str, seq_len: int, seed: int):
    source = resolve_model(spec)
    torch.manual_seed(seed)
    if isinstance(source, ModelConfig):
        # this script trains the reference decoder (a config.json included): capture what it trains
        source = source.model_copy(update={"hf_config": None})
        cfg = source if seq_len <= source.seq_length else source.model_copy(update={"seq_length": seq_len})
        model = build_model(cfg, "cpu", torch.float32)
        return model, capture(source, seq_len)
    return source.factory().float(), capture(spec, seq_len)


def run_layout(args, graph) -> Layout:
    if args.plan:
        return args.job_plan.to_layout()
    values = parse_text(args.layout, "--layout")
    if "dp" not in values:   # the data-parallel degree fills the ranks the other degrees leave
        others = values.get("tp", 1) * values.get("pp", 1) * values.get("cp", 1)
        values["dp"] = max(1, dist.get_world_size() // others)
    if "zero" not in values:   # the layout's default stage where this runtime runs it, else the lowest it runs
        dualpipev = str(values.get("schedule")) == "dualpipev"
        stages = load_stack(RUNTIME_STACK).zero_stages_for(values["dp"] * values.get("cp", 1), values.get("tp", 1),
                                                           values.get("ep", 1), dualpipev)
        if Layout.zero not in stages:
            values["zero"] = min(stages)
            if dist.get_rank() == 0:
                where = "under DualPipeV" if dualpipev else "beside tensor or expert parallelism"
                print(f"note: --layout states no zero: ZeRO-{values['zero']}, the lowest this runtime runs with "
                      f"dp={values['dp']}, cp={values.get('cp', 1)} {where}", file=sys.stderr, flush=True)
    return layout_from(values, global_batch=args.global_batch)


def run_precision(args, layout: Layout) -> str:
    """What to train in: --precision if given, else the plan's; a --layout without precision= is a numerical
    check and runs in fp32."""
    if args.precision:
        return args.precision
    if args.plan or "precision=" in args.layout:
        return str(layout.precision)
    return "fp32"


def batch(step: int, args, vocab: int):
    generator = torch.Generator().manual_seed(args.seed * 100003 + step)
    data = torch.randint(0, vocab, (args.global_batch, args.seq_len + 1), generator=generator)
    return data[:, :-1], data[:, 1:]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device_type is None:
        args.device_type = device_type_of(Plan.load(args.plan)) if args.plan else "cpu"
    init_distributed(args.device_type, args.collective_timeout)
    rank = dist.get_rank()
    watchdog = Watchdog(args.collective_timeout, args.flight_record_dir or args.checkpoint_dir)
    watchdog.report_on_termination()
    worst = 0
    for case, case_args in cases_of(args):
        prefix = f"case {case} " if case else ""
        if case and rank == 0:   # rank 0's lines (losses, health) after it are this case's
            print(f"begin case {case}", flush=True)
        try:
            injection = faults.parse_injection(case_args.inject, case_args.sdc_error, case_args.sdc_phase)
            skip_steps = {int(s) for s in str(case_args.skip_steps).split(",") if s.strip()}
        except ValueError as exc:
            print(f"error (rank {rank}): {prefix}{exc}", file=sys.stderr, flush=True)
            worst = 2
            continue
        # a case refused before its first step (exit 2 on every rank alike) leaves the group usable: the
        # next case runs, and the launch ends with the worst status
        worst = max(worst, train(case_args, rank, watchdog, injection, skip_steps, prefix=prefix))
        settle()   # no rank starts the next case while a peer still talks to this one's groups
    end_distributed()
    return worst


def cases_of(args):
    """(name, arguments) per training run: the one the flags describe, or each entry of --cases, whose keys
    (other than name) set the flags of that run by their argparse names (model, layout, steps, inject...)."""
    if not args.cases:
        yield "", args
        return
    import json
    for entry in json.loads(Path(args.cases).read_text()):
        unknown = sorted(set(entry) - set(vars(args)) - {"name"})
        if unknown:
            print(f"error: --cases {args.cases}: case {entry.get('name')!r} sets unknown flags "
                  f"{', '.join(unknown)} (expected the argparse names of this script's flags)", file=sys.stderr)
            raise SystemExit(2)
        dump = str(Path(args.dump_grads) / entry["name"]) if args.dump_grads else None
        settings = {key: value for key, value in entry.items() if key != "name"}
        yield entry["name"], argparse.Namespace(**{**vars(args), "layout": "", **settings, "dump_grads": dump})


def train(args, rank: int, watchdog: Watchdog, injection, skip_steps: set[int], prefix: str = "") -> int:
    health = None if args.no_health else HealthPolicy(on_nonfinite=args.on_nonfinite, on_spike=args.on_spike,
                                                       sdc_every=args.sdc_every, gemm_every=args.gemm_every,
                                                       on_sdc=args.on_sdc,
                                                       optimizer_every=args.optimizer_check_every,
                                                       optimizer_samples=args.optimizer_check_samples,
                                                       straggler_every=args.straggler_every)
    try:
        if args.plan:  # the plan fixes the batch and sequence it was made for
            args.job_plan = plan_for_ranks(Plan.load(args.plan), args.model, args.elastic)
            args.global_batch, args.seq_len = args.job_plan.layout.gbs, args.job_plan.seq_len
        cadence = checkpoint_cadence(args)
        if health is not None:
            health = replace(health, **check_cadences(args))
        model, graph = build(args.model, args.seq_len, args.seed)
        layout = run_layout(args, graph)
        if not args.plan and layout.global_batch % (layout.dp * layout.micro_batch):
            raise PlanError(f"global batch {layout.global_batch} is not a multiple of dp*mbs")
        precision = run_precision(args, layout)
        if args.plan and precision != str(layout.precision) and rank == 0:
            print(f"note: training in {precision} (--precision), not the plan's {layout.precision}",
                  file=sys.stderr, flush=True)
        parallel = apply_plan(model, graph, layout, args.device_type, optimizer=args.optimizer, lr=args.lr,
                              max_grad_norm=args.max_grad_norm, precision=precision, health=health)
        config = TrainerConfig(
            steps=args.steps, last_step=args.last_step, checkpoint_dir=args.checkpoint_dir, cadence=cadence,
            async_save=args.async_save, rollback_skip=args.rollback_skip, skip_steps=frozenset(skip_steps),
            save_at=args.save_at, save_to=args.checkpoint, resume_from=args.checkpoint if args.resume else None,
            drop_optimizer_state=args.drop_optimizer_state, injection=injection, telemetry_dir=args.telemetry,
            telemetry_comm_every=args.telemetry_comm_every, log_prefix=prefix)
        trainer = Trainer(parallel, lambda step: batch(step, args, graph.vocab_size), config, watchdog,
                          telemetry_header(args, layout) if args.telemetry else None)
    except (PlanError, UserInputError, ValueError) as exc:  # a plan this model cannot run: say so on every rank
        print(f"error (rank {rank}): {prefix}{exc}", file=sys.stderr, flush=True)
        return 2
    if rank == 0:
        for note in parallel.notes:
            print(f"note: {note}", file=sys.stderr, flush=True)
    if args.dump_grads:
        Path(args.dump_grads).mkdir(parents=True, exist_ok=True)

        def dump(pm):   # every step's gradients, before the optimizer uses them
            torch.save(pm.gradients(), Path(args.dump_grads) / f"step{pm.step}-rank{rank}.pt")
        parallel.on_gradients = dump
    code = trainer.fit()
    if code == STOPPED:
        os._exit(STOPPED)   # the policy stopped the job on every rank: the launch ends here
    # drop the optimizer, FSDP and mesh state (and any collective work they hold) while the groups still
    # exist: a group freed at interpreter exit with gloo threads alive aborts the process (seen twice in
    # the runtime tests as 'terminate called without an active exception' after a clean run)
    del trainer, parallel, model
    return code


def checkpoint_cadence(args) -> Cadence:
    """--save-every N, or auto (Daly's interval from the job's MTBF); refused before step 1 where it cannot run."""
    if args.save_every != "auto":
        if not args.save_every.isdigit():
            raise ValueError(f"--save-every {args.save_every}: expected a whole number of steps or auto")
        return Cadence(int(args.save_every))
    if args.mtbf_s is not None:
        return Cadence(None, args.mtbf_s)
    if not args.plan:
        raise ValueError("--save-every auto needs the job's MTBF: --mtbf-s, or a --plan whose cluster profile "
                         "gives the failure rate")
    from cost_models.reliability import job_mtbf_s
    from planner.job import plan_cluster
    return Cadence(None, job_mtbf_s(plan_cluster(args.job_plan), dist.get_world_size()))


def check_cadences(args) -> dict:
    """--gemm-every and --optimizer-check-every, each N or auto: the cadence the plan's goodput model chooses
    (rank 0 works it out, every rank takes its answer); HealthPolicy's fields."""
    given = {"gemm_every": args.gemm_every, "optimizer_every": args.optimizer_check_every}
    auto = [key for key, value in given.items() if value == "auto"]
    if not auto:
        return given
    if not args.plan:
        flag = "--gemm-every" if "gemm_every" in auto else "--optimizer-check-every"
        raise ValueError(f"{flag} auto needs a --plan: its step time, its cluster's failure rate and what the "
                         "check costs give the cadence")
    answer = [None]
    if dist.get_rank() == 0:
        from planner.api import check_cadence
        chosen = check_cadence(args.job_plan, model=args.model)
        answer = [{"gemm_every": chosen.products_every_steps, "optimizer_every": chosen.optimizer_every_steps}]
        what = {"gemm_every": "matrix products checked", "optimizer_every": "optimizer updates sampled"}
        for key in auto:
            print(f"note: {what[key]} every {answer[0][key]} steps, the cadence the plan's goodput model chooses "
                  "(0: never)", file=sys.stderr, flush=True)
    dist.broadcast_object_list(answer, src=0)
    return {key: answer[0][key] if key in auto else value for key, value in given.items()}


def telemetry_header(args, layout) -> TelemetryHeader:
    """What the job runs and what its plan predicted (nothing predicted for a bare --layout)."""
    if not args.plan:
        return TelemetryHeader(args.model, "", "", dist.get_world_size(), text_of(layout), None, {})
    from planner.job import plan_device
    plan = args.job_plan
    return TelemetryHeader(plan.model, plan.cluster, plan_device(plan), plan.num_devices, text_of(layout),
                           plan.step_time_s, dict(plan.breakdown), plan.model_dump(mode="json"),
                           model_source(args.model))


def model_source(spec: str) -> str:
    """The model as another process can find it again: a file (or file.py:factory) by its absolute path."""
    path, colon, factory = spec.partition(":")
    return str(Path(path).resolve()) + colon + factory if Path(path).is_file() else spec


if __name__ == "__main__":
    sys.exit(main())
