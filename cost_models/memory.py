"""Memory per rank: model states by precision and ZeRO stage, activations by recomputation, reserves.

Mixed-precision Adam (design-notes; Rajbhandari et al. 2020): bf16 weights 2 B, fp32 gradient
accumulation 4 B (2 B with bf16 gradient reduction), fp32 master weights 4 B, Adam moments 4 + 4 B =
18 B (16 B) per parameter; Megatron-Core's precision-aware optimizer can keep the moments in bf16 and the
master as 16-bit remainders (`StateSharding.of`). Megatron's
distributed optimizer is ZeRO-1 (master and moments sharded over the data-parallel ranks), ZeRO-2 also
shards gradients, ZeRO-3 (FSDP) also shards weights.
"""
from __future__ import annotations

from dataclasses import dataclass

from hardware_profiles.schema import Device

from .layout import DEFAULT_RECOMPUTE_MODULES, Recompute, RecomputeModule
from .records import LayerKind, SavedTensor, Sharding

WEIGHT_BYTES = 2        # bf16 weights (fp8 training keeps bf16 weights and casts per GEMM)
MASTER_BYTES = 4        # fp32 master weights
REMAINDER_BYTES = 2     # the fp32 master's low 16 bits, beside its bf16 weight (TE FusedAdam store_param_remainders)


@dataclass(frozen=True)
class StateSharding:
    tp: int
    ep: int
    etp: int
    dp_cp: int              # ranks a dense parameter's optimizer state is sharded over (dp x cp)
    expert_dp: int          # ranks an expert parameter's state is sharded over
    zero: int
    gradient_bytes: int     # per parameter: `Layout.gradient_bytes`
    fp32_parameters: bool = False   # the parameters are the fp32 master, cast to bf16 per use (FSDP2 mixed
    #                                 precision, autocast): the optimizer holds moments only
    copied_roles: tuple[str, ...] = ()   # `copied_roles`: layers whose parameters a bf16 copy shadows in the step
    unsharded_gradients: bool = False    # ZeRO-2/3 gradients accumulate whole (`SoftwareStack.accumulates_unsharded`)
    optimizer_swap_chunks: int = 0  # `SoftwareStack.optimizer_swap_chunks`: states in host memory, one
    #                                 chunk of them on the device at a time
    moment_bytes: int = 4           # each of Adam's two moments (`SoftwareStack.adam_moment_bytes`)
    master_bytes: int = MASTER_BYTES   # the optimizer's master copy, where it is separate

    @classmethod
    def of(cls, layout, stack) -> "StateSharding":
        # Megatron-Core keeps remainders where TE manages the master: no FP8, or FP8 with delayed scaling
        # (OptimizerConfig.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        remainders = stack.precision_aware_in(layout) and (layout.precision == "bf16" or layout.fp8_recipe == "delayed")
        fp32_parameters = stack.master_weights == "parameters"
        unsharded = stack.accumulates_unsharded(layout)
        return cls(tp=layout.tp, ep=layout.ep, etp=layout.etp, dp_cp=layout.dp * layout.cp,
                   expert_dp=layout.expert_data_parallel, zero=layout.zero, gradient_bytes=layout.gradient_bytes,
                   fp32_parameters=fp32_parameters,
                   copied_roles=copied_roles(fp32_parameters, layout.zero, layout.dp * layout.cp),
                   unsharded_gradients=unsharded,
                   optimizer_swap_chunks=stack.optimizer_swap_chunks, moment_bytes=stack.moment_bytes_in(layout),
                   master_bytes=REMAINDER_BYTES if remainders else MASTER_BYTES)

    @property
    def optimizer_resident_fraction(self) -> float:
        """Share of the optimizer's states in device memory: one chunk of them where they are swapped."""
        return 1 / self.optimizer_swap_chunks if self.optimizer_swap_chunks else 1.0


@dataclass(frozen=True)
class ModelStateBytes:
    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer

    def __add__(self, other: "ModelStateBytes") -> "ModelStateBytes":
        return ModelStateBytes(self.weights + other.weights, self.gradients + other.gradients,
                               self.optimizer + other.optimizer)

    def __rmul__(self, count: float) -> "ModelStateBytes":   # `count` layers of one kind
        return ModelStateBytes(count * self.weights, count * self.gradients, count * self.optimizer)


def casts_by_fsdp_policy(zero: int, dp_cp: int) -> bool:
    """Whether torch's FSDP2 machinery wraps the parameters, casting them by its MixedPrecisionPolicy rather than
    torch.autocast: fully_shard for ZeRO-2/3, torch's replicate built on it for ZeRO-0 over dp x cp > 1 (as this
    runtime, `runtime/parallelize.apply_dp`, and torchtitan wrap them); not ZeRO-1's DDP, nor one rank."""
    return zero >= 2 or (zero == 0 and dp_cp > 1)


