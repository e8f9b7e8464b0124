"""`apply_plan` and `ParallelModel`: a plan applied to a torch model, trained with one call per step."""
from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.pipelining import Schedule1F1B, ScheduleDualPipeV, ScheduleInterleaved1F1B
from torch.nn.parallel import DistributedDataParallel

from cost_models.layout import Layout, Recompute
from cost_models.pipeline import dualpipev_micro_batch_problem, even_partition
from cost_models.step_time import chunk_blocks
from hardware_profiles.loader import load_stack
from hardware_profiles.stack import RUNTIME_STACK
from planner.graph_capture.graph import ModelGraph
from planner.rules.stack import layout_stack_problems

from . import checkpoint
from .comm_telemetry import CommRecorder, GroupKinds
from .dims import PlanError, build_mesh, check_runnable, error_line, local_ranks, world
from .health import HealthMonitor, HealthPolicy
from .stragglers import ComputeTimer, StragglerMonitor
from .telemetry import Stopwatch
from .context_parallel import apply_cp, shard_sequence
from .experts import apply_ep, expert_meshes, finish_expert_grads
from . import mixed_precision
from .parallelize import apply_ac, apply_dp, apply_tp, uses_fsdp
from .pipeline_stage import GatheringPipelineStage
from .sequential_stage import sequential_stage
from .split import split_stage
from .tied import StageTies, retie, tied_names, untie_head


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


