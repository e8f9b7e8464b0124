"""Options the CLI's commands share, each declared once (typer)."""
from __future__ import annotations

from typing import get_args

import typer

from hardware_profiles.errors import UserInputError
from hardware_profiles.loader import list_stacks, resolve_stack
from hardware_profiles.stack import DEFAULT_STACK, MoeDispatcher

HELP = {"help_option_names": ["-h", "--help"]}
JsonOpt = typer.Option(False, "--json", help="print the result as JSON (an error as {\"error\": {...}}, status 2)")
SeqOpt = typer.Option(None, "--seq-len", help="sequence length (default: the model's)")
LeafOpt = typer.Option("", "--leaf-modules", help="comma-separated module names to measure as single ops")
StrictOpt = typer.Option(False, "--strict-capture", help="refuse a model that capture can only bill in part "
                         "(a leaf module, code that cannot run on meta) instead of noting it in the plan")


def leaf_names(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


ModelOpt = typer.Option(..., "--model", help="built-in name, model .yaml, HF config.json or file.py:factory")
ClusterOpt = typer.Option(None, "--cluster", help="cluster profile name or YAML path")
DeviceOpt = typer.Option(None, "--device", help="build a cluster from a device profile (with --num-devices)")
DevicesOpt = typer.Option(None, "--num-devices", help="number of devices")
PerNodeOpt = typer.Option(None, "--devices-per-node", help="devices per node (with --device)")
ImbalanceOpt = typer.Option(1.0, "--ep-imbalance", help="MoE: the busiest expert-parallel rank's routed tokens "
                            "over the mean, as measured (1 = balanced routing, the default)")
SegmentOpt = typer.Option(None, "--segment-devices", help="devices the job takes in each scale-up domain, in equal "
                          "segments (Slurm --segment nodes x devices per node); default: domains filled in rank order")
BatchOpt = typer.Option(..., "--global-batch", help="sequences per optimizer step")
StackOpt = typer.Option(None, "--stack", help=f"software stack that trains the model: a name "
                        f"({', '.join(list_stacks())}) or a YAML path; default {DEFAULT_STACK}. The search stays "
                        "inside what it runs (planner stacks show NAME)")
OverlapOpt = typer.Option(False, "--tp-comm-overlap", help="also overlap TP collectives with GEMMs where the stack "
                          "does not (Megatron --tp-comm-overlap, NeMo ub_tp_comm_overlap)")
DISPATCHERS = get_args(MoeDispatcher)
DispatcherOpt = typer.Option(None, "--moe-dispatcher", help="the only MoE token dispatcher the stack runs (without it "
                             "the search weighs each one the stack runs on the device; dispatcher=NAME in the layout "
                             "pins one): alltoall "
                             "(one copy per chosen expert), deepep (one per destination node, forwarded over "
                             "NVLink, BF16 tokens as Megatron-Core sends them: --moe-token-dispatcher-type "
                             "flex --moe-flex-dispatcher-backend deepep) or allgather (every token gathered to the "
                             "expert tp x ep group and the outputs reduce-scattered back: Megatron-Core's default)")
MoeOverlapOpt = typer.Option(False, "--moe-a2a-overlap", help="the stack runs Megatron's combined 1F1B "
                             "(--overlap-moe-expert-parallel-comm: MoE all-to-alls beside another micro-batch's "
                             "compute, one more forward's activations held; no pipeline or virtual stages): plan "
                             "weighs it per layout, a2a_overlap=true|false in the layout pins it, evaluate of a "
                             "whole layout takes it on")


def flagged_stack(name: str | None, tp_comm_overlap: bool, moe_a2a_overlap: bool, moe_dispatcher: str | None = None):
    """The named stack, with the overlaps and the MoE dispatcher the flags add."""
    stack = resolve_stack(name)
    extra = {k: True for k, on in (("tp_comm_overlap", tp_comm_overlap), ("moe_a2a_overlap", moe_a2a_overlap)) if on}
    if moe_dispatcher is not None:
        if moe_dispatcher not in DISPATCHERS:
            raise UserInputError(f"'{moe_dispatcher}'", field="--moe-dispatcher", expected=" or ".join(DISPATCHERS))
        extra.update(moe_dispatcher=moe_dispatcher, moe_dispatchers=(moe_dispatcher,))
    return stack.model_copy(update=extra) if extra else stack
