"""Plans in the formats of the runtimes users already run: Megatron-LM, torchtitan, DeepSpeed, torchrun."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from cost_models.layout import first_blocks_of_each_chunk
from hardware_profiles.errors import UserInputError
from hardware_profiles.stack import RUNTIME_STACK

from .plans import Plan

# the release of each tool whose own code reads the export back in the tests (constraints.txt pins them)
CHECKED_RELEASES = {"megatron": "0.16", "torchtitan": "0.3", "deepspeed": "0.18", "torchrun": "2.13"}
RELEASE_OF = {"megatron": "megatron-core", "torchtitan": "torchtitan", "deepspeed": "deepspeed", "torchrun": "torch"}


def export_target(text: str) -> tuple[str, str]:
    """`NAME` or `NAME@RELEASE` -> (name, release); a release other than the checked one is refused."""
    name, _, release = text.partition("@")
    if name not in CHECKED_RELEASES:
        raise UserInputError(f"'{text}'", field="--to", expected="megatron, torchtitan, deepspeed or torchrun, "
                             "optionally @RELEASE")
    checked = CHECKED_RELEASES[name]
    if release and not (checked == release or checked.startswith(release + ".") or release.startswith(checked + ".")):
        raise UserInputError(f"'{text}'", field="--to", expected=f"{name}@{checked}: the {RELEASE_OF[name]} release "
                             "this export is written for and checked against (no other release is)")
    return name, checked


def _full_recompute_layers(plan: Plan) -> int:
    return sum(r == "full" for stage in plan.stages for r in stage.recompute)


def _full_layers_on_a_rank(plan: Plan) -> int:
    """The most fully recomputed layers any pipeline rank holds (over its virtual stages)."""
    per_rank: dict[int, int] = {}
    for stage in plan.stages:
        per_rank[stage.pipeline_rank] = per_rank.get(stage.pipeline_rank, 0) + stage.recompute.count("full")
    return max(per_rank.values(), default=0)


def _notes_for_recompute(plan: Plan, target: str) -> list[str]:
    kinds = {r for stage in plan.stages for r in stage.recompute}
    if len(kinds) > 1:
        return [f"{target} cannot express per-layer recomputation lists; the plan recomputes "
                f"{_full_recompute_layers(plan)} layers fully and "
                f"{sum(r == 'selective' for s in plan.stages for r in s.recompute)} selectively"]
    return []


DISPATCH_WORDS = {"deepep": "DeepEP-style (one copy per node)",
                  "allgather": "by all-gather (every token to the expert tp x ep group, Megatron's allgather)"}
FUSED_LOSS_NOTE = ("the plan's memory assumed Transformer Engine's fused cross-entropy (the bf16 logits hold their "
                   "own gradient); {target} keeps more for the loss (plan with that framework's stack to predict it)")
PRECISION_AWARE_NOTE = ("the plan's memory assumed Megatron-Core's precision-aware optimizer (the master kept as "
                        "16-bit remainders where it trains in BF16, or bf16 moments); {target} keeps fp32 states "
                        "(plan with that framework's stack to predict them)")


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
    if lay.moe_a2a_overlap:  # Megatron-Core's MoE docs pair it with delayed weight-gradient GEMMs
        args += ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
    if lay.moe_shared_expert_overlap:
        args.append("--moe-shared-expert-overlap")
    if lay.ep > 1 and lay.moe_dispatcher == "deepep":   # deduplicated dispatch, as the cost model billed it
        args.append("--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep")
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
    notes = []
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


def torchtitan_args(plan: Plan) -> tuple[list[str], list[str]]:
    """torchtitan 0.3 command-line overrides (`python -m torchtitan.train --module M --config C ...`): 0.3
    reads no TOML; every section is a dataclass that tyro fills from `--section.field value`, activation
    checkpointing a subcommand after them."""
    lay = plan.layout
    recompute = {r for stage in plan.stages for r in stage.recompute}
    mode = "none" if recompute == {"none"} else ("selective" if recompute == {"selective"} else "full")
    sharded = lay.zero >= 1   # torchtitan's FSDP2 shards parameters, gradients and optimizer state alike
    # local_batch_size is what one data-parallel rank feeds per optimizer step's forward: the micro-batch
    # without a pipeline (global / (local x dp) steps are accumulated), all micro-batches with one (the
    # schedule splits them into pipeline_parallel_microbatch_size)
    local = lay.mbs if lay.pp == 1 else lay.gbs // lay.dp
    args = [f"--parallelism.data_parallel_replicate_degree {1 if sharded else lay.dp}",
            f"--parallelism.data_parallel_shard_degree {lay.dp if sharded else 1}",
            f"--parallelism.tensor_parallel_degree {lay.tp}",
            # booleans are tyro flags: --field sets, --no-field clears
            "--parallelism.enable_sequence_parallel" if lay.sp and lay.tp > 1
            else "--parallelism.no-enable-sequence-parallel",
            f"--parallelism.context_parallel_degree {lay.cp}",
            f"--parallelism.expert_parallel_degree {lay.ep}",
            f"--parallelism.pipeline_parallel_degree {lay.pp}",
            f"--training.local_batch_size {local}", f"--training.global_batch_size {lay.gbs}",
            f"--training.seq_len {plan.seq_len}"]
    if sharded:   # FSDP2 resharding after forward is ZeRO-3, keeping the parameters to backward ZeRO-2; torchtitan's
        # "default" policy picks by pipelining instead (torchtitan/distributed/fsdp.py), so the plan's is stated
        args.append(f"--parallelism.fsdp_reshard_after_forward {'always' if lay.zero >= 3 else 'never'}")
    if lay.pp > 1:
        schedule = {"dualpipev": "DualPipeV", "interleaved-1f1b": "Interleaved1F1B"}.get(str(lay.schedule), "1F1B")
        args += [f"--parallelism.pipeline_parallel_schedule {schedule}",
                 f"--parallelism.pipeline_parallel_microbatch_size {lay.mbs}",
                 # the modules of each virtual stage in chunk order: any chunk sizes, embedding and output by name
                 "--parallelism.module_fqns_per_model_part "
                 + " ".join(shlex.quote(",".join(stage.modules)) for stage in plan.stages),
                 "--training.disable_cuda_graphs"]   # torchtitan captures no graphs under a pipeline
    args.append(f"activation-checkpoint:{mode}")
    return args, _torchtitan_notes(plan, mode)


def _torchtitan_notes(plan: Plan, mode: str) -> list[str]:
    lay = plan.layout
    notes = [*_notes_for_recompute(plan, "torchtitan")]
    if lay.pp > 1:
        notes.append("module_fqns_per_model_part names the modules of the model the plan was made for; plan the "
                     "torchtitan model itself (--model file.py:factory) where its names differ")
    if mode == "selective":
        notes.append("torchtitan 0.3's selective checkpointing is op-level (saves matmul outputs, recomputes the "
                     f"rest), not the recomputation of {lay.recompute_modules.replace('+', ', ')} the plan costs")
    if lay.zero == 1:
        notes.append("torchtitan shards with FSDP2, gradients too: ZeRO-1 has no exact equivalent; exported as FSDP2 "
                     "keeping the parameters from forward to backward (ZeRO-2)")
    if lay.etp > 1:
        notes.append(f"torchtitan 0.3 has no expert tensor-parallel degree: etp={lay.etp} cannot be expressed")
    if lay.tp_comm_overlap:
        notes.append("the plan assumes TP communication overlap; torchtitan 0.3 overlaps TP only through "
                     "torch.compile's async TP (--compile.enable), which this export does not turn on")
    if lay.moe_a2a_overlap:
        notes.append("the plan assumes combined 1F1B (MoE all-to-alls beside another micro-batch's compute); "
                     "torchtitan 0.3 has expert-parallel overlap only in experiments/graph_trainer, which this "
                     "export does not turn on (plan with --stack torchtitan to predict without it)")
    if lay.moe_shared_expert_overlap:
        notes.append("the plan runs the shared experts beside the all-to-alls (Megatron --moe-shared-expert-overlap)"
                     "; torchtitan 0.3 runs them in line, which this export cannot change")
    if lay.precision == "fp8":
        notes.append("the plan trains in FP8: add torchtitan's Float8LinearConverter to your config's model "
                     "converters; this export does not")
    if lay.moe_dispatcher != "alltoall":
        notes.append(f"the prediction dispatched MoE tokens {DISPATCH_WORDS[lay.moe_dispatcher]}; torchtitan 0.3's "
                     "expert parallelism sends one per expert, which this export cannot change")
    if plan.mtp_layers:
        notes.append(f"the plan trains {plan.mtp_layers} multi-token prediction module(s), which torchtitan's "
                     "models do not have (plan with --stack torchtitan, which refuses them)")
    if lay.precision_aware_optimizer:
        notes.append(PRECISION_AWARE_NOTE.format(target="torchtitan's AdamW"))
    if lay.fused_loss:
        notes.append(FUSED_LOSS_NOTE.format(target="torchtitan"))
    return notes


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
    if lay.moe_dispatcher != "alltoall":
        notes.append(f"the prediction dispatched MoE tokens {DISPATCH_WORDS[lay.moe_dispatcher]}; DeepSpeed's MoE "
                     "all-to-all sends one per expert, which this config cannot change")
    if lay.tp_comm_overlap or lay.moe_a2a_overlap or lay.moe_shared_expert_overlap:
        notes.append("the prediction hid TP or MoE all-to-all communication behind compute; DeepSpeed's config "
                     "has no such overlap (plan with --stack deepspeed to predict without it)")
    if plan.mtp_layers:
        notes.append(f"the plan trains {plan.mtp_layers} multi-token prediction module(s); DeepSpeed's config has "
                     "no such field (the model code must build them)")
    if lay.precision_aware_optimizer:
        notes.append(PRECISION_AWARE_NOTE.format(target="DeepSpeed's Adam"))
    if lay.fused_loss:
        notes.append(FUSED_LOSS_NOTE.format(target="the model's own loss under DeepSpeed"))
    return json.dumps(config, indent=2) + "\n", notes


TRAIN_MODULE = "runtime.train"   # the runtime's training driver, installed with the package
RENDEZVOUS = '"${MASTER_ADDR}:29500"'   # the head node, as the launcher's environment names it
ASSUMED_DEVICES_PER_NODE = 8   # only for plan files written before plans recorded their nodes (said in a note)


def torchrun_command(plan: Plan, plan_path: str) -> tuple[str, list[str]]:
    """A torchrun line for our runtime (`-m runtime.train`, installed with the package): nodes of the plan's
    cluster, the plan by its absolute path, every word quoted (the rendezvous host left to the shell)."""
    notes = []
    per_node = plan.devices_per_node
    if per_node is None:
        per_node = ASSUMED_DEVICES_PER_NODE
        notes.append(f"the plan file does not record devices per node; {per_node} assumed (plan again to record it)")
    if plan.stack != RUNTIME_STACK:
        notes.append(f"the plan was made for the {plan.stack} stack; the runtime runs what the {RUNTIME_STACK} "
                     f"stack allows and refuses the rest before the first step (plan with --stack {RUNTIME_STACK})")
    world = plan.num_devices
    per_node = min(per_node, world)
    nodes = world // per_node
    words = ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(per_node)]
    if nodes > 1:
        words += ["--rdzv-backend", "c10d", "--rdzv-endpoint", RENDEZVOUS]
    words += ["-m", TRAIN_MODULE, "--model", plan.model, "--plan", str(Path(plan_path).resolve())]
    # the rendezvous host stays for the shell to expand, inside double quotes (one word whatever it holds);
    # everything else is one literal word
    return " ".join(w if w == RENDEZVOUS else shlex.quote(w) for w in words), notes
