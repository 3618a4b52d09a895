"""Attention under the drafter's training mask: dense SDPA vs the two-part CPU kernel
(``block_attend``) and the varlen (flash-attn) layout.

On the CPU the varlen layout is checked with a reference kernel that has flash-attn's varlen
signature (per-sequence SDPA); the GPU test runs the real flash-attn kernel when installed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from adaflash.models.layers import BlockMask, attend, block_attend, block_attend_varlen


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=False):
    """flash_attn_varlen_func's contract in plain PyTorch: q (Σq, h, d), k/v (Σk, kv_h, d)."""
    assert not causal and cu_q.dtype == cu_k.dtype == torch.int32
    assert int(cu_q[-1]) == q.shape[0] and int(cu_k[-1]) == k.shape[0]
    outs = []
    for i in range(len(cu_q) - 1):
        qi = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1)[None]  # (1, h, n_q, d)
        ki = k[cu_k[i] : cu_k[i + 1]].transpose(0, 1)[None]
        vi = v[cu_k[i] : cu_k[i + 1]].transpose(0, 1)[None]
        assert qi.shape[2] <= max_q and ki.shape[2] <= max_k
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outs)


def tensors(anchors: list[int], bs: int, n_ctx: int, heads: int = 4, kv: int = 2, d: int = 8):
    g = torch.Generator().manual_seed(0)
    nq = len(anchors) * bs
    q = torch.randn(nq, heads, d, generator=g)
    k = torch.randn(kv, n_ctx + nq, d, generator=g)
    v = torch.randn(kv, n_ctx + nq, d, generator=g)
    return q, k, v, BlockMask(torch.tensor(anchors), bs, n_ctx)


def test_varlen_layout_equals_the_dense_block_mask():
    q, k, v, m = tensors([1, 5, 9, 12], bs=4, n_ctx=16)
    dense = attend(q, k, v, m.dense())
    packed = block_attend_varlen(q, k, v, m, reference_varlen)
    assert torch.allclose(dense, packed, atol=1e-6)
    # and it is not trivially so: a wrong layout (blocks seeing all context) differs
    wrong = BlockMask(torch.full((4,), 16), 4, 16)
    assert not torch.allclose(dense, block_attend_varlen(q, k, v, wrong, reference_varlen))


def test_varlen_layout_gives_the_dense_gradients():
    """Training backpropagates through it: gradients of q, k, v agree too."""
    q, k, v, m = tensors([1, 4, 8], bs=4, n_ctx=12)
    grads = []
    for path in ("dense", "varlen"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        if path == "dense":
            out = attend(*leaves, m.dense())
        else:
            out = block_attend_varlen(*leaves, m, reference_varlen)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads, strict=True):
        assert a is not None and b is not None and torch.allclose(a, b, atol=1e-5)


def test_block_attend_equals_the_dense_block_mask_with_gradients():
    q, k, v, m = tensors([1, 5, 9, 12, 13], bs=4, n_ctx=16, heads=6, kv=2)
    grads = []
    outs = []
    for path in ("dense", "two-part"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = attend(*leaves, m.dense()) if path == "dense" else attend(*leaves, m)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append(out.detach())
        grads.append([t.grad for t in leaves])
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    for a, b in zip(*grads, strict=True):
        assert a is not None and b is not None and torch.allclose(a, b, atol=1e-5)
    wrong = BlockMask(torch.full((5,), 16), 4, 16)  # blocks seeing all context differ
    assert not torch.allclose(outs[0], block_attend(q, k, v, wrong), atol=1e-3)


def test_key_index_orders_context_then_own_block():
    m = BlockMask(torch.tensor([2, 3]), 2, 5)
    assert m.key_index().tolist() == [0, 1, 5, 6, 0, 1, 2, 7, 8]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None,
    reason="needs CUDA and flash-attn",
)
def test_flash_attn_matches_sdpa_on_gpu():
    q, k, v, m = tensors([3, 40, 77, 100], bs=16, n_ctx=128, heads=8, kv=2, d=64)
    q, k, v = (t.cuda().bfloat16() for t in (q, k, v))
    flash = attend(q, k, v, m)  # goes to flash-attn
    dense = attend(q.float(), k.float(), v.float(), m.dense("cuda"))
    assert torch.allclose(flash.float(), dense, atol=2e-2)


def test_packed_weights_give_the_same_bf16_results_and_can_be_switched_off(monkeypatch):
    from adaflash.models.layers import linear, pack

    monkeypatch.setenv("ADAFLASH_FP32_ROWS", "0")  # the oneDNN layout alone
    monkeypatch.setenv("ADAFLASH_GEMV", "0")  # (one row goes to the GEMV kernel: test_gemv.py)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    packed = pack(w)
    if packed is None:
        pytest.skip("oneDNN is not available in this torch build")
    for m in (1, 3, 17):
        x = torch.randn(m, 64, generator=g).bfloat16()
        assert torch.equal(linear(x, w, None, packed), F.linear(x, w))
    assert pack(w.float()) is None  # fp32 stays on F.linear (the exactness tests run there)
    monkeypatch.setenv("ADAFLASH_PACKED_WEIGHTS", "0")
    assert pack(w) is None


def test_many_rows_go_through_fp32_weights_where_bf16_is_not_native(monkeypatch):
    """From ``ADAFLASH_FP32_ROWS`` rows on, a bf16 weight is applied as its fp32 copy (the
    output rounded to bf16 once); fewer rows keep the bf16 path bit for bit."""
    from adaflash.models import layers
    from adaflash.models.layers import linear, pack

    g = torch.Generator().manual_seed(1)
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    b = (torch.randn(96, generator=g) * 0.1).bfloat16()
    monkeypatch.setenv("ADAFLASH_FP32_ROWS", "4")
    monkeypatch.setenv("ADAFLASH_PANELS", "0")  # panels, where they serve, take every row count
    packed = pack(w, b)
    assert packed is not None and packed.fp32 is not None and packed.min_rows == 4
    for m in (1, 3):
        x = torch.randn(m, 64, generator=g).bfloat16()
        assert torch.equal(linear(x, w, b, packed), F.linear(x, w, b))
    for shape in ((4, 64), (2, 9, 64)):  # rows counted over the leading dims
        x = torch.randn(*shape, generator=g).bfloat16()
        out = linear(x, w, b, packed)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, F.linear(x.float(), w.float(), b.float()).bfloat16())
        assert torch.allclose(out.float(), F.linear(x, w, b).float(), atol=2e-2)
    assert pack(w, rows_scale=2).min_rows == 8  # the LM head's later crossover
    monkeypatch.delenv("ADAFLASH_FP32_ROWS")  # the default follows the CPU
    assert layers.fp32_rows() == (0 if layers.native_bf16() else 4)
    monkeypatch.setattr(layers, "native_bf16", lambda: True)
    assert layers.fp32_rows() == 0
    packed = pack(w)
    assert packed is None or packed.fp32 is None
