// y (M, N) = x (M, K) · W (N, K)ᵀ for any number of rows on CPUs with AVX2 + FMA but no native
// bf16: bf16 weights, fp32 products and sums, bf16 out.
//
// The GEMV kernel (gemv_bf16_avx2.cpp) takes each weight row's dot product with every input row
// and sums each vector horizontally: fine for one row, but at 16 rows (a verification pass) the
// loads and sums cost more than the multiplies. Here W is packed once (``gemv.pack_panels``) in
// panels of 16 output features, each panel one contiguous stream, K-major:
//   wp[p][k][j][h] = W[16p + 8h + j][k]     (N/16, K, 8, 2)
// so one 32-byte load holds the 16 features' weights for one k, and its low and high halves of
// each 32-bit lane, widened to fp32 in two instructions (avx2_bf16.h), are features 0–7 and 8–15
// in order. A tile of up to 6 input rows (fp32, converted once per call) broadcasts one element
// per row and does two FMAs per row into 12 accumulators that are the outputs themselves: no
// horizontal sums, 1 weight load and 6 broadcasts per 12 FMAs. Tiles of one or two rows keep two
// sets of accumulators (even and odd k) so that the FMAs' latency does not bound them. K is even.
// Threads split the panels; a panel is read from memory once, for the first tile of rows, and
// from cache for the others, while the second tile fetches the next panel into cache. Built by
// adaflash/models/gemv.py at first use (the AVX2 variant).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <array>
#include <utility>
#include <vector>

#include "avx2_bf16.h"

