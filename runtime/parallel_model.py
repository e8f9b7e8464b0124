"""`ParallelModel`: a laid-out model (`runtime/laid_out.py`), a step (`runtime/step.py`), an optimizer by name and
the in-step health checks, trained one global batch per call: what the training driver (`runtime/train.py`) and
the Trainer run. A user's own loop takes `parallelize` and `Step` instead, with its own optimizer and data."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from cost_models.layout import Layout, Recompute
from planner.graph_capture.graph import ModelGraph

from . import checkpoint
from .comm_telemetry import CommRecorder, GroupKinds
from .dims import PlanError
from .health import HealthMonitor, HealthPolicy
from .laid_out import LaidOutModel, device_type_of, inner, parallelize
from .optimizer_check import OptimizerCheck
from .step import Step, token_cross_entropy
from .stragglers import ComputeTimer, StragglerMonitor
from .telemetry import Stopwatch

OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


class ParallelModel:
    """A model laid out by a plan: `train_step(tokens, targets) -> loss`, `state_dict()`, `save`/`load`."""

    def __init__(self, model: nn.Module, graph: ModelGraph, layout: Layout, device_type: str = "cpu",
                 optimizer: str = "sgd", lr: float = 0.1, max_grad_norm: float | None = None,
                 precision: str | None = None, health: HealthPolicy | None = HealthPolicy()):
        self.laid = LaidOutModel(model, graph, layout, device_type, precision)
        laid = self.laid
        self.layout, self.graph, self.device, self.mesh, self.local = laid.layout, graph, laid.device, laid.mesh, laid.local
        self.modules, self.params, self.rank, self.notes = laid.modules, laid.params, laid.rank, laid.notes
        self.replicated, self.expert_params, self.chunk_ids = laid.replicated, laid.expert_params, laid.chunk_ids
        if optimizer not in OPTIMIZERS:
            raise PlanError(f"optimizer '{optimizer}' is not {' or '.join(OPTIMIZERS)}")
        self.optimizer = laid.optimizer(OPTIMIZERS[optimizer], self.params, lr=lr)
        self.step_runner = Step(laid, token_cross_entropy)
        self.max_grad_norm = max_grad_norm
        self.step = 0              # steps taken (a resumed run starts at the checkpoint's)
        self.timing = None         # the last step's parts (runtime/telemetry.StepTiming)
        self.comm_recorder, self.comm_every = None, 0   # exposed communication by kind (record_communication)
        self.on_gradients = None   # callback(ParallelModel) between backward and the optimizer step
        self.after_backward = None  # callback(ParallelModel) once gradients are complete (fault injection)
        self.after_step = None     # callback(ParallelModel) after the optimizer step (fault injection)
        # the replica check's all-gather read in the next step, after its loss all-reduce (waiting for no one): for a
        # caller that calls `settle()` after its last step, as the Trainer does; else each check is read at once
        self.deferred_checks = False
        group = laid.dp_mesh().get_group()
        self.health = None if health is None else HealthMonitor(health, group, self.replicated, self.device)
        blocks_alone = self.layout.tp == self.layout.cp == self.layout.ep == 1   # no collective inside a block
        self.stragglers = None if health is None or not health.straggler_every else StragglerMonitor(
            health.straggler_every, health.straggler_ratio, health.straggler_min_excess_s,
            ComputeTimer(self.modules, self.device, whole_blocks=blocks_alone), group, self.device,
            self.health.report)
        sharded_update = isinstance(self.optimizer, ZeroRedundancyOptimizer) or not self.replicated
        self.optimizer_check = OptimizerCheck(self.optimizer, group, health.optimizer_every, health.optimizer_samples) \
            if health and health.optimizer_every and sharded_update and laid.dp_mesh().size() > 1 else None
        if self.optimizer_check:
            self.notes.append(self.optimizer_check.limit())
        if self.health and not self.replicated and laid.dp_mesh().size() > 1:
            self.notes.append("the replica fingerprint (silent data corruption) is off: FSDP2 shards the "
                              "parameters, so no rank holds a replica to compare")

    def check_at(self, step: int) -> None:
        """Check `step`'s computation whatever the cadences (the step before a checkpoint): its matrix
        products and, where shards are owned, its optimizer update."""
        if self.health:
            self.health.check_at(step)
        if self.optimizer_check:
            self.optimizer_check.forced_step = step

    def settle(self) -> None:
        """The verdict of a check still in flight (the last step's replica check) read and said: after the last
        step, which has no next step to read it in."""
        if self.health:
            self.health.settle()

    def batch_slice(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's share of the global batch: rows by its data-parallel index, columns by cp."""
        return self.laid.shard(tokens)

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step on the global batch (every rank passes the same global tokens); what its parts
        took is in `self.timing` afterwards (runtime/telemetry.py)."""
        clock = Stopwatch(self.device)
        tokens, targets = self.batch_slice(tokens), self.batch_slice(targets)
        self.optimizer.zero_grad()
        if self.stragglers:
            self.stragglers.before_step(self.step + 1)
        recorder = self.comm_recorder if self.comm_every and (self.step + 1) % self.comm_every == 0 else None
        products = self.health.watching(self.step + 1) if self.health else contextlib.nullcontext()
        with recorder or contextlib.nullcontext(), products:
            share = self.step_runner.forward_backward_share(tokens, targets)
        self.step += 1
        if self.after_backward:
            self.after_backward(self)
        clock.mark("forward_backward_s")
        flag = self.health.nonfinite_flag(share, [p.grad for p in self.params if p.grad is not None]) \
            if self.health else None
        wrong = self.health.wrong_product_flag() if self.health else None
        mean, anywhere, wrong_anywhere = self._mean_over_ranks(share, flag, wrong)
        if self.health:   # the last step's replica check, read now that every rank has met
            self.health.settle()
        accepted = not self.health or (self.health.products_right(self.step, wrong_anywhere)
                                        and self.health.accept(self.step, mean, anywhere, flag))
        clock.mark("checks_s")
        if accepted:
            self._update()
            clock.mark("optimizer_s")
            if self.health:
                self.health.check_replicas(self.step, self.params, stragglers=self.stragglers,
                                           deferred=self.deferred_checks)
        else:
            self.optimizer.zero_grad()   # the batch is skipped on every rank: no update, no optimizer step
        computed = self.stragglers.after_step(self.step) if self.stragglers else None
        clock.mark("checks_s")
        self.timing = clock.timing(computed, recorder.exposed() if recorder else None)
        return mean

    def _mean_over_ranks(self, share: torch.Tensor, nonfinite_flag: torch.Tensor | None,
                         wrong_flag: torch.Tensor | None) -> tuple[float, bool, bool]:
        """The step's loss, whether any rank raised the non-finite flag and whether any found a wrong matrix
        product, by one all-reduce over every rank (none on a world of one), read once (`Step.loss_of` says
        whose shares add up to the loss)."""
        zero = torch.zeros((), device=share.device)
        value = torch.stack([share.detach().float().reshape(()), zero if nonfinite_flag is None else nonfinite_flag,
                             zero if wrong_flag is None else wrong_flag.to(share.device)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(value)
        total, flags, wrong = value.tolist()
        return self.step_runner.loss_of(total), flags > 0, wrong > 0

    def record_communication(self, every: int) -> None:
        """Measure exposed communication by kind on every `every`-th step (runtime/comm_telemetry.py)."""
        meshes = {name: self.mesh[name] for name in self.mesh.mesh_dim_names}
        meshes["dp_cp"] = self.laid.dp_mesh()
        if self.layout.ep > 1:
            meshes["ep"], meshes["edp"] = self.laid.ep_mesh, self.laid.edp_mesh
        groups = {name: mesh.get_group() for name, mesh in meshes.items() if mesh.size() > 1}
        self.comm_recorder = CommRecorder(GroupKinds.of(groups, self.layout.zero), self.device.type)
        self.comm_every = every

    def _update(self) -> None:
        if self.max_grad_norm:
            self.clip_gradients(self.max_grad_norm)
        if self.on_gradients:
            self.on_gradients(self)
        checked = self.optimizer_check.around(self.step) if self.optimizer_check else contextlib.nullcontext([])
        with checked as wrong:
            self.optimizer.step()
        if self.optimizer_check and self.optimizer_check.due(self.step):
            self.health.updates_right(self.step, wrong)   # raises Rollback or HealthStop on every rank alike
        if self.after_step:
            self.after_step(self)

    def clip_gradients(self, max_norm: float) -> float:
        return self.step_runner.clip_grad_norm_(max_norm)

    def gradients(self) -> dict[str, torch.Tensor]:
        return self.laid.gradients()

    @property
    def canonical_names(self) -> dict[str, str]:
        return self.laid.canonical_names

    def state_dict(self) -> dict:
        return self.laid.state_dict()

    def save(self, path: str, step: int, asynchronous: bool = False, process_group=None, writer=None):
        """The whole training state after `step` (model, optimizer, step, learning rate, RNG) as one DCP
        checkpoint any other layout can load; `asynchronous` returns `dcp.async_save`'s future; `writer` DCP's
        storage writer (None: its own)."""
        lr = self.optimizer.param_groups[0]["lr"]
        return checkpoint.save(path, [inner(m) for m in self.modules], self.optimizer, self.canonical_names,
                               checkpoint.TrainState(step=step, lr=lr), asynchronous, process_group, writer)

    def identity(self) -> checkpoint.Identity:
        """What a checkpoint of this rank's state is of (runtime/verified.py checks it before a load)."""
        return checkpoint.identity_of([inner(m) for m in self.modules], self.optimizer)

    def forget_optimizer_state(self) -> None:
        """Drop the optimizer's moments and step counts (what a model-only checkpoint resumes with)."""
        checkpoint.local_optimizer(self.optimizer).state.clear()

    def load(self, path: str) -> int:
        """Resume from a checkpoint written under any layout; returns the step it ended."""
        train = checkpoint.load(path, [inner(m) for m in self.modules], self.optimizer, self.canonical_names)
        self.step = train.step
        for group in self.optimizer.param_groups:   # ZeRO-1 copies the outer groups into its shard's
            group["lr"] = train.lr
        return train.step


def apply_plan(model: nn.Module, graph: ModelGraph, plan_or_layout, device_type: str | None = None,
               **kwargs) -> ParallelModel:
    """Lay `model` out as the plan says (a `planner.plans.Plan` or a `Layout`) and return a ParallelModel.
    The device type defaults to the one the plan's cluster profile names (cpu for a bare Layout)."""
    is_plan = hasattr(plan_or_layout, "to_layout")
    layout = plan_or_layout.to_layout() if is_plan else plan_or_layout
    if device_type is None:
        device_type = device_type_of(plan_or_layout) if is_plan else "cpu"
    return ParallelModel(model, graph, layout, device_type, **kwargs)


__all__ = ["ParallelModel", "apply_plan", "parallelize", "PlanError", "Recompute"]
