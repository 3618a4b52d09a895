// Attention of a few new tokens per request over the KV pool, for the compiled decode steps.
//
// o (B, T, heads, d) = softmax(q·Kᵀ / √d) · V, per request b and query head, over
//   - its past: positions j < pos[b] of its pool row, pool[rows[b], layer, 0 | 1, kv_head, j, :];
//   - its T new tokens k, v (B, T, kv_heads, d): token t sees new tokens ≤ t (causal);
// query heads share a kv head in groups of heads / kv_heads. fp32 arithmetic whatever the
// inputs' dtype (float or bf16), one softmax over past and new, rounded to q's dtype at the end:
// the math of decode_graph._Step's decomposed attention, which inductor turned into ~40 µs of
// scalar reductions per layer at a 256-position pool (one horizontal sum per position), and
// which read the whole capacity, not just the positions in use. Work items (request, query
// head, new token) are split over torch's intra-op threads. Built by adaflash/models/gemv.py
// with the GEMV kernel, into the same library.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// fp32 of a float or of a bf16's bits (the top half of a float's): the loops below read bf16 as
// uint16_t, which the compiler vectorises (through at::BFloat16 they ran 5x slower than fp32)
inline float widen(float x) { return x; }
inline float widen(uint16_t x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }

// e^x for x ≤ 0 (scores minus their maximum) in plain arithmetic, inlined, instead of a call of
// std::exp per score: x = n·ln2 + r, |r| ≤ ln2/2, e^r by Cephes' expf polynomial (within 8e-8
// relative over [-80, 0]), times 2^n through the exponent bits; below -87, where e^x < 2^-126,
// 0. With dot4 below: 51.4 against 58.5 µs a layer at 200 positions (one thread; 34.1 vs 38.8 on
// two; Zen 4 EPYC, interleaved A/B against std::exp and one dot per position)
inline float exp_nonpositive(float x) {
  const float xc = x < -87.f ? -87.f : x;
  const float n = __builtin_floorf(xc * 1.44269504088896341f + 0.5f);
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float er = p * r * r + r + 1.f;
  const float scale = __builtin_bit_cast(float, static_cast<int32_t>(n + 127.f) << 23);
  return x < -87.f ? 0.f : er * scale;
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
}
TORCH_LIBRARY_IMPL(adaflash, CPU, m) { m.impl("decode_attention", &decode_attention); }
