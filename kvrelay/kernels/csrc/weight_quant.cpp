// Symmetric int8 quantization of fp32 weights, the same bits as the torch code of
// `ops.quantize_int8_weight` (one scale per 32 inputs of each output row) and
// `ops.quantize_channel_weight` (one scale per row):
//   scale = max(amax, 1e-12f) / qmax          (an fp32 division, as torch's `/ qmax`)
//   q     = clamp(round(w / scale), -qmax, qmax)   (an fp32 division, not w * (1 / scale);
//                                                  round half to even, like torch.round)
// amax = max |w| over the block or row (a partial last block is zero-padded, which changes no
// maximum). Non-finite weights follow torch too: a block or row whose amax is inf gets the
// scale inf, one holding a NaN (any payload, signaling too) the default quiet NaN 0x7fc00000
// (torch's amax propagates NaN without its payload), and every q of such a block or row is 0
// (finite / inf = 0; inf / inf and NaN / x are NaN, and torch's cast of NaN to int8 gives 0).
// The maximum is an integer maximum of the |w| bit patterns: for non-negative floats it orders
// like the values, and every NaN pattern lies above inf. Rows are independent: any split across
// threads gives the same bits; the AVX2 code runs in every ISA variant (division bound, AVX-512
// divides no faster).
#include <immintrin.h>

#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "ops.h"
#include "parallel.h"

namespace kvr {

namespace {

constexpr int64_t kMinElementsPerThread = 65536;
constexpr int kBlock = 32;                  // inputs per scale of quantize_int8_blocks
constexpr uint32_t kInfBits = 0x7f800000u;  // |w| bits above: NaN; equal: inf
constexpr float kMinAmax = 1e-12f;          // torch's clamp_min(1e-12) on an fp32 tensor

inline __m256i abs_bits(__m256 v) {
  return _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff));
}

inline uint32_t hmax(__m256i m) {
  __m128i v = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  v = _mm_max_epu32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm_max_epu32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1)));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(v));
}

inline uint32_t abs_bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b & 0x7fffffffu;
}

// The bits of max |w| over n floats (0 for n == 0).
uint32_t amax_bits(const float* w, int64_t n) {
  __m256i m0 = _mm256_setzero_si256(), m1 = m0, m2 = m0, m3 = m0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    m0 = _mm256_max_epu32(m0, abs_bits(_mm256_loadu_ps(w + i)));
    m1 = _mm256_max_epu32(m1, abs_bits(_mm256_loadu_ps(w + i + 8)));
    m2 = _mm256_max_epu32(m2, abs_bits(_mm256_loadu_ps(w + i + 16)));
    m3 = _mm256_max_epu32(m3, abs_bits(_mm256_loadu_ps(w + i + 24)));
  }
  for (; i + 8 <= n; i += 8) m0 = _mm256_max_epu32(m0, abs_bits(_mm256_loadu_ps(w + i)));
  uint32_t m = hmax(_mm256_max_epu32(_mm256_max_epu32(m0, m1), _mm256_max_epu32(m2, m3)));
  for (; i < n; ++i) {
    const uint32_t b = abs_bits_of(w[i]);
    m = b > m ? b : m;
  }
  return m;
}

// torch's amax.clamp_min(1e-12) / qmax for an amax of these bits; any NaN gives torch's
// NaN scale, the default quiet NaN (its amax keeps no payload).
inline float scale_of(uint32_t bits, float qmax) {
  if (bits > kInfBits) return std::numeric_limits<float>::quiet_NaN();
  float amax;
  std::memcpy(&amax, &bits, 4);
  return (amax < kMinAmax ? kMinAmax : amax) / qmax;
}

// 8 lanes of clamp(round_half_even(w / scale), -qmax, qmax) as int32.
inline __m256i quant8(__m256 w, __m256 scale, __m256 qmax) {
  __m256 x = _mm256_round_ps(_mm256_div_ps(w, scale),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_sub_ps(_mm256_setzero_ps(), qmax)), qmax);
  return _mm256_cvtps_epi32(x);
}

