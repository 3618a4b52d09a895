// Attention of a few new tokens per request over the KV pool, for the compiled decode steps.
//
// o (B, T, heads, d) = softmax(q·Kᵀ / √d) · V, per request b and query head, over
//   - its past: positions j < pos[b] of its pool row, pool[rows[b], layer, 0 | 1, kv_head, j, :];
//   - its T new tokens k, v (B, T, kv_heads, d): token t sees new tokens ≤ t (causal);
// query heads share a kv head in groups of heads / kv_heads. fp32 arithmetic whatever the
// inputs' dtype (float or bf16), one softmax over past and new, rounded to q's dtype at the end:
// the math of decode_graph._Step's decomposed attention, which inductor turned into ~40 µs of
// scalar reductions per layer at a 256-position pool (one horizontal sum per position), and
// which read the whole capacity, not just the positions in use. Built by adaflash/models/gemv.py
// with the GEMV kernel, into the same library (every variant compiles with AVX2 + FMA).
// Where d is a multiple of 8, hand-vectorised (attend_avx2; its dot products and weighted sums
// in 512-bit vectors where the library is built with AVX-512 and d is a multiple of 16): the
// query heads sharing a kv head go together, so each key and value row is read and widened once
// for up to three of them; small calls stay on one thread where a second one did not pay
// (``parallel_work``). Per call, one new token, 9 query / 3 kv heads,
// d 64, bf16, one thread (AVX2 AMD EPYC, interleaved, each with ~30 µs of Python call): 41 / 85 /
// 155 µs at 40 / 170 / 400 past positions against 50 / 154 / 311 µs for the scalar loops below
// (one query head per work item, over two threads 50 / 114 / 215), which serve other d.
#include <ATen/Parallel.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <torch/library.h>
#include <torch/torch.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx_tiles.h"
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// work (positions × heads × d) a thread takes at least, where there is more than one thread;
// set per CPU class by models/gemv.py (``attention_split``). On an AVX2 AMD EPYC (Zen 1), below
// ~2M two threads were slower than one (waking the second cost ~20–40 µs a call: batch 1, 1 / 4
// / 16 new tokens at 170 past positions 61 / 220 / 737 µs on one thread, 117 / 409 / 743 on
// two; 8 requests at 400 positions 969 vs 693; quiet). On an Intel Xeon with AMX two threads
// won from the smallest call (1 / 4 / 16 tokens at 128 positions 10.4 / 34.2 / 129.0 µs on one,
// 9.0 / 20.0 / 70.8 on two).
std::atomic<int64_t> parallel_work{1 << 21};

void set_attention_split(int64_t work) {
  TORCH_CHECK(work >= 1, "attention_split: at least 1");
  parallel_work = work;
}

// new tokens a request from which calls take the tile path (attend_tokens_avx512) where it is
// built; set by models/gemv.py (``ADAFLASH_ATTENTION_TILES=0``: never)
std::atomic<int64_t> tile_tokens{2};

void set_attention_tile_tokens(int64_t tokens) {
  TORCH_CHECK(tokens >= 2, "attention_tile_tokens: at least 2");
  tile_tokens = tokens;
}

// fp32 of a float or of a bf16's bits (the top half of a float's): the loops below read bf16 as
// uint16_t, which the compiler vectorises (through at::BFloat16 they ran 5x slower than fp32)
inline float widen(float x) { return x; }
inline float widen(uint16_t x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }

// e^x for x ≤ 0 (scores minus their maximum) in plain arithmetic, inlined, instead of a call of
// std::exp per score: x = n·ln2 + r, |r| ≤ ln2/2, e^r by Cephes' expf polynomial (within 8e-8
// relative over [-80, 0]), times 2^n through the exponent bits; below -87, where e^x < 2^-126,
// 0. With dot4 below: 51.4 against 58.5 µs a layer at 200 positions (one thread; 34.1 vs 38.8 on
// two; Zen 4 EPYC, interleaved A/B against std::exp and one dot per position)
// Its constants, shared by the vector versions below (exp8, exp16): the cut-off, log2(e),
// ln 2 in two parts, the polynomial's coefficients from the highest power down.
constexpr float EXP_LOW = -87.f, EXP_LOG2E = 1.44269504088896341f;
constexpr float EXP_LN2_HI = 0.693359375f, EXP_LN2_LO = 2.12194440e-4f;
constexpr float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_nonpositive(float x) {
  const float xc = x < EXP_LOW ? EXP_LOW : x;
  const float n = __builtin_floorf(xc * EXP_LOG2E + 0.5f);
  const float r = xc - n * EXP_LN2_HI + n * EXP_LN2_LO;
  float p = EXP_POLY[0];
  for (int i = 1; i < 6; ++i) p = p * r + EXP_POLY[i];
  const float er = p * r * r + r + 1.f;
  const float scale = __builtin_bit_cast(float, static_cast<int32_t>(n + 127.f) << 23);
  return x < EXP_LOW ? 0.f : er * scale;
}

