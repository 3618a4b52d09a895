"""Per-request key/value cache slots for packed ragged batches.

Each slot owns one tensor (layers, 2, kv_heads, capacity, head_dim) that grows by doubling, and a
committed length. A forward pass writes new keys/values after the committed length; the engine
then calls ``truncate`` to keep only what the target accepted (partial acceptance).
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        initial_capacity: int = 256,
    ) -> None:
        self.shape = (num_layers, 2, kv_heads, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.initial_capacity = initial_capacity
        self._data: dict[int, torch.Tensor] = {}
        self._len: dict[int, int] = {}
        self._next = 0

    # -- slot life cycle ---------------------------------------------------------------------
    def allocate(self) -> int:
        slot = self._next
        self._next += 1
        layers, two, heads, dim = self.shape
        self._data[slot] = torch.empty(
            layers, two, heads, self.initial_capacity, dim, dtype=self.dtype, device=self.device
        )
        self._len[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self._data.pop(slot, None)
        self._len.pop(slot, None)

    def clear(self, slot: int) -> None:
        self._len[slot] = 0

    def __contains__(self, slot: int) -> bool:
        return slot in self._data

    def __len__(self) -> int:
        """Slots in use."""
        return len(self._data)

    # -- reading and writing -----------------------------------------------------------------
    def length(self, slot: int) -> int:
        return self._len[slot]

    def reserve(self, slot: int, extra: int) -> None:
        """Make room for ``extra`` tokens after the committed length."""
        data = self._data[slot]
        need = self._len[slot] + extra
        if need <= data.shape[3]:
            return
        cap = max(need, 2 * data.shape[3])
        grown = torch.empty(
            *data.shape[:3], cap, data.shape[4], dtype=self.dtype, device=self.device
        )
        grown[:, :, :, : self._len[slot]] = data[:, :, :, : self._len[slot]]
        self._data[slot] = grown

    def write(
        self, slot: int, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """Append k, v (kv_heads, n, d) after the committed length of ``slot`` for ``layer``.

        Returns the full keys and values (kv_heads, committed + n, d) to attend over. The committed
        length only moves on ``advance``; every layer of one pass writes at the same offset.
        """
        start = self._len[slot]
        end = start + k.shape[1]
        data = self._data[slot]
        data[layer, 0, :, start:end] = k
        data[layer, 1, :, start:end] = v
        return data[layer, 0, :, :end], data[layer, 1, :, :end]

    def read(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = self._len[slot]
        data = self._data[slot]
        return data[layer, 0, :, :end], data[layer, 1, :, :end]

    def advance(self, slot: int, n: int) -> None:
        self._len[slot] += n

    def truncate(self, slot: int, length: int) -> None:
        """Keep the first ``length`` positions (drop rejected drafts)."""
        if not 0 <= length <= self._len[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self._len[slot]} to {length}")
        self._len[slot] = length
