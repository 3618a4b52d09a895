"""Cached teacher sequences as a LightningDataModule.

A source is anything indexable that yields ``CachedSequence`` items: a list (an online round,
taught in memory) or a ``TeacherCache`` folder (offline training on many thousands)."""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from adaflash.teacher_cache import CachedSequence


class CachedDataset(Dataset[CachedSequence]):
    def __init__(self, source: Sequence[CachedSequence]) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> CachedSequence:
        return self.source[i]


def _as_list(batch: list[CachedSequence]) -> list[CachedSequence]:
    return batch  # sequences differ in length: the module handles them one by one


class TeacherDataModule(L.LightningDataModule):
    def __init__(
        self,
        train: Sequence[CachedSequence],
        val: Sequence[CachedSequence] = (),
        batch_size: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.train_source, self.val_source = train, val
        self.batch_size, self.seed = batch_size, seed

    def train_dataloader(self) -> DataLoader[CachedSequence]:
        return DataLoader(
            CachedDataset(self.train_source),
            batch_size=self.batch_size,
            shuffle=True,
            collate_fn=_as_list,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def val_dataloader(self) -> DataLoader[CachedSequence]:
        return DataLoader(
            CachedDataset(self.val_source), batch_size=self.batch_size, collate_fn=_as_list
        )
