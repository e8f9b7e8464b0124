"""Memory per rank: model states by precision and ZeRO stage, activations by recomputation, reserves.

Mixed-precision Adam (design-notes; Rajbhandari et al. 2020): bf16 weights 2 B, fp32 gradient
accumulation 4 B (2 B with bf16 gradient reduction), fp32 master weights 4 B, Adam moments 4 + 4 B =
18 B (16 B) per parameter. Megatron's
distributed optimizer is ZeRO-1 (master and moments sharded over the data-parallel ranks), ZeRO-2 also
shards gradients, ZeRO-3 (FSDP) also shards weights.
"""
from __future__ import annotations

from dataclasses import dataclass

from hardware_profiles.schema import Device

from .layout import Recompute
from .records import LayerKind, Sharding

WEIGHT_BYTES = 2        # bf16 weights (fp8 training keeps bf16 weights and casts per GEMM)
OPTIMIZER_BYTES = 12    # fp32 master + Adam m and v


@dataclass(frozen=True)
class StateSharding:
    tp: int
    ep: int
    etp: int
    dp_cp: int              # ranks a dense parameter's optimizer state is sharded over (dp x cp)
    expert_dp: int          # ranks an expert parameter's state is sharded over
    zero: int
    gradient_bytes: int     # per parameter: `Layout.gradient_bytes`


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


def params_on_rank(kind: LayerKind, sharding: StateSharding) -> tuple[float, float]:
    """(dense, expert) parameters of one layer held by one rank before ZeRO."""
    dense = kind.params_by(Sharding.tensor) / sharding.tp + kind.params_by(Sharding.sequence)
    expert = kind.params_by(Sharding.expert) / (sharding.ep * sharding.etp)
    return dense, expert


def model_state_bytes(kind: LayerKind, sharding: StateSharding) -> ModelStateBytes:
    dense, expert = params_on_rank(kind, sharding)

    def shard(count: float, group: int, from_stage: int) -> float:
        return count / group if sharding.zero >= from_stage else count

    weights = WEIGHT_BYTES * (shard(dense, sharding.dp_cp, 3) + shard(expert, sharding.expert_dp, 3))
    grads = sharding.gradient_bytes * (shard(dense, sharding.dp_cp, 2) + shard(expert, sharding.expert_dp, 2))
    optim = OPTIMIZER_BYTES * (shard(dense, sharding.dp_cp, 1) + shard(expert, sharding.expert_dp, 1))
    return ModelStateBytes(weights, grads, optim)


def activation_bytes(kind: LayerKind, recompute: Recompute, tp: int, sp: bool, cp: int, micro_batch: int,
                     precision: str = "bf16") -> float:
    """Saved-for-backward bytes of one layer and micro-batch (Korthikanti et al. 2022, Table 2 forms).

    Tensors inside tensor-parallel pairs are divided by tp; the rest by tp only with sequence
    parallelism; everything by cp. Selective drops the s x s attention tensors; full keeps the input.
    FP8 transformer layers keep their weight-GEMM inputs as 1-byte copies (Transformer Engine); the
    embedding and output layers stay in bf16 (Megatron-Core builds them without Transformer Engine).
    """
    if recompute is Recompute.full:
        return kind.input_bytes * micro_batch / ((tp if sp else 1) * cp)
    fp8 = precision == "fp8" and kind.role == "block"
    total = 0.0
    for saved in kind.saved:
        if recompute is Recompute.selective and saved.attention_matrix:
            continue
        divisor = tp if saved.sharding is Sharding.tensor or sp else 1
        total += (saved.fp8_bytes if fp8 else saved.bytes) / divisor
    return total * micro_batch / cp


def logits_bytes(kind: LayerKind, tp: int, cp: int, micro_batch: int) -> float:
    """fp32 logits kept for the vocabulary-parallel cross-entropy (last stage)."""
    return kind.logits_fp32_bytes * micro_batch / (tp * cp)


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
    recompute_working: float
    comm_buffers: float
    capacity: float

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.activations + self.logits
                + self.recompute_working + self.comm_buffers)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def parts(self) -> dict[str, float]:
        return {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "logits": self.logits,
                "recompute_working": self.recompute_working, "comm_buffers": self.comm_buffers}
