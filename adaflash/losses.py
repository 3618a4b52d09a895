"""Distillation losses for the drafter (AdaFlash §3.1; SPEC §4).

Per draft slot with drafter distribution q and teacher (target) distribution p, temperature 1:

    ℓ_hard = −log q(argmax p)                            hard CE on the target's top-1 token
    ℓ_rkl  = Σ_y min( q(y)·log(q(y)/p(y)), δ )           reverse KL, clipped per vocabulary entry
    ℓ_OPD  = α·ℓ_hard + (1−α)·ℓ_rkl                      α = 0.8, δ = 0.01

The OSD baseline (Liu et al., 2024) uses the forward KL Σ_y p(y)·log(p(y)/q(y)), unclipped.
Only q carries gradient: the teacher is detached.

``opd_loss`` / ``osd_loss`` are the exact definitions over full-vocabulary logits. Training uses
``opd_loss_topk`` / ``osd_loss_topk``, which take the teacher as its cached top-K log-probs and
the drafter's logits over its draft vocabulary V_d, and never build a (N, V) tensor. They depart
from the exact losses in exactly two ways (tests/test_losses.py compares them):

1. q lives on V_d (q(y) = 0 outside it): the rKL sum runs over V_d, where 0·log 0 = 0 makes it
   exact for such a q; the hard term is skipped for a row whose top-1 token lies outside V_d.
   Without a draft vocabulary (V_d = V) this is no departure at all.
2. p is known exactly on the teacher's top-K tokens; every other token gets the tail mass spread
   evenly, p̃(y) = (1 − Σ_topK p) / (V − K). The clip makes this nearly harmless for ℓ_rkl: an
   entry where q puts real mass on a tail token is clipped to δ whatever p̃ is. With K = V both
   losses equal the exact ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ALPHA = 0.8  # weight of the hard term (paper App. B.1)
DELTA = 0.01  # entry-wise clip threshold δ
SLOT_DECAY = 7.0  # w_i = exp(−(i−1)/7) for draft slot i ≥ 1 (SPEC §4)


def opd_loss(
    q_logits: torch.Tensor, p_logits: torch.Tensor, alpha: float = ALPHA, delta: float = DELTA
) -> torch.Tensor:
    """q_logits, p_logits (N, V) → per-row ℓ_OPD (N,)."""
    log_q = F.log_softmax(q_logits.float(), dim=-1)  # (N, V)
    log_p = F.log_softmax(p_logits.detach().float(), dim=-1)
    hard = -log_q.gather(-1, log_p.argmax(-1, keepdim=True)).squeeze(-1)  # (N,)
    rkl_entries = log_q.exp() * (log_q - log_p)  # (N, V): q(y)·log(q(y)/p(y))
    rkl = torch.clamp(rkl_entries, max=delta).sum(-1)  # min(·, δ) per (row, y)
    return alpha * hard + (1 - alpha) * rkl


def osd_loss(q_logits: torch.Tensor, p_logits: torch.Tensor) -> torch.Tensor:
    """Forward KL Σ p·log(p/q) per row (N,), no clip: the OSD baseline."""
    log_q = F.log_softmax(q_logits.float(), dim=-1)
    log_p = F.log_softmax(p_logits.detach().float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


@dataclass(frozen=True)
class TopKTeacher:
    """The teacher at N rows, in draft-vocabulary coordinates (``losses`` departure 2)."""

    index: torch.Tensor  # (N, K) draft index of each top-K token, −1 outside the draft vocab
    logp: torch.Tensor  # (N, K) exact log p of those tokens (full-vocabulary softmax)
    tail_logp: torch.Tensor  # (N,) log p̃ of every token outside the top-K

    def dense(self, draft_vocab_size: int) -> torch.Tensor:
        """log p̃ on the draft vocabulary (N, V_d): tail value, top-K entries scattered in."""
        n = self.logp.shape[0]
        out = self.tail_logp.float()[:, None].expand(n, draft_vocab_size).clone()
        inside = self.index >= 0
        rows = torch.arange(n, device=out.device)[:, None].expand_as(self.index)
        out[rows[inside], self.index[inside]] = self.logp.float()[inside]
        return out

    def to(self, device: torch.device) -> TopKTeacher:
        return TopKTeacher(self.index.to(device), self.logp.to(device), self.tail_logp.to(device))

    @staticmethod
    def cat(parts: Sequence[TopKTeacher]) -> TopKTeacher:
        """The rows of several teachers, in order."""
        return TopKTeacher(
            torch.cat([t.index for t in parts]),
            torch.cat([t.logp for t in parts]),
            torch.cat([t.tail_logp for t in parts]),
        )

    @property
    def top1(self) -> torch.Tensor:
        """(N,) draft index of the teacher's argmax (−1 outside the draft vocabulary); the top-K
        come sorted by probability, so it is column 0."""
        return self.index[:, 0]


def opd_loss_topk(
    q_logits: torch.Tensor, teacher: TopKTeacher, alpha: float = ALPHA, delta: float = DELTA
) -> torch.Tensor:
    """q_logits (N, V_d) → per-row ℓ_OPD (N,) against a top-K teacher (see the module doc)."""
    log_q = F.log_softmax(q_logits.float(), dim=-1)  # (N, V_d)
    log_p = teacher.dense(log_q.shape[-1]).detach()  # (N, V_d)
    top1 = teacher.top1
    hard = -log_q.gather(-1, top1.clamp_min(0)[:, None]).squeeze(-1) * (top1 >= 0)  # (N,)
    rkl = torch.clamp(log_q.exp() * (log_q - log_p), max=delta).sum(-1)  # (N,)
    return alpha * hard + (1 - alpha) * rkl


def osd_loss_topk(q_logits: torch.Tensor, teacher: TopKTeacher) -> torch.Tensor:
    """Forward KL Σ p̃·log(p̃/q) over the draft vocabulary (N,): the OSD baseline on a top-K
    teacher. Teacher mass outside V_d has no q to match and is left out."""
    log_q = F.log_softmax(q_logits.float(), dim=-1)
    log_p = teacher.dense(log_q.shape[-1]).detach()
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def slot_weights(
    block_size: int, device: torch.device | str = "cpu", decay: float | None = None
) -> torch.Tensor:
    """w_i = exp(−(i−1)/decay) for draft slots i = 1 … k−1 → (k−1,); decay defaults to 7
    (SPEC §4). Slot 0 (the anchor) has none."""
    i = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(i - 1) / (SLOT_DECAY if decay is None else decay))


def weighted_slot_mean(
    per_slot: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ w_i·ℓ_i over valid slots ÷ Σ w_i over valid slots. per_slot, valid (blocks, k−1);
    weights (k−1,), default ``slot_weights(block_size)``."""
    w = (
        slot_weights(block_size, per_slot.device)
        if weights is None
        else weights.to(per_slot.device)
    )
    w = w[None, :] * valid.float()  # (blocks, k−1)
    return (per_slot * w).sum() / w.sum().clamp_min(math.ulp(1.0))
