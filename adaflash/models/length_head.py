"""The adaptive length head (AdaFlash §3.2; SPEC §3).

We implement the paper's variant: Linear(H→H′) + SiLU per slot, mean-pool over the k slots
(anchor included), Linear(H′→1) + sigmoid → â ∈ [0, 1], the predicted fraction of the block that
the target will accept. It reads DETACHED drafter states, so its MSE loss never reaches the
drafter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LengthHead(nn.Module):
    def __init__(self, hidden: int, inner: int = 256) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, inner)
        self.out = nn.Linear(inner, 1)

    def forward(self, block_states: torch.Tensor) -> torch.Tensor:
        """block_states (B, k, H) → â (B,)."""
        h = F.silu(self.proj(block_states.detach()))  # (B, k, H′)
        return torch.sigmoid(self.out(h.mean(dim=1))).squeeze(-1)  # (B,)


def verify_len(a_hat: torch.Tensor, block_size: int, gamma: float = 1.0) -> torch.Tensor:
    """k̂ = clamp(⌊γ·â·k⌋, 1, k): how many block slots (anchor included) the target verifies."""
    k_hat = torch.floor(gamma * a_hat.double() * block_size)
    return k_hat.clamp(1, block_size).long()


def acceptance_label(accepted_drafts: torch.Tensor | int, block_size: int) -> torch.Tensor:
    """a* = (accepted drafts + 1) / k, the head's regression target (SPEC §3)."""
    return (torch.as_tensor(accepted_drafts, dtype=torch.float32) + 1.0) / block_size


def head_loss(a_hat: torch.Tensor, a_star: torch.Tensor) -> torch.Tensor:
    """ℓ_len = (â − a*)², averaged over blocks."""
    return ((a_hat - a_star) ** 2).mean()
