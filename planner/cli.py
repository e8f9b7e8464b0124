"""`planner`: the command line, a thin layer over the Python API (typer + rich)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import Progress, TextColumn

from cost_models.layout_codec import parse_text
from hardware_profiles.errors import UserInputError

from . import api, exports, views
from . import __version__ as planner_version_text
from .cli_catalog import models_app, profiles_app, stacks_app
from .cli_errors import error_kinds, usage_error
from .cli_options import (HELP, BatchOpt, ClusterOpt, DeviceOpt, DevicesOpt, DispatcherOpt, ImbalanceOpt, JsonOpt,
                          LeafOpt, ModelOpt, MoeOverlapOpt, OverlapOpt, PerNodeOpt, SegmentOpt, SeqOpt, StackOpt,
                          StrictOpt, flagged_stack as _stack, leaf_names as _leaves)
from .entry import INTERRUPTED, recorded_interrupts
from .goodput_report import goodput_summary, parse_recovery, plan_goodput
from .job import Job, job_of, plan_cluster
from .output_paths import check_plan_file, check_report_dir
from .plans import Plan
from .capacity import ClusterArguments, parse_sweep, parse_tokens, whatif_job, write_report

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, context_settings=HELP,
                  help="Plan, evaluate and export parallel layouts for LLM training.\n\n"
                       "Examples:\n\n"
                       "  planner plan --model llama3-70b --cluster dgx-h100 --num-devices 1024 --global-batch 1024\n\n"
                       "  planner evaluate --model gpt3-175b --cluster dgx-a100 --global-batch 1536 "
                       "--layout tp=8,pp=16,dp=8\n\n"
                       "  planner whatif --model llama3-70b --device h100-sxm --sweep num-devices=512,1024,2048 "
                       "--global-batch 1024 --tokens 15T --out report/\n\n"
                       "  planner export plan.yaml --to megatron")
app.add_typer(profiles_app, name="profiles")
app.add_typer(models_app, name="models")
app.add_typer(stacks_app, name="stacks")
out = Console()
err = Console(stderr=True)


def _show_version(value: bool) -> None:
    if value:
        out.print(f"parallel-planner {planner_version_text}", highlight=False)
        raise typer.Exit()


@app.callback()
def _main_options(version: bool = typer.Option(False, "--version", is_eager=True, callback=_show_version,
                                               help="print the version and exit")) -> None:
    """Plan, evaluate and export parallel layouts for LLM training."""

class SearchProgress:
    """The search's progress on stderr: one live line on a terminal, a plain line every PIPED_EVERY_S in a
    pipe; a Ctrl-C some library swallowed ends the search at the next report."""
    PIPED_EVERY_S = 5.0

    def __init__(self, deadline: float):
        self.deadline, self.last_line = deadline, time.perf_counter()
        self.interrupts = recorded_interrupts()
        self.live = Progress(TextColumn("{task.description}"), console=err, transient=True,
                             disable=not err.is_terminal)
        self.task = self.live.add_task("searching layouts", total=None)

    def __enter__(self):
        self.live.__enter__()
        return self

    def __exit__(self, *exc):
        return self.live.__exit__(*exc)

    def __call__(self, done) -> None:
        if self.interrupts is not None:
            self.interrupts.raise_if_seen()
        now = time.perf_counter()
        rate = f", about {done.elapsed_s * done.open / done.settled:,.0f} s more at this rate" if done.settled else ""
        text = (f"searching: {done.settled:,} of {done.candidates:,} candidate layouts settled "
                f"({done.pruned_memory:,} too big, {done.pruned_bound:,} bounded away, {done.solved:,} solved), "
                f"{done.open:,} open{rate}; {max(self.deadline - now, 0):.0f} s to --time-limit")
        if err.is_terminal:
            self.live.update(self.task, description=text)
        elif now - self.last_line >= self.PIPED_EVERY_S:
            err.print(text, markup=False, highlight=False)
            self.last_line = now


def _emit(result: Plan, as_json: bool, top_goodput: dict | None = None) -> None:
    if as_json:
        out.print_json(json.dumps(result.report(top_goodput)))
    else:
        views.show_plan(out, result, top_goodput)


@app.command()
def plan(model: str = ModelOpt, cluster: Optional[str] = ClusterOpt, device: Optional[str] = DeviceOpt,
         num_devices: Optional[int] = DevicesOpt, devices_per_node: Optional[int] = PerNodeOpt,
         segment_devices: Optional[int] = SegmentOpt, global_batch: int = BatchOpt, seq_len: Optional[int] = SeqOpt,
         precision: Optional[str] = typer.Option(None, "--precision", help="bf16 (default) or fp8"),
         fix: str = typer.Option("", "--fix", help="pin layout fields, e.g. tp=8,pp=16,recompute=none"),
         top: int = typer.Option(3, "--top", help="alternatives to report"),
         time_limit: float = typer.Option(60.0, "--time-limit", help="seconds the command may take from its start, capture included: the best plan found by then, said time-limited"),
         objective: str = typer.Option("step-time", "--objective", help="step-time or goodput"),
         recovery: str = typer.Option("", "--recovery", help="with --objective goodput: how the job recovers, e.g. "
                                      "timeout=300,spares=no,elastic=yes,sdc_every=10,spikes_per_day=1"),
         out_path: Optional[str] = typer.Option(None, "--out", help="write the plan to a .yaml or .json file"),
         as_json: bool = JsonOpt,
         stack: Optional[str] = StackOpt, tp_comm_overlap: bool = OverlapOpt, moe_a2a_overlap: bool = MoeOverlapOpt,
         moe_dispatcher: Optional[str] = DispatcherOpt, ep_imbalance: float = ImbalanceOpt,
         leaf_modules: str = LeafOpt, strict_capture: bool = StrictOpt) -> None:
    """Search the fastest layout that fits, with its prediction and why."""
    if objective not in ("step-time", "goodput"):
        raise UserInputError(f"'{objective}'", field="--objective", expected="step-time or goodput")
    if recovery and objective != "goodput":
        raise UserInputError(f"'{recovery}' is read only with --objective goodput", field="--recovery",
                             expected="--objective goodput beside it, or no --recovery")
    if top < 0:
        raise UserInputError(f"{top}", field="--top", expected="0 or more alternatives to report")
    if out_path is not None:
        out_path = check_plan_file(out_path)
    recovery_settings = parse_recovery(recovery)
    api.check_time_limit(time_limit)
    deadline = time.perf_counter() + time_limit   # the whole command: capture included
    job = _job(model, cluster, device, num_devices, devices_per_node, segment_devices, global_batch, seq_len,
               precision, api.pin_values(parse_text(fix, "--fix")), stack, tp_comm_overlap, moe_a2a_overlap,
               moe_dispatcher, ep_imbalance, leaf_modules, strict_capture)
    with SearchProgress(deadline) as progress:
        result = api.plan_job(job, time_limit, top + 1, progress, deadline=deadline)
    extra = _goodput_summary(result, job, recovery_settings) if objective == "goodput" else None
    if out_path:
        result.save(out_path)
    _emit(result, as_json, extra)
    if out_path and not as_json:
        out.print(f"plan written to {out_path}")


def _job(model, cluster, device, num_devices, devices_per_node, segment_devices, global_batch, seq_len, precision,
         layout_values, stack, tp_comm_overlap, moe_a2a_overlap, moe_dispatcher, ep_imbalance, leaf_modules="",
         strict_capture=False) -> Job:
    """The job the options state, built once for plan, evaluate and whatif."""
    return job_of(model, cluster, global_batch=global_batch, seq_len=seq_len, precision=precision, device=device,
                  num_devices=num_devices, devices_per_node=devices_per_node, segment_devices=segment_devices,
                  stack=_stack(stack, tp_comm_overlap, moe_a2a_overlap, moe_dispatcher), ep_imbalance=ep_imbalance,
                  leaf_modules=_leaves(leaf_modules), strict_capture=strict_capture, layout_values=layout_values)


def _goodput_summary(result: Plan, job: Job, recovery) -> dict:
    """Goodput on the cluster the plan names (its profile, device count and segments)."""
    return goodput_summary(plan_goodput(result, plan_cluster(result), job.graph.total_params, recovery, job))


@app.command()
def evaluate(model: str = ModelOpt, cluster: Optional[str] = ClusterOpt, device: Optional[str] = DeviceOpt,
             num_devices: Optional[int] = DevicesOpt, devices_per_node: Optional[int] = PerNodeOpt,
             segment_devices: Optional[int] = SegmentOpt, global_batch: int = BatchOpt, seq_len: Optional[int] = SeqOpt,
             layout: str = typer.Option(..., "--layout", help="e.g. tp=8,pp=16,dp=64,cp=1,ep=1,vp=1,mbs=1,zero=1,"
                                        "recompute=selective; fields left out are searched"),
             precision: Optional[str] = typer.Option(None, "--precision", help="bf16 (default) or fp8"),
             time_limit: float = typer.Option(60.0, "--time-limit"),
             as_json: bool = JsonOpt, leaf_modules: str = LeafOpt,
             out_path: Optional[str] = typer.Option(None, "--out", help="write the prediction as a plan file "
                                                     "(.yaml or .json) that export and Plan.load read"),
             stack: Optional[str] = StackOpt, tp_comm_overlap: bool = OverlapOpt,
             moe_a2a_overlap: bool = MoeOverlapOpt,
         moe_dispatcher: Optional[str] = DispatcherOpt, ep_imbalance: float = ImbalanceOpt,
         strict_capture: bool = StrictOpt) -> None:
    """Predict a layout you give (and explain it if it does not fit or divide)."""
    if out_path is not None:
        out_path = check_plan_file(out_path)
    api.check_time_limit(time_limit)
    deadline = time.perf_counter() + time_limit
    values = api.layout_values(layout)
    job = _job(model, cluster, device, num_devices, devices_per_node, segment_devices, global_batch, seq_len,
               precision, values, stack, tp_comm_overlap, moe_a2a_overlap, moe_dispatcher, ep_imbalance,
               leaf_modules, strict_capture)
    result = api.evaluate_job(job, values, time_limit, deadline)
    if out_path:
        result.save(out_path)
    _emit(result, as_json)
    if out_path and not as_json:
        out.print(f"plan written to {out_path}")


@app.command(name="whatif")
def whatif_command(model: str = ModelOpt, sweep: str = typer.Option(..., "--sweep", help="KEY=V1,V2,... with KEY one of "
                   "num-devices, device, inter-node-bandwidth-gbps, seq-len, global-batch"),
                   cluster: Optional[str] = ClusterOpt, device: Optional[str] = DeviceOpt,
                   num_devices: Optional[int] = DevicesOpt, devices_per_node: Optional[int] = PerNodeOpt,
                   segment_devices: Optional[int] = SegmentOpt, global_batch: int = BatchOpt,
                   seq_len: Optional[int] = SeqOpt,
                   tokens: str = typer.Option("1T", "--tokens", help="token budget, e.g. 15T"),
                   time_limit: float = typer.Option(30.0, "--time-limit", help="search limit per point"),
                   out_dir: Optional[str] = typer.Option(None, "--out", help="directory for whatif.png and whatif.html"),
                   as_json: bool = JsonOpt, stack: Optional[str] = StackOpt,
                   tp_comm_overlap: bool = OverlapOpt, moe_a2a_overlap: bool = MoeOverlapOpt,
         moe_dispatcher: Optional[str] = DispatcherOpt, ep_imbalance: float = ImbalanceOpt) -> None:
    """Best plan, time to train, device-hours and goodput at each point of a sweep."""
    if out_dir is not None:
        out_dir = check_report_dir(out_dir)
    if device is None and cluster is None:
        if not sweep.startswith("device="):
            raise UserInputError("no cluster given", field="--cluster", expected="--cluster or --device")
    if sweep.startswith("device=") and num_devices is None:
        raise UserInputError("a device sweep needs --num-devices", field="--num-devices", expected="a device count")
    key, points = parse_sweep(sweep)
    budget = parse_tokens(tokens)
    api.check_time_limit(time_limit)
    where = ClusterArguments(cluster, device or ("h100-sxm" if cluster is None else None), num_devices,
                             devices_per_node, segment_devices)
    job = _job(model, where.at(key, points[0]), None, None, None, None, global_batch, seq_len, None, {}, stack,
               tp_comm_overlap, moe_a2a_overlap, moe_dispatcher, ep_imbalance)
    report = whatif_job(job, key, points, budget, where, time_limit)
    if as_json:
        out.print_json(json.dumps({"model": report.model, "sweep": report.sweep_key, "tokens": report.tokens,
                                   "rows": [row.__dict__ for row in report.rows]}))
    else:
        views.show_whatif(out, report)
    if out_dir:
        png, page = write_report(report, out_dir)
        if not as_json:
            out.print(f"wrote {png} and {page}")


@app.command()
def replan(plan_file: Path = typer.Argument(..., help="a plan written by 'planner plan --out'"),
           num_devices: int = typer.Option(..., "--num-devices", help="the devices the job has now"),
           model: Optional[str] = typer.Option(None, "--model", help="the model, where the plan's name is not a "
                                               "built-in"),
           time_limit: float = typer.Option(60.0, "--time-limit"),
           out_path: Optional[str] = typer.Option(None, "--out", help="write the new plan (.yaml or .json)"),
           as_json: bool = JsonOpt) -> None:
    """The plan again for another device count (a node lost): same model, batch, precision and stack; the
    runtime resumes the old plan's checkpoint under the new layout."""
    if out_path is not None:
        out_path = check_plan_file(out_path)
    result = api.replan(Plan.load(plan_file), num_devices, model=model, time_limit_s=time_limit)
    if out_path:
        result.save(out_path)
    _emit(result, as_json)
    if out_path and not as_json:
        out.print(f"plan written to {out_path}")


