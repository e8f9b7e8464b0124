"""Apply a plan to a torch model with torch.distributed: DeviceMesh, DTensor TP/SP, FSDP2, pipelining,
activation checkpointing, DCP checkpoints."""
from .dims import PlanError
from .parallel_model import ParallelModel, apply_plan

__all__ = ["PlanError", "ParallelModel", "apply_plan"]
