"""Launcher lines read back by torch's own launcher parser (torch.distributed.run), for the same plans every
other export is read back for: the nodes and processes per node multiply to the plan's devices, the training
driver is the installed module runtime.train, the plan file an absolute path; the sbatch script asks Slurm for
those nodes and GPUs, and for the rack segments the plan was made for."""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from planner.api import evaluate
from planner.exports import sbatch_script, torchrun_command
from test_exports_megatron import PLANS

GB200_SEGMENTED = ("gb200-segments", "llama3-8b", "gb200", 128, 256,
                   "tp=1,pp=1,vp=1,dp=128,cp=1,ep=1,etp=1,mbs=1,zero=1,recompute=none", "bf16", None)


def planned(case, tmp_path):
    name, model, device, count, batch, layout, precision, stack = case
    per_node = 4 if count % 8 else None
    plan = evaluate(model, device=device, num_devices=count, devices_per_node=per_node, global_batch=batch,
                    layout=layout, precision=precision, stack=stack,
                    segment_devices=64 if name == "gb200-segments" else None)
    path = tmp_path / "plan.yaml"
    plan.save(path)
    return plan, path


def parsed(words: list[str], plan):
    assert words[0] == "torchrun"
    args = get_args_parser().parse_args(words[1:])
    assert args.module and args.training_script == "runtime.train"
    plan_arg = args.training_script_args[args.training_script_args.index("--plan") + 1]
    assert Path(plan_arg).is_absolute() and Path(plan_arg).exists()
    return args


@pytest.mark.parametrize("case", PLANS + [GB200_SEGMENTED], ids=[c[0] for c in PLANS] + ["gb200-segments"])
def test_torchrun_and_sbatch_read_back_as_the_plan(case, tmp_path):
    plan, path = planned(case, tmp_path)
    line, _ = torchrun_command(plan, str(path))
    args = parsed(shlex.split(line.replace("${MASTER_ADDR}", "head-node")), plan)
    assert int(args.nnodes) * int(args.nproc_per_node) == plan.num_devices
    script, _ = sbatch_script(plan, str(path))
    options = dict((line[len("#SBATCH --"):] + "=").split("=")[:2] for line in script.splitlines()
                   if line.startswith("#SBATCH"))   # --exclusive has no value
    assert int(options["nodes"]) * int(options["gpus-per-node"]) == plan.num_devices
    assert options["ntasks-per-node"] == "1"   # torchrun starts the node's processes
    if plan.segment_devices:
        assert int(options["segment"]) * int(options["gpus-per-node"]) == plan.segment_devices
    else:
        assert "segment" not in options
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    args = parsed(shlex.split(srun[len("srun "):].replace("${SLURM_NNODES}", options["nodes"])
                              .replace("${MASTER_ADDR}", "head-node")), plan)
    assert int(args.nproc_per_node) == int(options["gpus-per-node"])
