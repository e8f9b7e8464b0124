"""The training driver's flags (`python -m runtime.train --help`)."""
from __future__ import annotations

import argparse

from cost_models.reliability import Recovery

from .health import HealthPolicy
from .process_group import BACKENDS


DESCRIPTION = """Train a model under a plan with this project's runtime, or as the single-process reference.

    python -m runtime.train --model tiny-llama --steps 5                      # reference
    torchrun --nproc-per-node 8 -m runtime.train --model tiny-llama --layout dp=2,tp=2,pp=2 --steps 5
    torchrun --nproc-per-node 8 -m runtime.train --model tiny-llama --plan plan.yaml

Prints `step K loss X` from rank 0. Same seed and data on every layout, fp32 on CPU (gloo)."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m runtime.train", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--layout", default="", help="e.g. dp=2,tp=2,pp=2,vp=1,mbs=1,zero=3,recompute=full")
    parser.add_argument("--plan", default=None, help="a plan file from 'planner plan --out'")
    parser.add_argument("--steps", type=positive_steps, default=5)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    parser.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp8"],
                        help="train in this precision instead of the plan's (fp32 for numerical checks; "
                             "default: the plan's, or fp32 for a --layout that names none)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--max-grad-norm", type=float, default=None, help="clip by the global gradient norm")
    parser.add_argument("--dump-grads", default=None, help="directory: every step's gradients per rank")
    parser.add_argument("--cases", default=None, help="a JSON file of [{name, model, layout}]: train each in turn in "
                        "this one launch (one process group), its lines prefixed 'case NAME', its gradients "
                        "under --dump-grads/NAME (the runtime tests run many layouts per launch)")
    parser.add_argument("--save-at", type=int, default=None, help="save a DCP checkpoint after this step")
    parser.add_argument("--checkpoint", default=None, help="DCP checkpoint directory (save or resume)")
    parser.add_argument("--resume", action="store_true", help="load --checkpoint and continue after the step it "
                        "was saved at (model, optimizer, step, learning rate, RNG)")
    parser.add_argument("--async-save", action="store_true", help="write checkpoints with dcp.async_save (on a "
                        "gloo group of their own); training waits only for the staging")
    parser.add_argument("--checkpoint-dir", default=None, help="save every --save-every steps into this directory "
                        "and, on start (as after a torchrun restart), resume from its last complete checkpoint")
    parser.add_argument("--save-every", default="0", help="steps between checkpoints in --checkpoint-dir, or auto: "
                        "Daly's interval from the measured blocking time and the job's MTBF (--mtbf-s, else the "
                        "plan's cluster profile)")
    parser.add_argument("--mtbf-s", type=float, default=None, help="the job's mean time between failures, for "
                        "--save-every auto (default: the plan's cluster profile at this many devices)")
    parser.add_argument("--last-step", type=int, default=None, help="train up to this step (default: --steps with "
                        "--checkpoint-dir, whose job spans its restarts; else the first step + --steps - 1)")
    parser.add_argument("--drop-optimizer-state", action="store_true", help="with --resume: forget the "
                        "optimizer's state after loading, as a model-only checkpoint would (shows what it costs)")
    parser.add_argument("--elastic", action="store_true", help="with --plan: when the job has another number of "
                        "ranks than the plan's devices (torchrun restarted it on the nodes left), plan again for "
                        "the ranks there are (planner.api.replan) and train that, resuming the checkpoint")
    parser.add_argument("--collective-timeout", type=float, default=Recovery.collective_timeout_s,
                        help="seconds a collective may wait for a peer before the job fails naming the ranks "
                             "that stopped (torch's default is 30 minutes)")
    parser.add_argument("--flight-record-dir", default=None, help="where a rank that loses a peer writes torch's "
                        "flight record of its last collectives (default: --checkpoint-dir, else the temp directory)")
    parser.add_argument("--inject", default=None, action=Once, help="KIND@STEP[:RANK], KIND one of stop, kill, "
                        "node, nan, spike, bitflip, slow, sdc, defect, optsdc, diskfull, savekill (runtime/faults.py): a fault the "
                        "health checks or the watchdog must name")
    parser.add_argument("--sdc-error", type=float, default=1.0, help="--inject sdc, defect or optsdc: the wrong "
                        "element's error relative to itself (1: doubled, as a flipped low exponent bit)")
    parser.add_argument("--sdc-phase", default="forward", choices=["forward", "backward"],
                        help="--inject sdc or defect: a product of the forward or of the backward")
    parser.add_argument("--no-health", action="store_true", help="turn the in-step health checks off")
    parser.add_argument("--sdc-every", type=steps_or_never, default=HealthPolicy.sdc_every,
                        help="steps between replica fingerprints (0: never)")
    parser.add_argument("--optimizer-check-every", type=steps_never_or_auto, default=HealthPolicy.optimizer_every,
                        help="auto (with --plan: the cadence its goodput model chooses), or steps between checks "
                        "of a sharded optimizer's update by another rank (0: never)")
    parser.add_argument("--optimizer-check-samples", type=steps_or_never, default=HealthPolicy.optimizer_samples,
                        help="elements of each owned tensor the other rank recomputes (0: all)")
    parser.add_argument("--gemm-every", type=steps_never_or_auto, default=HealthPolicy.gemm_every,
                        help="auto (with --plan: the cadence its goodput model chooses), or steps between steps whose matrix products are checked by their checksums (silent data corruption in "
                        "computation; 0: never)")
    parser.add_argument("--on-sdc", default="skip", choices=["skip", "rollback", "exclude", "stop"],
                        help="a wrong matrix product found: skip the batch on every rank, roll back to the last "
                        "checkpoint (each is written after a clean check of its step) and skip it, exclude the "
                        "node where its self-test fails or it was found before (it leaves the job; torchrun "
                        "restarts the rest, --elastic re-plans; else it is kept and the job rolls back), or stop "
                        "the job (a wrong optimizer update: roll back, exclude or stop)")
    parser.add_argument("--straggler-every", type=steps_or_never, default=HealthPolicy.straggler_every,
                        help="steps per straggler comparison (0: off)")
    parser.add_argument("--on-nonfinite", default="skip", choices=["skip", "stop"])
    parser.add_argument("--on-spike", default="skip", choices=["skip", "rollback", "ignore"],
                        help="rollback: reload the last complete checkpoint of --checkpoint-dir and skip the "
                             "--rollback-skip batches that end at the spike")
    parser.add_argument("--rollback-skip", type=int, default=1, help="batches skipped after a rollback, ending at "
                        "the spike's (PaLM skipped 200-500 around each spike)")
    parser.add_argument("--skip-steps", default="", help="comma-separated steps whose batches are not trained "
                        "(the reference a skipped batch is compared with)")
    parser.add_argument("--telemetry", default=None, help="directory: each rank writes rank-R.jsonl, every step's "
                        "measured parts beside the plan's predicted ones (read by 'planner calibrate --telemetry')")
    parser.add_argument("--telemetry-comm-every", type=steps_or_never, default=10, help="with --telemetry: steps per "
                        "measurement of exposed communication by kind and of the pipeline's waits (0: never; the "
                        "measurement costs a few per cent of the step it runs on)")
    parser.add_argument("--device-type", default=None, choices=sorted(BACKENDS),
                        help="cpu (gloo), cuda (nccl; rccl on ROCm builds) or npu (hccl via torch_npu); "
                             "default: what the plan's cluster profile names, else cpu")
    return parser.parse_args(argv)


class Once(argparse.Action):
    """A flag given twice is refused: a second --inject would silently replace the first."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) not in (None, self.default):
            parser.error(f"{option_string} is given twice ({getattr(namespace, self.dest)} and {values}); "
                         "one fault per run")
        setattr(namespace, self.dest, values)


def positive_steps(text: str) -> int:
    value = int(text) if text.strip().isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of steps >= 1")
    return value


def steps_never_or_auto(text: str) -> int | str:
    return "auto" if text.strip() == "auto" else steps_or_never(text)


def steps_or_never(text: str) -> int:
    value = int(text) if text.strip().isdigit() else -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of steps >= 0 (0: never)")
    return value