def copied_roles(fp32_parameters: bool, zero: int, dp_cp: int) -> tuple[str, ...]:
    """The layers (by role) whose parameters a step computes with in a bf16 copy held from their forward to their
    backward, where the fp32 parameters are the master (torch's mixed precision; a separate master's bf16 weights
    are the weights themselves). FSDP2's MixedPrecisionPolicy (fully_shard for ZeRO-2/3, torch's replicate on it
    for ZeRO-0 over dp > 1) casts every parameter into its unsharded copy, which only resharding after forward
    frees: ZeRO-3 (`reshard_after_forward=True`, the root too) frees each module's, and the two layers it gathers
    ahead are `comm_buffer_bytes`. torch.autocast (ZeRO-1's DDP, one data-parallel rank) keeps a copy of each
    weight a GEMM reads in its cache for the step's autocast region; an embedding lookup is no autocast op.
    Under torch's pipelining too: ZeRO-2 gathers once a step and keeps the copy, ZeRO-3 gathers every module but
    a stage's last in each forward and backward (its copy freed between them; the last module's is one layer).
    tests/test_precision_memory.py reads these from torch."""
    if not fp32_parameters or zero >= 3:
        return ()
    return ("embedding", "block", "head") if casts_by_fsdp_policy(zero, dp_cp) else ("block", "head")


def params_on_rank(kind: LayerKind, sharding: StateSharding) -> tuple[float, float]:
    """(dense, expert) parameters of one layer held by one rank before ZeRO."""
    dense = kind.params_by(Sharding.tensor) / sharding.tp + kind.params_by(Sharding.sequence)
    expert = kind.params_by(Sharding.expert) / (sharding.ep * sharding.etp)
    return dense, expert


def model_state_bytes(kind: LayerKind, sharding: StateSharding) -> ModelStateBytes:
    dense, expert = params_on_rank(kind, sharding)

    def shard(count: float, group: int, from_stage: int) -> float:
        return count / group if sharding.zero >= from_stage else count

    weight_bytes = MASTER_BYTES if sharding.fp32_parameters else WEIGHT_BYTES
    optimizer_bytes = optimizer_state_bytes_per_param(sharding)
    weights = weight_bytes * (shard(dense, sharding.dp_cp, 3) + shard(expert, sharding.expert_dp, 3))
    if kind.role in sharding.copied_roles:
        weights += WEIGHT_BYTES * (dense + expert)
    grads_from = 4 if sharding.unsharded_gradients else 2   # no ZeRO stage shards them inside the step then
    grads = sharding.gradient_bytes * (shard(dense, sharding.dp_cp, grads_from) +
                                       shard(expert, sharding.expert_dp, grads_from))
    optim = optimizer_bytes * (shard(dense, sharding.dp_cp, 1) + shard(expert, sharding.expert_dp, 1))
    return ModelStateBytes(weights, grads, optim * sharding.optimizer_resident_fraction)


def optimizer_state_bytes_per_param(sharding: StateSharding) -> int:
    """Bytes the optimizer keeps per parameter it updates: two moments, and the master where it is separate."""
    moments = 2 * sharding.moment_bytes
    return moments if sharding.fp32_parameters else moments + sharding.master_bytes


def adam_bytes_touched(sharding: StateSharding) -> float:
    """Bytes one Adam update moves per parameter: the gradient read, every state read and written (the fp32
    parameter too where it is the master), and the bf16 weight written (read as well beside remainders)."""
    if sharding.fp32_parameters:
        return sharding.gradient_bytes + 2 * (optimizer_state_bytes_per_param(sharding) + MASTER_BYTES)
    weight = 2 * WEIGHT_BYTES if sharding.master_bytes == REMAINDER_BYTES else WEIGHT_BYTES
    return sharding.gradient_bytes + 2 * optimizer_state_bytes_per_param(sharding) + weight


def activation_bytes(kind: LayerKind, recompute: Recompute, tp: int, sp: bool, cp: int, micro_batch: int,
                     precision: str = "bf16",
                     modules: tuple[RecomputeModule, ...] = DEFAULT_RECOMPUTE_MODULES, expert_load: float = 1.0,
                     probs_in_expert_activation: bool = False) -> float:
    """Saved-for-backward bytes of one layer and micro-batch (Korthikanti et al. 2022, Table 2 forms).

    Tensors inside tensor-parallel pairs are divided by tp; the rest by tp only with sequence
    parallelism; everything by cp. Selective drops what recomputing `modules` frees (by default the
    attention core's own tensors: the s x s ones where attention is not fused); full keeps the input.
    What the routed ops make or keep (`OpCost.routed`) is the most loaded expert rank's: `expert_load` x the mean.
    FP8 transformer layers keep their weight-GEMM inputs as 1-byte copies (Transformer Engine; `precision` is
    the stack's `saved_input_precision`, bf16 where FP8 layers keep bf16 inputs); the embedding and output
    layers stay in bf16 (Megatron-Core builds them without Transformer Engine). `probs_in_expert_activation`:
    the stack's `moe_probs_in_expert_activation`, under which the routed experts' output is not kept.
    """
    if recompute is Recompute.full:
        return kind.input_bytes * micro_batch / ((tp if sp else 1) * cp)
    fp8 = precision == "fp8" and kind.role == "block"
    total = 0.0
    for saved in kind.saved:
        if recompute is Recompute.selective and saved.dropped_by(modules):
            continue
        if probs_in_expert_activation and saved.routed_output_for_probs:
            continue
        divisor = tp if saved.sharding is Sharding.tensor or sp else 1
        load = expert_load if expert_load != 1.0 and routed_tensor(kind, saved) else 1.0
        total += (saved.fp8_bytes if fp8 else saved.bytes) * load / divisor
    return total * micro_batch / cp