template <typename S> struct Raw { using type = S; };
template <> struct Raw<at::BFloat16> { using type = uint16_t; };

template <typename S>
inline float dot(const float* q, const S* k, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += q[i] * widen(k[i]);
  return acc;
}

// four positions' scores at once (rows at a stride): their sums' latencies overlap
template <typename S>
inline void dot4(const float* q, const S* k, int64_t stride, int64_t d, float* out) {
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
  for (int64_t i = 0; i < d; ++i) {
    a0 += q[i] * widen(k[i]);
    a1 += q[i] * widen(k[stride + i]);
    a2 += q[i] * widen(k[2 * stride + i]);
    a3 += q[i] * widen(k[3 * stride + i]);
  }
  out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3;
}

template <typename S>
inline void axpy(float* o, float p, const S* v, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) o[i] += p * widen(v[i]);
}

#if defined(__AVX2__) && defined(__FMA__)
// The same attention, vectorised by hand for AVX2 + FMA where d is a multiple of 8: the query
// heads that share a kv head (up to three at a time) go together, so each key and value row is
// read and widened once for all of them; scores two or four positions at a time (their sums
// reduced together), exponentials eight at a time, and o = Σ p·V 16 or 32 dims at a time: at
// most 13 of AVX2's 16 vector registers, so nothing spills.

// eight floats of a float or bf16 row
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// four vectors → their four horizontal sums
inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// exp_nonpositive on eight lanes
inline __m256 exp8(__m256 x) {
  const __m256 low = _mm256_set1_ps(EXP_LOW);
  const __m256 xc = _mm256_max_ps(x, low);
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(xc, _mm256_set1_ps(EXP_LOG2E), _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO),
                                   _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), xc));
  __m256 p = _mm256_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[i]));
  const __m256 er = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(er, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, low, _CMP_LT_OQ), y);  // below -87: 0
}

// P vectors → their P horizontal sums (P = 1, 2 or 4), stored at s
template <int P>
inline void store_sums(const __m256* a, float* s) {
  if constexpr (P == 4) {
    _mm_storeu_ps(s, sum4(a[0], a[1], a[2], a[3]));
  } else if constexpr (P == 2) {
    const __m128 h = sum4(a[0], a[1], a[0], a[1]);  // [Σa0, Σa1, Σa0, Σa1]
    _mm_storel_pi(reinterpret_cast<__m64*>(s), h);
  } else {
    s[0] = _mm_cvtss_f32(sum4(a[0], a[0], a[0], a[0]));
  }
}

