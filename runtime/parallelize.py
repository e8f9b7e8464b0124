"""apply_tp / apply_ac / apply_dp: the torchtitan steps, driven by the captured graph instead of per-model code."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed._composable import checkpoint, replicate
from torch.distributed._composable.replicate_with_fsdp import replicate as replicate_with_fsdp
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as checkpoint_function

from cost_models.layout import Recompute
from cost_models.memory import casts_by_fsdp_policy
from planner.graph_capture.graph import ModelGraph

from . import mixed_precision
from .sequential_stage import HeadOnLaterStage, HiddenInput


def _present(module: nn.Module) -> set[str]:
    return {name for name, _ in module.named_modules()}


def _styles(module: nn.Module, name: str) -> tuple[type, type]:
    """Column- and row-parallel styles for the linear at `name`: torchao's for its Float8Linear (fp8)."""
    if type(module.get_submodule(name)).__name__ == "Float8Linear":
        return mixed_precision.fp8_parallel_styles()
    return ColwiseParallel, RowwiseParallel


def tp_plan(module: nn.Module, graph: ModelGraph, sp: bool) -> dict:
    """Colwise/Rowwise for every pair capture found, SequenceParallel norms, vocabulary-parallel ends."""
    present = _present(module)
    plan: dict = {}
    seq = Shard(1)
    for slot in graph.blocks:
        if slot.module_name not in present:
            continue
        structure = graph.structure(slot.kind)
        for pair in structure.tp_pairs:
            if pair.fused_columns:
                raise ValueError(f"{slot.module_name}.{pair.fused_columns[0]} is a fused projection split into parts "
                                 "by the model: column-sharding it would mix q/k/v across ranks; give the model "
                                 "separate projections or run it with tp=1")
            for column in pair.columns:
                name = f"{slot.module_name}.{column}"
                plan[name] = _styles(module, name)[0](input_layouts=seq if sp else Replicate())
            name = f"{slot.module_name}.{pair.row}"
            plan[name] = _styles(module, name)[1](output_layouts=seq if sp else Replicate())
        for norm, heads_axis in structure.head_norms:
            # each rank normalises its own heads with the whole (replicated) weight; as torchtitan shards
            # Qwen3's q/k norms, the input is the shard of the heads axis and the weight's gradient, a
            # partial sum per rank, is summed over tp by DTensor
            plan[f"{slot.module_name}.{norm}"] = SequenceParallel(sequence_dim=heads_axis, use_local_output=True)
        if sp:
            for norm in structure.norms:
                if norm.count(".") == 0:  # norms on the residual stream; inner ones see replicated inputs
                    plan[f"{slot.module_name}.{norm}"] = SequenceParallel(use_local_output=False)
            if structure.expert_container:
                plan[f"{slot.module_name}.{structure.expert_container}"] = PrepareModuleInput(
                    input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True)
    for name in graph.embedding_modules:
        if name in present and isinstance(module.get_submodule(name), nn.Embedding) and name == graph.embedding_modules[0]:
            plan[name] = RowwiseParallel(input_layouts=Replicate(),
                                         output_layouts=seq if sp and _sp_from_embedding(graph) else Replicate())
    for name in graph.head_modules:
        if name not in present or isinstance(module.get_submodule(name), HeadOnLaterStage):
            continue
        sub = module.get_submodule(name)
        if isinstance(sub, nn.Linear):
            plan[name] = ColwiseParallel(input_layouts=seq if sp else Replicate(), output_layouts=Replicate())
        elif sp:
            plan[name] = SequenceParallel(use_local_output=False)
    return plan


def _sp_from_embedding(graph: ModelGraph) -> bool:
    """The sequence is cut at the embedding's output when the embedding part is one token embedding;
    otherwise (transformers' decoders: rotary embeddings, positions and masks computed from the embedding's
    output between it and the first block) it is cut at the first block's input, the top-level code seeing
    the whole sequence."""
    return len(graph.embedding_modules) == 1


