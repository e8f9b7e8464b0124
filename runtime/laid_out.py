"""Building a layout: a torch model laid out as a plan says, on this rank, without taking over the loop.

`parallelize(model, graph, plan)` checks the plan against this job (the rulebook's runtime rules), builds the
device mesh and applies tensor, context and expert parallelism, activation checkpointing, FSDP2 or DDP (ZeRO
0-3) and the pipeline split (this rank's stages), as torchtitan's `parallelize_*` does for its models, for any
model capture reads. Running a step is `runtime/step.py`'s; the user's loop holds the optimizer, the scheduler
and the data.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from cost_models.layout import Layout
from cost_models.pipeline import dualpipev_micro_batch_problem, even_partition
from cost_models.step_time import chunk_blocks
from hardware_profiles.loader import load_stack
from hardware_profiles.stack import RUNTIME_STACK
from planner.graph_capture.graph import ModelGraph
from planner.rules.stack import layout_stack_problems

from . import mixed_precision
from .context_parallel import apply_cp, shard_sequence
from .dims import PlanError, build_mesh, check_runnable, error_line, local_ranks, world
from .experts import apply_ep, expert_meshes
from .parallelize import apply_ac, apply_dp, apply_tp, uses_fsdp
from .sequential_stage import sequential_stage
from .split import split_stage
from .tied import StageTies, retie, tied_names, untie_head


def inner(module: nn.Module) -> nn.Module:
    """The stage module inside a DistributedDataParallel wrapper (its parameter names are the model's)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


class LaidOutModel:
    """A model laid out by a plan on this rank: its stages (`modules`, one without a pipeline), the mesh and
    this rank's place in it, and what a step and a checkpoint need to know of them."""

    def __init__(self, model: nn.Module, graph: ModelGraph, layout: Layout, device_type: str = "cpu",
                 precision: str | None = None):
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
        self.graph, self.device, self.rank = graph, torch.device(device_type), rank
        self.notes: list[str] = []   # where the runtime applies the plan otherwise than it says
        self.mesh = build_mesh(self.layout, device_type)
        self.local = local_ranks(self.mesh)
        self.tied = tied_names(model)
        self.chunk_ids = [0]
        self.modules = self._build_modules(model, graph, layout.block_recompute(stage_layers))
        self.stage_ties = StageTies(self.tied, self.mesh, graph.embedding_modules, graph.head_modules,
                                    self.layout.chunk_rank(len(stage_layers) - 1)) \
            if self.tied and self.layout.pp > 1 else None
        self.params = [p for m in self.modules for p in m.parameters()]
        self._check_forward(graph)

    # -- construction ---------------------------------------------------------------------------
    def _build_modules(self, model: nn.Module, graph: ModelGraph, recompute) -> list[nn.Module]:
        lay = self.layout
        chunks = chunk_blocks(lay.stage_layers)
        if lay.pp == 1:
            modules = [model]
        else:
            # round robin, or DualPipeV's V (the rank holding chunk 0 holds the last chunk too)
            mine = [j for j in range(len(chunks)) if lay.chunk_rank(j) == self.local["pp"]]
            modules = [self._stage(model, graph, chunks[j], j == 0, j == len(chunks) - 1) for j in mine]
            self.chunk_ids = mine
            if self.tied and 0 in mine and len(chunks) - 1 in mine:
                untie_head(modules[-1], self.tied, graph.head_modules)
        self.expert_params: list[nn.Parameter] = []
        if lay.ep > 1:
            self.ep_mesh, self.edp_mesh, self.expert_mesh = expert_meshes(self.mesh, lay.ep, lay.etp)
        wrapped = [self._lay_out(module, graph, recompute) for module in modules]
        # ZeRO-1 beside tp or ep with dp > 1 never gets here: the stack's zero_stages_beside_model_parallel
        # refuses it before step 1 (ZeroRedundancyOptimizer takes no DTensor), and the planner never plans it
        self.replicated = lay.zero < 2   # every data-parallel rank holds the same parameters
        self.autocast = mixed_precision.autocast(self.precision, self.device.type,
                                                 uses_fsdp(lay.zero, self.dp_mesh().size()))
        return wrapped

    def _lay_out(self, module: nn.Module, graph: ModelGraph, recompute) -> nn.Module:
        """One stage: on the device, FP8 linears, TP/SP, CP, experts, checkpointing, then data parallelism."""
        lay = self.layout
        module.to(self.device)
        if self.precision == "fp8":
            mixed_precision.fp8_linears(module, graph)
        if lay.tp > 1:
            apply_tp(module, graph, self.mesh["tp"], lay.sp)
            retie(module, self.tied)
        if lay.cp > 1:
            apply_cp(module, graph, self.mesh["cp"], graph.seq_len)
        experts = apply_ep(module, graph, self.ep_mesh, self.expert_mesh) if lay.ep > 1 else []
        self.expert_params += experts
        apply_ac(module, graph, recompute, lay.dualpipev)
        return apply_dp(module, graph, self.dp_mesh(), lay.zero, set(experts), pipelined=lay.pp > 1,
                        mp_policy=mixed_precision.fsdp_policy(self.precision, lay))

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
        lay = self.layout
        if lay.tp == 1 or lay.pp > 1 or lay.cp > 1:
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
            raise PlanError(f"under tp={lay.tp} the model's forward fails before training ({cause}): its "
                            "code assumes the full hidden width where column-parallel projections hand it "
                            f"1/{lay.tp} of it (e.g. a head width computed as C // n_head); compute "
                            "widths from the projection's output (reshape(b, s, heads, -1)) or run tp=1") from None
        finally:
            module.train(training)
            # FSDP2 without resharding after forward (ZeRO-1/2) would keep the unsharded parameters
            # registered until a backward: put the sharded ones back, as the optimizer and DCP know them
            for sub in module.modules():
                if isinstance(sub, FSDPModule):
                    sub.reshard()

    # -- what the loop and the checkpoints read --------------------------------------------------
    def dp_mesh(self):
        """The ranks that reduce gradients together: data- and context-parallel."""
        names = self.mesh.mesh_dim_names
        if "cp" in names and self.layout.cp > 1:
            return self.mesh["dp", "cp"]._flatten("dp_cp")
        return self.mesh["dp"]

    @property
    def first(self) -> bool:
        """This rank holds the first chunk (it takes the inputs)."""
        return 0 in self.chunk_ids

    @property
    def last(self) -> bool:
        """This rank holds the last chunk (it computes the loss)."""
        return len(self.layout.stage_layers) - 1 in self.chunk_ids

    @property
    def canonical_names(self) -> dict[str, str]:
        """Each tied weight's names -> its first (the single-process model's parameter name)."""
        return {name: names[0] for names in self.tied for name in names}

    def named_parameters(self):
        """This rank's parameters by full-model name (a tied weight once, by its first name)."""
        seen, canonical = set(), self.canonical_names
        for module in self.modules:
            for name, param in inner(module).named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield canonical.get(name, name), param

    def parameters(self):
        return (param for _, param in self.named_parameters())

    def optimizer(self, optimizer_class, params, **options) -> torch.optim.Optimizer:
        """The user's optimizer (any torch.optim class, its parameter groups kept) over this rank's parameters;
        under ZeRO-1 on data-parallel ranks, sharded by torch's ZeroRedundancyOptimizer."""
        params = list(params)
        if self.layout.zero == 1 and self.layout.tp == 1 and self.dp_mesh().size() > 1 and not self.expert_params:
            return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class,
                                           process_group=self.dp_mesh().get_group(), **options)
        return optimizer_class(params, **options)

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's share of a global batch: rows by its data-parallel index, columns by cp (causally
        balanced), as `runtime.data` hands each rank its samples."""
        lay = self.layout
        rows = batch.shape[0] // lay.dp
        start = self.local.get("dp", 0) * rows
        mine = batch[start:start + rows]
        return shard_sequence(mine, lay.cp, self.local["cp"]) if lay.cp > 1 else mine

    def state_dict(self) -> dict:
        """Model state with the full model's parameter names, whatever the layout (DTensors where sharded)."""
        state: dict = {}
        for module in self.modules:
            state.update(get_model_state_dict(inner(module)))
        return state

    def gradients(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) gradients of this rank's parameters by full-model name, for checks."""
        grads = {}
        canonical = self.canonical_names
        for module in self.modules:
            for name, param in inner(module).named_parameters():
                if param.grad is not None:
                    grad = param.grad
                    grads[canonical.get(name, name)] = grad.full_tensor() if hasattr(grad, "full_tensor") \
                        else grad.detach().clone()
        return grads


def parallelize(model: nn.Module, graph: ModelGraph, plan_or_layout, device_type: str | None = None,
                precision: str | None = None) -> LaidOutModel:
    """Lay `model` out as the plan says (a `planner.plans.Plan` or a `Layout`) on this rank. The device type
    defaults to the one the plan's cluster profile names (cpu for a bare Layout)."""
    is_plan = hasattr(plan_or_layout, "to_layout")
    layout = plan_or_layout.to_layout() if is_plan else plan_or_layout
    if device_type is None:
        device_type = device_type_of(plan_or_layout) if is_plan else "cpu"
    return LaidOutModel(model, graph, layout, device_type, precision)


def device_type_of(plan) -> str:
    """The torch device type the plan's cluster profile names (cuda for NVIDIA/AMD/Hygon, npu for Ascend)."""
    from planner.job import plan_cluster
    return plan_cluster(plan).device.torch_device_type
