// y (M, N) = x (M, K) · W (N, K)ᵀ for a few rows M ≤ 16 on CPUs with AVX2 + FMA but no native
// bf16: bf16 in, fp32 products and sums, bf16 out.
//
// Without AVX512-BF16 a bf16 weight must become fp32 before it is multiplied. This kernel does
// that in registers, two instructions per 16 weights, so the weights are read from memory once,
// as bf16: a 32-bit lane holding bf16 elements (2j, 2j+1) is element 2j+1 as fp32 once its low
// half is masked off, and element 2j once shifted left by 16. The input rows are split the same
// way beforehand (even and odd elements of each 16-chunk, in fp32), so each 16 weights take one
// load, a shift, an and, and two FMAs per input row. W is read as one stream, row after row,
// prefetched ahead (four rows at a time in four streams reached only ~60% of the bandwidth),
// split over torch's intra-op threads; input rows go four at a time over a row (it stays in L1).
// Built by adaflash/models/gemv.py at first use, where the CPU has AVX2 and FMA but no
// AVX512-BF16 (that CPU gets gemv_bf16.cpp).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <vector>

namespace {

constexpr int64_t MAX_M = 16;
constexpr int PREFETCH = 512;  // bytes ahead of the weight stream (256–1024 measured alike)

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// one weight row n against input rows [m0, m0 + M) (split: per 16-chunk of K, 8 even then 8
// odd fp32 elements), 32 weights a step into A accumulators per input row, prefetching ahead of
// the stream (one row after another is one sequential read: W's rows are contiguous); then one
// more 16-chunk where K % 32 ≥ 16 and the last K % 16 elements in scalar code
template <int M, int A>
void row(const float* xs, const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* y,
         int64_t K, int64_t N, int64_t n, int64_t m0) {
  const int64_t full = K - K % 16, pairs = K - K % 32;
  const at::BFloat16* wr = w + n * K;
  const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
  __m256 acc[M][A];
  for (int m = 0; m < M; ++m)
    for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
  for (int64_t k = 0; k < pairs; k += 32) {
    _mm_prefetch((const char*)(wr + k) + PREFETCH, _MM_HINT_T0);
    __m256i v0 = _mm256_loadu_si256((const __m256i*)(wr + k));
    __m256i v1 = _mm256_loadu_si256((const __m256i*)(wr + k + 16));
    __m256 p[4] = {_mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)),
                   _mm256_castsi256_ps(_mm256_and_si256(v0, high)),
                   _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)),
                   _mm256_castsi256_ps(_mm256_and_si256(v1, high))};
    for (int m = 0; m < M; ++m) {
      const float* xm = xs + (m0 + m) * full + k;
      for (int j = 0; j < 4; ++j)
        acc[m][j % A] = _mm256_fmadd_ps(p[j], _mm256_loadu_ps(xm + 8 * j), acc[m][j % A]);
    }
  }
  if (pairs < full) {
    __m256i v = _mm256_loadu_si256((const __m256i*)(wr + pairs));
    __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    __m256 o = _mm256_castsi256_ps(_mm256_and_si256(v, high));
    for (int m = 0; m < M; ++m) {
      const float* xm = xs + (m0 + m) * full + pairs;
      acc[m][0] = _mm256_fmadd_ps(e, _mm256_loadu_ps(xm), acc[m][0]);
      acc[m][A - 1] = _mm256_fmadd_ps(o, _mm256_loadu_ps(xm + 8), acc[m][A - 1]);
    }
  }
  for (int m = 0; m < M; ++m) {
    __m256 s = acc[m][0];
    for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[m][a]);
    float total = hsum(s);
    for (int64_t k = full; k < K; ++k)
      total += static_cast<float>(x[(m0 + m) * K + k]) * static_cast<float>(wr[k]);
    y[(m0 + m) * N + n] = at::BFloat16(total);
  }
}

// every input row against weight row n: four at a time (the row stays in L1 between them)
void rows(const float* xs, const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* y,
          int64_t M, int64_t K, int64_t N, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) row<4, 2>(xs, x, w, y, K, N, n, m);
  switch (M - m) {
    case 3: row<3, 2>(xs, x, w, y, K, N, n, m); break;
    case 2: row<2, 4>(xs, x, w, y, K, N, n, m); break;
    case 1: row<1, 4>(xs, x, w, y, K, N, n, m); break;
    default: break;
  }
}

at::Tensor gemv_bf16(const at::Tensor& x_in, const at::Tensor& w_in) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && w_in.scalar_type() == at::kBFloat16,
              "gemv_bf16: bf16 tensors only");
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1),
              "gemv_bf16: x (M, K) and w (N, K)");
  TORCH_CHECK(x_in.size(0) >= 1 && x_in.size(0) <= MAX_M, "gemv_bf16: 1 to 16 rows");
  at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), full = K - K % 16;
  at::Tensor y = at::empty({M, N}, x.options());
  const at::BFloat16* xp = x.const_data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.const_data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.mutable_data_ptr<at::BFloat16>();
  // x's full 16-chunks, split into even and odd elements in fp32: (M, full)
  std::vector<float> split(M * full);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < full; k += 16)
      for (int j = 0; j < 8; ++j) {
        split[m * full + k + j] = static_cast<float>(xp[m * K + k + 2 * j]);
        split[m * full + k + 8 + j] = static_cast<float>(xp[m * K + k + 2 * j + 1]);
      }
  const float* xs = split.data();
  at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) rows(xs, xp, wp, yp, M, K, N, n);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(adaflash, m) { m.def("gemv_bf16(Tensor x, Tensor w) -> Tensor"); }
TORCH_LIBRARY_IMPL(adaflash, CPU, m) { m.impl("gemv_bf16", &gemv_bf16); }