def _cut_sequence_at(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The first block's hidden-state input, whole on every rank, cut to this rank's part of the sequence
    (as a DTensor redistribution, whose backward gathers the parts' gradients back)."""
    hidden = HiddenInput.of(block)

    def hook(module, args, kwargs):
        whole = DTensor.from_local(hidden.get(args, kwargs), tp_mesh, [Replicate()], run_check=False)
        return hidden.put(args, kwargs, whole.redistribute(placements=[Shard(1)]).to_local())
    block.register_forward_pre_hook(hook, with_kwargs=True)


def apply_tp(module: nn.Module, graph: ModelGraph, tp_mesh: DeviceMesh, sp: bool) -> None:
    parallelize_module(module, tp_mesh, tp_plan(module, graph, sp))
    first_block = graph.blocks[0].module_name
    if sp and not _sp_from_embedding(graph) and first_block in _present(module):
        _cut_sequence_at(module.get_submodule(first_block), tp_mesh)
    _localize_head_counts(module, graph, tp_mesh.size())
    if sp:
        for slot in graph.blocks:
            structure = graph.structure(slot.kind)
            if structure.expert_container and slot.module_name in _present(module):
                parallelize_module(module.get_submodule(f"{slot.module_name}.{structure.expert_container}"),
                                   tp_mesh, PrepareModuleOutput(output_layouts=(Replicate(),),
                                                                desired_output_layouts=(Shard(1),),
                                                                use_local_output=True))


def _localize_head_counts(module: nn.Module, graph: ModelGraph, tp: int) -> None:
    """Attention modules that reshape by a head count must see the heads of one rank (torchtitan
    divides n_heads by tp per model; here: int attributes named *head*/*group* equal to the counts
    capture found, on the modules owning the column projections)."""
    present = _present(module)
    for slot in graph.blocks:
        if slot.module_name not in present:
            continue
        structure = graph.structure(slot.kind)
        counts = {structure.attention_heads, structure.kv_groups} - {0}
        for pair in structure.tp_pairs:
            owner_path = pair.columns[0].rpartition(".")[0]
            owner = module.get_submodule(f"{slot.module_name}.{owner_path}" if owner_path else slot.module_name)
            for attr, value in list(vars(owner).items()):
                if (isinstance(value, int) and not isinstance(value, bool) and value in counts
                        and _names_a_head_count(attr) and value % tp == 0):
                    setattr(owner, attr, value // tp)


def _names_a_head_count(attr: str) -> bool:
    """`n_head`, `heads`, `num_kv_heads`, `groups`: counts a rank holds 1/tp of. A head's width (`head_dim`,
    `head_size`) or heads per kv group (`num_key_value_groups`) is the same on every rank, even where it
    happens to equal a count."""
    name = attr.lower()
    if any(word in name for word in ("dim", "size", "width")) or name.endswith(("per_group", "key_value_groups")):
        return False
    return "head" in name or "group" in name


ATTENTION_OPS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                 torch.ops.aten._scaled_dot_product_efficient_attention.default,
                 torch.ops.aten._scaled_dot_product_flash_attention.default,
                 torch.ops.aten._scaled_dot_product_cudnn_attention.default}


def _recompute_attention_only(ctx, op, *args, **kwargs):
    # selective recomputation (Megatron): keep everything but the attention core, which is recomputed
    return CheckpointPolicy.PREFER_RECOMPUTE if op in ATTENTION_OPS else CheckpointPolicy.MUST_SAVE


def apply_ac(module: nn.Module, graph: ModelGraph, recompute: tuple[Recompute, ...], dualpipev: bool = False) -> None:
    """Composable checkpoint keeps parameter names: full per block, or attention-only per block. Under DualPipeV
    full recomputation is torch's non-reentrant checkpoint around each block's forward instead (as torchtitan's
    checkpoint_wrapper, names kept): the composable one recomputes once per forward, and the split weight pass
    asks again (one graph task per parameter group, each recomputing: billed by the stack's
    dualpipev_weight_pass_recompute); selective recomputation is refused there before this."""
    present = _present(module)
    for index, slot in enumerate(graph.blocks):
        if slot.module_name not in present or recompute[index] is Recompute.none:
            continue
        block = module.get_submodule(slot.module_name)
        if recompute[index] is Recompute.full and dualpipev:
            block.forward = partial(checkpoint_function, block.forward, use_reentrant=False)
        elif recompute[index] is Recompute.full:
            checkpoint(block)
        else:
            checkpoint(block, context_fn=partial(create_selective_checkpoint_contexts, _recompute_attention_only))


def uses_fsdp(zero: int, dp: int) -> bool:
    """Whether `apply_dp` wraps with FSDP2's machinery, which then also applies the mixed-precision policy:
    fully_shard for ZeRO-2/3, and for ZeRO-0 over dp > 1 torch's replicate built on it (the rule the memory
    model bills the bf16 copies by). ZeRO-1 beside tensor or expert parallelism with dp > 1 is refused before
    this (the stack's zero_stages_beside_model_parallel): ZeroRedundancyOptimizer and the DDP-based replicate
    take no DTensor."""
    return casts_by_fsdp_policy(zero, dp)


def apply_dp(module: nn.Module, graph: ModelGraph, dp_mesh: DeviceMesh, zero: int,
             ignored: set[nn.Parameter], pipelined: bool = False, mp_policy=None) -> nn.Module:
    """ZeRO 0: torch's replicate built on FSDP2 (replicate_with_fsdp, as torchtitan applies DDP: each block,
    then the root), whose parameters are DTensors replicated over dp, so it stands beside tensor and expert
    parallelism, and whose reduction torch's pipeline stages run themselves after the last micro-batch (also
    under DualPipeV's split backward, which arms no DDP reducer); 1: the DDP-based replicate +
    ZeroRedundancyOptimizer (see ParallelModel), a pipeline stage in DistributedDataParallel, whose reduction
    torch's stages hold back until the last micro-batch's backward (the composable replicate cannot be told
    so and reduced wrong gradients with several forwards in flight under 1F1B); 2 and 3: FSDP2 without and
    with resharding after forward. Returns the module to run."""
    if not uses_fsdp(zero, dp_mesh.size()) and dp_mesh.size() == 1:
        return module
    if uses_fsdp(zero, dp_mesh.size()):
        wrap = partial(fully_shard, reshard_after_forward=zero >= 3) if zero >= 2 else replicate_with_fsdp
        present = _present(module)
        options = dict(mesh=dp_mesh, ignored_params=ignored or None)
        if mp_policy is not None:
            options["mp_policy"] = mp_policy
        for slot in graph.blocks:
            if slot.module_name in present:
                wrap(module.get_submodule(slot.module_name), **options)
        wrap(module, **options)
    elif pipelined:
        # gradients as views into DDP's reduction buckets: otherwise DDP keeps a second copy of every gradient
        # ("the saved memory size will be equal to the total gradients size", DistributedDataParallel's docs)
        wrapped = DistributedDataParallel(module, process_group=dp_mesh.get_group(), gradient_as_bucket_view=True)
        # forwards must not arm the reducer: 1F1B runs several before their backwards, so the stage arms
        # it itself for the last micro-batch's backward (PipelineStage's prepare_for_backward)
        wrapped.require_backward_grad_sync = False
        return wrapped
    else:
        replicate(module, device_mesh=dp_mesh, gradient_as_bucket_view=True)
    return module
