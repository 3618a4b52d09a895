"""The AVX512-BF16 GEMV kernel: the product of bf16 operands to within bf16 rounding, in eager
and compiled code, and the projections of one row go through it (where the CPU has it)."""

import pytest
import torch
import torch.nn.functional as F

from adaflash.models import gemv
from adaflash.models.layers import linear, pack

pytestmark = pytest.mark.skipif(not gemv.available(), reason="no AVX512-BF16 (or no build)")


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() @ w.float().T  # exact products, fp32 sums


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize(("n", "k"), [(576, 576), (37, 100), (5, 1536), (64, 31)])
def test_the_kernel_is_the_product_rounded_to_bf16(m, n, k):
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


def test_one_row_goes_through_the_kernel_more_rows_do_not(monkeypatch):
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    packed = pack(w)
    assert packed is not None and packed.gemv
    calls = []
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda x, w: calls.append(x.shape) or real(x, w))
    one, three = (
        torch.randn(1, 64, generator=g).bfloat16(),
        torch.randn(3, 64, generator=g).bfloat16(),
    )
    assert torch.equal(linear(one, w, None, packed), real(one, w))
    linear(three, w, None, packed)
    assert calls == [(1, 64)]
    monkeypatch.setenv("ADAFLASH_GEMV", "0")  # switched off: oneDNN for every row count
    off = pack(w)
    assert off is None or not off.gemv
    assert torch.equal(linear(one, w, None, off), F.linear(one, w))


def test_bad_inputs_are_refused():
    w = torch.randn(8, 64).bfloat16()
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        torch.ops.adaflash.gemv_bf16(torch.randn(5, 64).bfloat16(), w)
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.adaflash.gemv_bf16(torch.randn(1, 64), w.float())
    with pytest.raises(RuntimeError, match=r"x \(M, K\)"):
        torch.ops.adaflash.gemv_bf16(torch.randn(1, 32).bfloat16(), w)
