"""Megatron-LM / Megatron-Core arguments (`pretrain_gpt.py`), read back by Megatron-Core 0.16's own parser."""
from __future__ import annotations

import shlex

from cost_models.layout import first_blocks_of_each_chunk

from ..plans import Plan
from .common import _full_recompute_layers, connections_note


def megatron_args(plan: Plan) -> tuple[list[str], list[str]]:
    """Megatron-LM pretrain_gpt.py arguments and what they cannot say."""
    lay = plan.layout
    args = [f"--tensor-model-parallel-size {lay.tp}", f"--pipeline-model-parallel-size {lay.pp}",
            f"--context-parallel-size {lay.cp}", f"--expert-model-parallel-size {lay.ep}",
            f"--expert-tensor-parallel-size {lay.etp}", f"--micro-batch-size {lay.mbs}",
            f"--global-batch-size {lay.gbs}", f"--seq-length {plan.seq_len}"]
    layers_per_chunk = {len(s.layers) for s in plan.stages}
    if plan.mtp_layers:
        args.append(f"--mtp-num-layers {plan.mtp_layers}")
    if len(layers_per_chunk) > 1 or plan.mtp_layers:   # any per-chunk count, embedding, MTP and loss by name
        args.append(f"--pipeline-model-parallel-layout {shlex.quote(megatron_pipeline_layout(plan))}")
    elif lay.vp > 1:
        args.append(f"--num-layers-per-virtual-pipeline-stage {layers_per_chunk.pop()}")
    if lay.sp and lay.tp > 1:
        args.append("--sequence-parallel")
    if lay.tp_comm_overlap:
        args.append("--tp-comm-overlap")
    if lay.offload_layers:   # arguments.py sets cpu_offloading where the count is positive
        args.append(f"--cpu-offloading-num-layers {lay.offload_layers}")
    if lay.moe_a2a_overlap:  # Megatron-Core's MoE docs pair it with delayed weight-gradient GEMMs
        args += ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
    if lay.moe_shared_expert_overlap:
        args.append("--moe-shared-expert-overlap")
    if lay.ep > 1 and lay.moe_dispatcher == "deepep":   # deduplicated dispatch, as the cost model billed it
        backend = lay.flex_dispatcher_backend or "deepep"   # plans written before the field: DeepEP
        args.append(f"--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend {backend}")
    elif lay.ep > 1:   # the dispatcher the cost model billed (Megatron's default is allgather)
        args.append(f"--moe-token-dispatcher-type {lay.moe_dispatcher}")
    if lay.grad_reduce == "bf16":
        args.append("--grad-reduce-in-bf16")
    if lay.fused_loss:   # the bf16 logits hold their own gradient, as memory.py bills it
        args.append("--cross-entropy-loss-fusion --cross-entropy-fusion-impl te")
    if lay.precision_aware_optimizer:   # its store_param_remainders is on by default, as memory.py bills it
        args.append("--use-precision-aware-optimizer")
        if lay.adam_moment_bytes == 2:
            args.append("--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16")
    if lay.zero >= 1:
        args.append("--use-distributed-optimizer")
    if lay.zero >= 2:   # Megatron-FSDP: gradients (2) and also parameters (3) sharded
        strategy = "optim_grads" if lay.zero == 2 else "optim_grads_params"
        args += ["--use-megatron-fsdp", f"--data-parallel-sharding-strategy {strategy}"]
    if lay.dp * lay.cp > 1:   # the prediction hides the DP reduction (and ZeRO's parameter gather) in backward
        args.append("--overlap-grad-reduce")
        if lay.zero >= 1:
            args.append("--overlap-param-gather")
    if lay.precision == "fp8":
        args += ["--bf16", "--fp8-format hybrid", f"--fp8-recipe {lay.fp8_recipe}"]
    else:
        args.append("--bf16")
    notes = connections_note(plan)
    if lay.schedule == "dualpipev":
        notes.append("Megatron-Core has no DualPipeV schedule: these arguments run its chunks interleaved (chunk j "
                     f"on pipeline rank j mod {lay.pp}), not as DualPipeV's V, and the prediction does not hold; "
                     "MindSpeed-LLM runs it with --schedules-method dualpipev"
                     + (" --moe-fb-overlap" if lay.ep > 1 and plan.stack == "mindspeed" else "")
                     + " (plan with --stack megatron-core for a Megatron schedule)")
    recompute = {r for stage in plan.stages for r in stage.recompute}
    full = _full_recompute_layers(plan)
    if recompute == {"selective"}:
        args.append("--recompute-granularity selective")
        if lay.recompute_modules != "core_attn":   # Megatron-Core's default set
            args.append(f"--recompute-modules {lay.recompute_modules.replace('+', ' ')}")
        if "moe_act" in lay.recompute_modules.split("+"):   # TransformerConfig accepts it with grouped GEMM only
            args.append("--moe-grouped-gemm")
    elif "selective" in recompute:
        notes.append("Megatron recomputes selectively every layer or none: the plan's "
                     f"{sum(r == 'selective' for s in plan.stages for r in s.recompute)} selective layers beside "
                     "others cannot be expressed (plan with --stack megatron-core, which never mixes them)")
    elif "full" in recompute:
        per_stage = max(sum(r == "full" for r in s.recompute) for s in plan.stages)
        args += ["--recompute-granularity full", "--recompute-method block", f"--recompute-num-layers {per_stage}"]
        megatron_runs = first_blocks_of_each_chunk(tuple(len(s.layers) for s in plan.stages), per_stage)
        if tuple(r for s in plan.stages for r in s.recompute) != tuple(r.value for r in megatron_runs):
            notes.append(f"Megatron recomputes the first {per_stage} layers of every chunk (--recompute-method "
                         f"block), where the plan asks for {full} in all, placed otherwise")
    return args, notes


def megatron_pipeline_layout(plan: Plan) -> str:
    """Megatron-Core's --pipeline-model-parallel-layout for the plan's chunks, in chunk order: E (the
    embedding) opens the first chunk, L (output layer and loss) closes the last, t is a decoder layer and m a
    multi-token prediction layer (the plan's last blocks, in the last chunk); runs of equal chunks are written
    '(x|)*n' and a layer repeated 'tn' as 't*n', as its parser unrolls them."""
    chunks = []
    last = len(plan.stages) - 1
    decoder_layers = sum(len(stage.layers) for stage in plan.stages) - plan.mtp_layers
    for j, stage in enumerate(plan.stages):
        n = sum(layer < decoder_layers for layer in stage.layers)
        layers = ("t" * n if n <= 3 else f"t*{n}") + "m" * (len(stage.layers) - n)
        chunks.append(("E" if j == 0 else "") + layers + ("L" if j == last else ""))
    text, j = "", 0
    while j < last:
        run = 1
        while j + run < last and chunks[j + run] == chunks[j]:
            run += 1
        text += f"({chunks[j]}|)*{run}," if run > 1 else f"{chunks[j]}|"
        j += run
    return text + chunks[last]
