"""The batched grouped-query attention against PyTorch's SDPA, in each working dtype it picks."""

import pytest
import torch
import torch.nn.functional as F

from adaflash.models import batch_attention
from adaflash.models.batch_attention import SMALL_ATTENTION, gqa_attend


def reference(q, keys, values, bias):
    """SDPA with the key/value heads repeated per query head, in float32."""
    g = q.shape[2] // keys.shape[1]
    k = keys.float().repeat_interleave(g, dim=1)  # (R, heads, L, d)
    v = values.float().repeat_interleave(g, dim=1)
    mask = bias[:, 0, 0][:, None]  # (R, 1, n, L)
    out = F.scaled_dot_product_attention(q.float().transpose(1, 2), k, v, attn_mask=mask)
    return out.transpose(1, 2)  # (R, n, heads, d)


def problem(r: int, n: int, length: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d = 6, 2, 16
    q = torch.randn(r, n, heads, d, generator=g).to(dtype)
    keys = torch.randn(r, kv_heads, length, d, generator=g).to(dtype)
    values = torch.randn(r, kv_heads, length, d, generator=g).to(dtype)
    past = torch.randint(0, length - n, (r,), generator=g)
    limit = past[:, None] + torch.arange(n)[None, :]  # (R, n) last visible key
    visible = torch.arange(length)[None, None, :] <= limit[:, :, None]
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[:, None, None]
    return q, keys, values, bias


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("length", [24, 400])  # below and above SMALL_ATTENTION
def test_gqa_attend_matches_sdpa_in_bf16_whatever_the_cpu(monkeypatch, native, length):
    monkeypatch.setattr(batch_attention, "native_bf16", lambda: native)
    q, keys, values, bias = problem(r=8, n=3, length=length, dtype=torch.bfloat16)
    assert (keys.numel() > SMALL_ATTENTION) == (length == 400)
    out = gqa_attend(q, keys, values, bias)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.float(), reference(q, keys, values, bias), atol=3e-2, rtol=0)


def test_gqa_attend_is_float32_exact():
    q, keys, values, bias = problem(r=4, n=5, length=50, dtype=torch.float32)
    out = gqa_attend(q, keys, values, bias)
    torch.testing.assert_close(out, reference(q, keys, values, bias), atol=1e-5, rtol=1e-5)
