"""Building blocks shared by the target runtime and the drafter.

Numerics follow Hugging Face's Llama/Qwen3 modeling code so that fp32 logits match within 1e-4:
RMSNorm computes in fp32 and casts back before the weight multiply; RoPE tables are computed in
fp32 and cast to the activation dtype; rotation is the ``rotate_half`` convention.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from adaflash.hardware import native_bf16
from adaflash.models import gemv as gemv_kernel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x·rsqrt(mean(x²) + eps) in fp32, cast back, then the weight: HF's order, one kernel
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)


def fp32_rows() -> int:
    """Inputs with at least this many rows go through fp32 copies of bf16 weights (0: never).
    ``ADAFLASH_FP32_ROWS`` overrides; by default 4 where the CPU lacks native bf16 (the
    measured crossover), else never."""
    raw = os.environ.get("ADAFLASH_FP32_ROWS")
    if raw is not None:
        return max(int(raw), 0)
    return 0 if native_bf16() else 4


@dataclass(frozen=True)
class Packed:
    """Inference copies of one bf16 weight: oneDNN's blocked layout (what inductor's freezing
    uses; bit-identical to ``F.linear``) for few rows, and an fp32 copy for ``min_rows`` rows and
    more where that is faster (no native bf16): more memory, several times less time.
    ``gemv_rows``: inputs of up to this many rows go through the bf16 GEMV kernel
    (``models/gemv.py``; 0: none), which reads the weight as it is (no copy). ``panels``: the
    weight packed for the panels kernel (``gemv.pack_panels``), which then takes every input
    instead of the others (it beat oneDNN's prepacked weights from 1 to 512 rows where it
    serves), and the compiled steps share it."""

    onednn: torch.Tensor | None
    fp32: torch.Tensor | None = None
    fp32_bias: torch.Tensor | None = None
    min_rows: int = 0
    gemv_rows: int = 0
    panels: torch.Tensor | None = None


def pack(
    weight: torch.Tensor, bias: torch.Tensor | None = None, rows_scale: int = 1
) -> Packed | None:
    """The ``Packed`` copies of a bf16 CPU weight, or None where none applies (not bf16 on a
    CPU, or switched off: ``ADAFLASH_PACKED_WEIGHTS=0`` for the oneDNN layout,
    ``ADAFLASH_FP32_ROWS=0`` for the fp32 copy). ``rows_scale`` moves the fp32 crossover for
    memory-bound shapes (the LM head: ×2)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    panels = gemv_kernel.pack_panels(weight) if bias is None else None
    if panels is not None:
        return Packed(None, panels=panels)
    gemv_rows = gemv_kernel.eager_rows() if bias is None else 0  # reads the weight as it is
    onednn = None
    use_onednn = os.environ.get("ADAFLASH_PACKED_WEIGHTS", "1") != "0"
    if use_onednn and torch.backends.mkldnn.is_available():
        try:
            onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        except (RuntimeError, AttributeError):
            onednn = None
    rows = fp32_rows() * rows_scale
    if rows == 0:
        return Packed(onednn, gemv_rows=gemv_rows) if onednn is not None or gemv_rows else None
    fp32_bias = None if bias is None else bias.detach().float()
    return Packed(onednn, weight.detach().float(), fp32_bias, rows, gemv_rows)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: Packed | None = None,
) -> torch.Tensor:
    """``F.linear``, through the fastest ``Packed`` copy for this many rows."""
    if packed is not None:
        if packed.panels is not None:
            return gemv_kernel.panel_linear(x, packed.panels)
        if packed.gemv_rows and x.numel() <= packed.gemv_rows * x.shape[-1]:
            return gemv_kernel.gemv(x, weight)
        if packed.fp32 is not None and x.numel() >= packed.min_rows * x.shape[-1]:
            return F.linear(x.float(), packed.fp32, packed.fp32_bias).to(x.dtype)
        if packed.onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Projection(nn.Linear):
    """A bias-optional Linear that can pack its weight for inference (``pack_weight``)."""

    packed: Packed | None = None

    def pack_weight(self, rows_scale: int = 1) -> None:
        self.packed = pack(self.weight, self.bias, rows_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


def fuse_rows(*linears: nn.Linear) -> torch.Tensor:
    """Concatenate the weights of linears that read the same input into one (Σ out, in) tensor
    and make each linear's weight a view of it: one GEMM instead of several, no extra memory."""
    fused = torch.cat([m.weight.detach() for m in linears], dim=0)
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(fused[start : start + n], requires_grad=False)
        start += n
    return fused


def fuse_bias(*linears: nn.Linear) -> torch.Tensor:
    assert all(m.bias is not None for m in linears)
    return torch.cat([m.bias.detach() for m in linears if m.bias is not None])


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = Projection(intermediate, hidden, bias=bias)
        self.gate_up: torch.Tensor | None = None  # fused for inference (``fuse``)
        self.gate_up_bias: torch.Tensor | None = None
        self.gate_up_packed: Packed | None = None

    def fuse(self) -> None:
        """Inference: gate|up in one (packed) projection, down packed too."""
        self.gate_up = fuse_rows(self.gate_proj, self.up_proj)
        if self.gate_proj.bias is not None:
            self.gate_up_bias = fuse_bias(self.gate_proj, self.up_proj)
        self.gate_up_packed = pack(self.gate_up, self.gate_up_bias)
        self.down_proj.pack_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gu = linear(x, self.gate_up, self.gate_up_bias, self.gate_up_packed)
            gate, up = gu.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
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


@dataclass(frozen=True)
class BlockMask:
    """The drafter's training attention, kept structured: queries come in ``block_size``-row
    blocks; block b sees context keys [0, ctx_lens[b]) and its own block's keys, which follow the
    ``n_ctx`` context keys in block order. ``dense()`` is the same mask as a bool matrix."""

    ctx_lens: torch.Tensor  # (Nb,) context length each block sees (its anchor position)
    block_size: int
    n_ctx: int

    def dense(self, device: torch.device | None = None) -> torch.Tensor:
        """(Nb·k, n_ctx + Nb·k) bool, True = may attend."""
        nb, k = self.ctx_lens.numel(), self.block_size
        device = device or self.ctx_lens.device
        q_block = torch.arange(nb, device=device).repeat_interleave(k)  # (Nb·k,)
        lens = self.ctx_lens.to(device)
        ctx_ok = torch.arange(self.n_ctx, device=device)[None, :] < lens[q_block][:, None]
        blk_ok = q_block[:, None] == q_block[None, :]  # (Nb·k, Nb·k)
        return torch.cat([ctx_ok, blk_ok], dim=1)

    def key_index(self, device: torch.device | None = None) -> torch.Tensor:
        """Packed key order for a varlen kernel: per block, its context prefix then its block."""
        k = self.block_size
        parts = [
            torch.cat([torch.arange(p), self.n_ctx + b * k + torch.arange(k)])
            for b, p in enumerate(self.ctx_lens.tolist())
        ]
        return torch.cat(parts).to(device)


Mask = torch.Tensor | BlockMask | None


@functools.cache
def flash_varlen_kernel() -> Callable[..., torch.Tensor] | None:
    """flash-attn's ``flash_attn_varlen_func`` when installed (``adaflash[flash-attn]``) and not
    switched off with ``ADAFLASH_FLASH_ATTN=0``; else None (PyTorch SDPA is used)."""
    if os.environ.get("ADAFLASH_FLASH_ATTN", "1") == "0":
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def block_attend_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: BlockMask,
    kernel: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """``attend`` under a BlockMask as one varlen call: one sequence per block, whose keys are
    the block's context prefix and its own slots (gathered, so no mask is needed).

    q (Nb·k, heads, d); k, v (kv_heads, n_ctx + Nb·k, d). Returns (Nb·k, heads·d).
    """
    nb, bs = mask.ctx_lens.numel(), mask.block_size
    assert q.shape[0] == nb * bs and k.shape[1] == mask.n_ctx + nb * bs, "mask/tensor mismatch"
    assert int(mask.ctx_lens.max()) <= mask.n_ctx
    idx = mask.key_index(q.device)  # (Σ (p_b + k),)
    keys = k[:, idx].transpose(0, 1).contiguous()  # (Σ, kv_heads, d)
    values = v[:, idx].transpose(0, 1).contiguous()
    lens = mask.ctx_lens.to(q.device, torch.int32) + bs
    cu_k = torch.cat([lens.new_zeros(1), lens.cumsum(0, dtype=torch.int32)])
    cu_q = torch.arange(nb + 1, device=q.device, dtype=torch.int32) * bs
    out = kernel(
        q.contiguous(),
        keys,
        values,
        cu_q,
        cu_k,
        bs,
        int(lens.max()),
        causal=False,
    )  # (Nb·k, heads, d)
    return out.reshape(q.shape[0], -1)


def block_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask
) -> torch.Tensor:
    """``attend`` under a BlockMask without the dense mask's wasted work: each query scores the
    context keys (masked to its block's prefix) and its own block's k keys only, and one softmax
    runs over both parts. Same result as dense SDPA; ~2× fewer scores and far less time on a CPU.

    q (Nb·k, heads, d); k, v (kv_heads, n_ctx + Nb·k, d). Returns (Nb·k, heads·d).
    """
    nb, bs, n_ctx = mask.ctx_lens.numel(), mask.block_size, mask.n_ctx
    kvh, d = k.shape[0], k.shape[-1]
    g = q.shape[1] // kvh
    assert q.shape[0] == nb * bs and k.shape[1] == n_ctx + nb * bs, "mask/tensor mismatch"
    qh = q.reshape(nb * bs, kvh, g, d).permute(1, 2, 0, 3)  # (kvh, g, Nb·k, d)
    kc, vc = k[:, None, :n_ctx], v[:, None, :n_ctx]  # (kvh, 1, C, d)
    kb = k[:, n_ctx:].reshape(kvh, 1, nb, bs, d)  # (kvh, 1, Nb, k, d)
    vb = v[:, n_ctx:].reshape(kvh, 1, nb, bs, d)
    scale = d**-0.5
    s_ctx = (qh @ kc.transpose(-1, -2)) * scale  # (kvh, g, Nb·k, C)
    q_block = torch.arange(nb, device=q.device).repeat_interleave(bs)  # (Nb·k,)
    lens = mask.ctx_lens.to(q.device)[q_block]
    hidden = torch.arange(n_ctx, device=q.device)[None, :] >= lens[:, None]  # (Nb·k, C)
    s_ctx = s_ctx.masked_fill(hidden, float("-inf")).reshape(kvh, g, nb, bs, n_ctx)
    s_blk = (qh.reshape(kvh, g, nb, bs, d) @ kb.transpose(-1, -2)) * scale  # (kvh, g, Nb, k, k)
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1).float(), dim=-1).to(q.dtype)
    out = (p[..., :n_ctx].reshape(kvh, g, nb * bs, n_ctx) @ vc).reshape(kvh, g, nb, bs, d)
    out = out + p[..., n_ctx:] @ vb  # (kvh, g, Nb, k, d)
    return out.reshape(kvh * g, nb * bs, d).transpose(0, 1).reshape(nb * bs, -1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
    """Grouped-query attention for one sequence.

    q (n_q, heads, d); k, v (kv_heads, n_k, d); mask (n_q, n_k) bool (True = may attend), a
    BlockMask, or None for full attention. Returns (n_q, heads·d). A BlockMask goes to
    flash-attn on a CUDA half / bf16 tensor when it is installed, else to ``block_attend``.
    """
    if isinstance(mask, BlockMask):
        half = q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype
        kernel = flash_varlen_kernel() if q.is_cuda and half else None
        if kernel is not None:
            return block_attend_varlen(q, k, v, mask, kernel)
        return block_attend(q, k, v, mask)
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