// One vector type's operations, so that each block function below is written once: 8 lanes
// (AVX2) or, where the library is built with AVX-512, 16 (Lanes16). ``fold``: a vector of sums
// → eight partial sums in a __m256 (``store_sums`` adds those).
struct Lanes8 {
  using V = __m256;
  static constexpr int n = 8;
  static V zero() { return _mm256_setzero_ps(); }
  template <typename R>
  static V load(const R* p) { return load8(p); }
  static V splat(const float* p) { return _mm256_broadcast_ss(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static __m256 fold(V x) { return x; }
};

#if defined(__AVX512F__)
// 16 lanes and 32 registers: four keys or 64 dims at a time for three heads (17 registers).
// Sums in another order than 8 lanes' (within fp32 rounding). Per call, 9 / 3 heads, d 64, bf16,
// 2 threads (Intel Xeon with AMX, interleaved): 1 / 4 / 16 new tokens at 128 positions 7.3 /
// 13.7 / 45.3 µs against 7.9 / 15.7 / 54.1 with 8 lanes; one token at 400 positions 13.0 vs 15.4.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

struct Lanes16 {
  using V = __m512;
  static constexpr int n = 16;
  static V zero() { return _mm512_setzero_ps(); }
  template <typename R>
  static V load(const R* p) { return load16(p); }
  static V splat(const float* p) { return _mm512_set1_ps(*p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static __m256 fold(V x) {  // the two halves added
    return _mm256_add_ps(_mm512_castps512_ps256(x),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  }
};
#endif

// s[g·ld + r] = q_g · key_r for the G query heads (q: G rows of d, fp32) and P keys from k0, a
// stride apart: G·P sums, P keys and a query in registers (8 lanes: at most 13 of the 16)
template <typename L, int G, int P, typename R>
inline void score_block(const float* q, const R* k0, int64_t stride, int64_t d, float* s,
                        int64_t ld) {
  typename L::V acc[G][P];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int r = 0; r < P; ++r) acc[g][r] = L::zero();
  for (int64_t i = 0; i < d; i += L::n) {
    typename L::V kv[P];
#pragma GCC unroll 4
    for (int r = 0; r < P; ++r) kv[r] = L::load(k0 + r * stride + i);
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      const typename L::V qv = L::load(q + g * d + i);
#pragma GCC unroll 4
      for (int r = 0; r < P; ++r) acc[g][r] = L::fma(qv, kv[r], acc[g][r]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    __m256 sums[P];
#pragma GCC unroll 4
    for (int r = 0; r < P; ++r) sums[r] = L::fold(acc[g][r]);
    store_sums<P>(sums, s + g * ld);
  }
}

// s[g·ld + j] = q_g · key_j for n keys a stride apart: P at a time, then one by one
template <typename L, int G, int P, typename R>
void score_run(const float* q, const R* keys, int64_t stride, int64_t n, int64_t d, float* s,
               int64_t ld) {
  int64_t j = 0;
  for (; j + P <= n; j += P) score_block<L, G, P>(q, keys + j * stride, stride, d, s + j, ld);
  for (; j < n; ++j) score_block<L, G, 1>(q, keys + j * stride, stride, d, s + j, ld);
}

template <int G, typename R>
void scores(const float* q, const R* keys, int64_t stride, int64_t n, int64_t d, float* s,
            int64_t ld) {
#if defined(__AVX512F__)
  if (d % 16 == 0) return score_run<Lanes16, G, 4>(q, keys, stride, n, d, s, ld);
#endif
  score_run<Lanes8, G, G == 3 ? 2 : 4>(q, keys, stride, n, d, s, ld);
}

// o[g·d + i0 + i] += Σ_{jb ≤ j < je} p[g·ld + j]·value_j[i0 + i] for i < lanes·C: G·C sums, C
// values and a weight in registers
template <typename L, int G, int C, typename R>
inline void weigh_block(const float* p, int64_t ld, const R* values, int64_t stride, int64_t jb,
                        int64_t je, int64_t i0, int64_t d, float* o) {
  typename L::V acc[G][C];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[g][c] = L::load(o + g * d + i0 + L::n * c);
  for (int64_t j = jb; j < je; ++j) {
    const R* v = values + j * stride + i0;
    typename L::V vv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) vv[c] = L::load(v + L::n * c);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const typename L::V pj = L::splat(p + g * ld + j);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[g][c] = L::fma(pj, vv[c], acc[g][c]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) L::store(o + g * d + i0 + L::n * c, acc[g][c]);
}

// o[g·d + i] += Σ_j p[g·ld + j]·value_j[i] for n values a stride apart, C vectors of dims at a
// time and then one, over blocks of 128 positions (they stay in L1)
template <typename L, int G, int C, typename R>
void weigh_run(const float* p, int64_t ld, const R* values, int64_t stride, int64_t n, int64_t d,
               float* o) {
  for (int64_t jb = 0; jb < n; jb += 128) {
    const int64_t je = std::min<int64_t>(n, jb + 128);
    int64_t i0 = 0;
    for (; i0 + L::n * C <= d; i0 += L::n * C)
      weigh_block<L, G, C>(p, ld, values, stride, jb, je, i0, d, o);
    for (; i0 < d; i0 += L::n) weigh_block<L, G, 1>(p, ld, values, stride, jb, je, i0, d, o);
  }
}

template <int G, typename R>
void weigh(const float* p, int64_t ld, const R* values, int64_t stride, int64_t n, int64_t d,
           float* o) {
#if defined(__AVX512F__)
  if (d % 16 == 0) return weigh_run<Lanes16, G, 4>(p, ld, values, stride, n, d, o);
#endif
  weigh_run<Lanes8, G, G == 3 ? 2 : 4>(p, ld, values, stride, n, d, o);
}

// query heads [h0, h0 + G) of new token t of request b, sharing kv head kvh: their attention over
// the past (n_past keys and values of the pool row, a stride apart) and new tokens ≤ t
template <int G, typename S, typename R>
void heads(const R* q, const R* keys, const R* values, int64_t s_pos, int64_t n_past,
           const R* new_keys, const R* new_values, int64_t s_new, int64_t t, int64_t d, float scale,
           S* out, std::vector<float>& work) {
  const int64_t seen = n_past + t + 1, ld = (seen + 7) / 8 * 8;
  work.resize(G * d * 2 + G * ld);
  float* qf = work.data();  // (G, d) scaled queries
  float* o = qf + G * d;    // (G, d) Σ p·V
  float* s = o + G * d;     // (G, ld) scores, then their exponentials
  for (int64_t i = 0; i < G * d; ++i) qf[i] = widen(q[i]) * scale, o[i] = 0.f;
  scores<G>(qf, keys, s_pos, n_past, d, s, ld);
  scores<G>(qf, new_keys, s_new, t + 1, d, s + n_past, ld);
  float total[G];
  for (int g = 0; g < G; ++g) {
    float* e = s + g * ld;
    // the largest score, eight lanes at a time (a scalar max is one 4-cycle chain per score:
    // 16-token calls at 128 positions took 64.7 µs with it against 53.7, 2 threads, AMX Xeon)
    __m256 most = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t i = 0;
    for (; i + 8 <= seen; i += 8) most = _mm256_max_ps(most, _mm256_loadu_ps(e + i));
    const __m128 half = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
    const __m128 quarter = _mm_max_ps(half, _mm_movehl_ps(half, half));
    float top = _mm_cvtss_f32(_mm_max_ss(quarter, _mm_movehdup_ps(quarter)));
    for (; i < seen; ++i) top = std::max(top, e[i]);
    const __m256 m = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= seen; j += 8) {
      const __m256 x = exp8(_mm256_sub_ps(_mm256_loadu_ps(e + j), m));
      _mm256_storeu_ps(e + j, x);
      sum = _mm256_add_ps(sum, x);
    }
    total[g] = _mm_cvtss_f32(sum4(sum, sum, sum, sum));
    for (; j < seen; ++j) total[g] += (e[j] = exp_nonpositive(e[j] - top));
  }
  weigh<G>(s, ld, values, s_pos, n_past, d, o);
  weigh<G>(s + n_past, ld, new_values, s_new, t + 1, d, o);
  for (int g = 0; g < G; ++g)
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = static_cast<S>(o[g * d + i] / total[g]);
}

#if defined(__AVX512F__)
// Several new tokens a request (verification): every query of a kv head — T tokens × its query
// heads, rows r = t·group + g — against that head's keys at once, the keys transposed once so
// that they run along the lanes (kt: key j of lane element i at kt[i·ldk + j]), and a score is a
// sum over d in each lane: no horizontal sums, every key read once for all T·group queries (the
// one-token path above reads each key once per token and folds each score across lanes). bf16
// keys stay bf16, in pairs of elements (32-bit lanes) that vdpbf16ps multiplies and adds in
// fp32 (bf16 products are exact in fp32); fp32 keys are fp32 lanes. Σ p·V (each value row read
// once for six queries), the softmax and the rounding are fp32 as in the one-token path. Per
// call, 9 / 3 heads, d 64, bf16, 2 threads (Intel Xeon with AMX, the one-token path for all T
// in the same minutes): 4 / 8 / 16 new tokens at 128 past positions 13.5 / 22.0 / 38.3 µs
// against 15.0 / 26.1 / 49.4, at 400 positions 33.2 / 52.8 / 90.9 against 38.4 / 68.0 / 130.5;
// with the scores through AMX tiles (``score_amx``, where built with AMX-BF16) 16 tokens at 128
// positions 32.8 µs, at 400 77.6.

#if defined(__AVX512BF16__)
constexpr bool kBf16Pairs = true;
#else
constexpr bool kBf16Pairs = false;
#endif

// keys multiplied as bf16 pairs (R is bf16's bits and the CPU has vdpbf16ps), else as floats
template <typename R>
constexpr bool pairs = kBf16Pairs && std::is_same_v<R, uint16_t>;

// sixteen rows of sixteen 32-bit lanes transposed in registers
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: rows i and i + 4, then i + 8 and i + 12
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// sixteen lanes of a row from lane element i0: bf16 pairs as they are, else floats
template <typename R>
inline __m512 lanes(const R* row, int64_t i0) {
  if constexpr (pairs<R>) return _mm512_castsi512_ps(_mm512_loadu_si512(row + 2 * i0));
  else return load16(row + i0);
}

// kt[i·ldk + j] = lane element i of key j (w of them, a multiple of 16: d, or d / 2 pairs) for
// keys j < n (the n_past of the pool row, a stride apart, then the new ones), 0 for n ≤ j < ldk
template <typename R>
void transpose_keys(const R* past, int64_t s_pos, int64_t n_past, const R* fresh, int64_t s_new,
                    int64_t n, int64_t w, float* kt, int64_t ldk) {
  __m512 m[16];
  for (int64_t j0 = 0; j0 < ldk; j0 += 16) {
    for (int64_t i0 = 0; i0 < w; i0 += 16) {
      for (int r = 0; r < 16; ++r) {
        const int64_t j = j0 + r;
        m[r] = j >= n        ? _mm512_setzero_ps()
               : j < n_past ? lanes(past + j * s_pos, i0)
                            : lanes(fresh + (j - n_past) * s_new, i0);
      }
      transpose16(m);
      for (int r = 0; r < 16; ++r) _mm512_storeu_ps(kt + (i0 + r) * ldk + j0, m[r]);
    }
  }
}

// s[r·lds + j0 + 16c + l] = scale · Σ_i q_r[i]·kt[i·ldk + j0 + 16c + l] for RB rows (lane
// elements a row apart in q) and KB vectors of keys: RB·KB sums and KB keys in registers (6 × 4:
// 28 of 32), the query's element (or pair) broadcast
template <bool P, int RB, int KB>
inline void score_tile(const float* q, int64_t w, const float* kt, int64_t ldk, int64_t j0,
                       float scale, float* s, int64_t lds) {
  __m512 acc[RB][KB];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < KB; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < w; ++i) {
    __m512 k[KB];
#pragma GCC unroll 4
    for (int c = 0; c < KB; ++c) k[c] = _mm512_loadu_ps(kt + i * ldk + j0 + 16 * c);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m512 qr = _mm512_set1_ps(q[r * w + i]);
#pragma GCC unroll 4
      for (int c = 0; c < KB; ++c) {
#if defined(__AVX512BF16__)
        if constexpr (P) {
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)qr, (__m512bh)k[c]);
          continue;
        }
#endif
        acc[r][c] = _mm512_fmadd_ps(qr, k[c], acc[r][c]);
      }
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < KB; ++c)
      _mm512_storeu_ps(s + r * lds + j0 + 16 * c, _mm512_mul_ps(acc[r][c], sv));
}

constexpr int TILE_ROWS = 6;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The same scores through AMX tiles where the library is built with AMX-BF16 (bf16 only): the
// transposed keys are already the pair-interleaved layout a tile product's second operand takes
// (16 pairs of d × 16 keys), the queries the first as they lie (16 rows × 32 of d), and one tile
// product does what 32 vdpbf16ps do. Tiles: 0 scores (16 × 16, fp32), 1 queries, 2 keys.
inline void configure_score_tiles() {
  adaflash_amx::TileConfig cfg;
  for (int t = 0; t < 3; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// s[r·ldk + j] = scale · q_r · key_j for rows r < nr (a multiple of 16: q's rows, d bf16 each)
// and keys j < ldk; d a multiple of 32
inline void score_amx(const uint16_t* q, int64_t nr, int64_t d, const float* kt, int64_t ldk,
                      float scale, float* s) {
  for (int64_t r = 0; r < nr; r += 16)
    for (int64_t j0 = 0; j0 < ldk; j0 += 16) {
      _tile_zero(0);
      for (int64_t i = 0; i < d; i += 32) {
        _tile_loadd(1, q + r * d + i, d * 2);
        _tile_loadd(2, kt + (i / 2) * ldk + j0, ldk * 4);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, s + r * ldk + j0, ldk * 4);
    }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < nr * ldk; i += 16)
    _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), sv));
}
#endif

