"""Running a step of a laid-out model with the user's loss: micro-batches accumulated (or torch's pipeline
schedule run), gradients reduced once per step, and the loss normalised as one process would normalise it.

The loss function takes the model's output and the targets of one micro-batch and returns `LossTerms`: the sum
of its per-position losses over the positions it counts (masked positions, `ignore_index`, excluded) and an
auxiliary term of the micro-batch (a router's load-balancing loss). The step's objective is the sum over every
counted position of the global batch divided by their number, plus the auxiliary terms' mean over micro-batches:
what a single process computes for the same batch split into the same micro-batches, whatever the layout (data
and context parallelism split the positions, the pipeline the layers, and the per-position sums do not care).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import Schedule1F1B, ScheduleDualPipeV, ScheduleInterleaved1F1B

from .experts import finish_expert_grads
from .laid_out import LaidOutModel, inner
from .pipeline_stage import GatheringPipelineStage

IGNORE_INDEX = -100   # torch's cross_entropy default and transformers' label padding


@dataclass(frozen=True)
class LossTerms:
    """One micro-batch's loss: the sum over the positions it counts, and its auxiliary term."""
    total: torch.Tensor
    aux: torch.Tensor | float = 0.0


def logits_of(output) -> torch.Tensor:
    """The logits of a model's output: a tensor, or an object or dict holding `logits` (transformers')."""
    if isinstance(output, torch.Tensor):
        return output
    return output["logits"] if isinstance(output, dict) else output.logits


def token_cross_entropy(output, targets: torch.Tensor) -> LossTerms:
    """Cross-entropy summed over the positions whose target is not IGNORE_INDEX."""
    logits = logits_of(output)
    return LossTerms(F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX,
                                     reduction="sum"))


def counted_positions(targets: torch.Tensor) -> torch.Tensor:
    return (targets != IGNORE_INDEX).sum()