// 4 x 8 int32 lanes (each within int8) -> 32 int8 in order.
inline __m256i pack32(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = _mm256_packs_epi32(a, b);    // per 128-bit lane: a0-3 b0-3 | a4-7 b4-7
  const __m256i cd = _mm256_packs_epi32(c, d);
  const __m256i v = _mm256_packs_epi16(ab, cd);  // dwords: a0-3 b0-3 c0-3 d0-3 a4-7 ...
  return _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// q[0..32) of w[0..32) with a finite scale.
inline void quant32(const float* w, __m256 scale, __m256 qmax, int8_t* q) {
  const __m256i v = pack32(quant8(_mm256_loadu_ps(w), scale, qmax),
                           quant8(_mm256_loadu_ps(w + 8), scale, qmax),
                           quant8(_mm256_loadu_ps(w + 16), scale, qmax),
                           quant8(_mm256_loadu_ps(w + 24), scale, qmax));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), v);
}

// q[0..n) of w[0..n), n < 32, through zero-padded copies.
inline void quant_tail(const float* w, int64_t n, __m256 scale, __m256 qmax, int8_t* q) {
  alignas(32) float buf[kBlock] = {};
  alignas(32) int8_t out[kBlock];
  std::memcpy(buf, w, n * sizeof(float));
  quant32(buf, scale, qmax, out);
  std::memcpy(q, out, n);
}

// q[0..n) of w[0..n) with the scale of amax bits `bits`; returns the scale.
float quant_span(const float* w, int64_t n, uint32_t bits, float qmax, int8_t* q) {
  const float scale = scale_of(bits, qmax);
  if (bits >= kInfBits) {  // inf or NaN scale: torch's q are all 0
    std::memset(q, 0, n);
    return scale;
  }
  const __m256 s = _mm256_set1_ps(scale), qm = _mm256_set1_ps(qmax);
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) quant32(w + i, s, qm, q + i);
  if (i < n) quant_tail(w + i, n - i, s, qm, q + i);
  return scale;
}

// One row of quantize_int8_blocks: each full block's 32 values stay in registers between its
// maximum and its division (the blocks' scalar chains overlap out of order: as fast as
// gathering 8 blocks' maxima into one vector division).
void block_row(const float* __restrict w, int64_t k, int8_t* __restrict q,
               float* __restrict scales) {
  const __m256 qm = _mm256_set1_ps(127.0f);
  const int64_t full = k / kBlock;
  for (int64_t b = 0; b < full; ++b) {
    const float* p = w + b * kBlock;
    const __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8);
    const __m256 v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
    const uint32_t bits = hmax(_mm256_max_epu32(_mm256_max_epu32(abs_bits(v0), abs_bits(v1)),
                                                _mm256_max_epu32(abs_bits(v2), abs_bits(v3))));
    const float scale = scale_of(bits, 127.0f);
    scales[b] = scale;
    int8_t* o = q + b * kBlock;
    if (bits >= kInfBits) {  // inf or NaN scale: torch's q are all 0
      std::memset(o, 0, kBlock);
      continue;
    }
    const __m256 s = _mm256_set1_ps(scale);
    const __m256i v = pack32(quant8(v0, s, qm), quant8(v1, s, qm), quant8(v2, s, qm),
                             quant8(v3, s, qm));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), v);
  }
  const int64_t rest = k - full * kBlock;
  if (rest > 0) {
    const float* p = w + full * kBlock;
    scales[full] = quant_span(p, rest, amax_bits(p, rest), 127.0f, q + full * kBlock);
  }
}

int64_t grain_of(int64_t cols) {
  return cols >= kMinElementsPerThread ? 1 : kMinElementsPerThread / cols;
}

void check(int64_t rows, int64_t cols) {
  if (rows < 0 || cols < 0)
    throw std::invalid_argument("negative weight shape " + std::to_string(rows) + " x " +
                                std::to_string(cols));
}

}  // namespace

void quantize_int8_blocks(const float* w, int64_t rows, int64_t cols, int8_t* q,
                          float* scales) {
  check(rows, cols);
  if (rows == 0 || cols == 0) return;
  const int64_t blocks = (cols + kBlock - 1) / kBlock;
  parallel_for(rows, grain_of(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      block_row(w + r * cols, cols, q + r * cols, scales + r * blocks);
  });
}

void quantize_int8_channels(const float* w, int64_t rows, int64_t cols, int qmax, int8_t* q,
                            float* scales) {
  check(rows, cols);
  if (qmax < 1 || qmax > 127)
    throw std::invalid_argument("qmax must lie in [1, 127], got " + std::to_string(qmax));
  if (rows == 0 || cols == 0) return;
  const float qm = static_cast<float>(qmax);
  parallel_for(rows, grain_of(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = w + r * cols;
      scales[r] = quant_span(row, cols, amax_bits(row, cols), qm, q + r * cols);
    }
  });
}

}  // namespace kvr
