// y (M, N) = x (M, K) · W (N, K)ᵀ for M ≤ 128 rows on CPUs with AVX2 + FMA but no native bf16:
// bf16 in, fp32 products and sums, bf16 out.
//
// Without AVX512-BF16 a bf16 weight must become fp32 before it is multiplied. This kernel does
// that in registers, two instructions per 16 weights, so the weights are read from memory once,
// as bf16: a 32-bit lane holding bf16 elements (2j, 2j+1) is element 2j+1 as fp32 once its low
// half is masked off, and element 2j once shifted left by 16. The input rows are split the same
// way beforehand (even and odd elements of each 16-chunk, in fp32), so each 16 weights take one
// load, a shift, an and, and two FMAs per input row. W is read as one stream, row after row,
// prefetched ahead (four rows at a time in four streams reached only ~60% of the bandwidth),
// split over torch's intra-op threads; input rows go four at a time over a row (it stays in L1).
// Rows are taken eight at a time, one after another, and their eight sums reduced together into
// one vector (three rounds of horizontal adds) and stored as eight bf16: over a step's 121
// projections 0.93x the time of one reduction and one scalar store per row for one input row,
// 0.89x for four (AMD EPYC of family 25 model 1, 2 threads, interleaved, two runs). Eager
// projections of up to 128 rows (prompt chunks) come here too: each block of eight weight rows
// is read from memory once for all of them (adaflash/models/gemv.py has the measurements).
// From WIDE_M input rows on, the conversion is paid once per weight row instead of once per four
// input rows: each thread widens eight weight rows at a time into an fp32 block (in L1/L2) and
// multiplies it in register tiles of three input rows × four weight rows (12 accumulators, 7
// loads per 12 FMAs, against 18 loads per 16 FMAs above). Over a step's 120 per-layer
// projections (AMD EPYC of family 25 model 1, 2 threads, 15 interleaved rounds, a /tmp probe):
// 24 / 36 rows 52.9 / 80.4 ms against 60.2 / 98.1, 64 / 128 rows 129.5 / 237.4 against 164.6 /
// 333.5 (9 rounds); 20 rows 1.05×, but 16 rows 0.85× and 12 rows 0.97×, so fewer stay above.
// Built by adaflash/models/gemv.py at first use, where the CPU has AVX2 and FMA but no
// AVX512-BF16 (that CPU gets gemv_bf16.cpp).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <vector>

#include "avx2_bf16.h"

namespace {

using adaflash_avx2::bf16_bits;
using adaflash_avx2::even_bf16;
using adaflash_avx2::odd_bf16;
using adaflash_avx2::to_bf16;

constexpr int64_t MAX_M = 128;
constexpr int PREFETCH = 512;  // bytes ahead of the weight stream (0–2048 measured alike)

// eight vectors → one vector of their eight horizontal sums
inline __m256 sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// the dot product of one input row and one weight row over the last K % 16 elements
inline float tail_dot(const at::BFloat16* x, const uint16_t* w, int64_t full, int64_t K) {
  float t = 0.0f;
  for (int64_t k = full; k < K; ++k) t += static_cast<float>(x[k]) * bf16_bits(w[k]);
  return t;
}

// one weight row wr (K) against M input rows (split: per 16-chunk of K, 8 even then 8 odd fp32
// elements, rows `full` apart), 32 weights a step into A accumulators per input row, prefetching
// ahead of the stream, then one more 16-chunk where K % 32 ≥ 16: per input row, out[m] is a
// vector whose horizontal sum is the dot product over K's full 16-chunks
template <int M, int A>
inline void row(const float* xs, int64_t full, const uint16_t* wr, int64_t K, __m256* out) {
  const int64_t pairs = K - K % 32;
  __m256 acc[M][A];
  for (int m = 0; m < M; ++m)
    for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
  for (int64_t k = 0; k < pairs; k += 32) {
    _mm_prefetch((const char*)(wr + k) + PREFETCH, _MM_HINT_T0);
    const __m256i v0 = _mm256_loadu_si256((const __m256i*)(wr + k));
    const __m256i v1 = _mm256_loadu_si256((const __m256i*)(wr + k + 16));
    const __m256 p[4] = {even_bf16(v0), odd_bf16(v0), even_bf16(v1), odd_bf16(v1)};
    for (int m = 0; m < M; ++m) {
      const float* xm = xs + m * full + k;
      for (int j = 0; j < 4; ++j)
        acc[m][j % A] = _mm256_fmadd_ps(p[j], _mm256_loadu_ps(xm + 8 * j), acc[m][j % A]);
    }
  }
  if (pairs < full) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(wr + pairs));
    const __m256 e = even_bf16(v), o = odd_bf16(v);
    for (int m = 0; m < M; ++m) {
      const float* xm = xs + m * full + pairs;
      acc[m][0] = _mm256_fmadd_ps(e, _mm256_loadu_ps(xm), acc[m][0]);
      acc[m][A - 1] = _mm256_fmadd_ps(o, _mm256_loadu_ps(xm + 8), acc[m][A - 1]);
    }
  }
  for (int m = 0; m < M; ++m) {
    out[m] = acc[m][0];
    for (int a = 1; a < A; ++a) out[m] = _mm256_add_ps(out[m], acc[m][a]);
  }
}