class Step:
    """A step of `laid_out` under `loss_fn` (`LossTerms` of an output and its targets); `count_fn` counts the
    positions a micro-batch's targets make the loss sum over (those not IGNORE_INDEX by default)."""

    def __init__(self, laid_out: LaidOutModel, loss_fn: Callable = token_cross_entropy,
                 count_fn: Callable = counted_positions):
        self.model, self.loss_fn, self.count_fn = laid_out, loss_fn, count_fn
        self.scale = torch.zeros(())      # this step's: the averaging ranks over the global count
        self.aux_scale = 0.0              # ... and the averaging ranks over the micro-batches
        self.schedule = self._schedule() if laid_out.layout.pp > 1 else None

    def _schedule(self):
        lay, model = self.model.layout, self.model
        stages = [GatheringPipelineStage(module, j, len(lay.stage_layers), model.device,
                                         group=model.mesh["pp"].get_group())
                  for module, j in zip(model.modules, model.chunk_ids)]
        options = dict(n_microbatches=lay.num_micro_batches, loss_fn=self._objective, scale_grads=False)
        if lay.dualpipev:   # torch places the stages as a V itself and checks micro >= 2 pp
            return ScheduleDualPipeV(stages, **options)
        if lay.vp > 1:
            return ScheduleInterleaved1F1B(stages, **options)
        return Schedule1F1B(stages[0], **options)

    def _objective(self, output, targets) -> torch.Tensor:
        """One micro-batch's share of this rank's objective: data- and context-parallel reductions average the
        ranks' gradients, so each rank's share is scaled up by their number."""
        terms = self.loss_fn(output, targets)
        return terms.total * self.scale + terms.aux * self.aux_scale

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """This rank's micro-batches of one step (its data-parallel rows and context-parallel columns) forward
        and backward, gradients complete; the step's loss as every rank sees it."""
        share = self.forward_backward_share(inputs, targets)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(share)
        return self.loss_of(float(share))

    def forward_backward_share(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """`forward_backward` without its one all-reduce: this rank's share of the step's loss (a caller that
        reduces more in the same collective, the health checks' flag, adds the shares itself: `loss_of`)."""
        model, lay = self.model, self.model.layout
        inputs, targets = inputs.to(model.device), targets.to(model.device)
        self._normalise(targets)
        ranks = model.dp_mesh().size()
        with model.autocast:   # bf16 compute over fp32 parameters where FSDP2's policy does not cast
            share = self._accumulate(inputs, targets) if self.schedule is None else self._pipelined(inputs, targets)
        if model.stage_ties:
            model.stage_ties.sum_gradients([inner(module) for module in model.modules])
        if model.expert_params:
            finish_expert_grads(model.expert_params, model.edp_mesh, lay.dp)
        return (share / ranks).detach().float().reshape(()).clone()

    def loss_of(self, total: float) -> float:
        """The step's loss from every rank's share summed: the last stage's ranks hold a share (zeros on the
        others), each tensor-parallel rank of a shard the same one."""
        return total / self.model.layout.tp

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """The same loss without backward (an evaluation pass): micro-batches forward, or the schedule's eval."""
        model = self.model
        inputs, targets = inputs.to(model.device), targets.to(model.device)
        self._normalise(targets)
        for module in model.modules:
            module.eval()
        try:
            with model.autocast:
                if self.schedule is None:
                    share = sum(self._objective(model.modules[0](x), y).float()
                                for x, y in zip(inputs.chunk(model.layout.num_micro_batches),
                                                targets.chunk(model.layout.num_micro_batches)))
                else:
                    losses: list[torch.Tensor] = []
                    target = targets if model.last else None
                    args = (inputs,) if model.first else ()
                    self.schedule.eval(*args, target=target, losses=losses)
                    share = torch.stack(losses).sum().float() if model.last else torch.zeros((), device=model.device)
        finally:
            for module in model.modules:
                module.train()
                for sub in module.modules():   # FSDP2 that keeps parameters to backward: no backward came
                    if isinstance(sub, FSDPModule):
                        sub.reshard()
        share = (share / model.dp_mesh().size()).reshape(()).clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(share)
        return self.loss_of(float(share))

    def _normalise(self, targets: torch.Tensor) -> None:
        """This step's scales: the global count of counted positions (over the data- and context-parallel
        ranks, whose reductions average), and the micro-batches the auxiliary terms average over."""
        group = self.model.dp_mesh()
        counted = torch.as_tensor(self.count_fn(targets), dtype=torch.float64, device=self.model.device).reshape(())
        if group.size() > 1:
            dist.all_reduce(counted, group=group.get_group())
        self.scale = group.size() / counted.clamp(min=1).to(torch.float32)
        self.aux_scale = 1.0 / self.model.layout.num_micro_batches

    def _accumulate(self, inputs, targets) -> torch.Tensor:
        """Micro-batches one after another; ZeRO-0/1 reduce gradients once, after the last micro-batch."""
        micro = self.model.layout.num_micro_batches
        module = self.model.modules[0]
        once = hasattr(module, "set_requires_gradient_sync") and self.model.layout.zero < 2
        share = torch.zeros((), device=self.model.device)
        for index, (mb_inputs, mb_targets) in enumerate(zip(inputs.chunk(micro), targets.chunk(micro))):
            if once:
                module.set_requires_gradient_sync(index == micro - 1)
            objective = self._objective(module(mb_inputs), mb_targets)
            objective.backward()
            share += objective.detach().float()
        return share

    def _pipelined(self, inputs, targets) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        target = targets if self.model.last else None
        if self.model.first:
            self.schedule.step(inputs, target=target, losses=losses)
        else:
            self.schedule.step(target=target, losses=losses)
        if self.model.last:
            return torch.stack(losses).sum().detach().float()
        return torch.zeros((), device=self.model.device)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the global gradient norm over every group: DTensor norms reduce over their meshes, stages add
        their squares over the pipeline group. Returns the norm before clipping."""
        model = self.model
        grads = [p.grad for p in model.params if p.grad is not None]
        squares = torch.zeros((), device=model.device)
        for grad in grads:
            norm = torch.linalg.vector_norm(grad)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            squares = squares + norm.float() ** 2
        if model.layout.pp > 1:
            dist.all_reduce(squares, group=model.mesh["pp"].get_group())
        total = float(squares.sqrt())
        scale = max_norm / (total + 1e-6)
        if scale < 1:
            for grad in grads:
                grad.mul_(scale)
        return total
