// y (M, N) = x (M, K) · W (N, K)ᵀ through AMX tiles: bf16 in, fp32 accumulation, bf16 out.
//
// A few rows read every weight once, like a decode step, and do a few times its arithmetic: AMX
// does that arithmetic in a fraction of the time the weights take to arrive, so up to ~16 rows
// cost about what one row costs. Serves eager projections of up to 32 rows (inside compiled steps
// inductor's own AMX template did better: models/gemv.py). The weight is used as it lies, with no
// packed copy: the product is computed transposed, yᵀ (N, M) = W (N, K) · xᵀ, so that the tiles
// that stream are W's rows (A: 16 rows × 32 of K, 64 bytes each, straight from W) and the one that
// needs AMX's pair-interleaved (VNNI) layout is the small input x (B: 16 pairs of K × M columns,
// repacked once per call). Four blocks of 16 weight rows go together, so each input tile loaded
// serves four products; blocks of four are split over torch's threads. A block of 16 rows of W is
// one contiguous run of memory, so each thread still reads W in order. Needs K % 32 == 0 and N %
// 64 == 0 (``gemv.amx_fits``); built by adaflash/models/gemv.py where the CPU has AMX-BF16.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <vector>

#include "amx_tiles.h"

namespace {

using adaflash_amx::TileConfig;
using adaflash_amx::tiles_permitted;

constexpr int64_t GROUP = 64;  // weight rows per group: four 16-row tiles
constexpr int64_t KB = 32;     // K per tile

// tiles 0-3: yᵀ accumulators (16 weight rows × m inputs, fp32); 4: the input (16 pairs of K ×
// m inputs, bf16 pairs); 5-7: weight rows (16 × 32 of K, bf16)
void configure(int64_t m) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.rows[t] = 16, cfg.colsb[t] = static_cast<uint16_t>(m * 4);
  cfg.rows[4] = 16, cfg.colsb[4] = static_cast<uint16_t>(m * 4);
  for (int t = 5; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// one group of 64 weight rows (n0…n0+63) against m ≤ 16 inputs; xp: the inputs in B's layout,
// one (16 × m pairs) tile per 32 of K
void group(const at::BFloat16* w, const at::BFloat16* xp, at::BFloat16* y, int64_t K, int64_t N,
           int64_t n0, int64_t m, float* out /* 16 × 16 scratch */) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t ldw = K * 2, ldx = m * 4;  // bytes per tile row
  const at::BFloat16* w0 = w + n0 * K;
  for (int64_t k = 0; k < K; k += KB) {
    _tile_loadd(4, xp + k * m, ldx);
    _tile_loadd(5, w0 + k, ldw);
    _tile_dpbf16ps(0, 5, 4);
    _tile_loadd(6, w0 + 16 * K + k, ldw);
    _tile_dpbf16ps(1, 6, 4);
    _tile_loadd(7, w0 + 32 * K + k, ldw);
    _tile_dpbf16ps(2, 7, 4);
    _tile_loadd(5, w0 + 48 * K + k, ldw);
    _tile_dpbf16ps(3, 5, 4);
  }
  // yᵀ tile t holds rows n0 + 16t … of y's columns; y (M, N) is written transposed back
  for (int t = 0; t < 4; ++t) {
    switch (t) {  // tile numbers are immediates
      case 0: _tile_stored(0, out, m * 4); break;
      case 1: _tile_stored(1, out, m * 4); break;
      case 2: _tile_stored(2, out, m * 4); break;
      default: _tile_stored(3, out, m * 4);
    }
    // column c of the tile (its 16 weight rows for input c) → 16 adjacent bf16 of y's row c
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5,
                                                             4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(static_cast<int>(m)));
    for (int64_t c = 0; c < m; ++c) {
      const __m512 col = _mm512_i32gather_ps(rows, out + c, 4);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + c * N + n0 + 16 * t),
                          (__m256i)_mm512_cvtneps_pbh(col));
    }
  }
}

bool fits(int64_t M, int64_t K, int64_t N) { return M >= 1 && K % KB == 0 && N % GROUP == 0; }

at::Tensor linear_amx(const at::Tensor& x_in, const at::Tensor& w_in) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && w_in.scalar_type() == at::kBFloat16,
              "linear_amx: bf16 tensors only");
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1),
              "linear_amx: x (M, K) and w (N, K)");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w_in.size(0);
  TORCH_CHECK(fits(M, K, N), "linear_amx: needs K % 32 == 0 and N % 64 == 0, got K ", K, ", N ",
              N);
  TORCH_CHECK(tiles_permitted(), "linear_amx: the kernel refused AMX tile state to this process");
  at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const at::BFloat16* xr = x.const_data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.const_data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.mutable_data_ptr<at::BFloat16>();
  // x in B's layout, per 16 inputs: for each 32 of K, 16 rows (pairs of K) × m inputs × 2
  std::vector<at::BFloat16> packed(M * K);
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t m = std::min<int64_t>(16, M - m0);
    at::BFloat16* dst = packed.data() + m0 * K;
    for (int64_t k = 0; k < K; k += 2)
      for (int64_t c = 0; c < m; ++c) {
        dst[(k / 2) * m * 2 + c * 2] = xr[(m0 + c) * K + k];
        dst[(k / 2) * m * 2 + c * 2 + 1] = xr[(m0 + c) * K + k + 1];
      }
  }
  at::parallel_for(0, N / GROUP, 4, [&](int64_t g0, int64_t g1) {
    alignas(64) float out[16 * 16];
    int64_t configured = -1;
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t m0 = 0; m0 < M; m0 += 16) {  // a second block of inputs finds W in cache
        const int64_t m = std::min<int64_t>(16, M - m0);
        if (m != configured) configure(m), configured = m;
        group(wp, packed.data() + m0 * K, yp + m0 * N, K, N, g * GROUP, m, out);
      }
    _tile_release();
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adaflash, m) { m.def("linear_amx(Tensor x, Tensor w) -> Tensor"); }
TORCH_LIBRARY_IMPL(adaflash, CPU, m) { m.impl("linear_amx", &linear_amx); }
