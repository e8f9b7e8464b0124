"""`ModelGraph`: what capture learned about a model, read by the cost models, the search and the runtime."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from cost_models.layout import RecomputeModule
from cost_models.records import LayerKind, ModelCosts


@dataclass(frozen=True)
class TensorParallelPair:
    """Linears found by dataflow: `columns` feed `row` through element-wise or attention ops."""
    columns: tuple[str, ...]    # module paths relative to the block
    row: str
    fused_columns: tuple[str, ...] = ()  # columns whose output is split into parts (a fused QKV)


@dataclass(frozen=True)
class LayerSlot:
    module_name: str            # e.g. "layers.17" ("" for the embedding and head parts)
    kind: str                   # LayerKind.name


@dataclass(frozen=True)
class BlockStructure:
    """Per block kind: what capture recognised in the graph."""
    kind: str
    tp_pairs: tuple[TensorParallelPair, ...]
    attention_heads: int
    kv_groups: int
    head_dim: int
    norms: tuple[str, ...]
    expert_container: str | None    # module path of the routed-experts leaf, if any
    num_experts: int
    router_topk: int
    # what this project's runtime can shard (runtime/context_parallel.py, runtime/experts.py): the attention
    # core is the reference decoder's `CoreAttention`; the experts are stacked with its route/routed protocol
    reference_attention: bool = False
    stacked_experts: bool = False
    # attention as a scaled_dot_product_attention call: context parallelism can all-gather K/V around it
    # (runtime/context_parallel.py) unless a module of the block declares a sliding window, whose mask the
    # top-level code picks per layer (by the layer's index in its loop: pipeline stages of recorded models
    # cannot keep that either)
    sdpa_attention: bool = False
    sliding_window: bool = False
    reference_experts: bool = False     # stacked experts with the reference MoE's route/routed protocol
    router_num_groups: int = 1          # group-limited routing, as the router names it (n_group, topk_group)
    router_group_topk: int = 1
    # norms over one head's channels inside a column-parallel region (Qwen3 / Gemma 3 q_norm, k_norm), with
    # the axis of their input that holds the heads: under tp each rank normalises its own heads, and the
    # weight's gradient is the sum over the ranks
    head_norms: tuple[tuple[str, int], ...] = ()
    # the modules selective recomputation can repeat in this block (capture/recompute_regions.py)
    recompute_modules: tuple[RecomputeModule, ...] = ()


@dataclass(frozen=True)
class ModelGraph:
    name: str
    seq_len: int
    hidden_size: int
    vocab_size: int
    activation_dtype_bytes: int
    block_stack: str                # module path of the repeated blocks (e.g. "layers")
    kinds: tuple[LayerKind, ...]
    layers: tuple[LayerSlot, ...]   # embedding, blocks in order, head
    structures: tuple[BlockStructure, ...]
    embedding_modules: tuple[str, ...]   # top-level modules before the blocks (first pipeline stage)
    head_modules: tuple[str, ...]        # top-level modules after the blocks (last pipeline stage)
    capture_seconds: float
    front_end: str = "torch.fx"          # "torch.fx" (symbolic trace) or "recorded" (eager on meta, recording.py)
    capture_notes: tuple[str, ...] = ()  # what capture could not see or bill exactly, with its effect
    assumed: tuple[str, ...] = ()        # what the model's config left out that the stack's defaults filled
    model_class: str = ""                # the nn.Module class captured (a transformers class, or Decoder)
    # embedding-part modules whose weights the top-level code reads without calling them (a learned position
    # table sliced by the sequence length): positions context parallelism cannot make global
    embedding_weights_read: tuple[str, ...] = ()
    # multi-token prediction modules: output-layer applications after the first, each with its loss; their
    # layers are the last `mtp_layers` blocks
    mtp_layers: int = 0

    def kind(self, name: str) -> LayerKind:
        for kind in self.kinds:
            if kind.name == name:
                return kind
        raise KeyError(name)

    def structure(self, kind: str) -> BlockStructure | None:
        return next((s for s in self.structures if s.kind == kind), None)

    @cached_property
    def blocks(self) -> tuple[LayerSlot, ...]:
        return tuple(slot for slot in self.layers if self.kind(slot.kind).role == "block")

    @cached_property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def total_params(self) -> int:
        return sum(self.kind(slot.kind).param_count for slot in self.layers)

    @property
    def active_params(self) -> int:
        return sum(self.kind(slot.kind).active_param_count for slot in self.layers)

    @cached_property
    def attention_heads(self) -> int:
        return min((s.attention_heads for s in self.structures if s.attention_heads), default=0)

    @cached_property
    def kv_groups(self) -> int:
        return min((s.kv_groups for s in self.structures if s.kv_groups), default=0)

    @cached_property
    def recompute_modules(self) -> tuple[RecomputeModule, ...]:
        """The modules selective recomputation can repeat in some block, in RecomputeModule order."""
        found = {m for s in self.structures for m in s.recompute_modules}
        return tuple(m for m in RecomputeModule if m in found)

    @cached_property
    def num_experts(self) -> int:
        return max((s.num_experts for s in self.structures), default=0)

    def model_flops_per_sample(self) -> float:
        """Forward + backward matmul FLOPs of one sequence (no recomputation)."""
        return sum(self.kind(slot.kind).model_flops for slot in self.layers)

    def model_flops_per_token(self) -> float:
        return self.model_flops_per_sample() / self.seq_len

    @cached_property
    def costs_record(self) -> ModelCosts:
        return self.costs()

    def costs(self) -> ModelCosts:
        return ModelCosts(self.name, self.seq_len, self.hidden_size, self.kinds,
                          tuple(slot.kind for slot in self.blocks))

    def layer_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for slot in self.layers:
            counts[slot.kind] = counts.get(slot.kind, 0) + 1
        return counts