// exp_nonpositive on sixteen lanes
inline __m512 exp16(__m512 x) {
  const __m512 low = _mm512_set1_ps(EXP_LOW);
  const __m512 xc = _mm512_max_ps(x, low);
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(xc, _mm512_set1_ps(EXP_LOG2E), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), xc));
  __m512 p = _mm512_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[i]));
  const __m512 er = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 y = _mm512_mul_ps(er, _mm512_castsi512_ps(e));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, low, _CMP_NLT_UQ), y);  // below -87: 0
}

// e[j] = exp(e[j] - max) for j < seen and 0 for seen ≤ j < n; returns Σ e
inline float softmax_row(float* e, int64_t seen, int64_t n) {
  __m512 most = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= seen; j += 16) most = _mm512_max_ps(most, _mm512_loadu_ps(e + j));
  float top = _mm512_reduce_max_ps(most);
  for (; j < seen; ++j) top = std::max(top, e[j]);
  const __m512 m = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j + 16 <= seen; j += 16) {
    const __m512 x = exp16(_mm512_sub_ps(_mm512_loadu_ps(e + j), m));
    _mm512_storeu_ps(e + j, x);
    sum = _mm512_add_ps(sum, x);
  }
  float total = _mm512_reduce_add_ps(sum);
  for (; j < seen; ++j) total += (e[j] = exp_nonpositive(e[j] - top));
  std::fill(e + std::max<int64_t>(seen, 0), e + n, 0.f);  // keys it does not see weigh nothing
  return total;
}

