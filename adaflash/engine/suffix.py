"""Suffix drafts: the continuation that followed the current suffix before (SuffixDecoding,
arXiv 2411.04975), in the request's own prompt and output or in recently served sequences.

A draft costs dictionary lookups, no model pass, and the index learns every token the moment it
is served. Each index maps every n-gram of ``min_n`` … ``max_n`` tokens to where its latest
occurrence ended (continuation known); a proposal is the continuation of the longest suffix of
the request that occurred before, its score the match length. ArcticInference keeps suffix
trees in C++ and proposes the most frequent continuation; here the latest one stands in for it
(what the measurement that motivated this drafter simulated).

Drafts never change what a request receives (verification keeps the target's tokens), but the
global history makes one user's replies shape another's speed: ``SuffixConfig.scope`` chooses
whether a request drafts from its own tokens alone or also from recently served sequences.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

MAX_DRAFT = 15  # a suffix proposal's tokens at most: a verification of 16, the widest compiled


@dataclass(frozen=True)
class SuffixConfig:
    """The n-grams an index keeps, what a proposal may carry and the history's size (the
    scope, what a request may draft from, is ``EngineConfig.suffix``)."""

    min_n: int = 2  # the shortest suffix that may propose (one token matches too much)
    max_n: int = 8
    max_draft: int = MAX_DRAFT  # tokens a proposal carries at most
    global_tokens: int = 200_000  # the global history's size in tokens

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError("suffix n-grams need 1 ≤ min_n ≤ max_n")
        if self.max_draft < 1 or self.global_tokens < 0:
            raise ValueError("max_draft must be ≥ 1 and global_tokens ≥ 0")


@dataclass(frozen=True)
class Proposal:
    """A suffix draft: ``tokens`` to verify after the anchor, found by a match of ``match``
    tokens (its score: longer matches are accepted further)."""

    tokens: tuple[int, ...]
    match: int


class SuffixIndex:
    """The n-grams of one growing token sequence → the end of their latest occurrence."""

    def __init__(self, cfg: SuffixConfig, tokens: Sequence[int] = ()) -> None:
        self.cfg = cfg
        self.tokens: list[int] = []
        self.table: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens; every n-gram that now has a continuation joins the table."""
        lo, hi = self.cfg.min_n, self.cfg.max_n
        seq = self.tokens
        for t in tokens:
            end = len(seq)  # the n-grams ending here are continued by t
            for n in range(lo, min(hi, end) + 1):
                self.table[tuple(seq[end - n : end])] = end
            seq.append(t)

    def match(self) -> tuple[int, int]:
        """(match length, end of its latest occurrence) of the sequence's longest suffix that
        occurred before; (0, -1) when none of ``min_n`` tokens or more did."""
        tail = self.tokens
        for n in range(min(self.cfg.max_n, len(tail)), self.cfg.min_n - 1, -1):
            end = self.table.get(tuple(tail[len(tail) - n :]))
            if end is not None:
                return n, end
        return 0, -1

    def propose(self, limit: int) -> Proposal | None:
        """The continuation (at most ``limit`` tokens) of the sequence's longest suffix that
        occurred before. Where the continuation runs into the sequence's end, it goes on with
        itself (what it predicts follows the suffix, which it ends in): a loop of period p is
        drafted on for as long as the limit allows."""
        n, end = self.match()
        if not n or limit < 1:
            return None
        cont = self.tokens[end : end + limit]
        period = len(cont)
        while len(cont) < limit and end + period == len(self.tokens):
            cont.append(cont[len(cont) - period])
        return Proposal(tuple(cont), n) if cont else None


