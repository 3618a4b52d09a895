"""Key/value cache slots for packed ragged batches, in one preallocated pool.

Every layer's keys and values of every slot live in one tensor
``(rows, layers, 2, kv_heads, capacity, head_dim)``, written in place: a row's keys and values
are one block whose strides depend only on the capacity (what a compiled decode graph reads,
``models/decode_graph.py``). A slot is a stable id that
maps to a row; the rows in use are always ``0 … len(self) − 1`` (freeing a slot moves the last
row's data into its row), so ``layer(l)`` is a view over every live request at once — what
batched attention reads without copying. Rows and capacity grow by doubling when a request
needs more (the pool moves then, rarely); nothing is allocated or freed per request, so a long
running server does not fragment its heap (a per-request tensor did: RSS crept up under load).

A forward pass writes new keys/values after a slot's committed length; the engine then calls
``truncate`` to keep only what the target accepted (partial acceptance). The pool is never part
of an autograd graph: its mutations run in inference mode, from any caller.
"""

from __future__ import annotations

import torch


class Rows:
    """Stable slot ids over compacted rows ``0 … n−1`` (the KV pool and the feature pool use
    it): freeing a slot moves the last row into the freed one."""

    def __init__(self) -> None:
        self.row: dict[int, int] = {}  # slot id → row
        self.slots: list[int] = []  # row → slot id
        self._next = 0

    def add(self) -> tuple[int, int]:
        slot, row = self._next, len(self.slots)
        self._next += 1
        self.row[slot] = row
        self.slots.append(slot)
        return slot, row

    def remove(self, slot: int) -> tuple[int, int, int] | None:
        """Forget ``slot``. Returns (moved slot, its old row, its new row) when the last row
        moved into the freed one, else None (the caller moves the data)."""
        row = self.row.pop(slot)
        last = self.slots.pop()
        if last == slot:
            return None
        self.row[last] = row
        self.slots[row] = last
        return last, len(self.slots), row

    def __len__(self) -> int:
        return len(self.slots)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        initial_capacity: int = 256,
        initial_rows: int = 4,
    ) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.data = self._empty(max(initial_rows, 1), max(initial_capacity, 1))
        self.rows = Rows()
        self._len: dict[int, int] = {}  # slot id → committed length

    @torch.inference_mode()
    def _empty(self, rows: int, capacity: int) -> torch.Tensor:
        """Always an inference tensor (the compiled decode step's guards see one kind)."""
        return torch.zeros(
            rows,
            self.num_layers,
            2,
            self.kv_heads,
            capacity,
            self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    @property
    def capacity(self) -> int:
        return self.data.shape[4]

    # -- slot life cycle ---------------------------------------------------------------------
    @torch.inference_mode()
    def allocate(self) -> int:
        if len(self.rows) == self.data.shape[0]:
            self._resize(2 * len(self.rows), self.capacity)
        slot, _ = self.rows.add()
        self._len[slot] = 0
        return slot

    @torch.inference_mode()
    def free(self, slot: int) -> None:
        """Release a slot; the last row in use moves into its row (its committed part only)."""
        if slot not in self.rows.row:
            return
        moved = self.rows.remove(slot)
        self._len.pop(slot)
        if moved is not None:
            other, src, dst = moved
            n = self._len[other]
            self.data[dst, ..., :n, :] = self.data[src, ..., :n, :]

    def clear(self, slot: int) -> None:
        self._len[slot] = 0

    def __contains__(self, slot: int) -> bool:
        return slot in self.rows.row

    def __len__(self) -> int:
        """Slots in use (= rows in use)."""
        return len(self.rows)

    @torch.inference_mode()
    def _resize(self, rows: int, capacity: int) -> None:
        grown = self._empty(rows, capacity)
        used, longest = len(self.rows), max(self._len.values(), default=0)
        grown[:used, ..., :longest, :] = self.data[:used, ..., :longest, :]
        self.data = grown

    # -- reading and writing -----------------------------------------------------------------
    def row(self, slot: int) -> int:
        return self.rows.row[slot]

    def length(self, slot: int) -> int:
        return self._len[slot]

    def reserve(self, slot: int, extra: int) -> None:
        """Make room for ``extra`` tokens after the committed length."""
        need = self._len[slot] + extra
        if need > self.capacity:
            self._resize(self.data.shape[0], max(need, 2 * self.capacity))

    @torch.inference_mode()
    def write(
        self, slot: int, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """Append k, v (kv_heads, n, d) after the committed length of ``slot`` for ``layer``.

        Returns the full keys and values (kv_heads, committed + n, d) to attend over. The committed
        length only moves on ``advance``; every layer of one pass writes at the same offset.
        """
        row, start = self.rows.row[slot], self._len[slot]
        end = start + k.shape[1]
        self.data[row, layer, 0, :, start:end] = k
        self.data[row, layer, 1, :, start:end] = v
        return self.data[row, layer, 0, :, :end], self.data[row, layer, 1, :, :end]

    @torch.inference_mode()
    def write_layers(self, slot: int, kv: torch.Tensor) -> None:
        """Append every layer's keys and values at once after the committed length of
        ``slot`` (room made by ``reserve``): kv (layers, 2, kv_heads, n, d)."""
        row, start = self.rows.row[slot], self._len[slot]
        self.data[row, :, :, :, start : start + kv.shape[3]] = kv

    @torch.inference_mode()
    def write_rows(
        self,
        layer: int,
        rows: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Scatter the keys/values of a packed batch in place: token t goes to
        (rows[t], positions[t]); k, v (T, kv_heads, d)."""
        keys = self.data[:, layer, 0].permute(0, 2, 1, 3)  # (rows, capacity, kv_heads, d) view
        values = self.data[:, layer, 1].permute(0, 2, 1, 3)
        keys[rows, positions] = k
        values[rows, positions] = v

    def layer(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every row in use, first ``length`` positions: views
        (rows in use, kv_heads, length, d)."""
        used = len(self.rows)
        return self.data[:used, layer, 0, :, :length], self.data[:used, layer, 1, :, :length]

    def read(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        row, end = self.rows.row[slot], self._len[slot]
        return self.data[row, layer, 0, :, :end], self.data[row, layer, 1, :, :end]

    def advance(self, slot: int, n: int) -> None:
        self._len[slot] += n

    def truncate(self, slot: int, length: int) -> None:
        """Keep the first ``length`` positions (drop rejected drafts)."""
        if not 0 <= length <= self._len[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self._len[slot]} to {length}")
        self._len[slot] = length
