"""The small records the cost models consume: the work of an op and of a layer kind.

Capture (`planner.graph_capture`) produces them from a traced graph; the cost models never import `planner`.
All figures are for one micro-batch of size 1 at the captured sequence length.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum
from functools import cached_property

from .layout import RecomputeModule


class OpKind(str, Enum):
    gemm = "gemm"               # a Linear or a matmul with a weight
    attention = "attention"     # a fused attention kernel (SDPA / flash): skips the causally masked blocks
    attention_matmul = "attention-matmul"            # unfused q k^T or probs x v: the whole s x s is computed
    attention_elementwise = "attention-elementwise"  # unfused scale, mask, softmax, dropout over s x s
    elementwise = "elementwise" # memory-bound ops: norms, activations, residuals, rotary
    embedding = "embedding"     # a gather from a table
    loss = "loss"               # softmax cross-entropy over the vocabulary
    # one copy of a MoE layer's routed tokens (k per token, read and written) that a stack's dispatcher may
    # make beyond the model's own permutation (`SoftwareStack.moe_sort_copies` of them, compute.py)
    token_copy = "token-copy"


# the attention core, fused or not: what selective recomputation repeats by default (Korthikanti et al. 2022)
ATTENTION_CORE = (OpKind.attention, OpKind.attention_matmul, OpKind.attention_elementwise)
ATTENTION_MATMUL_KINDS = (OpKind.attention, OpKind.attention_matmul)
MATMUL_KINDS = (OpKind.gemm, *ATTENTION_MATMUL_KINDS)   # what model FLOPs count


class Sharding(str, Enum):
    """How tensor parallelism divides an op's work or a saved tensor."""
    tensor = "tensor"           # inside a column->row pair: divided by tp always
    sequence = "sequence"       # outside pairs: divided by tp only with sequence parallelism
    expert = "expert"           # expert weights: divided by ep x etp


@dataclass(frozen=True)
class OpCost:
    name: str
    kind: OpKind
    sharding: Sharding
    forward_flops: float
    backward_input_flops: float
    backward_weight_flops: float
    bytes_accessed: float                   # forward reads + writes
    gemm_mnk: tuple[int, int, int] | None   # shape of one GEMM, for the efficiency curve
    gemm_count: int = 1                     # identical GEMMs in this op (experts, heads batched)
    weight_bytes: float = 0.0               # of bytes_accessed, the weights (read whatever the batch)
    node: str = ""                          # the graph node that ran it
    module: RecomputeModule | None = None   # the recomputable module it belongs to, if any
    inner_module: RecomputeModule | None = None   # a module inside that one (moe_act inside moe)
    # kernels its node launches eagerly beside its GEMMs (the node's first op carries them): outside routed
    # expert modules, and inside them for all the experts (planner/graph_capture/launches.py)
    launches: int = 0
    expert_launches: int = 0
    reads: str = ""   # a GEMM's activation input: the graph node that made it (projections reading one input fuse)
    # a fused attention's share of its counted FLOPs that a causal kernel computes, where capture knows it (a
    # sliding window); None: the stack's causal_attention_work
    causal_work: float | None = None

    def recomputed_by(self, modules: tuple[RecomputeModule, ...]) -> bool:
        """Whether selective recomputation of `modules` repeats it: its module's or the one inside it."""
        return self.module in modules or self.inner_module in modules

    @property
    def routed(self) -> bool:
        """Whether it works on the tokens routed to a rank's experts (their GEMMs and activation, the
        dispatcher's sorts): what a rank given more than its share of tokens does more of."""
        return self.sharding is Sharding.expert or self.kind is OpKind.token_copy \
            or self.inner_module is RecomputeModule.moe_act


@dataclass(frozen=True)
class SavedTensor:
    """A tensor autograd keeps for backward, measured under saved_tensors_hooks."""
    producer: str
    bytes: float
    sharding: Sharding
    attention_matrix: bool      # s x s shaped (what fused attention never stores)
    fp8_bytes: float            # the same with weight-GEMM inputs kept as 1-byte FP8 copies (Transformer Engine)
    savers: tuple[str, ...] = ()                    # the graph nodes that keep it
    producer_module: RecomputeModule | None = None  # the recomputable module that made it, if any
    saver_modules: frozenset = frozenset()          # the modules of its savers (None: outside any)
    inner_module: RecomputeModule | None = None     # made and kept by a module inside producer_module's
    # the routed experts' output, kept by its multiply by the routing probabilities (for their gradient): what
    # a stack that applies them inside the expert activation never keeps (`moe_probs_in_expert_activation`)
    routed_output_for_probs: bool = False

    def dropped_by(self, modules: tuple[RecomputeModule, ...]) -> bool:
        """Whether recomputing `modules` frees it: made inside one of them, and either that module discards
        its output (output-discarding checkpointing) or only the module itself keeps it (a checkpoint keeps
        its input and nothing it saves inside). An inner module (inside an expert container) drops what capture
        marked as made and kept by it."""
        made_by = self.producer_module
        if self.inner_module is not None and self.inner_module in modules:   # marked only where it makes and keeps it
            return True
        return made_by in modules and (made_by.discards_output or self.saver_modules <= {made_by})


@dataclass(frozen=True)
class ParamGroup:
    count: int
    sharding: Sharding          # tensor: split by tp; sequence: replicated over tp; expert: split by ep x etp
    # the parameter tensors holding them (a weight, a bias, a norm's scale: capture's count), where a stack
    # gathers and reduces each tensor apart (`SoftwareStack.zero3_collectives`)
    tensors: int = 1