@app.command()
def calibrate(telemetry: str = typer.Option(..., "--telemetry", help="a directory written by "
                                            "'python -m runtime.train --telemetry DIR' (rank-R.jsonl files)"),
              out_path: Optional[str] = typer.Option(None, "--out", help="write the device profile with the "
                                                     "refitted efficiencies to this YAML file"),
              warmup_steps: int = typer.Option(2, "--warmup-steps", help="first steps left out of the medians"),
              model: Optional[str] = typer.Option(None, "--model", help="the model the job trained, where the "
                                                  "telemetry names a Python file (imported only when given here)"),
              as_json: bool = JsonOpt) -> None:
    """Measured step parts against the plan's prediction, and the device's efficiencies refitted from them."""
    from .calibration import calibrate as calibrate_telemetry, write_device_profile
    if warmup_steps < 0:
        raise UserInputError(f"{warmup_steps}", field="--warmup-steps", expected="0 or more")
    if out_path is not None:
        check_plan_file(out_path)   # before any work: not a link, FIFO or directory
    result = calibrate_telemetry(telemetry, warmup_steps, model)
    if as_json:
        out.print_json(json.dumps({"parts": [vars(p) for p in result.parts], "refits": [vars(r) for r in result.refits],
                                   "steps_used": list(result.steps_used), "ranks": result.ranks,
                                   "notes": list(result.notes)}))
    else:
        views.show_calibration(out, result)
    if out_path:
        written = write_device_profile(result, out_path)
        if not as_json:
            out.print(f"device profile written to {written}")


