"""The runtime's training driver: a model trained under a plan, or as the single-process reference.

    python -m runtime.train --model tiny-llama --steps 5                      # reference
    torchrun --nproc-per-node 8 -m runtime.train --model tiny-llama --layout dp=2,tp=2,pp=2 --steps 5
    torchrun --nproc-per-node 8 -m runtime.train --model tiny-llama --plan plan.yaml

Prints `step K loss X` from rank 0. Same seed and data on every layout, fp32 on CPU (gloo).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from datetime import timedelta
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
from .checkpointing import Cadence, Checkpointer
from .dims import PlanError
from .health import HealthPolicy, HealthStop, Rollback
from .laid_out import device_type_of
from .parallel_model import apply_plan
from .telemetry import TelemetryHeader, TelemetryWriter
from .train_args import BACKENDS, parse_args
from .watchdog import Watchdog, enable_flight_recorder


def init_distributed(device_type: str = "cpu", timeout_s: float = 300.0) -> None:
    if "RANK" in os.environ:
        enable_flight_recorder()   # each rank's last collectives, written when a peer is lost (watchdog)
        if device_type == "npu":
            import torch_npu  # noqa: F401  (registers the npu device and hccl)
        if device_type != "cpu":
            getattr(torch, device_type).set_device(int(os.environ.get("LOCAL_RANK", 0)))
        timeout = timedelta(seconds=timeout_s)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if restart == "0":
            dist.init_process_group(BACKENDS[device_type], timeout=timeout)
        else:   # after a torchrun restart: keys of this attempt only (a dead attempt's addresses stay behind)
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                  is_master=not agent_store and rank == 0, timeout=timeout)
            dist.init_process_group(BACKENDS[device_type], store=dist.PrefixStore(f"attempt-{restart}", store),
                                    rank=rank, world_size=world_size, timeout=timeout)
    else:  # the single-process reference runs the same code on a one-rank group
        store = tempfile.mktemp(prefix="planner-ref-")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


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


def scale_output_layer(parallel, graph, factor: float) -> None:
    """Multiply the output projection's weights in place (the spike fault); a power of two is exact."""
    if factor == 1:
        return
    with torch.no_grad():
        for module in parallel.modules:
            inner = module.module if hasattr(module, "module") else module
            present = dict(inner.named_modules())
            for name in graph.head_modules:
                if isinstance(present.get(name), torch.nn.Linear):
                    present[name].weight.mul_(factor)


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
            injection = faults.parse_injection(case_args.inject)
            skip_steps = {int(s) for s in str(case_args.skip_steps).split(",") if s.strip()}
        except ValueError as exc:
            print(f"error (rank {rank}): {prefix}{exc}", file=sys.stderr, flush=True)
            worst = 2
            continue
        # a case refused before its first step (exit 2 on every rank alike) leaves the group usable: the
        # next case runs, and the launch ends with the worst status
        worst = max(worst, train(case_args, rank, watchdog, injection, skip_steps, prefix=prefix))
        gc.collect()
        dist.barrier()  # no rank tears its group down (or starts the next case) while a peer still talks to it
    dist.destroy_process_group()
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
                                                       sdc_every=args.sdc_every,
                                                       straggler_every=args.straggler_every)
    try:
        if args.plan:  # the plan fixes the batch and sequence it was made for
            args.job_plan = plan_for_this_job(args)
            args.global_batch, args.seq_len = args.job_plan.layout.gbs, args.job_plan.seq_len
        cadence = checkpoint_cadence(args)
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
    except (PlanError, UserInputError, ValueError) as exc:  # a plan this model cannot run: say so on every rank
        print(f"error (rank {rank}): {prefix}{exc}", file=sys.stderr, flush=True)
        return 2
    if rank == 0:
        for note in parallel.notes:
            print(f"note: {note}", file=sys.stderr, flush=True)
    saver = Checkpointer(parallel, args.checkpoint_dir, cadence, args.async_save) if args.checkpoint_dir else None
    start = resume(args, parallel, saver, rank)
    if args.dump_grads:
        Path(args.dump_grads).mkdir(parents=True, exist_ok=True)

        def dump(pm):   # every step's gradients, before the optimizer uses them
            torch.save(pm.gradients(), Path(args.dump_grads) / f"step{pm.step}-rank{rank}.pt")
        parallel.on_gradients = dump
    faults.install(injection, parallel, rank)
    # a job that checkpoints into a directory trains steps 1..--steps as a whole, across its restarts
    last = args.last_step if args.last_step is not None else (
        args.steps if args.checkpoint_dir else start + args.steps - 1)
    telemetry = TelemetryWriter(args.telemetry, rank, telemetry_header(args, layout)) if args.telemetry else None
    if telemetry and args.telemetry_comm_every > 0:
        parallel.record_communication(args.telemetry_comm_every)
    code = run_steps(args, parallel, graph, saver, watchdog, injection, skip_steps, range(start, last + 1), prefix,
                     telemetry)
    if telemetry:
        telemetry.close()
    # drop the optimizer, FSDP and mesh state (and any collective work they hold) while the groups still
    # exist: a group freed at interpreter exit with gloo threads alive aborts the process (seen twice in
    # the runtime tests as 'terminate called without an active exception' after a clean run)
    del parallel, model, saver
    return code


