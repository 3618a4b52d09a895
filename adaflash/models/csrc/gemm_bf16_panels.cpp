// y (M, N) = x (M, K) · W (N, K)ᵀ for a few to a few dozen rows, on CPUs with AVX512-BF16 and
// no AMX: bf16 in, fp32 accumulation, bf16 out.
//
// Verifying 16 drafted tokens multiplies every weight by 16 rows. Widening bf16 to fp32 and
// using FMAs (inductor's C++ template on such CPUs) does 16 multiply-adds per instruction;
// vdpbf16ps does 32, so this kernel is compute-bound at half the instructions. W is packed once
// (``gemv.pack_panels``) into panels of 32 output features, each panel a contiguous stream:
//   wp[p][k2][f][j] = W[32p + f][2 k2 + j]     (N/32, K/2, 32, 2)
// so one 64-byte line holds 16 features × one pair of K, the operand layout of vdpbf16ps. For a
// tile of up to 8 input rows, each pair of K costs two weight loads, one 32-bit broadcast per
// input row and 2 × rows dot products into 2 × rows accumulators (16 zmm registers at 8 rows);
// the accumulators are the outputs themselves (16 features each), so no horizontal sums.
// Threads split the panels; a panel is read from memory once, for the first tile of rows, and
// from cache for the others. Tiles of 8 rows against 12 and 64-feature panels against 32: level
// within the noise at 8-32 rows; a panel processed in blocks of K that every tile reads from L1
// before the next block: slower from 12 rows on (an AMD EPYC of family 25 model 17, a step's 121
// projections, interleaved). Built by adaflash/models/gemv.py at first use.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <array>
#include <utility>

namespace {

constexpr int64_t PANEL = 32;  // output features per panel: two zmm of fp32 accumulators
constexpr int MAX_TILE = 8;    // input rows per tile: 16 accumulators

template <int MT>
void tile(const int32_t* x, const at::BFloat16* w, at::BFloat16* y, int64_t K2, int64_t N) {
  // x: MT rows of K/2 bf16 pairs (32-bit words); w: one panel (K/2, 32, 2); y: MT rows of N,
  // at this panel's first feature
  __m512 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void*)(w + k2 * PANEL * 2));
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void*)(w + k2 * PANEL * 2 + 32));
    for (int m = 0; m < MT; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(x[m * K2 + k2]);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xb);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xb);
    }
  }
  for (int m = 0; m < MT; ++m) {
    _mm256_storeu_si256((__m256i*)(y + m * N), (__m256i)_mm512_cvtneps_pbh(acc[m][0]));
    _mm256_storeu_si256((__m256i*)(y + m * N + 16), (__m256i)_mm512_cvtneps_pbh(acc[m][1]));
  }
}

using TileFn = void (*)(const int32_t*, const at::BFloat16*, at::BFloat16*, int64_t, int64_t);

template <int... I>
constexpr auto tiles(std::integer_sequence<int, I...>) {
  return std::array<TileFn, sizeof...(I)>{&tile<I + 1>...};
}
constexpr auto TILES = tiles(std::make_integer_sequence<int, MAX_TILE>{});

at::Tensor gemm_bf16_panels(const at::Tensor& x_in, const at::Tensor& wp) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16,
              "gemm_bf16_panels: bf16 tensors only");
  TORCH_CHECK(wp.dim() == 4 && wp.size(2) == PANEL && wp.size(3) == 2 && wp.is_contiguous(),
              "gemm_bf16_panels: wp (N/32, K/2, 32, 2), contiguous");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == 2 * wp.size(1),
              "gemm_bf16_panels: x (M, K) with K = 2 · wp.size(1)");
  at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K2 = wp.size(1), panels = wp.size(0), N = panels * PANEL;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const int32_t* xi = reinterpret_cast<const int32_t*>(x.const_data_ptr<at::BFloat16>());
  const at::BFloat16* w = wp.const_data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.mutable_data_ptr<at::BFloat16>();
  // rows in tiles of at most MAX_TILE, as even as possible (12 rows: 6 + 6, not 8 + 4)
  const int64_t count = (M + MAX_TILE - 1) / MAX_TILE;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t t = 0, m0 = 0; t < count; ++t) {
        const int64_t rows = (M - m0) / (count - t);
        TILES[rows - 1](xi + m0 * K2, w + p * K2 * PANEL * 2, yp + m0 * N + p * PANEL, K2, N);
        m0 += rows;
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adaflash, m) { m.def("gemm_bf16_panels(Tensor x, Tensor wp) -> Tensor"); }
TORCH_LIBRARY_IMPL(adaflash, CPU, m) { m.impl("gemm_bf16_panels", &gemm_bf16_panels); }