@app.command()
def export(plan_file: Path = typer.Argument(..., help="a plan written by 'planner plan --out'"),
           to: str = typer.Option(..., "--to", help="megatron, torchtitan, deepspeed, torchrun or sbatch, "
                                  "optionally @RELEASE (megatron-core 0.16, torchtitan 0.3, deepspeed 0.18, torch "
                                  "2.13)"),
           as_json: bool = JsonOpt) -> None:
    """Translate a plan for Megatron-LM, torchtitan, DeepSpeed, or a launcher line (torchrun, sbatch) for our
    runtime."""
    done = exports.export(Plan.load(plan_file), to, str(plan_file))
    if as_json:
        out.print_json(json.dumps({"target": done.target, "release": done.release, "text": done.text,
                                   "notes": list(done.notes)}))
        return
    err.print(f"note: written for {done.target} {done.release}")
    sys.stdout.write(done.text + "\n")
    for note in done.notes:
        err.print(f"note: {note}")


def main() -> None:
    as_json = "--json" in sys.argv[1:]
    try:
        code = app(standalone_mode=False)
    except KeyboardInterrupt:
        code = INTERRUPTED
    except typer.Abort:
        code = INTERRUPTED   # click turns Ctrl-C into Abort
    except UserInputError as exc:
        _refuse(exc, as_json)
    except (typer.Exit, SystemExit) as exc:
        code = getattr(exc, "exit_code", getattr(exc, "code", 0))
    except Exception as exc:   # an unknown flag, a missing option, a value of the wrong type (click's UsageError)
        if not error_kinds(exc) & {"UsageError"}:
            raise
        _refuse(usage_error(exc), as_json)
    if code == INTERRUPTED:
        err.print("interrupted", markup=False, highlight=False)
    if isinstance(code, int) and code:
        sys.exit(code)


def _refuse(exc: UserInputError, as_json: bool) -> None:
    """One paragraph on stderr and, with --json, the same as an error object on stdout; status 2."""
    if as_json:
        out.print_json(json.dumps({"error": {"message": exc.message, "source": exc.source, "field": exc.field,
                                             "expected": exc.expected, "text": str(exc)}}))
    err.print(f"error: {exc}", markup=False, highlight=False)
    sys.exit(2)


if __name__ == "__main__":
    main()
