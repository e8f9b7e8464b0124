"""Data as users have it: each rank's share of a real dataset, resumable under any layout.

`GlobalBatches` samples global batches (index lists of `global_batch` samples, in an order seeded per epoch)
and keeps its position as (epoch, global batches taken): nothing in it depends on the layout, so a checkpoint
written under tp2 resumes under dp2 or pp2 at the next unseen sample. `RankBatches` hands this rank the rows
of each global batch its data-parallel index takes; `rank_loader` puts a torch (or torchdata
`StatefulDataLoader`) loader over them whose collated tensors keep this rank's context-parallel columns, the
causally balanced chunks `runtime.context_parallel.shard_sequence` cuts.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.data import DataLoader, Sampler, default_collate

from .context_parallel import shard_sequence

try:   # torchdata's loader keeps its own state (workers' prefetch included); torch's does not
    from torchdata.stateful_dataloader import StatefulDataLoader as _Loader
except ImportError:   # pragma: no cover - torchdata is a test extra
    _Loader = DataLoader


class GlobalBatches(Sampler):
    """Global batches of a dataset of `length` samples: each epoch a permutation seeded by (seed, epoch) (or the
    dataset's order), cut into `global_batch`-sized batches, the last partial one dropped."""

    def __init__(self, length: int, global_batch: int, seed: int = 0, shuffle: bool = True):
        if length < global_batch:
            raise ValueError(f"{length} samples do not make one global batch of {global_batch}")
        self.length, self.global_batch, self.seed, self.shuffle = length, global_batch, seed, shuffle
        self.epoch, self.taken = 0, 0   # the position: global batches taken in this epoch
        self.last: list[int] = []       # the global batch taken last (its sample indices)

    @property
    def per_epoch(self) -> int:
        return self.length // self.global_batch

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.length))
        return torch.randperm(self.length, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)).tolist()

    def __iter__(self):
        while True:
            order = self.order(self.epoch)
            while self.taken < self.per_epoch:
                start = self.taken * self.global_batch
                self.taken += 1
                self.last = order[start:start + self.global_batch]
                yield self.last
            self.epoch, self.taken = self.epoch + 1, 0

    def __len__(self) -> int:
        return self.per_epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "taken": self.taken, "seed": self.seed, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        if state.get("global_batch", self.global_batch) != self.global_batch:
            raise ValueError(f"the data position is in global batches of {state['global_batch']}, and this job "
                             f"takes batches of {self.global_batch}")
        self.epoch, self.taken, self.seed = int(state["epoch"]), int(state["taken"]), int(state["seed"])


class RankBatches(Sampler):
    """This rank's rows of each global batch: the `index`-th of `ranks` equal slices."""

    def __init__(self, batches: GlobalBatches, ranks: int, index: int):
        if batches.global_batch % ranks:
            raise ValueError(f"a global batch of {batches.global_batch} does not split over {ranks} "
                             "data-parallel ranks")
        self.batches, self.ranks, self.index = batches, ranks, index
        self.rows = batches.global_batch // ranks

    def __iter__(self):
        for indices in self.batches:
            yield indices[self.index * self.rows:(self.index + 1) * self.rows]

    def __len__(self) -> int:
        return len(self.batches)

    def state_dict(self) -> dict:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.batches.load_state_dict(state)


def rank_loader(model, dataset, global_batch: int, collate_fn: Callable = default_collate, seed: int = 0,
                shuffle: bool = True, num_workers: int = 0):
    """A loader of this rank's share of each global batch of `dataset` for a laid-out model
    (`runtime.laid_out.LaidOutModel`): its data-parallel rows, and of every collated tensor of two or more
    dimensions its context-parallel columns."""
    lay = model.layout
    sampler = RankBatches(GlobalBatches(len(dataset), global_batch, seed, shuffle), lay.dp, model.local.get("dp", 0))
    cp, cp_rank = lay.cp, model.local.get("cp", 0)

    def collate(samples):
        batch = collate_fn(samples)
        if cp == 1:
            return batch
        return type(batch)(shard_sequence(t, cp, cp_rank) if isinstance(t, torch.Tensor) and t.dim() > 1 else t
                           for t in batch)
    return _Loader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=num_workers)