// weight rows [n, n + R) (R = 8, or a last 1) against input rows [m0, m0 + M): the rows read one
// after another; eight rows' sums reduced together and stored as eight bf16, the last K % 16
// elements added in scalar code
template <int M, int A, int R>
void block(const float* xs, int64_t full, const at::BFloat16* x, const uint16_t* w, uint16_t* y,
           int64_t K, int64_t N, int64_t n, int64_t m0) {
  __m256 part[M][R];
  for (int r = 0; r < R; ++r) {
    __m256 out[M];
    row<M, A>(xs + m0 * full, full, w + (n + r) * K, K, out);
    for (int m = 0; m < M; ++m) part[m][r] = out[m];
  }
  for (int m = 0; m < M; ++m) {
    alignas(32) float t[8];
    if constexpr (R == 8) _mm256_store_ps(t, sum8(part[m]));
    else t[0] = hsum(part[m][0]);
    for (int r = 0; r < R; ++r) t[r] += tail_dot(x + (m0 + m) * K, w + (n + r) * K, full, K);
    if constexpr (R == 8)
      _mm_storeu_si128((__m128i*)(y + (m0 + m) * N + n), to_bf16(_mm256_load_ps(t)));
    else y[(m0 + m) * N + n] = at::BFloat16(t[0]).x;
  }
}

// weight rows [n, n + R) against every input row, four at a time (the rows stay in L1/L2)
template <int R>
void rows(const float* xs, int64_t full, const at::BFloat16* x, const uint16_t* w, uint16_t* y,
          int64_t M, int64_t K, int64_t N, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) block<4, 2, R>(xs, full, x, w, y, K, N, n, m);
  switch (M - m) {
    case 3: block<3, 2, R>(xs, full, x, w, y, K, N, n, m); break;
    case 2: block<2, 4, R>(xs, full, x, w, y, K, N, n, m); break;
    case 1: block<1, 4, R>(xs, full, x, w, y, K, N, n, m); break;
    default: break;
  }
}

constexpr int64_t WIDE_M = 24;  // input rows from which weight rows are widened once (above)
constexpr int WIDE_ROWS = 8;    // weight rows widened at a time, per thread

// a bf16 weight row's full 16-chunks → fp32 in the split order of the input rows (8 even, 8 odd)
inline void widen_row(const uint16_t* w, float* out, int64_t full) {
  for (int64_t k = 0; k < full; k += 16) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(w + k));
    _mm256_storeu_ps(out + k, even_bf16(v));
    _mm256_storeu_ps(out + k + 8, odd_bf16(v));
  }
}

// MR input rows (split fp32, `full` apart) × NR widened weight rows (`full` apart): the dot
// products over the full 16-chunks into out[m * NR + n]
template <int MR, int NR>
inline void tile(const float* x, const float* w, int64_t full, float* out) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t k = 0; k < full; k += 8) {
    __m256 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_ps(x + m * full + k);
    for (int n = 0; n < NR; ++n) {
      const __m256 wv = _mm256_loadu_ps(w + n * full + k);
      for (int m = 0; m < MR; ++m) acc[m][n] = _mm256_fmadd_ps(xv[m], wv, acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) out[m * NR + n] = hsum(acc[m][n]);
}

// input rows [m0, m0 + MR) × widened weight rows [n, n + NR) (wf: row n's block start): the
// last K % 16 elements added in scalar code, stored as bf16
template <int MR, int NR>
void wide_tile(const float* xs, int64_t full, const at::BFloat16* x, const uint16_t* w,
               const float* wf, uint16_t* y, int64_t K, int64_t N, int64_t n, int64_t m0) {
  float t[MR * NR];
  tile<MR, NR>(xs + m0 * full, wf, full, t);
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) {
      const float v = t[m * NR + r] + tail_dot(x + (m0 + m) * K, w + (n + r) * K, full, K);
      y[(m0 + m) * N + n + r] = at::BFloat16(v).x;
    }
}

