"""The bf16 GEMV kernel of this CPU (AVX512-BF16 or AVX2): the product of bf16 operands to
within bf16 rounding, in eager and compiled code, and the projections of few rows go through it
(where the CPU has one)."""

import pytest
import torch
import torch.nn.functional as F

from adaflash.models import gemv
from adaflash.models.layers import linear, pack

pytestmark = pytest.mark.skipif(not gemv.available(), reason="no GEMV kernel for this CPU")


def limit() -> int:
    chosen = gemv.variant()
    assert chosen is not None
    return chosen.limit


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() @ w.float().T  # exact products, fp32 sums


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 16, 41, 128])
@pytest.mark.parametrize(("n", "k"), [(576, 576), (37, 100), (5, 1536), (64, 31), (3, 48)])
def test_the_kernel_is_the_product_rounded_to_bf16(m, n, k):
    if m > limit() and gemv.variant() is not gemv.AMX:  # AMX takes any number of rows
        pytest.skip(f"this CPU's kernel takes up to {limit()} rows")
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    got, want = gemv.gemv(x, w).float(), reference(x, w)
    assert got.shape == (m, n)
    # fp32 sums in another order, then one rounding to bf16 (8 bits: ≤ 2⁻⁸ relative)
    assert torch.all((got - want).abs() <= want.abs() * 2**-8 + 1e-3)
    # and it is not some other product: the bf16 rounding of the reference itself
    assert (got - want.bfloat16().float()).abs().max() <= want.abs().max() * 2**-7


def test_it_runs_inside_a_compiled_function_and_keeps_leading_dims():
    g = torch.Generator().manual_seed(1)
    x, w = (
        torch.randn(1, 1, 64, generator=g).bfloat16(),
        torch.randn(48, 64, generator=g).bfloat16(),
    )
    fn = torch.compile(lambda a, b: gemv.gemv(a, b) * 2, fullgraph=True)
    out = fn(x, w)
    assert out.shape == (1, 1, 48)
    assert torch.equal(out, gemv.gemv(x, w) * 2)


def test_few_rows_go_through_the_kernel_more_rows_do_not(monkeypatch):
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(90, 64, generator=g) * 0.1).bfloat16()  # 90 rows: no panels (N % 32)
    packed = pack(w)
    rows = gemv.eager_rows()  # eager projections (compiled steps: ``max_rows``)
    assert packed is not None and packed.panels is None
    assert packed.gemv_rows == rows >= 1 and gemv.max_rows() >= 1
    calls = []
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda x, w: calls.append(x.shape) or real(x, w))
    few, more = (
        torch.randn(rows, 64, generator=g).bfloat16(),
        torch.randn(rows + 1, 64, generator=g).bfloat16(),
    )
    assert torch.equal(linear(few, w, None, packed), real(few, w))
    linear(more, w, None, packed)
    assert calls == [(rows, 64)]
    monkeypatch.setenv("ADAFLASH_GEMV", "0")  # switched off: the default path for every count
    assert gemv.max_rows() == gemv.eager_rows() == 0
    off = pack(w)
    assert off is None or off.gemv_rows == 0
    one = few[:1]
    assert torch.equal(linear(one, w, None, off), F.linear(one, w))


def test_bad_inputs_are_refused():
    w = torch.randn(8, 64).bfloat16()
    with pytest.raises(RuntimeError, match=rf"1 to {limit()} rows"):
        torch.ops.adaflash.gemv_bf16(torch.randn(limit() + 1, 64).bfloat16(), w)
    with pytest.raises(RuntimeError, match="1 to"):
        torch.ops.adaflash.gemv_bf16(torch.randn(0, 64).bfloat16(), w)
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.adaflash.gemv_bf16(torch.randn(1, 64), w.float())
    with pytest.raises(RuntimeError, match=r"x \(M, K\)"):
        torch.ops.adaflash.gemv_bf16(torch.randn(1, 32).bfloat16(), w)


