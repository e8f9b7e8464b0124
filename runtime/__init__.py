"""Apply a plan to a torch model with torch.distributed: DeviceMesh, DTensor TP/SP, FSDP2, pipelining,
activation checkpointing, DCP checkpoints.

A user's own loop: `parallelize(model, graph, plan)` lays the model out on this rank, `Step` runs a step of it
with the user's loss, `rank_loader` hands this rank its share of the data; the optimizer, the scheduler and the
loop stay the user's. `Trainer` composes them with health checks, checkpoints, restarts and telemetry."""
from .checkpoint import LoopState, load_training, save_training
from .checkpointing import Cadence, Checkpointer
from .data import rank_loader
from .dims import PlanError
from .health import HealthMonitor, HealthPolicy, HealthStop, Rollback
from .laid_out import LaidOutModel, parallelize
from .parallel_model import ParallelModel, apply_plan
from .process_group import end_distributed, init_distributed, settle
from .step import LossTerms, Step, token_cross_entropy
from .trainer import Trainer, TrainerConfig
from .verified import CheckpointFailed, CheckpointRefused
from .watchdog import Watchdog

__all__ = ["PlanError", "ParallelModel", "apply_plan", "LaidOutModel", "parallelize", "Step", "LossTerms",
           "token_cross_entropy", "rank_loader", "save_training", "load_training", "LoopState", "Cadence",
           "Checkpointer", "HealthMonitor", "HealthPolicy", "HealthStop", "Rollback", "Trainer", "TrainerConfig",
           "Watchdog", "init_distributed", "end_distributed", "settle", "CheckpointFailed", "CheckpointRefused"]