namespace {

using adaflash_avx2::bf16_bits;
using adaflash_avx2::even_bf16;
using adaflash_avx2::odd_bf16;
using adaflash_avx2::to_bf16;

constexpr int64_t PANEL = 16;  // output features per panel: two ymm of fp32 accumulators
constexpr int MAX_TILE = 6;    // input rows per tile: 12 accumulators

// one k for one input row: its element broadcast, times the panel's 16 widened weights
inline void fma_row(__m256& a0, __m256& a1, __m256 lo, __m256 hi, const float* x) {
  const __m256 xb = _mm256_broadcast_ss(x);
  a0 = _mm256_fmadd_ps(lo, xb, a0);
  a1 = _mm256_fmadd_ps(hi, xb, a1);
}

// one input row's 16 sums (features 0–7, 8–15) stored as bf16 at y
inline void store_row(uint16_t* y, __m256 a0, __m256 a1) {
  _mm_storeu_si128((__m128i*)y, to_bf16(a0));
  _mm_storeu_si128((__m128i*)(y + 8), to_bf16(a1));
}

template <int MT>
void tile(const float* x, const uint16_t* w, uint16_t* y, int64_t K, int64_t N,
          const uint16_t* ahead) {
  // x: MT rows of K fp32; w: one panel (K, 8, 2); y: MT rows of N, at this panel's first
  // feature; K even. Accumulators are named locals (an array indexed in loops lived on the
  // stack: a store per FMA): a<m><half>, and for tiles of one or two rows b<m><half> for odd k
  // (two chains each, so that the FMAs' latency does not bound them). From three rows on, one k
  // at a time: 12 accumulators, the two widened halves, the mask and a broadcast fill the 16
  // registers (k two at a time spilled an accumulator, 1.3x slower at 5 rows)
  constexpr bool pairs = MT <= 2;
  const __m256 z = _mm256_setzero_ps();
  __m256 a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z, a40 = z,
         a41 = z, a50 = z, a51 = z;
  __m256 b00 = z, b01 = z, b10 = z, b11 = z;
  for (int64_t k = 0; k < K; k += pairs ? 2 : 1) {
    if (ahead != nullptr && k % 2 == 0)  // one 64-byte line: two k of the next panel
      _mm_prefetch((const char*)(ahead + k * PANEL), _MM_HINT_T0);
    const __m256i v = _mm256_loadu_si256((const __m256i*)(w + k * PANEL));
    const __m256 lo = even_bf16(v), hi = odd_bf16(v);  // features 0–7, 8–15 at k
    fma_row(a00, a01, lo, hi, x + k);
    if constexpr (MT > 1) fma_row(a10, a11, lo, hi, x + K + k);
    if constexpr (MT > 2) fma_row(a20, a21, lo, hi, x + 2 * K + k);
    if constexpr (MT > 3) fma_row(a30, a31, lo, hi, x + 3 * K + k);
    if constexpr (MT > 4) fma_row(a40, a41, lo, hi, x + 4 * K + k);
    if constexpr (MT > 5) fma_row(a50, a51, lo, hi, x + 5 * K + k);
    if constexpr (pairs) {
      const __m256i v1 = _mm256_loadu_si256((const __m256i*)(w + (k + 1) * PANEL));
      const __m256 lo1 = even_bf16(v1), hi1 = odd_bf16(v1);  // at k + 1
      fma_row(b00, b01, lo1, hi1, x + k + 1);
      if constexpr (MT > 1) fma_row(b10, b11, lo1, hi1, x + K + k + 1);
    }
  }
  if constexpr (pairs) {
    a00 = _mm256_add_ps(a00, b00), a01 = _mm256_add_ps(a01, b01);
    a10 = _mm256_add_ps(a10, b10), a11 = _mm256_add_ps(a11, b11);
  }
  store_row(y, a00, a01);
  if constexpr (MT > 1) store_row(y + N, a10, a11);
  if constexpr (MT > 2) store_row(y + 2 * N, a20, a21);
  if constexpr (MT > 3) store_row(y + 3 * N, a30, a31);
  if constexpr (MT > 4) store_row(y + 4 * N, a40, a41);
  if constexpr (MT > 5) store_row(y + 5 * N, a50, a51);
}

using TileFn = void (*)(const float*, const uint16_t*, uint16_t*, int64_t, int64_t,
                       const uint16_t*);

template <int... I>
constexpr auto tiles(std::integer_sequence<int, I...>) {
  return std::array<TileFn, sizeof...(I)>{&tile<I + 1>...};
}
constexpr auto TILES = tiles(std::make_integer_sequence<int, MAX_TILE>{});

at::Tensor gemm_bf16_panels(const at::Tensor& x_in, const at::Tensor& wp) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16,
              "gemm_bf16_panels: bf16 tensors only");
  TORCH_CHECK(wp.dim() == 4 && wp.size(2) == PANEL / 2 && wp.size(3) == 2 && wp.is_contiguous(),
              "gemm_bf16_panels: wp (N/16, K, 8, 2), contiguous");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == wp.size(1) && wp.size(1) % 2 == 0,
              "gemm_bf16_panels: x (M, K) with K = wp.size(1), even");
  at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = wp.size(1), panels = wp.size(0), N = panels * PANEL;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  // x in fp32, once: (M, K)
  std::vector<float> xf(M * K);
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.const_data_ptr<at::BFloat16>());
  for (int64_t i = 0; i < M * K; ++i) xf[i] = bf16_bits(xb[i]);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(wp.const_data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.mutable_data_ptr<at::BFloat16>());
  // rows in tiles of at most MAX_TILE, as even as possible (8 rows: 4 + 4, not 6 + 2)
  const int64_t count = (M + MAX_TILE - 1) / MAX_TILE;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t t = 0, m0 = 0; t < count; ++t) {
        const int64_t rows = (M - m0) / (count - t);
        // the second tile fetches the next panel into cache while it computes from this one
        const uint16_t* ahead = t == 1 && p + 1 < p1 ? w + (p + 1) * K * PANEL : nullptr;
        TILES[rows - 1](xf.data() + m0 * K, w + p * K * PANEL, yp + m0 * N + p * PANEL, K, N,
                        ahead);
        m0 += rows;
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adaflash, m) { m.def("gemm_bf16_panels(Tensor x, Tensor wp) -> Tensor"); }
TORCH_LIBRARY_IMPL(adaflash, CPU, m) { m.impl("gemm_bf16_panels", &gemm_bf16_panels); }