class GlobalSuffixes:
    """Recently served sequences, searched together: each n-gram → (sequence, end) of its
    latest occurrence among them; the oldest sequences leave once ``global_tokens`` is
    exceeded, and their n-grams with them (unless a later sequence holds them too)."""

    def __init__(self, cfg: SuffixConfig) -> None:
        self.cfg = cfg
        self.sequences: OrderedDict[int, list[int]] = OrderedDict()
        self.table: dict[tuple[int, ...], tuple[int, int]] = {}
        self.size = 0
        self._next = 0

    def add(self, tokens: Sequence[int]) -> None:
        """A served sequence (prompt + output) joins the history."""
        if not tokens or self.cfg.global_tokens == 0:
            return
        seq = list(tokens[-self.cfg.global_tokens :])
        sid, self._next = self._next, self._next + 1
        self.sequences[sid] = seq
        self.size += len(seq)
        lo, hi = self.cfg.min_n, self.cfg.max_n
        for end in range(1, len(seq)):
            for n in range(lo, min(hi, end) + 1):
                self.table[tuple(seq[end - n : end])] = (sid, end)
        while self.size > self.cfg.global_tokens:
            self._evict()

    def _evict(self) -> None:
        sid, seq = self.sequences.popitem(last=False)
        self.size -= len(seq)
        lo, hi = self.cfg.min_n, self.cfg.max_n
        for end in range(1, len(seq)):
            for n in range(lo, min(hi, end) + 1):
                key = tuple(seq[end - n : end])
                if self.table.get(key, (None,))[0] == sid:
                    del self.table[key]

    def propose(self, tail: Sequence[int], limit: int) -> Proposal | None:
        """Like ``SuffixIndex.propose``, over every sequence held."""
        for n in range(min(self.cfg.max_n, len(tail)), self.cfg.min_n - 1, -1):
            hit = self.table.get(tuple(tail[len(tail) - n :]))
            if hit is not None:
                cont = self.sequences[hit[0]][hit[1] : hit[1] + limit]
                if cont:
                    return Proposal(tuple(cont), n)
        return None


def best(*proposals: Proposal | None) -> Proposal | None:
    """The proposal of the longest match (the first of equals: the request's own first)."""
    found = [p for p in proposals if p is not None]
    return max(found, key=lambda p: p.match) if found else None


MATCH_BUCKETS = 7  # match lengths 2, 3, …, 7 and 8+ learn apart (longer matches hold longer)


class SuffixProfile:
    """What suffix drafts are worth here: per match length (``bucket``), per draft slot i,
    decayed counts of P(slot i accepted | slots < i accepted). Every proposal teaches it for
    free — verified or not, the tokens the request commits next decide its slots
    (``shadow_progress``) — so it starts at a = 0 (nothing verified on faith) and learns from
    the first proposals."""

    DECAY = 0.995  # ~200 slot observations of memory per bucket
    PRIOR_WEIGHT = 1.0

    def __init__(self, slots: int = MAX_DRAFT) -> None:
        self.slots = slots
        self.seen = [[0.0] * slots for _ in range(MATCH_BUCKETS)]
        self.ok = [[0.0] * slots for _ in range(MATCH_BUCKETS)]
        self.version = 0  # changes whenever a count does (survival may be kept by it)

    @staticmethod
    def bucket(match: int) -> int:
        return min(max(match, 2), MATCH_BUCKETS + 1) - 2

    def observe(self, match: int, first: int, compared: int, accepted: int) -> None:
        """Slots ``first`` … ``compared`` − 1 of a proposal, decided by the committed tokens:
        the first ``accepted`` were right; each slot counts once every slot before it was right
        (as ``policy.reached``)."""
        b = self.bucket(match)
        seen, ok = self.seen[b], self.ok[b]
        for i in range(first, min(compared, accepted + 1, self.slots)):
            seen[i] = self.DECAY * seen[i] + 1.0
            ok[i] = self.DECAY * ok[i] + float(i < accepted)
        self.version += 1

    def survival(self, match: int, length: int) -> list[float]:
        """Π_{j≤i} a_j for slots i = 0 … length − 1 of a proposal of this match length."""
        b = self.bucket(match)
        seen, ok, w = self.seen[b], self.ok[b], self.PRIOR_WEIGHT
        out, s = [], 1.0
        for i in range(min(length, self.slots)):
            s *= ok[i] / (seen[i] + w)
            out.append(s)
        return out


def shadow_progress(output: Sequence[int], start: int, drafts: Sequence[int]) -> tuple[int, int]:
    """(draft slots decided, drafts right) of ``drafts`` standing for ``output[start:]``: the
    matches up to the first miss among the tokens committed so far (the miss decided too)."""
    got = output[start : start + len(drafts)]
    n = 0
    while n < len(got) and got[n] == drafts[n]:
        n += 1
    return (n + 1 if n < len(got) else n), n
