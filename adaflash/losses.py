"""Distillation losses for the drafter (AdaFlash §3.1; SPEC §4).

Per draft slot with drafter distribution q and teacher (target) distribution p, temperature 1:

    ℓ_hard = −log q(argmax p)                            hard CE on the target's top-1 token
    ℓ_rkl  = Σ_y min( q(y)·log(q(y)/p(y)), δ )           reverse KL, clipped per vocabulary entry
    ℓ_OPD  = α·ℓ_hard + (1−α)·ℓ_rkl                      α = 0.8, δ = 0.01

The OSD baseline (Liu et al., 2024) uses the forward KL Σ_y p(y)·log(p(y)/q(y)), unclipped.
Only q carries gradient: the teacher is detached.
"""

from __future__ import annotations

import math

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


def slot_weights(block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """w_i = exp(−(i−1)/7) for draft slots i = 1 … k−1 → (k−1,). Slot 0 (the anchor) has none."""
    i = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(i - 1) / SLOT_DECAY)


def weighted_slot_mean(
    per_slot: torch.Tensor, valid: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Σ w_i·ℓ_i over valid slots ÷ Σ w_i over valid slots. per_slot, valid (blocks, k−1)."""
    w = slot_weights(block_size, per_slot.device)[None, :] * valid.float()  # (blocks, k−1)
    return (per_slot * w).sum() / w.sum().clamp_min(math.ulp(1.0))