// dst[i] = o[i] / total, rounded to S, for i < d (a multiple of 16)
template <typename S>
inline void store_row(const float* o, float total, int64_t d, S* dst) {
  const __m512 t = _mm512_set1_ps(total);
  for (int64_t i = 0; i < d; i += 16) {
    const __m512 x = _mm512_div_ps(_mm512_loadu_ps(o + i), t);
    if constexpr (std::is_same_v<S, float>) {
      _mm512_storeu_ps(dst + i, x);
    } else {
#if defined(__AVX512BF16__)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(x));
#else
      alignas(64) float tmp[16];
      _mm512_store_ps(tmp, x);
      for (int l = 0; l < 16; ++l) dst[i + l] = static_cast<S>(tmp[l]);
#endif
    }
  }
}

// work items (request, kv head, half of its rows where there are two tiles or more)
template <typename S, typename R>
void attend_tokens_avx512(const R* qp, const R* kp, const R* vp, const R* pp, S* op, int64_t B,
                          int64_t T, int64_t H, int64_t KVH, int64_t d, const int64_t* rows_of,
                          const int64_t* pos, int64_t layer_off, int64_t s_row, int64_t s_kv,
                          int64_t s_head, int64_t s_pos) {
  constexpr bool P = pairs<R>;
  const int64_t group = H / KVH, rows = T * group, w = P ? d / 2 : d;  // w: lanes a key
  const int64_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS, parts = tiles >= 2 ? 2 : 1;
  const int64_t items = B * KVH * parts;
  int64_t work = 0;  // positions × heads × d over every item
  for (int64_t b = 0; b < B; ++b) work += T * (pos[b] + T) * H * d;
  const int64_t grain =
      std::max<int64_t>(1, items * parallel_work.load() / std::max<int64_t>(work, 1));
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const bool amx = P && adaflash_amx::tiles_permitted();
#else
  const bool amx = false;
#endif
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, kt, buf;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx) configure_score_tiles();
#endif
    for (int64_t item = begin; item < end; ++item) {
      const int64_t part = item % parts, kvh = (item / parts) % KVH, b = item / (parts * KVH);
      const int64_t r0 = TILE_ROWS * (tiles * part / parts);
      const int64_t nr = TILE_ROWS * (tiles * (part + 1) / parts) - r0;
      const int64_t n_past = pos[b], n = n_past + T, ldk = (n + 15) / 16 * 16;
      const R* keys = pp + rows_of[b] * s_row + layer_off + kvh * s_head;
      const R* values = keys + s_kv;
      const R* nk = kp + (b * T * KVH + kvh) * d;
      const R* nv = vp + (b * T * KVH + kvh) * d;
      const int64_t nr16 = (nr + 15) / 16 * 16;  // AMX tiles take rows 16 at a time
      // its rows' queries (rows past the last: 0): bf16 pairs as they are, floats scaled
      qf.assign((amx ? nr16 : nr) * w, 0.f);
      for (int64_t r = r0; r < std::min(r0 + nr, rows); ++r) {
        const R* q = qp + ((b * T + r / group) * H + kvh * group + r % group) * d;
        float* dst = qf.data() + (r - r0) * w;
        if constexpr (P) std::memcpy(dst, q, d * sizeof(R));
        else for (int64_t i = 0; i < d; ++i) dst[i] = widen(q[i]) * scale;
      }
      kt.resize(w * ldk);
      transpose_keys(keys, s_pos, n_past, nk, KVH * d, n, w, kt.data(), ldk);
      buf.resize((amx ? nr16 : nr) * ldk + nr * d);
      float* s = buf.data();                    // (nr, ldk) scores, then their exponentials
      float* o = s + (amx ? nr16 : nr) * ldk;  // (nr, d) Σ p·V
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if (amx)
        score_amx(reinterpret_cast<const uint16_t*>(qf.data()), nr16, d, kt.data(), ldk, scale, s);
#endif
      for (int64_t r = 0; r < nr && !amx; r += TILE_ROWS) {
        const float* q = qf.data() + r * w;
        const float sc = P ? scale : 1.f;
        int64_t c = 0;
        for (; c + 4 <= ldk / 16; c += 4)
          score_tile<P, TILE_ROWS, 4>(q, w, kt.data(), ldk, 16 * c, sc, s + r * ldk, ldk);
        switch (ldk / 16 - c) {
          case 3: score_tile<P, TILE_ROWS, 3>(q, w, kt.data(), ldk, 16 * c, sc, s + r * ldk, ldk); break;
          case 2: score_tile<P, TILE_ROWS, 2>(q, w, kt.data(), ldk, 16 * c, sc, s + r * ldk, ldk); break;
          case 1: score_tile<P, TILE_ROWS, 1>(q, w, kt.data(), ldk, 16 * c, sc, s + r * ldk, ldk); break;
          default: break;
        }
      }
      float total[TILE_ROWS];
      for (int64_t r = 0; r < nr; r += TILE_ROWS) {
        for (int64_t u = 0; u < TILE_ROWS; ++u) {  // row r0 + r + u sees the past, new ≤ its token
          const int64_t row = r0 + r + u;
          total[u] = softmax_row(s + (r + u) * ldk, row < rows ? n_past + row / group + 1 : 0, n);
        }
        std::fill(o + r * d, o + (r + TILE_ROWS) * d, 0.f);
        weigh_run<Lanes16, TILE_ROWS, 4>(s + r * ldk, ldk, values, s_pos, n_past, d, o + r * d);
        weigh_run<Lanes16, TILE_ROWS, 4>(s + r * ldk + n_past, ldk, nv, KVH * d, T, d, o + r * d);
        for (int64_t u = 0; u < TILE_ROWS && r0 + r + u < rows; ++u) {
          const int64_t row = r0 + r + u;
          store_row(o + (r + u) * d, total[u], d,
                    op + ((b * T + row / group) * H + kvh * group + row % group) * d);
        }
      }
    }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx) _tile_release();
