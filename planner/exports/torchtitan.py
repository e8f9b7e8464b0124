"""torchtitan 0.3 command lines, read back by torchtitan's own ConfigManager and pipeline split."""
from __future__ import annotations

import shlex

from ..plans import Plan
from .common import _notes_for_recompute, notes_for_unexpressed


# the children of torchtitan 0.3's decoders (llama3, deepseek_v3, qwen3, gpt_oss: tok_embeddings, the layers'
# ModuleDict, norm, lm_head), which its pipeline split (_split_module) keeps or drops by these names
EMBEDDING, LAYERS, HEAD = ("tok_embeddings",), "layers", ("norm", "lm_head")
FP8_CONVERTERS = {"mxfp8": "MXFP8LinearConverter (MXFP8GroupedExpertsConverter for grouped experts)"}
ROWWISE = "Float8LinearConverter (Float8GroupedExpertsConverter for grouped experts), rowwise scaling"


def torchtitan_model(plan: Plan):
    """The plan's model in torchtitan's registry (`TorchtitanModel`), where it is a built-in torchtitan has."""
    from ..graph_capture.model_sources import list_builtin_models, resolve_model
    return resolve_model(plan.model).torchtitan if plan.model in list_builtin_models() else None


def stage_modules(plan: Plan, twin) -> list[list[str]]:
    """The modules of each virtual stage in chunk order, as the model torchtitan builds names them: torchtitan's
    own names where it has the model (multi-token prediction layers, which its configs lack, left out), else
    the names captured from the model the plan was made for."""
    if twin is None:
        return [list(stage.modules) for stage in plan.stages]
    decoder_layers = sum(len(stage.layers) for stage in plan.stages) - plan.mtp_layers
    last = len(plan.stages) - 1
    return [[*(EMBEDDING if j == 0 else ()), *(f"{LAYERS}.{b}" for b in stage.layers if b < decoder_layers),
             *(HEAD if j == last else ())] for j, stage in enumerate(plan.stages)]


def torchtitan_command(plan: Plan) -> tuple[str, list[str]]:
    """`python -m torchtitan.train --module M --config C` and the overrides; M and C are torchtitan's registry
    entry of the model where it has one (its FP8 config where it has one for the plan's recipe)."""
    twin = torchtitan_model(plan)
    lay = plan.layout
    fp8 = str(lay.fp8_recipe) if lay.precision == "fp8" else None
    config = twin.config_for(fp8) if twin else None
    words = ["python -m torchtitan.train", f"--module {twin.module if twin else 'MODULE'}",
             f"--config {config or 'CONFIG'}"]
    args, notes = torchtitan_args(plan)
    if twin is None:
        notes.insert(0, f"torchtitan 0.3 has no model registered as {plan.model}: --module and --config are the "
                     "one thing left to fill (a config_registry entry of this architecture), and the stage split "
                     "names the modules captured from the model the plan was made for")
    elif config is None and not fp8:
        notes.insert(0, f"torchtitan 0.3's {twin.module} registry has {plan.model} only in FP8 ({twin.fp8_config}, "
                     "Float8LinearConverter): --config CONFIG is left to fill with a config of it without the "
                     "converter, as the plan trains in BF16")
    if fp8:
        notes.append(_fp8_note(fp8, twin, config))
    return " \\\n  ".join(words[:1] + [" ".join(words[1:])] + args), notes


def _fp8_note(recipe: str, twin, config: str | None) -> str:
    converter = FP8_CONVERTERS.get(recipe, ROWWISE)
    how = f"--config {config} sets {converter}" if config else \
        f"torchtitan 0.3 sets FP8 converters in Python, not by flag: add {converter} to your config's model_spec"
    if recipe not in FP8_CONVERTERS:
        how += (f"; torchtitan 0.3's float8 scales rowwise, not {recipe} as the prediction billed (its casts read "
                "each row's amax: about tensorwise's cost, a finer scale)")
    return f"the plan trains in FP8 ({recipe}): {how}"


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
                 + " ".join(shlex.quote(",".join(names)) for names in stage_modules(plan, torchtitan_model(plan)))]
    if lay.pp > 1 or lay.ep > 1:   # torchtitan captures no CUDA graphs under a pipeline, nor beside its all-to-all
        # dispatch, which syncs with the host (Trainer.Config._validate_cuda_graphs refuses both otherwise)
        args.append("--training.disable_cuda_graphs")
    args.append(f"activation-checkpoint:{mode}")
    return args, _torchtitan_notes(plan, mode)


def _torchtitan_notes(plan: Plan, mode: str) -> list[str]:
    lay = plan.layout
    notes = [*_notes_for_recompute(plan, "torchtitan")]
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
    notes += notes_for_unexpressed(plan, framework="torchtitan 0.3", experts="torchtitan 0.3's expert parallelism",
                                   mtp="torchtitan's models do not have them (plan with --stack torchtitan, "
                                       "which refuses them)",
                                   optimizer="torchtitan's AdamW", loss="torchtitan")
    return notes
