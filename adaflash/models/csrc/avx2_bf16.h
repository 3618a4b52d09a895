// bf16 ↔ fp32 in AVX2 registers, shared by the AVX2 kernels (gemv_bf16_avx2.cpp,
// gemm_bf16_panels_avx2.cpp). A 32-bit lane holding bf16 elements (2j, 2j+1) is element 2j+1 as
// fp32 once its low half is masked off, and element 2j once shifted left by 16.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace adaflash_avx2 {

// eight fp32 → eight bf16, rounded to nearest even, NaN kept NaN: as at::BFloat16(float)
inline __m128i to_bf16(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), odd);
  r = _mm256_srli_epi32(r, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

inline float bf16_bits(uint16_t x) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16);
}

// 16 bf16 (a 256-bit load) → their 8 even elements and their 8 odd ones as fp32 (above)
inline __m256 even_bf16(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 odd_bf16(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}

}  // namespace adaflash_avx2
