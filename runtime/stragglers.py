"""Stragglers: the rank whose own compute is slow, named from per-rank timings.

In synchronous training a slow rank makes every peer wait inside the collectives, so step time is the same
everywhere and says nothing about who is slow. What differs is the time each rank spends computing: the
forward of its leaf modules that hold parameters (Linear, Embedding, norms, experts), timed from after the
parallel wrappers' input hooks (TP's redistribution, registered first) to before their output hooks (ours is
prepended), so collectives stay outside. FSDP2 gathers at the block boundary, outside the leaves. Where no
collective runs inside a block (no tensor, context or expert parallelism: data parallelism, FSDP2 and
pipelining communicate at block and stage boundaries), whole blocks are timed instead of their leaves: the same
compute, with a tenth of the hooks. On a CPU the host clock times it; on an accelerator, device events recorded
on the compute stream (read once a step, after the loss has synchronised it).

One step in every `every` is timed (the hooks cost a few percent of a toy step, so they are attached for
that step only; a throttled or failing device is slow step after step) and its compute seconds are
all-gathered over the ranks that do the same work (the data-parallel replicas of one stage and tensor
shard); a rank above `ratio` x their median, by at least `min_excess_s`, is named in one `health:` line.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn


def compute_leaves(modules: list[nn.Module]) -> list[nn.Module]:
    """The modules that compute on parameters of their own: no children, parameters held directly."""
    return [leaf for module in modules for leaf in module.modules()
            if not any(True for _ in leaf.children()) and any(True for _ in leaf.parameters(recurse=False))]


def compute_blocks(modules: list[nn.Module]) -> list[nn.Module]:
    """The largest units of compute below the stage modules: each member of a ModuleList or ModuleDict (the
    blocks), and the leaves holding parameters outside them (embedding, final norm, head)."""
    units = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                units.extend(block for block in child.children() if any(True for _ in block.parameters()))
            elif any(True for _ in child.children()):
                visit(child)
            elif any(True for _ in child.parameters(recurse=False)):
                units.append(child)
    for module in modules:
        visit(module)
    return units


class ComputeTimer:
    """Seconds this rank spends in its compute modules' forward (leaves, or whole blocks where no collective runs
    inside one), summed until read."""

    def __init__(self, modules: list[nn.Module], device: torch.device, whole_blocks: bool = False):
        self.device = device
        self.units = compute_blocks(modules) if whole_blocks else compute_leaves(modules)
        self.events = device.type != "cpu"
        self.total_s = 0.0
        self.open: dict[int, object] = {}
        self.spans: list[tuple[object, object]] = []
        self.handles = []

    def arm(self) -> None:
        """Time the leaves from now on: starting after the hooks already there (TP's input redistribution),
        stopping before theirs (TP's output redistribution)."""
        for leaf in self.units:
            self.handles.append(leaf.register_forward_pre_hook(self._start))   # after TP's input redistribution
            self.handles.append(leaf.register_forward_hook(self._stop, prepend=True))

    def disarm(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _start(self, module, args) -> None:
        if self.events:
            event = getattr(torch, self.device.type).Event(enable_timing=True)
            event.record()
            self.open[id(module)] = event
        else:
            self.open[id(module)] = time.perf_counter()

    def _stop(self, module, args, output) -> None:
        began = self.open.pop(id(module), None)
        if began is None:
            return
        if self.events:
            ended = getattr(torch, self.device.type).Event(enable_timing=True)
            ended.record()
            self.spans.append((began, ended))
        else:
            self.total_s += time.perf_counter() - began

    def read(self) -> float:
        """The seconds since the last read (device events are resolved here, after the step synchronised)."""
        if self.spans:
            self.spans[-1][1].synchronize()
            self.total_s += sum(start.elapsed_time(end) for start, end in self.spans) / 1000
            self.spans.clear()
        seconds, self.total_s = self.total_s, 0.0
        return seconds


class StragglerMonitor:
    """Compares one step's compute seconds in every `every` over `peers` (ranks doing the same work)."""

    def __init__(self, every: int, ratio: float, min_excess_s: float, timer: ComputeTimer, peers, device, say):
        self.every, self.ratio, self.min_excess_s = every, ratio, min_excess_s
        self.timer, self.peers, self.device, self.say = timer, peers, device, say
        self.seconds_here = 0.0          # the last timed step's compute seconds on this rank
        self.stopped: int | None = None  # the last step timed: its seconds compared by whoever stopped it

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0 and dist.get_world_size(self.peers) > 1

    def before_step(self, step: int) -> None:
        if self.due(step):
            self.timer.arm()

    def stop_timing(self, step: int) -> float:
        """This rank's compute seconds of the timed `step`, the hooks removed; kept for `after_step` to return.
        Whoever stops it compares them (`judge`): the replica check's all-gather, or `after_step`'s own."""
        self.timer.disarm()
        self.seconds_here, self.stopped = self.timer.read(), step
        return self.seconds_here

    def after_step(self, step: int) -> float | None:
        """On a timed step: compare over the peers, name the slow ones (where the replica check's all-gather
        carries the seconds, it judges them); this rank's compute seconds."""
        if not self.due(step):
            return None
        if self.stopped != step:
            seconds_here = self.stop_timing(step)
            size = dist.get_world_size(self.peers)
            gathered = [torch.zeros(1, dtype=torch.float64, device=self.device) for _ in range(size)]
            dist.all_gather(gathered, torch.tensor([seconds_here], dtype=torch.float64, device=self.device),
                            group=self.peers)
            self.judge(step, [float(t.item()) for t in gathered])
        return self.seconds_here

    def judge(self, step: int, seconds: list[float]) -> None:
        """Name the peers whose compute seconds (one per peer, in group order) are slow against their median."""
        ranks = dist.get_process_group_ranks(self.peers)
        median = statistics.median(seconds)
        slow = [(rank, s) for rank, s in zip(ranks, seconds)
                if s > self.ratio * median and s - median >= self.min_excess_s]
        if slow and dist.get_rank() == ranks[0]:   # one line per group of peers
            named = ", ".join(f"rank {rank} {s:.3f} s (x{s / max(median, 1e-12):.1f})" for rank, s in slow)
            self.say(f"health: step {step}: straggler{'s' if len(slow) > 1 else ''}: {named} "
                     f"in forward compute against a median of {median:.3f} s over ranks "
                     f"{', '.join(map(str, ranks))}")
