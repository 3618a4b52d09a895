// y (M, N) = x (M, K) · W (N, K)ᵀ for a few rows M ≤ 4: bf16 in, fp32 accumulation, bf16 out.
//
// Decoding one token reads every weight once for one row: the time is the weights' bytes over
// memory bandwidth plus each call's fixed cost. This kernel walks W's rows in order, each from
// start to end (one sequential stream per thread), with one AVX512-BF16 dot product (vdpbf16ps)
// per 32-element chunk of K and input row into two accumulators, and sums four rows' lanes at
// once; the rows are split over torch's intra-op threads. Reading four rows' chunks interleaved
// instead (four streams per thread) took 1.4-1.9x as long from DRAM (an AMD EPYC of family 25
// model 17, a step's 121 projections). Built by adaflash/models/gemv.py at first use, where the
// CPU has AVX512-BF16.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/torch.h>

namespace {

// the sums of four vectors' lanes, [Σa, Σb, Σc, Σd], in 9 instructions instead of 4 reductions
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], then [a, b, c, d] partial sums
  __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  __m512 lanes = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                               _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  // the four 128-bit lanes added together
  __m256 half = _mm256_add_ps(_mm512_castps512_ps256(lanes),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

template <int M, int R>
void block(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* y, int64_t K, int64_t N,
           int64_t n) {
  __m512 sums[M][R];  // per (input row, weight row): the lanes of its dot product
  const int64_t full = K - K % 64;
  // W's rows one after another, each from start to end: one sequential stream per thread
  // (interleaving the R rows' chunks read R streams and halved the bandwidth from DRAM)
  for (int r = 0; r < R; ++r) {
    const at::BFloat16* wr = w + (n + r) * K;
    // two accumulators per input row (even and odd 32-element chunks of K), locals indexed
    // only by the unrolled m: kept in registers. Indexed by the runtime r as well, four input
    // rows' 32 of them lived on the stack, each vdpbf16ps a load and a store (1.37x the time).
    __m512 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < full; k += 64) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void*)(wr + k));
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void*)(wr + k + 32));
      for (int m = 0; m < M; ++m) {
        const at::BFloat16* xm = x + m * K + k;
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, (__m512bh)_mm512_loadu_si512(xm));
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, (__m512bh)_mm512_loadu_si512(xm + 32));
      }
    }
    for (; k < K; k += 32) {  // K's tail: masked loads, the rest reads as zeros
      const int64_t left = K - k < 32 ? K - k : 32;
      const __mmask32 mask = (__mmask32)((1ull << left) - 1);
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const void*)(wr + k));
      for (int m = 0; m < M; ++m) {
        __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const void*)(x + m * K + k));
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, xv);
      }
    }
    for (int m = 0; m < M; ++m) sums[m][r] = _mm512_add_ps(acc[m][0], acc[m][1]);
  }
  for (int m = 0; m < M; ++m) {
    if constexpr (R == 4) {
      alignas(16) float out[4];
      _mm_store_ps(out, sum4(sums[m][0], sums[m][1], sums[m][2], sums[m][3]));
      for (int r = 0; r < 4; ++r) y[m * N + n + r] = at::BFloat16(out[r]);
    } else {
      for (int r = 0; r < R; ++r) y[m * N + n + r] = at::BFloat16(_mm512_reduce_add_ps(sums[m][r]));
    }
  }
}

template <int M>
void rows(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* y, int64_t K, int64_t N,
          int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) block<M, 4>(x, w, y, K, N, n);
  for (; n < n1; ++n) block<M, 1>(x, w, y, K, N, n);
}

at::Tensor gemv_bf16(const at::Tensor& x_in, const at::Tensor& w_in) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && w_in.scalar_type() == at::kBFloat16,
              "gemv_bf16: bf16 tensors only");
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1),
              "gemv_bf16: x (M, K) and w (N, K)");
  TORCH_CHECK(x_in.size(0) >= 1 && x_in.size(0) <= 4, "gemv_bf16: 1 to 4 rows");
  at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const at::BFloat16* xp = x.const_data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.const_data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.mutable_data_ptr<at::BFloat16>();
  const int64_t blocks = (N + 3) / 4;  // threads split W in blocks of four rows
  at::parallel_for(0, blocks, 16, [&](int64_t b, int64_t e) {
    const int64_t n0 = b * 4, n1 = std::min(e * 4, N);
    switch (M) {
      case 1: rows<1>(xp, wp, yp, K, N, n0, n1); break;
      case 2: rows<2>(xp, wp, yp, K, N, n0, n1); break;
      case 3: rows<3>(xp, wp, yp, K, N, n0, n1); break;
      default: rows<4>(xp, wp, yp, K, N, n0, n1);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(adaflash, m) { m.def("gemv_bf16(Tensor x, Tensor w) -> Tensor"); }
TORCH_LIBRARY_IMPL(adaflash, CPU, m) { m.impl("gemv_bf16", &gemv_bf16); }
