"""Megatron-Bridge overrides: a YAML file its recipe scripts merge into a recipe's ConfigContainer
(`--config-file`, `megatron.bridge.training.utils.omegaconf_utils.process_config_with_overrides`), read back in
the tests through Megatron-Bridge 0.3's own ConfigContainer and its `validate()`.

The sections are the ConfigContainer's: `model` (the GPT provider, a Megatron-Core TransformerConfig),
`train`, `dataset`, `ddp`, `optimizer`, `checkpoint` (Megatron-FSDP's format), `mixed_precision` (a recipe name
of Bridge's MIXED_PRECISION_RECIPES).
"""
from __future__ import annotations

import yaml

from ..plans import Plan
from .common import _full_recompute_layers, connections_note
from .megatron import megatron_pipeline_layout

# Megatron-Bridge's mixed-precision recipes by the plan's FP8 recipe (megatron/bridge/training/mixed_precision.py)
MIXED_PRECISION = {"delayed": "bf16_with_fp8_delayed_scaling_mixed", "tensorwise": "bf16_with_fp8_current_scaling_mixed",
                   "mxfp8": "bf16_with_mxfp8_mixed", "blockwise": "bf16_with_fp8_subchannel_scaling_mixed"}
DISPATCHER = {"alltoall": {"moe_token_dispatcher_type": "alltoall"},
              "allgather": {"moe_token_dispatcher_type": "allgather"},
              "deepep": {"moe_token_dispatcher_type": "flex"}}   # its backend: the plan's flex_dispatcher_backend


def bridge_overrides(plan: Plan) -> tuple[dict, list[str]]:
    """The ConfigContainer sections the plan sets, and what Megatron-Bridge will do otherwise than planned."""
    lay = plan.layout
    model = {"tensor_model_parallel_size": lay.tp, "pipeline_model_parallel_size": lay.pp,
             "virtual_pipeline_model_parallel_size": lay.vp if lay.vp > 1 else None,
             "context_parallel_size": lay.cp, "expert_model_parallel_size": lay.ep,
             "expert_tensor_parallel_size": lay.etp, "sequence_parallel": lay.sp and lay.tp > 1,
             "seq_length": plan.seq_len, "cuda_graph_impl": "none",   # the prediction bills no CUDA graphs
             **_pipeline_split(plan), **_recompute(plan),
             # activation offloading as the GB200 recipes write it (perf_recipes/llama/gb200/llama3.py), always set
             # so that a recipe's own count is overridden by the plan's
             "cpu_offloading": lay.offload_layers > 0, "cpu_offloading_weights": False,
             "cpu_offloading_num_layers": lay.offload_layers}
    if lay.ep > 1:
        if lay.moe_dispatcher == "deepep":   # plans written before the backend was recorded: DeepEP
            model["moe_flex_dispatcher_backend"] = lay.flex_dispatcher_backend or "deepep"
        model.update(DISPATCHER[lay.moe_dispatcher], overlap_moe_expert_parallel_comm=lay.moe_a2a_overlap,
                     delay_wgrad_compute=lay.moe_a2a_overlap, moe_shared_expert_overlap=lay.moe_shared_expert_overlap)
    # Transformer Engine's fused cross-entropy (the bf16 logits hold their own gradient) as memory.py billed it
    model["cross_entropy_loss_fusion"] = lay.fused_loss
    if lay.fused_loss:
        model["cross_entropy_fusion_impl"] = "te"
    sharded = lay.zero >= 2   # Megatron-FSDP: gradients (2) and also parameters (3) sharded
    ddp = {"use_distributed_optimizer": lay.zero >= 1, "grad_reduce_in_fp32": lay.grad_reduce != "bf16",
           "overlap_grad_reduce": lay.dp * lay.cp > 1, "overlap_param_gather": lay.dp * lay.cp > 1 and lay.zero >= 1,
           "use_megatron_fsdp": sharded,
           "data_parallel_sharding_strategy": {2: "optim_grads", 3: "optim_grads_params"}.get(lay.zero, "no_shard")}
    sections = {
        "model": model,
        "train": {"global_batch_size": lay.gbs, "micro_batch_size": lay.mbs},
        "dataset": {"seq_length": plan.seq_len},
        "ddp": ddp,
        "optimizer": {"use_distributed_optimizer": lay.zero >= 1,
                      "use_precision_aware_optimizer": lay.precision_aware_optimizer},
        "mixed_precision": MIXED_PRECISION[str(lay.fp8_recipe)] if lay.precision == "fp8" else "bf16_mixed",
    }
    if sharded:   # Megatron-FSDP checkpoints only in its DTensor format (ConfigContainer.validate refuses others)
        sections["checkpoint"] = {"ckpt_format": "fsdp_dtensor"}
    return sections, _notes(plan)