@pytest.mark.skipif(gemv.variant() is not gemv.AMX, reason="no AMX on this CPU")
def test_amx_tiles_take_the_shapes_that_fit_and_refuse_the_rest():
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(128, 96, generator=g) * 0.1).bfloat16()  # N % 64 == 0, K % 32 == 0
    assert gemv.amx_fits(w) and not gemv.amx_fits(w[:, :80]) and not gemv.amx_fits(w[:100])
    for m in (1, 16, 17, 33):  # one tile of inputs, then blocks of 16 and a remainder
        x = torch.randn(m, 96, generator=g).bfloat16()
        got = torch.ops.adaflash.linear_amx(x, w)
        assert torch.equal(gemv.gemv(x, w), got)  # what the projections call
        want = reference(x, w)
        assert torch.all((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-3)
    with pytest.raises(RuntimeError, match="K % 32 == 0 and N % 64 == 0"):
        torch.ops.adaflash.linear_amx(torch.randn(2, 80).bfloat16(), w[:, :80].contiguous())
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.adaflash.linear_amx(torch.randn(2, 96), w.float())
    x = torch.randn(5, 80, generator=g).bfloat16()  # no fit: F.linear serves the call
    assert torch.equal(gemv.gemv(x, w[:, :80]), F.linear(x, w[:, :80]))


def test_the_attention_op_refuses_what_it_cannot_serve():
    pool = torch.randn(2, 3, 2, 3, 16, 8)
    q, kv = torch.randn(1, 1, 9, 8), torch.randn(1, 1, 3, 8)
    rows, pos = torch.tensor([1]), torch.tensor([4])
    assert gemv.attention(q, kv, kv, pool, rows, 2, pos).shape == (1, 1, 9, 8)
    with pytest.raises(RuntimeError, match="share a dtype"):
        gemv.attention(q.bfloat16(), kv, kv, pool, rows, 0, pos)
    with pytest.raises(RuntimeError, match="outside the pool"):
        gemv.attention(q, kv, kv, pool, torch.tensor([2]), 0, pos)
    with pytest.raises(RuntimeError, match="outside the pool"):
        gemv.attention(q, kv, kv, pool, rows, 0, torch.tensor([17]))
    with pytest.raises(RuntimeError, match="one row and one position per request"):
        gemv.attention(q, kv, kv, pool, torch.tensor([0, 1]), 0, pos)
    with pytest.raises(RuntimeError, match="divisible"):
        gemv.attention(torch.randn(1, 1, 8, 8), kv, kv, pool, rows, 0, pos)
    with pytest.raises(RuntimeError, match="no such layer"):
        gemv.attention(q, kv, kv, pool, rows, 3, pos)
    with pytest.raises(RuntimeError, match="disagree"):
        gemv.attention(q, kv[..., :4], kv[..., :4], pool, rows, 0, pos)


def attention_reference(q, k, v, pool, rows, layer, pos):  # type: ignore[no-untyped-def]
    """Each new token over its request's past (pool positions < pos) and new tokens up to
    itself, in fp32: softmax(q·Kᵀ/√d)·V, query heads sharing kv heads in groups."""
    b_n, t_n, heads, d = q.shape
    group = heads // k.shape[2]
    out = torch.empty(q.shape)
    for b in range(b_n):
        past = pool[rows[b], layer, :, :, : pos[b]].float()  # (2, kv_heads, past, d)
        for t in range(t_n):
            keys = torch.cat([past[0], k[b, : t + 1].float().transpose(0, 1)], dim=1)
            values = torch.cat([past[1], v[b, : t + 1].float().transpose(0, 1)], dim=1)
            for h in range(heads):
                s = keys[h // group] @ q[b, t, h].float() / d**0.5  # (positions,)
                out[b, t, h] = torch.softmax(s, dim=0) @ values[h // group]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "d"),
    # 3 / 2 / 1 query heads a kv head (SmolLM2, Qwen3, MHA), eight in chunks of 3, 3, 2; d with
    # a last 8-chunk beyond the 32-dim blocks (24), and d no multiple of 8 (the scalar path)
    [(9, 3, 64), (4, 2, 64), (2, 2, 32), (8, 1, 24), (6, 2, 12)],
)
@pytest.mark.parametrize("tiles", [True, False])  # several tokens: the tile path, or one by one
def test_the_attention_op_is_softmax_attention_over_past_and_new_tokens(
    heads, kv_heads, d, dtype, tiles
):
    torch.ops.adaflash.set_attention_tile_tokens(2 if tiles else 1 << 30)
    try:
        check_attention(heads, kv_heads, d, dtype)
    finally:
        torch.ops.adaflash.set_attention_tile_tokens(2)


def check_attention(heads: int, kv_heads: int, d: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(heads * d + kv_heads)
    b_n, t_n, layers, cap = 3, 5, 2, 300
    pool = torch.randn(4, layers, 2, kv_heads, cap, d, generator=g).to(dtype)
    q = torch.randn(b_n, t_n, heads, d, generator=g).to(dtype)
    k = torch.randn(b_n, t_n, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(b_n, t_n, kv_heads, d, generator=g).to(dtype)
    rows, pos = torch.tensor([2, 0, 3]), torch.tensor([0, 7, 295])  # no past, a few, many
    got = gemv.attention(q, k, v, pool, rows, 1, pos)
    assert got.dtype == dtype and got.shape == q.shape
    want = attention_reference(q, k, v, pool, rows, 1, pos)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 8e-3, "rtol": 8e-3}
    torch.testing.assert_close(got.float(), want, **tol)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same on one thread as on several
    try:
        assert torch.equal(gemv.attention(q, k, v, pool, rows, 1, pos), got)
    finally:
        torch.set_num_threads(threads)


def test_the_attention_op_splits_its_work_over_threads_without_changing_it():
    chosen = gemv.serving()
    assert chosen is not None
    g = torch.Generator().manual_seed(5)
    pool = torch.randn(2, 2, 2, 3, 200, 64, generator=g).bfloat16()
    q = torch.randn(1, 16, 9, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 16, 3, 64, generator=g).bfloat16() for _ in range(2))
    rows, pos = torch.tensor([1]), torch.tensor([150])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs = []
        for work in (1, 1 << 30):  # every item its own share, then all on one thread
            torch.ops.adaflash.set_attention_split(work)
            outs.append(gemv.attention(q, k, v, pool, rows, 0, pos))
        assert torch.equal(outs[0], outs[1])
        with pytest.raises(RuntimeError, match="at least 1"):
            torch.ops.adaflash.set_attention_split(0)
        with pytest.raises(RuntimeError, match="at least 2"):
            torch.ops.adaflash.set_attention_tile_tokens(1)
    finally:
        torch.ops.adaflash.set_attention_split(chosen.attention_split)
        torch.set_num_threads(threads)


needs_panels = pytest.mark.skipif(not gemv.panels(), reason="no panels kernel for this CPU")


def unpacked(wp: torch.Tensor) -> torch.Tensor:
    """W (N, K) back from its panels, by the layouts ``pack_panels`` documents."""
    if gemv.serving() is gemv.AVX2:  # (N/16, K, 8, 2): wp[p, k, j, h] = W[16p + 8h + j, k]
        return wp.permute(0, 3, 2, 1).reshape(-1, wp.shape[1])
    return wp.permute(0, 2, 1, 3).reshape(wp.shape[0] * 32, -1)  # (N/32, K/2, 32, 2)


@needs_panels
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 9, 16, 17, 41, 130])  # every tile size
@pytest.mark.parametrize(("n", "k"), [(576, 576), (64, 1536), (32, 2), (96, 100)])
def test_panels_are_the_product_rounded_to_bf16(m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    wp = gemv.pack_panels(w)
    assert wp is not None and torch.equal(unpacked(wp), w)  # the layout
    if gemv.serving() is gemv.AVX2:
        assert wp.shape == (n // 16, k, 8, 2) and wp[0, 1, 3, 1] == w[8 + 3, 1]
    else:
        assert wp.shape == (n // 32, k // 2, 32, 2) and torch.equal(wp[0, 0, 3], w[3, :2])
    got, want = gemv.panel_linear(x, wp).float(), reference(x, w)
    assert got.shape == (m, n)
    assert torch.all((got - want).abs() <= want.abs() * 2**-8 + 1e-3)
    assert (got - want.bfloat16().float()).abs().max() <= want.abs().max() * 2**-7


@needs_panels
def test_weights_that_fit_take_panels_for_every_row_count_and_the_rest_do_not(monkeypatch):
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(64, 48, generator=g) * 0.1).bfloat16()
    packed = pack(w)
    assert packed is not None and packed.panels is not None and packed.onednn is None
    calls = []
    real = gemv.panel_linear
    monkeypatch.setattr(gemv, "panel_linear", lambda x, p: calls.append(x.shape) or real(x, p))
    for m in (1, 5, 300):
        x = torch.randn(2, m, 48, generator=g).bfloat16()  # leading dims kept
        out = linear(x, w, None, packed)
        assert out.shape == (2, m, 64)
        assert torch.equal(out, real(x, packed.panels))
    assert calls == [(2, 1, 48), (2, 5, 48), (2, 300, 48)]
    assert gemv.pack_panels(w[:40]) is None and gemv.pack_panels(w[:, :47]) is None  # N%32, K%2
    assert pack(w, torch.zeros(64).bfloat16()).panels is None  # a bias: not through panels
    monkeypatch.setenv("ADAFLASH_PANELS", "0")  # switched off: the GEMV kernel as before
    assert not gemv.panels() and gemv.max_rows() == gemv.variant().max_rows
    assert pack(w).panels is None


@needs_panels
def test_panels_run_inside_a_compiled_function_and_refuse_bad_inputs():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 64, generator=g).bfloat16(), torch.randn(32, 64, generator=g).bfloat16()
    wp = gemv.pack_panels(w)
    fn = torch.compile(lambda a, b: gemv.panel_linear(a, b) * 2, fullgraph=True)
    assert torch.equal(fn(x, wp), gemv.panel_linear(x, wp) * 2)
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.adaflash.gemm_bf16_panels(x.float(), wp)
    with pytest.raises(RuntimeError, match=r"x \(M, K\)"):
        torch.ops.adaflash.gemm_bf16_panels(x[:, :62], wp)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.adaflash.gemm_bf16_panels(x, wp.transpose(1, 2))