def plan_for_this_job(args) -> Plan:
    """The plan file's plan, or, --elastic and on another number of ranks, that plan again for the ranks there
    are: rank 0 plans, every rank trains what it planned (one search, one answer)."""
    plan = Plan.load(args.plan)
    ranks = dist.get_world_size()
    if plan.num_devices == ranks:
        return plan
    if not args.elastic:
        raise PlanError(f"the plan is for {plan.num_devices} devices but the job has {ranks} "
                        f"rank{'s' if ranks != 1 else ''} (--elastic "
                        f"plans again for the ranks there are)")
    import json
    from planner.api import replan
    answer = [None]
    if dist.get_rank() == 0:
        try:
            answer = [{"plan": replan(plan, ranks, model=args.model).model_dump(mode="json")}]
        except (UserInputError, ValueError) as exc:   # every rank is told, none waits for a plan that never comes
            answer = [{"error": f"--elastic: no plan for {ranks} ranks: {exc}"}]
    dist.broadcast_object_list(answer, src=0)
    if "error" in answer[0]:
        raise PlanError(answer[0]["error"])
    new = Plan.model_validate(json.loads(json.dumps(answer[0]["plan"])))
    if dist.get_rank() == 0:
        print(f"note: {new.reasons[0]}", file=sys.stderr, flush=True)
    return new


def checkpoint_cadence(args) -> Cadence:
    """--save-every N, or auto (Daly's interval from the job's MTBF); refused before step 1 where it cannot run."""
    if args.on_spike == "rollback" and not (args.checkpoint_dir and args.save_every != "0"):
        raise ValueError("--on-spike rollback needs checkpoints to roll back to: --checkpoint-dir and --save-every")
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


def resume(args, parallel, saver, rank: int) -> int:
    """The first step to train: after the directory's last complete checkpoint (as after a torchrun restart),
    or after --checkpoint with --resume, else 1."""
    start = 1
    restored = saver.restore() if saver else None
    if restored is not None:
        start = restored + 1
        if rank == 0:
            print(f"resumed from {saver.latest().name} (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')})",
                  file=sys.stderr, flush=True)
    if args.resume:
        start = parallel.load(args.checkpoint).step + 1
        if args.drop_optimizer_state:
            parallel.forget_optimizer_state()
    return start


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


def run_steps(args, parallel, graph, saver, watchdog, injection, skip_steps, steps: range, prefix: str,
              telemetry=None) -> int:
    rank = dist.get_rank()
    pending = None
    step = steps.start
    while step < steps.stop:
        faults.stop_here(injection, step, rank)
        watchdog.reached(step)
        if step in skip_steps:   # this batch is not trained at all
            parallel.step += 1
            step += 1
            continue
        tokens, targets = batch(step, args, graph.vocab_size)
        scale = faults.spike_scale(injection, step)
        started = time.perf_counter()
        try:
            scale_output_layer(parallel, graph, scale)
            try:
                loss = parallel.train_step(tokens, targets)
            finally:
                scale_output_layer(parallel, graph, 1 / scale)
        except Rollback as spike:
            step = roll_back(args, parallel, saver, spike.step, skip_steps)
            continue
        except HealthStop as exc:
            print(f"error (rank {rank}): stopped by the health policy: {exc}", file=sys.stderr, flush=True)
            os._exit(4)
        except (RuntimeError, dist.DistError) as exc:   # a peer lost mid-collective, or this rank failed
            watchdog.fail(step, exc)
        step_s = time.perf_counter() - started
        if rank == 0:
            print(f"{prefix}step {step} loss {loss:.10f}", flush=True)
        if args.save_at == step and args.checkpoint:
            pending = parallel.save(args.checkpoint, step, asynchronous=args.async_save)
        blocking = saver.after_step(step, step_s) if saver else 0.0
        if telemetry:
            telemetry.write(step, parallel.timing, blocking)
        step += 1
    if pending is not None:
        pending.result()   # the asynchronous write finishes before the job ends
    if saver:
        saver.finish()
    return 0


def roll_back(args, parallel, saver, spike_step: int, skip_steps: set[int]) -> int:
    """Reload the last complete checkpoint, skip the batches that end at the spike; the step to go on from."""
    back = saver.restore()
    if back is None:   # nothing to roll back to yet: the batch is skipped instead, and that is said
        parallel.health.say(f"health: step {spike_step}: no complete checkpoint to roll back to; batch "
                            f"{spike_step} skipped instead")
        skip_steps.add(spike_step)
        return spike_step + 1
    skipped = list(range(max(back + 1, spike_step - args.rollback_skip + 1), spike_step + 1))
    skip_steps.update(skipped)
    parallel.health.forget_after(back)
    parallel.health.say(f"health: step {spike_step}: rolled back to step {back} (its checkpoint); batch"
                        f"{'es' if len(skipped) > 1 else ''} {', '.join(map(str, skipped))} skipped")
    return back + 1


if __name__ == "__main__":
    sys.exit(main())
