"""What the target says about each training trajectory, computed once (SPEC §4, §10).

Distillation needs, per trajectory, the drafter context features at every position and the
teacher's next-token distribution at every response position. Neither changes while the drafter
trains, so the target runs once per trajectory (packed batches, no gradient) and we keep:

- ``features`` (S, K·H): the captured target layers, in the target's dtype;
- ``top_ids`` / ``top_logp`` (R, K): the teacher's top-K tokens and their exact log-probs, for
  the rows that teach a draft slot (t = prompt_len … S−2; row t predicts token t+1);
- ``tail_logp`` (R,): log p̃ of every other token, (1 − Σ_topK p) / (V − K) (``losses``).

``teach`` returns them in memory (an online round); ``build_cache`` writes them as safetensors
shards with an index, resumably, and ``TeacherCache`` reads sequences back without loading whole
shards (offline training on many thousands of trajectories).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from adaflash.losses import TopKTeacher
from adaflash.models.target import PackedBatch, TargetModel
from adaflash.paths import write_text_atomic
from adaflash.workloads import Trajectory

TOP_K = 32  # teacher tokens kept per row; the tail mass covers the rest
INDEX = "index.json"


@dataclass
class CachedSequence:
    """One trajectory as the drafter's training sees it."""

    id: str
    domain: str
    tokens: torch.Tensor  # (S,) int64, prompt + response
    prompt_len: int
    features: torch.Tensor  # (S, K·H)
    top_ids: torch.Tensor  # (R, K) int64 target ids, R = S − 1 − prompt_len
    top_logp: torch.Tensor  # (R, K) float32, sorted descending per row
    tail_logp: torch.Tensor  # (R,) float32
    vocab_size: int

    def __post_init__(self) -> None:
        s, r = self.tokens.numel(), self.top_ids.shape[0]
        assert self.features.shape[0] == s, "one feature row per token"
        assert r == s - 1 - self.prompt_len, "one teacher row per response position but the last"
        assert self.top_logp.shape == self.top_ids.shape and self.tail_logp.shape == (r,)

    def teacher(self, rows: torch.Tensor, lookup: torch.Tensor | None) -> TopKTeacher:
        """The teacher at absolute rows (N,) (each in prompt_len … S−2), in draft coordinates
        given the draft vocabulary's lookup table (V,) (None: the full vocabulary)."""
        r = rows - self.prompt_len
        ids = self.top_ids[r]  # (N, K)
        return TopKTeacher(
            ids if lookup is None else lookup[ids], self.top_logp[r], self.tail_logp[r]
        )


def topk_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher logits (R, V) → top-K ids (R, K), their log-probs (R, K), tail log p̃ (R,)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    k = min(k, logits.shape[-1])
    top_logp, top_ids = logp.topk(k, dim=-1)  # sorted descending
    tail = (1.0 - top_logp.exp().sum(-1)).clamp_min(1e-30)  # mass outside the top-K
    spread = max(logits.shape[-1] - k, 1)
    tail_logp = tail.log() - torch.log(torch.tensor(float(spread)))
    return top_ids, top_logp, tail_logp


@torch.no_grad()
def teach(
    target: TargetModel,
    trajectories: Sequence[Trajectory],
    layer_ids: tuple[int, ...],
    top_k: int = TOP_K,
    max_tokens: int = 2048,
) -> list[CachedSequence]:
    """Run the target once over each trajectory (several per packed pass, up to ``max_tokens``
    tokens) and keep what distillation needs; ``top_k`` 0 keeps the features alone."""
    out: list[CachedSequence] = []
    usable = [t for t in trajectories if len(t.response_ids) >= 2]
    for group in _packs(usable, max_tokens):
        cache = target.new_cache(
            initial_capacity=max(len(t.prompt_ids + t.response_ids) for t in group)
        )
        seqs = [t.prompt_ids + t.response_ids for t in group]
        slots = tuple(cache.allocate() for _ in group)
        starts: list[int] = []
        rows: list[int] = []
        acc = 0
        for t, seq in zip(group, seqs, strict=True):
            starts.append(acc)
            rows.extend(range(acc + len(t.prompt_ids), acc + len(seq) - 1))
            acc += len(seq)
        batch = PackedBatch(
            torch.tensor([x for s in seqs for x in s]), slots, tuple(map(len, seqs))
        )
        res = target(
            batch,
            cache,
            capture_layers=layer_ids,
            logits=torch.tensor(rows[: len(rows) * bool(top_k)], dtype=torch.long),
        )
        assert res.features is not None
        if top_k:
            assert res.logits is not None
            ids, logp, tail = topk_rows(res.logits, top_k)  # (ΣR, K), (ΣR, K), (ΣR,)
        else:  # features only (replaying a drafter needs no teacher distribution)
            ids, logp = torch.zeros(len(rows), 0, dtype=torch.long), torch.zeros(len(rows), 0)
            tail = torch.zeros(len(rows))
        r0 = 0
        for t, seq, start in zip(group, seqs, starts, strict=True):
            r = len(seq) - 1 - len(t.prompt_ids)
            out.append(
                CachedSequence(
                    t.id,
                    t.domain,
                    torch.tensor(seq),
                    len(t.prompt_ids),
                    # on the CPU and out of inference mode, whatever device the target is on
                    res.features[start : start + len(seq)].cpu().clone(),
                    ids[r0 : r0 + r].cpu().clone(),
                    logp[r0 : r0 + r].cpu().clone(),
                    tail[r0 : r0 + r].cpu().clone(),
                    target.cfg.vocab_size,
                )
            )
            r0 += r
    return out


