// KV pool element types: fp32, bf16 and fp16 pages under fp32 compute.
//
// Loads widen to fp32 exactly (bf16: the 16 bits become the high half of an fp32; fp16: F16C's
// vcvtph2ps), so a kernel run on a 16-bit pool computes bitwise what it computes on an fp32
// pool holding the widened values. Stores narrow with round-to-nearest-even, bitwise what
// torch's `.to(torch.bfloat16 / torch.float16)` writes (NaN included: it stays a NaN).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace kvr {

enum class KVType : int { f32 = 0, bf16 = 1, f16 = 2 };

struct bf16 {
  uint16_t bits;
};
struct fp16 {
  uint16_t bits;
};

// 8 consecutive elements as fp32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128((const __m128i*)p);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 load8(const fp16* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// One fp32 to the element type, round-to-nearest-even (c10::BFloat16's rounding for bf16).
inline void narrow1(float x, float* dst) { *dst = x; }

inline void narrow1(float x, bf16* dst) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u)  // NaN: 0xffff, as torch's vectorized conversion writes
    dst->bits = 0xffffu;
  else
    dst->bits = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline void narrow1(float x, fp16* dst) {
  dst->bits = (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
}

// n fp32 values to dst.
inline void narrow_row(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void narrow_row(const float* src, fp16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i*)(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) narrow1(src[i], dst + i);
}

inline void narrow_row(const float* src, bf16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) narrow1(src[i], dst + i);
}

}  // namespace kvr
