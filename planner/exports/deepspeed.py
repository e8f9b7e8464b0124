"""DeepSpeed configuration JSON, read back by DeepSpeed 0.18's own DeepSpeedConfig."""
from __future__ import annotations

import json

from ..plans import Plan
from .common import _full_layers_on_a_rank, notes_for_unexpressed


def deepspeed_json(plan: Plan) -> tuple[str, list[str]]:
    lay = plan.layout
    config = {
        "train_batch_size": lay.gbs,
        "train_micro_batch_size_per_gpu": lay.mbs,
        "gradient_accumulation_steps": lay.gbs // (lay.dp * lay.mbs),
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": lay.zero, "overlap_comm": True, "contiguous_gradients": True},
        "communication_data_type": str(lay.grad_reduce),   # the gradient reduction's dtype the plan billed
        "gradient_clipping": 1.0,
        "activation_checkpointing": {"partition_activations": lay.tp > 1,
                                     "contiguous_memory_optimization": False,
                                     # per rank: the checkpoints one pipeline rank's layers hold
                                     "number_checkpoints": _full_layers_on_a_rank(plan) or None},
    }
    notes = ["DeepSpeed's tensor and pipeline degrees are set by the model code (Megatron-DeepSpeed "
             f"--tensor-model-parallel-size {lay.tp} --pipeline-model-parallel-size {lay.pp}), not this file; "
             f"its mpu must give a data-parallel size of {lay.dp} for the batch fields to check"]
    if lay.cp > 1 or lay.ep > 1:
        notes.append("context and expert parallel degrees are not DeepSpeed config fields")
    if lay.precision == "fp8":
        notes.append("the plan trains in FP8; this file says bf16: FP8 needs Transformer Engine layers in the model")
    if any(r == "selective" for stage in plan.stages for r in stage.recompute):
        notes.append("DeepSpeed has no selective (attention-only) recomputation: the plan's selective layers are "
                     "not checkpointed by this file")
    if lay.pp > 1 and lay.zero >= 2:
        notes.append(f"DeepSpeed's PipelineEngine runs ZeRO-0/1 only: ZeRO-{lay.zero} with pp={lay.pp} is refused "
                     "by DeepSpeed; plan with zero<=1 or --stack deepspeed")
    if lay.vp > 1:
        what = "DualPipeV schedule" if lay.schedule == "dualpipev" else "interleaved schedule"
        notes.append(f"DeepSpeed's PipelineModule has no {what}: vp={lay.vp} has no equivalent "
                     "(plan with --stack deepspeed)")
    if lay.tp_comm_overlap or lay.moe_a2a_overlap or lay.moe_shared_expert_overlap:
        notes.append("the prediction hid TP or MoE all-to-all communication behind compute; DeepSpeed's config "
                     "has no such overlap (plan with --stack deepspeed to predict without it)")
    notes += notes_for_unexpressed(plan, framework="DeepSpeed's config", experts="DeepSpeed's MoE all-to-all",
                                   mtp="DeepSpeed's config has no such field (the model code must build them)",
                                   optimizer="DeepSpeed's Adam", loss="the model's own loss under DeepSpeed")
    return json.dumps(config, indent=2) + "\n", notes