// widened weight rows [n, n + NR) (wf) against every input row, three at a time
template <int NR>
void wide_rows(const float* xs, int64_t full, const at::BFloat16* x, const uint16_t* w,
               const float* wf, uint16_t* y, int64_t M, int64_t K, int64_t N, int64_t n) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) wide_tile<3, NR>(xs, full, x, w, wf, y, K, N, n, m);
  if (M - m == 2) wide_tile<2, NR>(xs, full, x, w, wf, y, K, N, n, m);
  if (M - m == 1) wide_tile<1, NR>(xs, full, x, w, wf, y, K, N, n, m);
}

// one thread's blocks [begin, end) of WIDE_ROWS weight rows: each widened, then multiplied
void widened(const float* xs, int64_t full, const at::BFloat16* x, const uint16_t* w, uint16_t* y,
             int64_t M, int64_t K, int64_t N, int64_t begin, int64_t end) {
  std::vector<float> wf(WIDE_ROWS * full);
  for (int64_t b = begin; b < end; ++b) {
    const int64_t n0 = b * WIDE_ROWS, rows_here = std::min<int64_t>(WIDE_ROWS, N - n0);
    for (int64_t r = 0; r < rows_here; ++r) widen_row(w + (n0 + r) * K, wf.data() + r * full, full);
    int64_t r = 0;
    for (; r + 4 <= rows_here; r += 4)
      wide_rows<4>(xs, full, x, w, wf.data() + r * full, y, M, K, N, n0 + r);
    for (; r < rows_here; ++r) wide_rows<1>(xs, full, x, w, wf.data() + r * full, y, M, K, N, n0 + r);
  }
}

at::Tensor gemv_bf16(const at::Tensor& x_in, const at::Tensor& w_in) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && w_in.scalar_type() == at::kBFloat16,
              "gemv_bf16: bf16 tensors only");
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1),
              "gemv_bf16: x (M, K) and w (N, K)");
  TORCH_CHECK(x_in.size(0) >= 1 && x_in.size(0) <= MAX_M, "gemv_bf16: 1 to 128 rows");
  at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), full = K - K % 16;
  at::Tensor y = at::empty({M, N}, x.options());
  const at::BFloat16* xp = x.const_data_ptr<at::BFloat16>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.const_data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.mutable_data_ptr<at::BFloat16>());
  // x's full 16-chunks, split into even and odd elements in fp32: (M, full)
  std::vector<float> split(M * full);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < full; k += 16)
      for (int j = 0; j < 8; ++j) {
        split[m * full + k + j] = static_cast<float>(xp[m * K + k + 2 * j]);
        split[m * full + k + 8 + j] = static_cast<float>(xp[m * K + k + 2 * j + 1]);
      }
  const float* xs = split.data();
  if (M >= WIDE_M) {
    at::parallel_for(0, (N + WIDE_ROWS - 1) / WIDE_ROWS, 4, [&](int64_t begin, int64_t end) {
      widened(xs, full, xp, wp, yp, M, K, N, begin, end);
    });
    return y;
  }
  // threads take whole blocks of eight weight rows (64 rows at least), the last block may be short
  at::parallel_for(0, (N + 7) / 8, 8, [&](int64_t begin, int64_t end) {
    const int64_t last = std::min(N, end * 8);
    int64_t n = begin * 8;
    for (; n + 8 <= last; n += 8) rows<8>(xs, full, xp, wp, yp, M, K, N, n);
    for (; n < last; ++n) rows<1>(xs, full, xp, wp, yp, M, K, N, n);
  });
  return y;
}
}  // namespace

TORCH_LIBRARY(adaflash, m) { m.def("gemv_bf16(Tensor x, Tensor w) -> Tensor"); }
TORCH_LIBRARY_IMPL(adaflash, CPU, m) { m.impl("gemv_bf16", &gemv_bf16); }
