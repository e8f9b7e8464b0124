"""torchtitan exports read back by torchtitan 0.3's own code (a test extra): the exported overrides parsed by
tyro with torchtitan's registry into torchtitan's own config sections (`TrainingConfig`, `ParallelismConfig`,
the activation-checkpoint subcommands), then `ParallelDims.from_config`, which checks the degrees against the
world size; each degree, batch, schedule, stage, recomputation and sequence-parallel field must read back as
the plan says (issue 18). The Trainer itself needs torchdata, which the test extras do not install."""
import shlex
from dataclasses import dataclass, field

import pytest

tyro = pytest.importorskip("tyro")
configs = pytest.importorskip("torchtitan.config.configs")
from torchtitan.config.manager import ConfigManager, custom_registry  # noqa: E402
from torchtitan.distributed.activation_checkpoint import (ActivationCheckpointingConfig, FullAC,  # noqa: E402
                                                           SelectiveAC)
from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402
from torchtitan.distributed.pipeline_parallel import _get_pp_rank_to_stage_indices_mapping  # noqa: E402

from planner.api import evaluate  # noqa: E402
from planner.exports import torchtitan_args, torchtitan_command  # noqa: E402
from planner.exports.torchtitan import stage_modules, torchtitan_model  # noqa: E402
from hardware_profiles.loader import load_stack  # noqa: E402
from test_exports_megatron import FULL, PLANS  # noqa: E402

# DualPipeV, which torchtitan runs (torch ScheduleDualPipeV) and Megatron-Core does not
TORCHTITAN_PLANS = PLANS + [
    ("dualpipev", "llama3-8b", "h100-sxm", 16, 64,
     FULL.format(tp=1, pp=4, vp=2, dp=4, cp=1, ep=1, etp=1, mbs=1, zero=2, rc="none") + ",schedule=dualpipev", "bf16",
     load_stack("torchtitan")),
    # ZeRO-3 under a pipeline, where torchtitan's default policy would keep the parameters (ZeRO-2)
    ("zero3-pp", "llama3-8b", "h100-sxm", 16, 64,
     FULL.format(tp=1, pp=2, vp=1, dp=8, cp=1, ep=1, etp=1, mbs=1, zero=3, rc="none"), "bf16", load_stack("torchtitan")),
]
SCHEDULES = {"1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B", "dualpipev": "DualPipeV"}

ConfigManager.register_tyro_rules(custom_registry)   # what ConfigManager() does: comma-separated lists


@dataclass(kw_only=True)
class TrainerSections:
    """The sections of torchtitan 0.3's Trainer.Config the export writes, with the Trainer's own defaults."""
    training: configs.TrainingConfig = field(default_factory=configs.TrainingConfig)
    parallelism: configs.ParallelismConfig = field(default_factory=configs.ParallelismConfig)
    activation_checkpoint: ActivationCheckpointingConfig = field(default_factory=SelectiveAC.Config)
    compile: configs.CompileConfig = field(default_factory=configs.CompileConfig)


AC_KIND = {"none": type(None), "full": FullAC.Config, "selective": SelectiveAC.Config}


@pytest.mark.parametrize("case", TORCHTITAN_PLANS, ids=[c[0] for c in TORCHTITAN_PLANS])
def test_torchtitan_reads_the_export_as_the_plan(case):
    name, model, device, count, batch, layout, precision, stack = case
    per_node = 4 if count % 8 else None
    plan = evaluate(model, device=device, num_devices=count, devices_per_node=per_node, global_batch=batch,
                    layout=layout, precision=precision, stack=stack)
    args, _ = torchtitan_args(plan)
    _, notes = torchtitan_command(plan)
    parsed = tyro.cli(TrainerSections, args=shlex.split(" ".join(args)), default=TrainerSections(),
                      registry=custom_registry)
    dims = ParallelDims.from_config(parsed.parallelism, count)   # torchtitan's own check of the degrees
    lay, par, training = plan.layout, parsed.parallelism, parsed.training
    assert dims.dp_replicate * dims.dp_shard == lay.dp
    assert (dims.dp_shard > 1 or lay.dp == 1) == (lay.zero >= 1)   # FSDP2 for ZeRO >= 1, replicas for ZeRO-0
    assert (dims.tp, dims.cp, dims.pp, dims.ep) == (lay.tp, lay.cp, lay.pp, lay.ep)
    if lay.zero >= 1:   # ZeRO-3 reshards the parameters after forward, ZeRO-2 keeps them, as torchtitan resolves it
        assert get_fsdp_reshard_after_forward_policy(par.fsdp_reshard_after_forward, dims.pp_enabled) == (lay.zero >= 3)
    assert par.enable_sequence_parallel == (lay.sp and lay.tp > 1)
    assert training.seq_len == plan.seq_len and training.global_batch_size == lay.gbs
    # the Trainer accumulates global / (local x batch degree) steps; the pipeline splits local into micro-batches
    accumulation = training.global_batch_size // (training.local_batch_size * dims.dp_replicate * dims.dp_shard)
    micro_batches = lay.gbs // (lay.dp * lay.mbs)
    if lay.pp == 1:
        assert training.local_batch_size == lay.mbs and accumulation == micro_batches
    else:
        assert accumulation == 1 and par.pipeline_parallel_microbatch_size == lay.mbs
        assert training.local_batch_size // par.pipeline_parallel_microbatch_size == micro_batches
        assert par.pipeline_parallel_schedule == SCHEDULES[lay.schedule]
        # torchtitan's own names where it has the model (tests/test_exports_torchtitan_registry.py splits them)
        assert par.module_fqns_per_model_part == stage_modules(plan, torchtitan_model(plan))
        # torchtitan places the stages on pipeline ranks (looped, or as a V) where the plan costed them
        for rank in range(lay.pp):
            assert list(_get_pp_rank_to_stage_indices_mapping(rank, lay.pp, par.pipeline_parallel_schedule,
                                                              len(plan.stages))) \
                == [stage.index for stage in plan.stages if stage.pipeline_rank == rank]
    kinds = {r for stage in plan.stages for r in stage.recompute}
    expected = "none" if kinds == {"none"} else ("selective" if kinds == {"selective"} else "full")
    assert isinstance(parsed.activation_checkpoint, AC_KIND[expected])
    # what torchtitan cannot say is said
    assert (lay.etp > 1) == any("expert tensor-parallel" in note for note in notes)
    assert (lay.precision == "fp8") == any("Converter" in note for note in notes)
    assert lay.tp_comm_overlap == any("TP communication overlap" in note for note in notes)
