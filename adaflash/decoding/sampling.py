"""Turning target logits into the distribution the user asked for (temperature, top-k, top-p).

The same function serves plain decoding and speculative verification, so both sample from the
identical distribution — the precondition of losslessness.
"""

from __future__ import annotations

import torch


def target_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """logits (N, V) → probabilities (N, V) after temperature, top-k and top-p (nucleus).

    top-k keeps the k largest logits; top-p then keeps the smallest prefix of the sorted
    distribution whose mass reaches p (the token crossing p is kept). temperature must be > 0.
    Safe for every accepted value: the most likely token always survives top-k and top-p (a
    top_p below float32's smallest number keeps exactly it), and the logits are shifted by
    their maximum before dividing, so a tiny temperature gives a point mass, never NaN.
    """
    assert temperature > 0, "greedy decoding does not build a distribution"
    x = logits.float()
    x = (x - x.max(dim=-1, keepdim=True).values) / temperature  # ≤ 0, the maximum exactly 0
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]  # (N, 1)
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        drop = before >= top_p
        drop[..., 0] = False  # the most likely token is always kept
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row: probs (N, V) → (N,)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
