"""Health checks that run inside every step, on by default: what they find is one `health:` line, the same
on every rank, and the step's policy (skip the batch, or stop) is applied on every rank alike.

* non-finite loss or gradients: each rank tests its own gradients after backward (one fused pass); its flag
  rides the loss's all-reduce, and only when some rank raised it does an all-gather of the flags name the
  ranks that produced them, before any optimizer step uses them;
* loss spikes: a robust z-score of the step's loss (mean over ranks, the same number everywhere) against
  the median and median absolute deviation of the last accepted steps; the policy skips the batch, or
  rolls back to the last complete checkpoint and skips the batches from the spike back (`Rollback`,
  raised on every rank alike: the caller reloads and retrains), or only reports;
* silent data corruption in computation: every `gemm_every` steps each rank checks every matrix product of
  its forward and backward by their checksums (runtime/gemm_check.py); a wrong one raises a flag that rides
  the loss's all-reduce like the non-finite one, the ranks are named, and the batch is skipped before any
  optimizer step uses it (or the job stops, `on_sdc`);
* silent data corruption in memory: where parameters are replicated over the data-parallel ranks (ZeRO-0/1), a
  bit-exact fingerprint of each rank's parameters (their bytes summed as 64-bit integers) is compared
  over the replicas every `sdc_every` steps after the optimizer step (runtime/replica_check.py; in the driver's
  step its all-gather is read after the next step's loss all-reduce, so that it waits for no one); a rank that
  disagrees with the majority is named. Sharded parameters (FSDP2) have no replicas to compare, and that is said
  once.

The driver's `ParallelModel` runs them inside its step; a user's own loop calls them around its optimizer:

    health = HealthMonitor.for_model(laid, HealthPolicy())
    with health.watching(index):                    # the step's matrix products, on a checked step
        loss = step.forward_backward(inputs, targets)
    if health.check(index, loss, laid.params):     # raises Rollback or HealthStop where the policy says so
        optimizer.step()
        health.check_replicas(index, laid.params)
    optimizer.zero_grad()
"""
from __future__ import annotations

import contextlib
import math
import statistics
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cost_models.reliability import Recovery   # the settings the goodput model charges for

from .exclusion import Exclude
from .gemm_check import GemmCheck, GemmFault, GemmVerdict
from .dims import local_shard
from .replica_check import ReplicaCheck
from .stragglers import StragglerMonitor

MAD_TO_SIGMA = 1.4826   # median absolute deviation of a normal distribution, as a standard deviation


@dataclass(frozen=True)
class HealthPolicy:
    on_nonfinite: str = "skip"      # skip the batch (no optimizer step), or stop the job
    on_spike: str = "skip"          # skip the batch, roll back to the last checkpoint, or ignore (report only)
    spike_z: float = 6.0            # robust z-score that makes a loss a spike
    spike_window: int = 20          # accepted steps the median and deviation are taken over
    spike_min_history: int = 8      # steps before spikes are judged at all
    sdc_every: int = Recovery.sdc_check_every_steps   # steps between replica fingerprints (0: never)
    optimizer_every: int = 1000     # steps between checks of a sharded optimizer's update by another rank: the
    #                                 goodput model's cadence is 815 for Llama 3.1 405B on 16,384 H100 and tens of
    #                                 thousands for smaller jobs (docs/reliability.md); a real job's: auto with its plan
    optimizer_samples: int = Recovery.optimizer_samples   # elements of each owned tensor recomputed there (0: all)
    gemm_every: int = 1000          # steps between steps whose matrix products are checked (0: never): a
    #                                 checked step costs about 2.6x an unchecked one on the tiny model (its
    #                                 GEMMs are small; benchmarks/health_overhead.py), 0.16% of a step at 1000;
    #                                 a real job's: --gemm-every auto with its plan (the goodput model's)
    on_sdc: str = "skip"            # a wrong product found: skip the batch, roll back to the last checkpoint
    #                                 (every one is written after a clean check of its step), exclude the node
    #                                 (runtime/exclusion.py) or stop the job
    straggler_every: int = 10       # steps per straggler comparison (runtime/stragglers.py; 0: never)
    straggler_ratio: float = 2.0    # a rank this many times its peers' median compute...
    straggler_min_excess_s: float = 0.05   # ...and this many seconds over it in the window: not host jitter


@dataclass(frozen=True)
class InjectedProductFault:
    """A wrong product injected (runtime/faults.py): at `step` only (`sdc`), or from `step` on, the device's
    self-test included (`lasting`: a defective device, `defect`)."""
    step: int
    fault: GemmFault
    lasting: bool = False

    def at(self, step: int) -> GemmFault | None:
        return self.fault if step == self.step or (self.lasting and step >= self.step) else None