@torch.no_grad()
def teach_hf(
    model: Any,
    trajectories: Sequence[Trajectory],
    layer_ids: tuple[int, ...],
    top_k: int = TOP_K,
    max_tokens: int = 16384,
) -> list[CachedSequence]:
    """``teach`` through a Hugging Face causal LM (``model``: the same weights as the target)
    in right-padded batches of up to ``max_tokens`` (padded) tokens: a GPU runs each batch as a
    few large kernels, where the engine's packed pass loops over requests. Layer i's output is
    ``hidden_states[i + 1]``, as the engine captures it (the last layer's is normed there, so it
    is refused); the LM head runs on the teaching rows only."""
    n_layers = model.config.num_hidden_layers
    if max(layer_ids) >= n_layers - 1:
        raise ValueError(f"layer {max(layer_ids)}: HF returns the last layer's output normed")
    device = next(model.parameters()).device
    usable = [t for t in trajectories if len(t.response_ids) >= 2]
    order = sorted(  # by length: little padding
        range(len(usable)), key=lambda j: len(usable[j].prompt_ids) + len(usable[j].response_ids)
    )
    out: dict[int, CachedSequence] = {}
    i = 0
    while i < len(usable):
        idx = order[i : i + 1]
        width = len(usable[idx[0]].prompt_ids) + len(usable[idx[0]].response_ids)
        while i + len(idx) < len(usable):
            nxt = usable[order[i + len(idx)]]
            n = len(nxt.prompt_ids) + len(nxt.response_ids)
            if (len(idx) + 1) * max(width, n) > max_tokens:
                break
            idx.append(order[i + len(idx)])
            width = max(width, n)
        i += len(idx)
        group = [usable[j] for j in idx]
        seqs = [t.prompt_ids + t.response_ids for t in group]
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for b, seq in enumerate(seqs):  # right-padded: a causal pass never sees the pad
            ids[b, : len(seq)] = torch.tensor(seq)
            mask[b, : len(seq)] = 1
        res = model.model(
            input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True
        )
        feats = torch.cat([res.hidden_states[j + 1] for j in layer_ids], dim=-1)  # (B, W, K·H)
        for b, (j, t, seq) in enumerate(zip(idx, group, seqs, strict=True)):
            rows = torch.arange(len(t.prompt_ids), len(seq) - 1, device=device)
            if top_k:
                logits = model.lm_head(res.last_hidden_state[b, rows])  # (R, V)
                top_ids, top_logp, tail = topk_rows(logits, top_k)
            else:
                top_ids = torch.zeros(rows.numel(), 0, dtype=torch.long)
                top_logp, tail = torch.zeros(rows.numel(), 0), torch.zeros(rows.numel())
            out[j] = CachedSequence(
                t.id,
                t.domain,
                torch.tensor(seq),
                len(t.prompt_ids),
                feats[b, : len(seq)].cpu().clone(),
                top_ids.cpu().clone(),
                top_logp.float().cpu().clone(),
                tail.float().cpu().clone(),
                model.config.vocab_size,
            )
    return [out[j] for j in range(len(usable))]


def _packs(items: Sequence[Trajectory], max_tokens: int) -> Iterator[list[Trajectory]]:
    group: list[Trajectory] = []
    size = 0
    for t in items:
        n = len(t.prompt_ids) + len(t.response_ids)
        if group and size + n > max_tokens:
            yield group
            group, size = [], 0
        group.append(t)
        size += n
    if group:
        yield group


# -- on disk --------------------------------------------------------------------------------------


def _write_shard(path: Path, seqs: list[CachedSequence]) -> None:
    seq_start = torch.tensor([0, *torch.tensor([s.tokens.numel() for s in seqs]).cumsum(0)])
    row_start = torch.tensor([0, *torch.tensor([s.top_ids.shape[0] for s in seqs]).cumsum(0)])
    tensors = {
        "tokens": torch.cat([s.tokens for s in seqs]).int(),
        "features": torch.cat([s.features for s in seqs]),
        "top_ids": torch.cat([s.top_ids for s in seqs]).int(),
        "top_logp": torch.cat([s.top_logp for s in seqs]).float(),
        "tail_logp": torch.cat([s.tail_logp for s in seqs]).float(),
        "seq_start": seq_start.long(),
        "row_start": row_start.long(),
        "prompt_len": torch.tensor([s.prompt_len for s in seqs]).long(),
    }
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def _write_index(folder: Path, index: dict[str, Any]) -> None:
    write_text_atomic(folder / INDEX, json.dumps(index) + "\n")


