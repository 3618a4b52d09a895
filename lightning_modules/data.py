"""Trajectories as a LightningDataModule (files now; the database buffer plugs in later)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader, Dataset

from adaflash.workloads import Trajectory, read_trajectories


class TrajectoryDataset(Dataset[Trajectory]):
    def __init__(self, trajectories: list[Trajectory]) -> None:
        self.items = [t for t in trajectories if len(t.response_ids) >= 2]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Trajectory:
        return self.items[i]


def _as_list(batch: list[Trajectory]) -> list[Trajectory]:
    return batch  # sequences differ in length: the module handles them one by one


class TrajectoryDataModule(L.LightningDataModule):
    def __init__(
        self,
        train: list[Trajectory] | list[Path],
        val: list[Trajectory] | list[Path] | None = None,
        batch_size: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.train_items = _load(train)
        self.val_items = _load(val or [])
        self.batch_size, self.seed = batch_size, seed

    def train_dataloader(self) -> DataLoader[Trajectory]:
        import torch

        return DataLoader(
            TrajectoryDataset(self.train_items),
            batch_size=self.batch_size,
            shuffle=True,
            collate_fn=_as_list,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def val_dataloader(self) -> DataLoader[Trajectory]:
        return DataLoader(
            TrajectoryDataset(self.val_items), batch_size=self.batch_size, collate_fn=_as_list
        )


def _load(items: list[Trajectory] | list[Path]) -> list[Trajectory]:
    if items and not isinstance(items[0], Trajectory):
        return read_trajectories([Path(str(p)) for p in items])
    return list(items)  # type: ignore[arg-type]  # (mypy cannot narrow the list's type)