def _pipeline_split(plan: Plan) -> dict:
    """Megatron-Core's layout string where the chunks are uneven or hold MTP layers, as Megatron-LM's flag."""
    counts = {len(stage.layers) for stage in plan.stages}
    if plan.layout.pp > 1 and (len(counts) > 1 or plan.mtp_layers):
        return {"pipeline_model_parallel_layout": megatron_pipeline_layout(plan)}
    return {}


def _recompute(plan: Plan) -> dict:
    kinds = {r for stage in plan.stages for r in stage.recompute}
    if kinds == {"selective"}:
        return {"recompute_granularity": "selective", "recompute_modules": plan.layout.recompute_modules.split("+")}
    if "full" in kinds:
        per_chunk = max(sum(r == "full" for r in stage.recompute) for stage in plan.stages)
        return {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": per_chunk}
    return {"recompute_granularity": None}


def _notes(plan: Plan) -> list[str]:
    lay, notes = plan.layout, []
    kinds = {r for stage in plan.stages for r in stage.recompute}
    if len(kinds) > 1 and kinds != {"none", "full"}:
        notes.append("Megatron-Bridge recomputes selectively every layer or none: the plan's mix of methods is "
                     f"exported as full recomputation of {_full_recompute_layers(plan)} layers")
    if lay.schedule == "dualpipev":
        notes.append("Megatron-Bridge has no DualPipeV schedule: its chunks run interleaved, and the prediction does "
                     "not hold (plan with --stack megatron-bridge)")
    if lay.tp_comm_overlap:
        notes.append("the plan overlaps TP communication with GEMMs: the recipe's comm_overlap must be a "
                     "CommOverlapConfig(tp_comm_overlap=True) (Bridge's performance recipes set one; a YAML merge "
                     "cannot create the dataclass where the recipe leaves it None)")
    elif lay.tp > 1 and lay.sp:
        notes.append("the plan runs without TP communication overlap: where the recipe's comm_overlap sets "
                     "tp_comm_overlap=True (Bridge's performance recipes), set it to False")
    if lay.adam_moment_bytes == 2:
        notes.append("the plan keeps Adam's moments in bf16: set optimizer.exp_avg_dtype and exp_avg_sq_dtype to "
                     "torch.bfloat16 in the recipe (torch dtypes, which a YAML file cannot write)")
    notes += connections_note(plan)
    if plan.segment_devices:
        per_node = plan.devices_per_node or plan.segment_devices
        notes.append(f"the plan places the job in segments of {plan.segment_devices // per_node} nodes: launch with "
                     f"Slurm's --segment={plan.segment_devices // per_node} (`planner export --to sbatch`)")
    return notes


def bridge_yaml(plan: Plan) -> tuple[str, list[str]]:
    """The overrides as the YAML file a recipe script's --config-file merges."""
    sections, notes = bridge_overrides(plan)
    header = (f"# Megatron-Bridge overrides for {plan.model} on {plan.num_devices} x {plan.cluster}: merge into the "
              "recipe's ConfigContainer\n# (--config-file, omegaconf_utils.process_config_with_overrides)\n")
    return header + yaml.safe_dump(sections, sort_keys=False), notes