def joins_previous_projection(previous: OpCost, op: OpCost) -> bool:
    """Whether GEMM `op` reads the input the GEMM before it read: one module where the stack fuses the projections
    (Megatron's linear_qkv for q, k and v; linear_fc1 for gate and up)."""
    return previous.kind is op.kind is OpKind.gemm and bool(op.reads) and previous.reads == op.reads


@dataclass(frozen=True)
class LayerKind:
    """One distinct kind of layer (repeated layers share one record)."""
    name: str                   # "embedding", "dense", "moe", "head" or a user block's signature
    role: str                   # embedding | block | head
    ops: tuple[OpCost, ...]
    saved: tuple[SavedTensor, ...]
    params: tuple[ParamGroup, ...]
    input_bytes: float          # the layer's input for one sample: what full recomputation keeps
    tokens: int                 # tokens per sample (the captured sequence length)
    hidden_size: int
    num_experts: int = 0
    router_topk: int = 0
    router_num_groups: int = 1      # group-limited routing: experts in this many equal groups,
    router_group_topk: int = 1      # each token's experts from this many of them
    logits_fp32_bytes: float = 0.0  # head only: fp32 logits kept for the loss
    tp_pair_count: int = 0          # column->row pairs: each costs one TP collective forward and one backward
    kv_channels: int = 0            # kv heads x head dim: what context parallelism all-gathers
    # parameter groups torch's split weight pass computes one autograd.grad each for (capture's
    # `weight_pass_groups`): a recomputed layer is recomputed once per group in such a pass (`LayerCost`)
    weight_pass_groups: int = 0

    @property
    def param_count(self) -> int:
        return sum(group.count for group in self.params)

    def params_by(self, sharding: Sharding) -> int:
        return self._params_by_sharding.get(sharding, 0)

    @cached_property
    def _params_by_sharding(self) -> dict[Sharding, int]:   # a search asks for each layout it bounds
        counts: dict[Sharding, int] = {}
        for group in self.params:
            counts[group.sharding] = counts.get(group.sharding, 0) + group.count
        return counts

    def param_tensors_by(self, sharding: Sharding) -> int:
        return sum(group.tensors for group in self.params if group.sharding is sharding)

    @cached_property
    def projections_per_input(self) -> float:
        """Tensor-parallel GEMMs per module they make where a stack builds the projections reading one input as one
        GEMM (`SoftwareStack.fused_projections`, `joins_previous_projection`), which holds their weights (and
        biases) as one tensor each."""
        ops = [op for op in self.ops if op.kind is OpKind.gemm and op.sharding is Sharding.tensor]
        modules = sum(1 for i, op in enumerate(ops) if not (i and joins_previous_projection(ops[i - 1], op)))
        return len(ops) / modules if ops else 1.0

    @property
    def active_param_count(self) -> int:
        """Parameters one token touches: experts count by top-k of num_experts."""
        expert = self.params_by(Sharding.expert)
        if not self.num_experts:
            return self.param_count
        return self.param_count - expert + expert * self.router_topk // self.num_experts

    @property
    def forward_flops(self) -> float:
        return sum(op.forward_flops for op in self.ops)

    @cached_property
    def routed_nodes(self) -> frozenset[str]:
        """The graph nodes that run a routed op (`OpCost.routed`)."""
        return frozenset(op.node for op in self.ops if op.routed and op.node)

    @cached_property
    def dispatch_index(self) -> int:
        """Where its first routed op stands in `ops` (the dispatcher hands tokens to the experts there); len(ops)
        where it routes nothing."""
        return next((i for i, op in enumerate(self.ops) if op.routed), len(self.ops))

    @cached_property
    def only_routed_nodes(self) -> frozenset[str]:
        """Of `routed_nodes`, those that run nothing else (not an expert container captured as one node)."""
        return self.routed_nodes - frozenset(op.node for op in self.ops if not op.routed)

    @cached_property
    def model_flops(self) -> float:
        """Forward + backward matmul FLOPs (GEMM and attention), the MFU numerator per sample."""
        return sum(op.forward_flops + op.backward_input_flops + op.backward_weight_flops
                   for op in self.ops if op.kind in MATMUL_KINDS)


@dataclass(frozen=True)
class ModelCosts:
    """What the cost models need of a captured model: its layer kinds and their order."""
    name: str
    seq_len: int
    hidden_size: int
    kinds: tuple[LayerKind, ...]
    blocks: tuple[str, ...]     # kind name of each repeated block, in order

    def kind(self, name: str) -> LayerKind:
        return self._kinds_by_name[name]

    @cached_property
    def _kinds_by_name(self) -> dict[str, LayerKind]:   # estimate looks a kind up per block and layout
        return {kind.name: kind for kind in self.kinds}

    @cached_property
    def block_counts(self) -> tuple[tuple["LayerKind", int], ...]:
        """Each block kind with how many blocks are of it."""
        return tuple((self.kind(name), n) for name, n in Counter(self.blocks).items())

    @cached_property
    def embedding(self) -> LayerKind:
        return next(k for k in self.kinds if k.role == "embedding")

    @cached_property
    def head(self) -> LayerKind:
        return next(k for k in self.kinds if k.role == "head")

    @cached_property
    def model_flops_per_sample(self) -> float:
        return (self.embedding.model_flops + self.head.model_flops
                + sum(self.kind(name).model_flops for name in self.blocks))