def routed_tensor(kind: LayerKind, saved: SavedTensor) -> bool:
    """Whether a saved tensor is as large as the rank's share of the routed tokens: made by a routed op
    (`OpCost.routed`), or kept by a node that runs only routed ops (an expert GEMM keeps the dispatched tokens).
    A node that runs more (an expert container captured as one node) keeps its input too, which is not routed,
    and what a shared expert inside it makes is marked apart."""
    if saved.inner_module is RecomputeModule.shared_experts:
        return False
    return saved.producer in kind.routed_nodes or not kind.only_routed_nodes.isdisjoint(saved.savers)


def logits_bytes(kind: LayerKind, tp: int, cp: int, micro_batch: int, loss_gradient: str) -> float:
    """Logits the loss keeps (last stage): its fp32 softmax, or the bf16 logits a fused loss holds its
    gradient in."""
    kept = kind.logits_fp32_bytes * micro_batch / (tp * cp)
    return kept * BF16_BYTES / FP32_BYTES if loss_gradient == "fused" else kept


# bytes per logit that cross-entropy's backward allocates beside the logits it keeps, by stack behaviour:
# in place (Megatron vocab-parallel cross-entropy writes the gradient into the saved fp32 softmax and hands
# the output layer a bf16 copy, megatron/core/tensor_parallel/cross_entropy.py), eager (F.cross_entropy:
# NLL and log-softmax backward each allocate an fp32 tensor of the logits' size), or fused (Transformer
# Engine's parallel_cross_entropy, Megatron-Core --cross-entropy-fusion-impl te: it keeps the bf16 logits and
# three fp32 values per token, unbilled, and its backward kernel writes the gradient into those logits in
# place: transformer_engine/pytorch/cross_entropy.py, triton/cross_entropy.py @02965d2e)
LOSS_GRADIENT_BYTES_PER_LOGIT = {"in_place": 2, "eager": 2 * 4, "fused": 0}
FP32_BYTES = 4
BF16_BYTES = 2


def loss_gradient_bytes(kind: LayerKind, tp: int, cp: int, micro_batch: int, loss_gradient: str) -> float:
    """Gradient buffers the loss's backward adds on the last stage, at the start of backward."""
    logits = kind.logits_fp32_bytes / FP32_BYTES * micro_batch / (tp * cp)
    return logits * LOSS_GRADIENT_BYTES_PER_LOGIT[loss_gradient]


def gradients_held_at_peak(gradient_buffer: str, num_micro_batches: int) -> bool:
    """Whether the gradients exist while the activations peak: always with a persistent buffer (Megatron's
    param-and-grad buffer, DeepSpeed's contiguous gradients); with gradients that backward allocates, from
    the second micro-batch of a step on (accumulation), but not in a step of one micro-batch, where they
    grow only as backward frees the activations."""
    return gradient_buffer == "persistent" or num_micro_batches > 1


def usable_bytes(device: Device) -> float:
    """HBM left for tensors after the runtime context and allocator fragmentation."""
    reserve = device.memory_reserve
    return (device.hbm_bytes - reserve.runtime_context_bytes) * (1 - reserve.fragmentation_fraction)


@dataclass(frozen=True)
class StageMemory:
    """Peak memory of one pipeline stage, as named parts (bytes per rank)."""
    stage: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    loss_gradient: float
    recompute_working: float
    comm_buffers: float
    capacity: float
    gradients_held: bool = True     # `gradients_held_at_peak`
    # activation offloading (cost_models/offload.py): `activations` leaves the offloaded blocks out; the largest
    # of them is on the device while its copy runs
    offload_in_flight: float = 0.0
    host_bytes: float = 0.0                 # the offloaded activations, in host memory
    host_capacity: float = float("inf")     # `Device.host_memory_bytes`

    @property
    def total(self) -> float:
        """States, and the larger of the two peaks: the start of backward (activations, logits and their
        gradient, plus the gradients where they are held) and the end of backward (all gradients)."""
        activation_peak = (self.activations + self.logits + self.loss_gradient + self.recompute_working
                           + self.offload_in_flight)
        held = self.gradients if self.gradients_held else 0.0
        return self.weights + self.optimizer + self.comm_buffers + max(activation_peak + held, self.gradients)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity and self.host_bytes <= self.host_capacity

    def parts(self) -> dict[str, float]:
        return {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "logits": self.logits, "loss_gradient": self.loss_gradient,
                "recompute_working": self.recompute_working, "comm_buffers": self.comm_buffers,
                **({"offload_in_flight": self.offload_in_flight} if self.offload_in_flight else {})}
