"""Building blocks shared by the target runtime and the drafter.

Numerics follow Hugging Face's Llama/Qwen3 modeling code so that fp32 logits match within 1e-4:
RMSNorm computes in fp32 and casts back before the weight multiply; RoPE tables are computed in
fp32 and cast to the activation dtype; rotation is the ``rotate_half`` convention.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Rotary(nn.Module):
    """RoPE tables for arbitrary absolute positions (packed batches carry mixed positions)."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if scaling is not None:
            inv_freq = _llama3_scale(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions (N,) → cos, sin each (N, head_dim) in ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (N, head_dim/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (N, head_dim)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _llama3_scale(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama-3.1 frequency scaling (the formula of transformers' ``_compute_llama3_parameters``)."""
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, heads, head_dim); cos/sin (N, head_dim)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Grouped-query attention for one sequence.

    q (n_q, heads, d); k, v (kv_heads, n_k, d); mask (n_q, n_k) bool (True = may attend) or None
    for full attention. Returns (n_q, heads·d).
    """
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # (1, heads, n_q, d)
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=mask,
        enable_gqa=True,
    )  # (1, heads, n_q, d)
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


def causal_mask(n_new: int, n_past: int, device: torch.device) -> torch.Tensor | None:
    """New token i (absolute position n_past + i) sees keys 0 … n_past + i. None when n_new = 1."""
    if n_new == 1:
        return None
    q_pos = torch.arange(n_new, device=device)[:, None] + n_past
    k_pos = torch.arange(n_past + n_new, device=device)[None, :]
    return k_pos <= q_pos  # (n_new, n_past + n_new)
