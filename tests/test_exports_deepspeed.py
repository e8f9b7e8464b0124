"""DeepSpeed exports read by DeepSpeed's own `DeepSpeedConfig` (deepspeed, a test extra), with an mpu that
gives the plan's data-parallel size as Megatron-DeepSpeed's does: accepted, and the batch, accumulation,
ZeRO stage and precision read back as the plan's; what DeepSpeed cannot express is a note (issue 18)."""
import importlib
import json
import warnings

import pytest
import torch

from planner.api import evaluate
from planner.exports import deepspeed_json
from test_exports_megatron import PLANS

deepspeed_config = pytest.importorskip("deepspeed.runtime.config", reason="deepspeed is a test extra")


class PlanTopology:
    """The mpu interface DeepSpeedConfig asks for the data-parallel size (deepspeed/runtime/config.py)."""

    def __init__(self, dp: int, mp: int):
        self.dp, self.mp = dp, mp

    def get_data_parallel_world_size(self):
        return self.dp

    def get_model_parallel_world_size(self):
        return self.mp


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """DeepSpeedConfig asks deepspeed.comm for the rank before it asks the mpu: one gloo rank."""
    import socket

    import deepspeed.comm as ds_comm
    ds_torch_backend = importlib.import_module("deepspeed.comm.torch")   # (deepspeed.comm.torch is torch)
    import torch.distributed as dist
    # the shared-memory all-reduce kernel DeepSpeed compiles for CPU ranks (about 50 s of g++ on a fresh
    # machine) plays no part in reading a config: the backend is built without it
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(ds_torch_backend, "build_shm_op", lambda: None)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ds_comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    yield
    dist.destroy_process_group()
    monkeypatch.undo()


# beyond the plans every tool reads (test_exports_megatron.PLANS): what DeepSpeed's PipelineEngine refuses
EXTRA = [("pp-zero2-vp2", "llama3-8b", "h100-sxm", 8, 64,
          "tp=1,pp=2,vp=2,dp=4,cp=1,ep=1,etp=1,mbs=1,zero=2,recompute=none", "bf16", None),
         ("pp-full-zero1", "llama3-8b", "h100-sxm", 8, 64,
          "tp=2,pp=2,vp=1,dp=2,cp=1,ep=1,etp=1,mbs=1,zero=1,recompute=full", "bf16", None)]


@pytest.mark.parametrize("case", PLANS + EXTRA, ids=[c[0] for c in PLANS + EXTRA])
def test_deepspeed_reads_the_export_as_the_plan(case):
    name, model, device, count, batch, layout, precision, stack = case
    plan = evaluate(model, device=device, num_devices=count, devices_per_node=4 if count % 8 else None,
                    global_batch=batch, layout=layout, precision=precision, stack=stack)
    text, notes = deepspeed_json(plan)
    lay = plan.layout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = deepspeed_config.DeepSpeedConfig(json.loads(text), mpu=PlanTopology(lay.dp, lay.tp * lay.pp))
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == \
        (lay.gbs, lay.mbs, lay.gbs // (lay.dp * lay.mbs))
    assert config.zero_optimization_stage == lay.zero
    assert config.bfloat16_config.enabled
    assert config.communication_data_type == getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[str(lay.grad_reduce)])
    full = {rank: sum(s.recompute.count("full") for s in plan.stages if s.pipeline_rank == rank)
            for rank in range(lay.pp)}   # DeepSpeed's count is a rank's own (its contiguous buffer)
    assert config.activation_checkpointing_config.number_checkpoints == (max(full.values()) or None)
    methods = {r for stage in plan.stages for r in stage.recompute}
    # what DeepSpeed cannot express is a note, and only then
    expected = {"context and expert parallel": lay.cp > 1 or lay.ep > 1, "FP8": lay.precision == "fp8",
                "no selective": "selective" in methods, "runs ZeRO-0/1 only": lay.pp > 1 and lay.zero >= 2,
                "no interleaved": lay.vp > 1, "no such overlap": lay.tp_comm_overlap or lay.moe_a2a_overlap}
    for words, wanted in expected.items():
        assert any(words in note for note in notes) == wanted, (words, notes)