def cache_key(target_dir: str | Path, layer_ids: tuple[int, ...], top_k: int) -> dict[str, Any]:
    """What a cache was built for; a cache built for anything else is refused."""
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    return {
        "target_config": {
            k: cfg.get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")
        },
        "target_name": Path(target_dir).name,
        "layer_ids": list(layer_ids),
        "top_k": top_k,
    }


def build_cache(
    folder: str | Path,
    target: TargetModel,
    key: dict[str, Any],
    trajectories: Sequence[Trajectory],
    shard_size: int = 256,
    progress: Callable[[int, int], None] | None = None,
) -> TeacherCache:
    """Add every trajectory not yet in the cache at ``folder`` (resumable: finished shards stay,
    an interrupted shard is redone)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / INDEX
    index: dict[str, Any] = (
        json.loads(path.read_text()) if path.is_file() else {"key": key, "shards": []}
    )
    if index["key"] != key:
        raise ValueError(
            f"{folder} holds a teacher cache for {index['key']}, not {key}: use another folder"
        )
    done = {i for sh in index["shards"] for i in sh["ids"]}
    todo = [t for t in trajectories if t.id not in done and len(t.response_ids) >= 2]
    layer_ids = tuple(key["layer_ids"])
    for start in range(0, len(todo), shard_size):
        chunk = todo[start : start + shard_size]
        seqs = teach(target, chunk, layer_ids, key["top_k"])
        name = f"shard-{len(index['shards']):05d}.safetensors"
        _write_shard(folder / name, seqs)
        index["shards"].append(
            {
                "file": name,
                "ids": [s.id for s in seqs],
                "domains": [s.domain for s in seqs],
                "tokens": sum(s.tokens.numel() for s in seqs),
            }
        )
        _write_index(folder, index)
        if progress is not None:
            progress(min(start + shard_size, len(todo)), len(todo))
    return TeacherCache(folder)


class TeacherCache(Sequence[CachedSequence]):
    """Read-only view of a cache folder: ``cache[i]`` is a ``CachedSequence``; shards are
    memory-mapped and each sequence is sliced out on demand."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        path = self.folder / INDEX
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: build the cache first")
        self.manifest = json.loads(path.read_text())
        self.key: dict[str, Any] = self.manifest["key"]
        self.vocab_size = int(self.key["target_config"]["vocab_size"])
        self._where: list[tuple[int, int]] = [
            (si, j) for si, sh in enumerate(self.manifest["shards"]) for j in range(len(sh["ids"]))
        ]
        self._open: dict[int, Any] = {}
        self._offsets: dict[int, dict[str, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._where)

    @property
    def ids(self) -> list[str]:
        return [i for sh in self.manifest["shards"] for i in sh["ids"]]

    @property
    def domains(self) -> list[str]:
        return [d for sh in self.manifest["shards"] for d in sh["domains"]]

    @property
    def tokens(self) -> int:
        return sum(int(sh["tokens"]) for sh in self.manifest["shards"])

    def _shard(self, si: int) -> tuple[Any, dict[str, torch.Tensor]]:
        if si not in self._open:
            f = safe_open(str(self.folder / self.manifest["shards"][si]["file"]), framework="pt")
            self._open[si] = f
            self._offsets[si] = {
                k: f.get_tensor(k) for k in ("seq_start", "row_start", "prompt_len")
            }
        return self._open[si], self._offsets[si]

    @overload
    def __getitem__(self, i: int) -> CachedSequence: ...

    @overload
    def __getitem__(self, i: slice) -> list[CachedSequence]: ...

    def __getitem__(self, i: int | slice) -> CachedSequence | list[CachedSequence]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        si, j = self._where[i]
        f, off = self._shard(si)
        a, b = int(off["seq_start"][j]), int(off["seq_start"][j + 1])
        ra, rb = int(off["row_start"][j]), int(off["row_start"][j + 1])
        shard = self.manifest["shards"][si]
        return CachedSequence(
            shard["ids"][j],
            shard["domains"][j],
            f.get_slice("tokens")[a:b].long(),
            int(off["prompt_len"][j]),
            f.get_slice("features")[a:b],
            f.get_slice("top_ids")[ra:rb].long(),
            f.get_slice("top_logp")[ra:rb],
            f.get_slice("tail_logp")[ra:rb],
            self.vocab_size,
        )