class HealthStop(RuntimeError):
    """The policy says stop: raised on every rank at the same step."""


class Rollback(RuntimeError):
    """The spike policy says roll back, or an update was found wrong: raised on every rank at the same step,
    which is in `step`."""

    def __init__(self, step: int, reason: str = "loss spike"):
        super().__init__(f"{reason} at step {step}: roll back")
        self.step, self.reason = step, reason


class HealthMonitor:
    def __init__(self, policy: HealthPolicy, replica_group, replicated: bool, device: torch.device):
        self.policy, self.device = policy, device
        self.losses: deque[tuple[int, float]] = deque(maxlen=policy.spike_window)   # (step, loss) accepted
        self.replica_group = replica_group      # the data-parallel group replicas live in
        self.replicated = replicated            # parameters replicated over it (ZeRO-0/1)
        self.rank = dist.get_rank()
        self.reports: list[str] = []            # every `health:` line, in order
        self.replicas = ReplicaCheck(replica_group, device, self.report) if replicated else None
        self.found: torch.Tensor | None = None  # the non-finite flag, and the unit scale its kernel takes
        self.unit: torch.Tensor | None = None
        self.gemm = GemmCheck() if policy.gemm_every else None
        self.gemm_fault: InjectedProductFault | None = None   # injected (runtime/faults.py)
        self.gemm_verdict: GemmVerdict | None = None   # the last watched step's worst product on this rank
        self.gemm_verdict_said = False                 # the limit of detection, said at the first check
        self.forced_step: int | None = None   # a step checked whatever the cadence: the one before a save

    @classmethod
    def for_model(cls, laid_out, policy: HealthPolicy = HealthPolicy()) -> "HealthMonitor":
        """The checks of a `runtime.laid_out.LaidOutModel`: replicas compared over its data-parallel group."""
        return cls(policy, laid_out.dp_mesh().get_group(), laid_out.replicated, laid_out.device)

    def check(self, step: int, loss: float, parameters: list[torch.Tensor]) -> bool:
        """A user loop's check after backward, before its optimizer step: whether the step's gradients may be
        applied (every rank gets the same answer; False: skip the batch). `loss` is the step's loss, the same
        on every rank (`Step.forward_backward`'s), its forward and backward run inside `watching(step)`. One
        all-reduce of this rank's non-finite and wrong-product flags."""
        flag = self.nonfinite_flag(torch.tensor(float(loss), device=self.device),
                                   [p.grad for p in parameters if p.grad is not None])
        flags = torch.stack([flag, self.wrong_product_flag()])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags)
        nonfinite, wrong = flags.tolist()
        return self.products_right(step, wrong > 0) and self.accept(step, float(loss), nonfinite > 0, flag)

    # -- matrix products (runtime/gemm_check.py) ---------------------------------------------------
    def check_at(self, step: int) -> None:
        """Check `step`'s products (and a sharded optimizer's update) whatever the cadence: the step before a
        checkpoint, so that every checkpoint is written after a clean check of its own step."""
        self.forced_step = step

    def watching(self, step: int):
        """Around a step's forward and backward: its matrix products checked where the step is due (every
        `gemm_every`), and an injected product fault applied where one is due (checked or not)."""
        fault = self.gemm_fault.at(step) if self.gemm_fault else None
        due = bool(self.gemm) and (step % self.policy.gemm_every == 0 or step == self.forced_step)
        self.gemm_verdict = None
        if not due and fault is None:
            return contextlib.nullcontext()
        checker = self.gemm if due else GemmCheck(check=False)
        return checker.watching(fault, on_verdict=self._keep_verdict, with_limit=not self.gemm_verdict_said)

    def _keep_verdict(self, verdict: GemmVerdict | None) -> None:
        """The step's verdict; the first one's limit of detection is said once (what passes unseen), as a note:
        it is no finding."""
        if verdict is not None and self.gemm_verdict_said is False:
            self.gemm_verdict_said = True
            self._say(f"note: matrix products checked every {self.policy.gemm_every} steps: "
                      f"{verdict.products} per step on rank {self.rank}; an error under {verdict.limit:.2g} of a "
                      f"product's largest element passes unseen in the least sensitive of them "
                      f"({verdict.dtype}); fused attention kernels are not checked")
        self.gemm_verdict = verdict

    def injected_defect(self, step: int) -> GemmFault | None:
        """An injected defect of this device at `step`, which its self-test meets too (none: a real device's)."""
        return self.gemm_fault.at(step) if self.gemm_fault and self.gemm_fault.lasting else None

    def wrong_product_flag(self) -> torch.Tensor:
        """1 where this rank's last watched step had a wrong product, else 0 (rides the loss's all-reduce)."""
        wrong = self.gemm_verdict is not None and self.gemm_verdict.wrong
        return torch.tensor(float(wrong), device=self.device)

    def products_right(self, step: int, wrong_anywhere: bool) -> bool:
        """Whether the step's products were right on every rank; else the ranks and their worst product are
        said and the batch is skipped (or the job stopped, `on_sdc`)."""
        if not wrong_anywhere:
            return True
        everyone: list = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
        mine = self.gemm_verdict if self.gemm_verdict is not None and self.gemm_verdict.wrong else None
        if len(everyone) > 1:
            dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        named = [(rank, verdict) for rank, verdict in enumerate(everyone) if verdict is not None]
        what = "; ".join((f"rank {rank}: " if len(named) > 1 else "") + verdict.describe() for rank, verdict in named)
        self._say(f"health: step {step}: a matrix product computed wrong (silent data corruption in computation) "
                  f"on rank{'s' if len(named) > 1 else ''} {', '.join(str(rank) for rank, _ in named)}: {what}; "
                  f"policy {self.policy.on_sdc}")
        if self.policy.on_sdc == "stop":
            raise HealthStop(f"a wrong matrix product at step {step}")
        if self.policy.on_sdc == "rollback":   # a device that erred once may have erred since the last check
            raise Rollback(step, "a wrong matrix product")
        if self.policy.on_sdc == "exclude":
            raise Exclude(step, [rank for rank, _ in named], "a wrong matrix product")
        return False

    def _say(self, line: str) -> None:
        self.reports.append(line)
        if self.rank == 0:
            print(line, flush=True)

    # -- before the optimizer step ---------------------------------------------------------------
    def nonfinite_flag(self, loss: torch.Tensor, gradients: list[torch.Tensor]) -> torch.Tensor:
        """A 0-d tensor, 1 where this rank's loss or one of its gradients holds a NaN or an Inf, else 0; not
        read here: it rides the loss's all-reduce (ParallelModel._mean_over_ranks), so a step pays no read
        of its own. One fused pass over the gradients: the kernel AMP's GradScaler finds overflow with
        (`found` set where any element is not finite), at a scale of exactly 1, which leaves every value bit
        for bit. (A norm per gradient, summed, the test before it, cost 2.7x as much on the tiny model's 39
        tensors.)"""
        if self.found is None or self.found.device != loss.device:
            self.found, self.unit = torch.zeros((), device=loss.device), torch.ones((), device=loss.device)
        self.found.zero_()
        # the loss among them: its own storage, multiplied in place by exactly 1 (the kernel unscales)
        checked = [local_shard(g) for g in gradients] + [loss.detach().float().reshape(1)]
        torch._amp_foreach_non_finite_check_and_unscale_(checked, self.found, self.unit)
        return self.found

    def accept(self, step: int, loss: float, nonfinite_anywhere: bool, flag_here: torch.Tensor) -> bool:
        """Whether the step's gradients may be applied; says why not. `nonfinite_anywhere`: some rank's
        `nonfinite_flag`, reduced with the loss; `flag_here` this rank's, read only when some rank raised it."""
        bad = nonfinite_anywhere or not math.isfinite(loss)
        bad_ranks = self._nonfinite_ranks(bool(flag_here.item())) if bad else []
        if bad_ranks:
            self._say(f"health: step {step}: non-finite loss or gradients on rank{'s' if len(bad_ranks) > 1 else ''} "
                      f"{', '.join(map(str, bad_ranks))}; policy {self.policy.on_nonfinite}")
            if self.policy.on_nonfinite == "stop":
                raise HealthStop(f"non-finite gradients at step {step}")
            return False
        z = self._spike_z(loss)
        if z is not None and z > self.policy.spike_z:
            median = statistics.median(value for _, value in self.losses)
            self._say(f"health: step {step}: loss spike, {loss:.4f} against a median of {median:.4f} "
                      f"(robust z {z:.1f} > {self.policy.spike_z:g}); policy {self.policy.on_spike}")
            if self.policy.on_spike == "rollback":
                raise Rollback(step)
            if self.policy.on_spike == "skip":
                return False
        self.losses.append((step, loss))
        return True

    def forget_after(self, step: int) -> None:
        """A rollback to the checkpoint of `step`: the losses of the steps after it are trained again."""
        kept = [(s, value) for s, value in self.losses if s <= step]
        self.losses.clear()
        self.losses.extend(kept)

    def say(self, line: str) -> None:
        """A `health:` line the caller's policy produced (a rollback's outcome), from rank 0."""
        self._say(line)

    def report(self, line: str) -> None:
        """A `health:` line only this rank knows (its group's verdict): printed here, whatever the rank."""
        self.reports.append(line)
        print(line, flush=True)

    def _nonfinite_ranks(self, nonfinite_here: bool) -> list[int]:
        """Some rank found a NaN or Inf (or the mean loss is one): an all-gather names the ranks, every rank
        alike (a non-finite mean with no rank flagged names every rank)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [self.rank]
        flags = [torch.zeros(1, device=self.device) for _ in range(dist.get_world_size())]
        dist.all_gather(flags, torch.tensor([float(nonfinite_here)], device=self.device))
        named = [rank for rank, flag in enumerate(flags) if flag.item()]
        return named or list(range(dist.get_world_size()))

    def _spike_z(self, loss: float) -> float | None:
        if len(self.losses) < self.policy.spike_min_history or not math.isfinite(loss):
            return None
        values = [value for _, value in self.losses]
        median = _median(values)
        spread = MAD_TO_SIGMA * _median([abs(x - median) for x in values])
        return (loss - median) / max(spread, 1e-6 * abs(median) + 1e-12)

    # -- after the optimizer step ----------------------------------------------------------------
    def updates_right(self, step: int, wrong_ranks: list[int]) -> None:
        """The optimizer check's verdict (runtime/optimizer_check.py), made the job's: one all-reduce of a flag
        per rank; where some rank's update was wrong, the owners are named and every rank raises Rollback (the
        update is applied already: only a checkpoint from before it undoes it), or HealthStop under `on_sdc`
        stop."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        flags = torch.zeros(world, device=self.device)
        for rank in wrong_ranks:
            flags[rank] = 1
        if world > 1:
            dist.all_reduce(flags)
        owners = [rank for rank, flag in enumerate(flags.tolist()) if flag]
        if not owners:
            return
        self._say(f"health: step {step}: the optimizer update of rank{'s' if len(owners) > 1 else ''} "
                  f"{', '.join(map(str, owners))} differs from its recomputation by another rank (silent data "
                  f"corruption in computation); policy {'stop' if self.policy.on_sdc == 'stop' else 'rollback'}")
        if self.policy.on_sdc == "stop":
            raise HealthStop(f"a wrong optimizer update at step {step}")
        if self.policy.on_sdc == "exclude":
            raise Exclude(step, owners, "a wrong optimizer update")
        raise Rollback(step, "a wrong optimizer update")

    def check_replicas(self, step: int, parameters: list[torch.Tensor], before_save: bool = False,
                       stragglers: StragglerMonitor | None = None, deferred: bool = False) -> bool | None:
        """Every `sdc_every` steps, and before every checkpoint (so that none holds corruption a check could
        see): the replicas' parameter fingerprints agree, or the odd ranks are named (runtime/replica_check.py).
        False when they differ; None where `deferred` (the verdict read by `settle`, after the next step's
        loss all-reduce). `stragglers`: its comparison, due at this step too, rides the same all-gather."""
        every = self.policy.sdc_every
        due = before_save or (every and not step % every)
        if not every or not due or not self.replicated or dist.get_world_size(self.replica_group) < 2:
            return True
        return self.replicas.check(step, parameters, stragglers, deferred and not before_save)

    def settle(self) -> None:
        """A deferred replica check's verdict read and said (every rank alike, at the same point)."""
        if self.replicas is not None:
            self.replicas.settle()

    def clean_for_saving(self, step: int, parameters: list[torch.Tensor]) -> bool:
        """Before a checkpoint: every replica group agrees (one flag all-reduced over the job, since each
        group knows only its own verdict). The step's products were checked too (`check_at`) and a wrong one
        was skipped or rolled back on every rank alike before this is asked."""
        agree = torch.tensor([float(self.check_replicas(step, parameters, before_save=True))], device=self.device)
        dist.all_reduce(agree, op=dist.ReduceOp.MIN)
        return bool(agree.item())

    def verdict(self, step: int) -> dict:
        """What a checkpoint of `step` records of the checks before it (runtime/verified.py's manifest)."""
        products = self.gemm is not None and self.forced_step == step and self.gemm_verdict is not None
        return {"products_checked_at_step": products,
                "replicas_compared": bool(self.replicated and self.policy.sdc_every)}


def _median(values: list[float]) -> float:
    """statistics.median's value, without its per-call generality (a tenth of its time on 20 losses: it runs
    every step)."""
    ordered, half = sorted(values), len(values) // 2
    return ordered[half] if len(values) % 2 else (ordered[half - 1] + ordered[half]) / 2