class ParallelModel:
    """A model laid out by a plan: `train_step(tokens, targets) -> loss`, `state_dict()`, `save`/`load`."""

    def __init__(self, model: nn.Module, graph: ModelGraph, layout: Layout, device_type: str = "cpu",
                 optimizer: str = "sgd", lr: float = 0.1, max_grad_norm: float | None = None,
                 precision: str | None = None, health: HealthPolicy | None = HealthPolicy()):
        rank, world_size = world()
        check_runnable(layout, world_size, graph.num_blocks)
        self.precision = mixed_precision.check(precision or str(layout.precision), layout, device_type)
        # one rule set with the planner: what `--stack parallel-planner` would never plan, refused here
        refused = layout_stack_problems(layout, load_stack(RUNTIME_STACK), graph)
        if refused:
            raise PlanError("the plan asks for what this runtime does not run: " + "; ".join(refused)
                            + f" (plan with --stack {RUNTIME_STACK} to stay inside it)")
        too_few = dualpipev_micro_batch_problem(layout.num_micro_batches, layout.pp) if layout.dualpipev else None
        if too_few:
            raise PlanError(too_few + f": a global batch of at least {2 * layout.pp * layout.dp * layout.micro_batch}"
                            f" or a smaller mbs")
        stage_layers = layout.stage_layers or even_partition(graph.num_blocks, layout.pp * layout.vp)
        self.layout = replace(layout, stage_layers=stage_layers)
        recompute = layout.block_recompute(stage_layers)
        self.graph, self.device = graph, torch.device(device_type)
        self.notes: list[str] = []   # where the runtime applies the plan otherwise than it says
        self.mesh = build_mesh(self.layout, device_type)
        self.local = local_ranks(self.mesh)
        self.tied = tied_names(model)
        self.modules = self._build_modules(model, graph, recompute)
        self.stage_ties = StageTies(self.tied, self.mesh, graph.embedding_modules, graph.head_modules,
                                    self.layout.chunk_rank(len(stage_layers) - 1)) \
            if self.tied and self.layout.pp > 1 else None
        self.params = [p for m in self.modules for p in m.parameters()]
        self._check_forward(graph)
        self.optimizer = self._optimizer(optimizer, lr)
        self.max_grad_norm = max_grad_norm
        self.schedule = self._schedule() if self.layout.pp > 1 else None
        self.rank = rank
        self.step = 0              # steps taken (a resumed run starts at the checkpoint's)
        self.timing = None         # the last step's parts (runtime/telemetry.StepTiming)
        self.comm_recorder, self.comm_every = None, 0   # exposed communication by kind (record_communication)
        self.on_gradients = None   # callback(ParallelModel) between backward and the optimizer step
        self.after_backward = None  # callback(ParallelModel) once gradients are complete (fault injection)
        self.after_step = None     # callback(ParallelModel) after the optimizer step (fault injection)
        self.health = None if health is None else HealthMonitor(health, self._dp_mesh().get_group(),
                                                                self.replicated, self.device)
        self.stragglers = None if health is None or not health.straggler_every else StragglerMonitor(
            health.straggler_every, health.straggler_ratio, health.straggler_min_excess_s,
            ComputeTimer(self.modules, self.device), self._dp_mesh().get_group(), self.device, self.health.report)
        if self.health and not self.replicated and self._dp_mesh().size() > 1:
            self.notes.append("the replica fingerprint (silent data corruption) is off: FSDP2 shards the "
                              "parameters, so no rank holds a replica to compare")

    # -- construction ---------------------------------------------------------------------------
    def _build_modules(self, model: nn.Module, graph: ModelGraph, recompute) -> list[nn.Module]:
        dims = self.layout
        chunks = chunk_blocks(self.layout.stage_layers)
        if dims.pp == 1:
            modules = [model]
        else:
            # round robin, or DualPipeV's V (the rank holding chunk 0 holds the last chunk too)
            mine = [j for j in range(len(chunks)) if self.layout.chunk_rank(j) == self.local["pp"]]
            modules = [self._stage(model, graph, chunks[j], j == 0, j == len(chunks) - 1) for j in mine]
            self.chunk_ids = mine
            if self.tied and 0 in mine and len(chunks) - 1 in mine:
                untie_head(modules[-1], self.tied, graph.head_modules)
        self.expert_params: list[nn.Parameter] = []
        if dims.ep > 1:
            self.ep_mesh, self.edp_mesh, self.expert_mesh = expert_meshes(self.mesh, dims.ep, dims.etp)
        wrapped = []
        for module in modules:
            module.to(self.device)
            if self.precision == "fp8":
                mixed_precision.fp8_linears(module, graph)
            if dims.tp > 1:
                apply_tp(module, graph, self.mesh["tp"], dims.sp)
                retie(module, self.tied)
            if dims.cp > 1:
                apply_cp(module, graph, self.mesh["cp"], graph.seq_len)
            experts = apply_ep(module, graph, self.ep_mesh, self.expert_mesh) if dims.ep > 1 else []
            self.expert_params += experts
            apply_ac(module, graph, recompute, self.layout.dualpipev)
            wrapped.append(apply_dp(module, graph, self._dp_mesh(), dims.zero, set(experts),
                                    pipelined=dims.pp > 1,
                                    mp_policy=mixed_precision.fsdp_policy(self.precision, self.layout)))
        # ZeRO-1 beside tp or ep with dp > 1 never gets here: the stack's zero_stages_beside_model_parallel
        # refuses it before step 1 (ZeroRedundancyOptimizer takes no DTensor), and the planner never plans it
        self.replicated = dims.zero < 2   # every data-parallel rank holds the same parameters
        self.autocast = mixed_precision.autocast(self.precision, self.device.type,
                                                 uses_fsdp(dims.zero, self._dp_mesh().size()))
        return wrapped

    def _stage(self, model: nn.Module, graph: ModelGraph, blocks: range, is_first: bool, is_last: bool) -> nn.Module:
        """One pipeline chunk: cut from the fx graph where torch.fx traced the model, else a shell of the
        model running its own forward over the chunk's blocks (runtime/sequential_stage.py)."""
        if graph.front_end == "torch.fx":
            return split_stage(model, [slot.module_name for slot in graph.blocks], blocks, is_first, is_last)
        shards = self.layout.tp if self.layout.sp and self.layout.tp > 1 else 1
        return sequential_stage(model, graph.block_stack, blocks, is_first, is_last, graph.embedding_modules,
                                graph.head_modules, shards)

    def _check_forward(self, graph: ModelGraph) -> None:
        """Under tensor parallelism, one forward of one sequence before the first step: a module whose code
        assumes the full width (nanoGPT's `C // n_head` head width) fails here, on every rank alike, as a
        refusal that names the cause instead of a view error in step 1. (Pipelined and context-parallel
        layouts are not dry-run: their forward needs the schedule or the sequence shards.)"""
        if self.layout.tp == 1 or self.layout.pp > 1 or self.layout.cp > 1:
            return
        tokens = torch.zeros((1, graph.seq_len), dtype=torch.long, device=self.device)
        module, training = self.modules[0], self.modules[0].training
        devices = [] if self.device.type == "cpu" else [self.device]
        try:   # in eval mode, with the RNG put back: the dry run draws nothing training would
            with torch.no_grad(), torch.random.fork_rng(devices=devices, device_type=self.device.type), self.autocast:
                module.eval()
                module(tokens)
        except RuntimeError as exc:
            cause = error_line(exc, 160)
            raise PlanError(f"under tp={self.layout.tp} the model's forward fails before training ({cause}): its "
                            "code assumes the full hidden width where column-parallel projections hand it "
                            f"1/{self.layout.tp} of it (e.g. a head width computed as C // n_head); compute "
                            "widths from the projection's output (reshape(b, s, heads, -1)) or run tp=1") from None
        finally:
            module.train(training)
            # FSDP2 without resharding after forward (ZeRO-1/2) would keep the unsharded parameters
            # registered until a backward: put the sharded ones back, as the optimizer and DCP know them
            for sub in module.modules():
                if isinstance(sub, FSDPModule):
                    sub.reshard()

    def _dp_mesh(self):
        names = self.mesh.mesh_dim_names
        if "cp" in names and self.layout.cp > 1:
            return self.mesh["dp", "cp"]._flatten("dp_cp")
        return self.mesh["dp"]

    def _optimizer(self, name: str, lr: float):
        make = {"sgd": lambda params: torch.optim.SGD(params, lr=lr),
                "adamw": lambda params: torch.optim.AdamW(params, lr=lr)}
        if name not in make:
            raise PlanError(f"optimizer '{name}' is not sgd or adamw")
        if self.layout.zero == 1 and self.layout.tp == 1 and self._dp_mesh().size() > 1 and not self.expert_params:
            cls = torch.optim.SGD if name == "sgd" else torch.optim.AdamW
            return ZeroRedundancyOptimizer(self.params, optimizer_class=cls, lr=lr,
                                           process_group=self._dp_mesh().get_group())
        return make[name](self.params)

    def _schedule(self):
        dims = self.layout
        pp_group = self.mesh["pp"].get_group()
        chunks = len(self.layout.stage_layers)
        stages = [GatheringPipelineStage(module, j, chunks, self.device, group=pp_group)
                  for module, j in zip(self.modules, self.chunk_ids)]
        micro = self.layout.num_micro_batches
        if self.layout.dualpipev:   # torch places the stages as a V itself and checks micro >= 2 pp
            return ScheduleDualPipeV(stages, n_microbatches=micro, loss_fn=cross_entropy)
        if dims.vp > 1:
            return ScheduleInterleaved1F1B(stages, n_microbatches=micro, loss_fn=cross_entropy)
        return Schedule1F1B(stages[0], n_microbatches=micro, loss_fn=cross_entropy)

    # -- training -------------------------------------------------------------------------------
    def batch_slice(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's share of the global batch: rows by its data-parallel index, columns by cp."""
        dp = self.layout.dp
        rows = tokens.shape[0] // dp
        start = self.local.get("dp", 0) * rows
        mine = tokens[start:start + rows]
        if self.layout.cp > 1:  # and its share of the sequence, causally balanced
            mine = shard_sequence(mine, self.layout.cp, self.local["cp"])
        return mine

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step on the global batch (every rank passes the same global tokens); what its parts
        took is in `self.timing` afterwards (runtime/telemetry.py)."""
        clock = Stopwatch(self.device)
        tokens, targets = self.batch_slice(tokens).to(self.device), self.batch_slice(targets).to(self.device)
        self.optimizer.zero_grad()
        if self.stragglers:
            self.stragglers.before_step(self.step + 1)
        recorder = self.comm_recorder if self.comm_every and (self.step + 1) % self.comm_every == 0 else None
        with recorder or contextlib.nullcontext():
            loss = self._forward_backward(tokens, targets)
        self.step += 1
        if self.after_backward:
            self.after_backward(self)
        clock.mark("forward_backward_s")
        flag = self.health.nonfinite_flag(loss, [p.grad for p in self.params if p.grad is not None]) \
            if self.health else None
        mean, anywhere = self._mean_over_ranks(loss, flag)
        accepted = not self.health or self.health.accept(self.step, mean, anywhere, flag)
        clock.mark("checks_s")
        if accepted:
            self._update()
            clock.mark("optimizer_s")
            if self.health:
                self.health.check_replicas(self.step, self.params)
        else:
            self.optimizer.zero_grad()   # the batch is skipped on every rank: no update, no optimizer step
        computed = self.stragglers.after_step(self.step) if self.stragglers else None
        clock.mark("checks_s")
        self.timing = clock.timing(computed, recorder.exposed() if recorder else None)
        return mean

    def _forward_backward(self, tokens, targets) -> torch.Tensor:
        """The step's forward and backward and the gradient reductions that complete it (its exposed
        communication is what `runtime/comm_telemetry.py` measures)."""
        with self.autocast:   # bf16 compute over fp32 parameters where FSDP2's policy does not cast
            loss = self._accumulate(tokens, targets) if self.schedule is None else self._pipelined(tokens, targets)
        if self.stage_ties:
            self.stage_ties.sum_gradients([_inner(module) for module in self.modules])
        if self.expert_params:
            finish_expert_grads(self.expert_params, self.edp_mesh, self.layout.dp)
        return loss

    def record_communication(self, every: int) -> None:
        """Measure exposed communication by kind on every `every`-th step (runtime/comm_telemetry.py)."""
        meshes = {name: self.mesh[name] for name in self.mesh.mesh_dim_names}
        meshes["dp_cp"] = self._dp_mesh()
        if self.layout.ep > 1:
            meshes["ep"], meshes["edp"] = self.ep_mesh, self.edp_mesh
        groups = {name: mesh.get_group() for name, mesh in meshes.items() if mesh.size() > 1}
        self.comm_recorder = CommRecorder(GroupKinds.of(groups, self.layout.zero), self.device.type)
        self.comm_every = every

    def _update(self) -> None:
        if self.max_grad_norm:
            self.clip_gradients(self.max_grad_norm)
        if self.on_gradients:
            self.on_gradients(self)
        self.optimizer.step()
        if self.after_step:
            self.after_step(self)

    def _accumulate(self, tokens, targets) -> torch.Tensor:
        micro = self.layout.num_micro_batches
        total = torch.zeros((), device=self.device)
        module = self.modules[0]
        # ZeRO-0/1: gradients accumulate unreduced and are all-reduced once, after the last micro-batch
        once = hasattr(module, "set_requires_gradient_sync") and self.layout.zero < 2
        for index, (mb_tokens, mb_targets) in enumerate(zip(tokens.chunk(micro), targets.chunk(micro))):
            if once:
                module.set_requires_gradient_sync(index == micro - 1)
            loss = cross_entropy(module(mb_tokens), mb_targets) / micro
            loss.backward()
            total += loss.detach()
        return total

    def _pipelined(self, tokens, targets) -> torch.Tensor:
        first = 0 in self.chunk_ids
        last = len(self.layout.stage_layers) - 1 in self.chunk_ids
        losses: list[torch.Tensor] = []
        if first:
            self.schedule.step(tokens, target=targets if last else None, losses=losses)
        else:
            self.schedule.step(target=targets if last else None, losses=losses)
        if last:
            return torch.stack(losses).mean().detach()
        return torch.zeros((), device=self.device)

    def _mean_over_ranks(self, loss: torch.Tensor, nonfinite_flag: torch.Tensor | None) -> tuple[float, bool]:
        """The step's mean loss and whether any rank raised the non-finite flag, by one all-reduce over every
        rank (none on a world of one), read once: the loss is held by the last stage's ranks (zeros on the
        others), the same on the tensor-parallel ranks of a shard, so the mean over the world / pp ranks that
        hold it is the mean over data and context parallelism."""
        flag = torch.zeros((), device=loss.device) if nonfinite_flag is None else nonfinite_flag
        value = torch.stack([loss.detach().float().reshape(()), flag])
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            dist.all_reduce(value)
        total, flags = value.tolist()
        return total / (world // self.layout.pp), flags > 0

    def clip_gradients(self, max_norm: float) -> float:
        """Clip by the global gradient norm over every group: DTensor norms reduce over their meshes,
        stages add their squares over the pipeline group. Returns the norm before clipping."""
        grads = [p.grad for p in self.params if p.grad is not None]
        squares = torch.zeros((), device=self.device)
        for grad in grads:
            norm = torch.linalg.vector_norm(grad)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            squares = squares + norm.float() ** 2
        if self.layout.pp > 1:
            dist.all_reduce(squares, group=self.mesh["pp"].get_group())
        total = float(squares.sqrt())
        scale = max_norm / (total + 1e-6)
        if scale < 1:
            for grad in grads:
                grad.mul_(scale)
        return total

    def gradients(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) gradients of this rank's parameters by full-model name, for checks."""
        grads = {}
        canonical = self.canonical_names
        for module in self.modules:
            for name, param in _inner(module).named_parameters():
                if param.grad is None:
                    continue
                grad = param.grad
                grads[canonical.get(name, name)] = grad.full_tensor() if hasattr(grad, "full_tensor") \
                    else grad.detach().clone()
        return grads

    # -- state ----------------------------------------------------------------------------------
    @property
    def canonical_names(self) -> dict[str, str]:
        """Each tied weight's names -> its first (the single-process model's parameter name)."""
        return {name: names[0] for names in self.tied for name in names}

    def state_dict(self) -> dict:
        """Model state with the full model's parameter names, whatever the layout (DTensors where sharded)."""
        state: dict = {}
        for module in self.modules:
            state.update(get_model_state_dict(_inner(module)))
        return state

    def save(self, path: str, step: int, asynchronous: bool = False, process_group=None):
        """The whole training state after `step` (model, optimizer, step, learning rate, RNG) as one DCP
        checkpoint any other layout can load; `asynchronous` returns `dcp.async_save`'s future."""
        lr = self.optimizer.param_groups[0]["lr"]
        return checkpoint.save(path, [_inner(m) for m in self.modules], self.optimizer, self.canonical_names,
                               checkpoint.TrainState(step=step, lr=lr), asynchronous, process_group)

    def forget_optimizer_state(self) -> None:
        """Drop the optimizer's moments and step counts (what a model-only checkpoint resumes with)."""
        checkpoint.local_optimizer(self.optimizer).state.clear()

    def load(self, path: str) -> checkpoint.TrainState:
        """Resume from a checkpoint written under any layout; returns the step it ended and its lr."""
        train = checkpoint.load(path, [_inner(m) for m in self.modules], self.optimizer, self.canonical_names)
        self.step = train.step
        for group in self.optimizer.param_groups:   # ZeRO-1 copies the outer groups into its shard's
            group["lr"] = train.lr
        return train


def _inner(module: nn.Module) -> nn.Module:
    """The stage module inside a DistributedDataParallel wrapper (its parameter names are the model's)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def device_type_of(plan) -> str:
    """The torch device type the plan's cluster profile names (cuda for NVIDIA/AMD/Hygon, npu for Ascend)."""
    from planner.job import plan_cluster
    return plan_cluster(plan).device.torch_device_type


def apply_plan(model: nn.Module, graph: ModelGraph, plan_or_layout, device_type: str | None = None,
               **kwargs) -> ParallelModel:
    """Lay `model` out as the plan says (a `planner.plans.Plan` or a `Layout`) and return a ParallelModel.
    The device type defaults to the one the plan's cluster profile names (cpu for a bare Layout)."""
    is_plan = hasattr(plan_or_layout, "to_layout")
    layout = plan_or_layout.to_layout() if is_plan else plan_or_layout
    if device_type is None:
        device_type = device_type_of(plan_or_layout) if is_plan else "cpu"
    return ParallelModel(model, graph, layout, device_type, **kwargs)


__all__ = ["ParallelModel", "apply_plan", "PlanError", "Recompute"]
