// AVX2/FMA helpers with a fixed operation order (no reassociation), so every lane's result
// depends only on that lane's inputs. Compiled with -ffp-contract=off: FMAs are explicit.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace kvr {

// The first 64-byte boundary at or after p (the buffer needs 64 bytes of slack): tile and
// 64-byte vector rows that straddle two cache lines cost their loads twice, and malloc's
// large blocks start 16 bytes into a page.
template <typename T>
inline T* line_aligned(T* p) {
  const uintptr_t u = reinterpret_cast<uintptr_t>(p);
  return reinterpret_cast<T*>((u + 63) & ~static_cast<uintptr_t>(63));
}

// exp(x) for 8 lanes (Cephes polynomial, ~2 ulp). x <= -87.3 gives exactly 0 (no denormals,
// -inf included), so masked scores contribute exact zeros.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(88.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                                23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float exp1(float x) { return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x))); }

// Lane j of the result = sum of the 8 lanes of a[j], in a fixed tree.
inline __m256 reduce8(const __m256* a) {
  __m256 t0 = _mm256_hadd_ps(a[0], a[1]);
  __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
  __m256 t2 = _mm256_hadd_ps(a[4], a[5]);
  __m256 t3 = _mm256_hadd_ps(a[6], a[7]);
  __m256 u0 = _mm256_hadd_ps(t0, t1);
  __m256 u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#if defined(__AVX512F__)
// AVX-512 forms of the helpers above, for the avx512 build variant. Each lane takes exactly the
// operations of the 8-lane form (same constants, same order, same rounding), so a lane's
// result has the same bits whichever form computed it.

// exp(x) for 16 lanes: exp8's clamp, polynomial and rounding.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)),
                                23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// Lanes [0, count) set (count <= 16): masked loads/stores of a row's last columns.
inline __mmask16 mask16(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF)
                     : static_cast<__mmask16>((1u << count) - 1u);
}
#endif

}  // namespace kvr