#endif
  });
}
#endif

// the vectorised path: work items (request, new token, kv head, up to three of its query heads),
// on one thread where there is little work (a batch-1 decode step: ~20 µs a layer)
template <typename S, typename R>
void attend_avx2(const R* qp, const R* kp, const R* vp, const R* pp, S* op, int64_t B, int64_t T,
                 int64_t H, int64_t KVH, int64_t d, const int64_t* rows, const int64_t* pos,
                 int64_t layer_off, int64_t s_row, int64_t s_kv, int64_t s_head, int64_t s_pos) {
  const int64_t group = H / KVH, chunks = (group + 2) / 3, items = B * T * KVH * chunks;
  int64_t work = 0;  // positions × heads × d over every item
  for (int64_t b = 0; b < B; ++b) work += T * (pos[b] + T) * H * d;
  const int64_t grain =
      std::max<int64_t>(1, items * parallel_work.load() / std::max<int64_t>(work, 1));
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item % chunks, kvh = (item / chunks) % KVH, t = (item / (chunks * KVH)) % T,
                    b = item / (chunks * KVH * T);
      const int64_t h0 = kvh * group + 3 * c, G = std::min<int64_t>(3, group - 3 * c);
      const R* keys = pp + rows[b] * s_row + layer_off + kvh * s_head;
      const int64_t tok = b * T;  // request b's first new token
      const R* q = qp + ((tok + t) * H + h0) * d;
      const R* nk = kp + (tok * KVH + kvh) * d;
      const R* nv = vp + (tok * KVH + kvh) * d;
      S* o = op + ((tok + t) * H + h0) * d;
      const auto run = [&](auto g) {
        heads<decltype(g)::value, S>(q, keys, keys + s_kv, s_pos, pos[b], nk, nv, KVH * d, t, d,
                                      scale, o, buffer);
      };
      if (G == 3) run(std::integral_constant<int, 3>{});
      else if (G == 2) run(std::integral_constant<int, 2>{});
      else run(std::integral_constant<int, 1>{});
    }
  });
}
#endif

