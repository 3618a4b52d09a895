"""The draft vocabulary: a frequency-ranked subset of the target's vocabulary that the drafter
drafts from (the idea of EAGLE-3's draft vocabulary, SPEC §10).

The drafter owns no LM head: it scores its block states against rows of the target's frozen LM
head. With a draft vocabulary it scores only the rows of the ``V_d`` tokens the target emits most
often, which makes the draft pass and the training loss ~V/V_d times cheaper in that layer. A
token outside the set is never drafted; the target still verifies every draft and emits its own
bonus token, so output stays exactly the target's.

Stored as ``draft_vocab.json`` in the drafter folder (ids in rank order, plus how it was built).
A folder without one drafts over the whole vocabulary, and SGLang's DFlash loader never reads the
file, so the same folder serves there with the full head.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

FILE = "draft_vocab.json"


def count_tokens(sequences: Iterable[list[int]], vocab_size: int) -> torch.Tensor:
    """How often each target id occurs in ``sequences`` → (V,) int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        if seq:
            counts += torch.bincount(torch.tensor(seq, dtype=torch.long), minlength=vocab_size)
    return counts


def build_draft_vocab(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent ids (ties broken by id), ``always`` included → (V_d,) int64."""
    vocab_size = counts.numel()
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    forced = sorted({int(i) for i in always})
    if any(not 0 <= i < vocab_size for i in forced) or len(forced) > size:
        raise ValueError("forced draft-vocabulary ids must be valid ids and fit in the size")
    score = counts.double().clone()
    score[forced] = float("inf")
    # stable descending sort: equal counts keep id order
    order = torch.sort(score, descending=True, stable=True).indices
    return order[:size].clone()


def coverage(ids: torch.Tensor, counts: torch.Tensor) -> float:
    """Fraction of the counted token occurrences that fall inside the draft vocabulary."""
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else 0.0


def lookup_table(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(V,) int64: the draft index of each target id, −1 outside the draft vocabulary."""
    table = torch.full((vocab_size,), -1, dtype=torch.long)
    table[ids] = torch.arange(ids.numel())
    return table


def save_draft_vocab(folder: str | Path, ids: torch.Tensor, info: dict[str, Any]) -> Path:
    path = Path(folder) / FILE
    path.write_text(json.dumps({**info, "size": ids.numel(), "ids": ids.tolist()}) + "\n")
    return path


def load_draft_vocab(
    folder: str | Path, vocab_size: int
) -> tuple[torch.Tensor, dict[str, Any]] | None:
    """The folder's draft vocabulary ids (V_d,) and how it was built, or None when it has none;
    refuses a broken file."""
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        ids = torch.tensor(raw["ids"], dtype=torch.long)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a draft vocabulary ({exc})") from exc
    if ids.dim() != 1 or ids.numel() == 0 or ids.numel() != int(raw.get("size", ids.numel())):
        raise ValueError(f"{path}: 'ids' must be a non-empty list of size {raw.get('size')}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"{path}: ids must lie in [0, {vocab_size})")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"{path}: ids must be distinct")
    return ids, {k: v for k, v in raw.items() if k != "ids"}
