"""Launcher lines for this project's runtime: torchrun, and an sbatch header for a Slurm cluster."""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from hardware_profiles.stack import RUNTIME_STACK

from ..plans import Plan


TRAIN_MODULE = "runtime.train"   # the runtime's training driver, installed with the package
RENDEZVOUS = '"${MASTER_ADDR}:29500"'   # the head node, as the launcher's environment names it
ASSUMED_DEVICES_PER_NODE = 8   # only for plan files written before plans recorded their nodes (said in a note)


@dataclass(frozen=True)
class Nodes:
    """How the plan's devices sit on nodes: the launcher's nodes and processes per node."""
    nodes: int
    per_node: int
    notes: tuple[str, ...]

    @classmethod
    def of(cls, plan: Plan) -> "Nodes":
        notes = []
        per_node = plan.devices_per_node
        if per_node is None:
            per_node = ASSUMED_DEVICES_PER_NODE
            notes.append(f"the plan file does not record devices per node; {per_node} assumed (plan again to record "
                         "it)")
        if plan.stack != RUNTIME_STACK:
            notes.append(f"the plan was made for the {plan.stack} stack; the runtime runs what the {RUNTIME_STACK} "
                         f"stack allows and refuses the rest before the first step (plan with --stack {RUNTIME_STACK})")
        per_node = min(per_node, plan.num_devices)
        return cls(plan.num_devices // per_node, per_node, tuple(notes))


def torchrun_words(plan: Plan, plan_path: str, nodes: str) -> list[str]:
    """torchrun's words for our runtime (`-m runtime.train`, installed with the package), with `nodes` as the node
    count (a number, or the launcher's variable)."""
    placed = Nodes.of(plan)
    words = ["torchrun", "--nnodes", nodes, "--nproc-per-node", str(placed.per_node)]
    if placed.nodes > 1:
        words += ["--rdzv-backend", "c10d", "--rdzv-endpoint", RENDEZVOUS]
    return words + ["-m", TRAIN_MODULE, "--model", plan.model, "--plan", str(Path(plan_path).resolve())]


def quoted(words: list[str]) -> str:
    """Every word one literal word, but the shell's own variables, expanded inside double quotes."""
    return " ".join(w if w.startswith('"$') else shlex.quote(w) for w in words)


def torchrun_command(plan: Plan, plan_path: str) -> tuple[str, list[str]]:
    """A torchrun line for our runtime: nodes of the plan's cluster, the plan by its absolute path, every word
    quoted (the rendezvous host left to the shell)."""
    placed = Nodes.of(plan)
    return quoted(torchrun_words(plan, plan_path, str(placed.nodes))), list(placed.notes)


def sbatch_script(plan: Plan, plan_path: str) -> tuple[str, list[str]]:
    """A Slurm batch script: the plan's nodes, one task per node, its GPUs per node, the rack segments the plan
    was made for (`--segment`, nodes per segment: NVL72 and supernode clusters), and torchrun under srun."""
    placed = Nodes.of(plan)
    lines = ["#!/bin/bash", f"#SBATCH --nodes={placed.nodes}", "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --gpus-per-node={placed.per_node}", "#SBATCH --exclusive"]
    notes = list(placed.notes)
    if plan.segment_devices:
        lines.append(f"#SBATCH --segment={plan.segment_devices // placed.per_node}")
    elif placed.nodes > 1 and plan.placement and "partial" in plan.placement:
        notes.append(f"the plan fills the scale-up domains in rank order ({plan.placement}); Slurm places nodes as "
                     "it finds them unless --segment says otherwise")
    lines += ['export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              "srun " + quoted(torchrun_words(plan, plan_path, '"${SLURM_NNODES}"'))]
    return "\n".join(lines) + "\n", notes