template <typename S>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pool,
            const int64_t* rows, int64_t layer, const int64_t* pos, at::Tensor& out) {
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), d = q.size(3);
  const int64_t KVH = k.size(2), group = H / KVH;
  using R = typename Raw<S>::type;  // what the loops read
  const R* qp = reinterpret_cast<const R*>(q.const_data_ptr<S>());
  const R* kp = reinterpret_cast<const R*>(k.const_data_ptr<S>());
  const R* vp = reinterpret_cast<const R*>(v.const_data_ptr<S>());
  const R* pp = reinterpret_cast<const R*>(pool.const_data_ptr<S>());
  S* op = out.mutable_data_ptr<S>();
  // pool (rows, layers, 2, kv_heads, capacity, d): strides in elements
  const int64_t s_row = pool.stride(0), s_layer = pool.stride(1), s_kv = pool.stride(2),
                s_head = pool.stride(3), s_pos = pool.stride(4);
#if defined(__AVX512F__)
  if (T >= tile_tokens.load() && d % 32 == 0) {  // (bf16 pairs: whole vectors of 16 a key)
    attend_tokens_avx512<S>(qp, kp, vp, pp, op, B, T, H, KVH, d, rows, pos, layer * s_layer,
                            s_row, s_kv, s_head, s_pos);
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 8 == 0) {
    attend_avx2<S>(qp, kp, vp, pp, op, B, T, H, KVH, d, rows, pos, layer * s_layer, s_row, s_kv,
                   s_head, s_pos);
    return;
  }
