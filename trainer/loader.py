"""Batches for training: a torch DataLoader over the split's arrays as they are (memory-mapped
uint8 pixels stay on disk; each batch is read and converted to float32 on its own).

The batch composition is decided in the main process, from (seed, epoch) alone, by
`EpochBatches`: worker processes only read the rows they are handed. So the same seed gives
the same batches whatever the number of workers, and a resumed run can skip the batches of an
epoch it already took. Under torchrun every rank draws the same global batch and reads only its
own interleaved share of it (`global[rank::world]`).
"""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler


def epoch_permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    """The order of the n training examples in `epoch`: a function of (seed, epoch) only."""
    generator = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))
    return torch.randperm(n, generator=generator)  # [n]


class EpochBatches(Sampler):
    """Index lists of one epoch's global batches from batch `start` on (the last partial batch
    is dropped: batch losses and BatchNorm need a full batch), this rank's share of each."""

    def __init__(self, n: int, batch: int, seed: int, epoch: int, start: int = 0, rank: int = 0, world: int = 1):
        self.n, self.batch, self.seed, self.epoch, self.start = n, batch, seed, epoch, start
        self.rank, self.world = rank, world

    def __len__(self) -> int:
        return max(0, self.n // self.batch - self.start)

    def global_batches(self):
        order = epoch_permutation(self.seed, self.epoch, self.n)
        for b in range(self.start, self.n // self.batch):
            yield order[b * self.batch:(b + 1) * self.batch]  # [batch]

    def __iter__(self):
        for idx in self.global_batches():
            yield idx[self.rank::self.world].tolist()


class ArrayRows(Dataset):
    """Rows of x (any array-like, memory-mapped or not) as float32 tensors, a batch at a time."""

    def __init__(self, x, y: np.ndarray):
        self.x, self.y = x, np.asarray(y, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.__getitems__([i])

    def __getitems__(self, idx: list[int]):
        """One read of the rows, in sorted order (sequential on disk), then put back in `idx` order."""
        idx = np.asarray(idx, dtype=np.int64)
        order = np.argsort(idx, kind="stable")
        rows = np.asarray(self.x[idx[order]], dtype=np.float32)  # [B, *shape]
        back = np.empty_like(order)
        back[order] = np.arange(len(order))
        return torch.from_numpy(rows[back]), torch.from_numpy(self.y[idx]), torch.from_numpy(idx)


def _whole_batch(batch):
    return batch  # __getitems__ already built the batch


def batch_loader(x, y, sampler: EpochBatches, workers: int = 0, pin_memory: bool = False) -> DataLoader:
    """Batches (x float32 [B, *shape], y int64 [B], indices int64 [B]) in the sampler's order."""
    return DataLoader(ArrayRows(x, y), batch_sampler=sampler, num_workers=workers, collate_fn=_whole_batch,
                      pin_memory=pin_memory, persistent_workers=False,
                      prefetch_factor=4 if workers > 0 else None)