#endif
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  at::parallel_for(0, B * H * T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(d), of(d), s;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (H * T), h = (item / T) % H, t = item % T, kvh = h / group;
      const int64_t past = pos[b];
      const R* qrow = qp + ((b * T + t) * H + h) * d;
      for (int64_t i = 0; i < d; ++i) qf[i] = widen(qrow[i]) * scale;
      const R* keys = pp + rows[b] * s_row + layer * s_layer + kvh * s_head;
      const R* values = keys + s_kv;
      s.resize(past + t + 1);
      float top = -std::numeric_limits<float>::infinity();
      int64_t j = 0;
      for (; j + 4 <= past; j += 4) dot4(qf.data(), keys + j * s_pos, s_pos, d, s.data() + j);
      for (; j < past; ++j) s[j] = dot(qf.data(), keys + j * s_pos, d);
      for (j = 0; j < past; ++j) top = std::max(top, s[j]);
      for (int64_t j = 0; j <= t; ++j) {
        const R* kn = kp + ((b * T + j) * KVH + kvh) * d;
        top = std::max(top, s[past + j] = dot(qf.data(), kn, d));
      }
      float total = 0.f;
      float* e = s.data();
      const int64_t seen = past + t + 1;
#pragma omp simd reduction(+ : total)
      for (int64_t j = 0; j < seen; ++j) total += (e[j] = exp_nonpositive(e[j] - top));
      std::fill(of.begin(), of.end(), 0.f);
      // o = Σ_j p_j·V_j, 16 dims at a time over every past position: the sums stay in registers
      // (an axpy per position stored and reloaded o each time: the op's slowest loop)
      for (int64_t i0 = 0; i0 + 16 <= d; i0 += 16) {
        float acc[16] = {};
        for (int64_t j = 0; j < past; ++j) {
          const R* vr = values + j * s_pos + i0;
          const float pj = s[j];
#pragma omp simd
          for (int64_t i = 0; i < 16; ++i) acc[i] += pj * widen(vr[i]);
        }
        for (int64_t i = 0; i < 16; ++i) of[i0 + i] = acc[i];
      }
      for (int64_t j = 0; j < past; ++j)  // d's tail beyond a multiple of 16
        for (int64_t i = d - d % 16; i < d; ++i) of[i] += s[j] * widen(values[j * s_pos + i]);
      for (int64_t j = 0; j <= t; ++j)
        axpy(of.data(), s[past + j], vp + ((b * T + j) * KVH + kvh) * d, d);
      S* orow = op + ((b * T + t) * H + h) * d;
      for (int64_t i = 0; i < d; ++i) orow[i] = static_cast<S>(of[i] / total);
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                            const at::Tensor& pool, const at::Tensor& rows_in, int64_t layer,
                            const at::Tensor& pos_in) {
  TORCH_CHECK(q_in.dim() == 4 && k_in.dim() == 4 && v_in.dim() == 4 && pool.dim() == 6,
              "decode_attention: q (B, T, heads, d), k and v (B, T, kv_heads, d), "
              "pool (rows, layers, 2, kv_heads, capacity, d)");
  TORCH_CHECK(q_in.scalar_type() == pool.scalar_type() && k_in.scalar_type() == pool.scalar_type() &&
                  v_in.scalar_type() == pool.scalar_type(),
              "decode_attention: q, k, v and the pool share a dtype");
  TORCH_CHECK(pool.stride(5) == 1, "decode_attention: the pool's last dim is contiguous");
  TORCH_CHECK(q_in.size(2) % k_in.size(2) == 0, "decode_attention: heads divisible by kv heads");
  TORCH_CHECK(k_in.sizes() == v_in.sizes() && k_in.size(0) == q_in.size(0) &&
                  k_in.size(1) == q_in.size(1) && k_in.size(3) == q_in.size(3) &&
                  pool.size(3) == k_in.size(2) && pool.size(5) == q_in.size(3) && pool.size(2) == 2,
              "decode_attention: q, k, v and the pool disagree on requests, tokens, heads or d");
  TORCH_CHECK(layer >= 0 && layer < pool.size(1), "decode_attention: no such layer in the pool");
  at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  at::Tensor rows = rows_in.to(at::kLong).contiguous(), pos = pos_in.to(at::kLong).contiguous();
  TORCH_CHECK(rows.numel() == q.size(0) && pos.numel() == q.size(0),
              "decode_attention: one row and one position per request");
  const int64_t* rp = rows.const_data_ptr<int64_t>();
  const int64_t* pp = pos.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b)
    TORCH_CHECK(rp[b] >= 0 && rp[b] < pool.size(0) && pp[b] >= 0 && pp[b] <= pool.size(4),
                "decode_attention: row or position outside the pool");
  at::Tensor out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat)
    attend<float>(q, k, v, pool, rp, layer, pp, out);
  else if (q.scalar_type() == at::kBFloat16)
    attend<at::BFloat16>(q, k, v, pool, rp, layer, pp, out);
  else
    TORCH_CHECK(false, "decode_attention: float or bf16 only");
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adaflash, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor pool, Tensor rows, int layer, "
      "Tensor pos) -> Tensor");
  m.def("set_attention_split(int work) -> ()");
  m.def("set_attention_tile_tokens(int tokens) -> ()");
}
TORCH_LIBRARY_IMPL(adaflash, CPU, m) { m.impl("decode_attention", &decode_attention); }
TORCH_LIBRARY_IMPL(adaflash, CompositeExplicitAutograd, m) {
  m.impl("set_attention_split", &set_attention_split);
  m.impl("set_attention_tile_tokens", &set_attention_tile_tokens);
}
