// GGUF (ggml) block dequantization to fp32, the same bits as gguf-py's numpy code
// (gguf/quants.py, `dequantize_blocks` of each type): every element is computed with the
// float32 operations numpy applies, in its order (a scale times a 16- or 32-element group
// scale first where numpy forms one, then times q, then minus or plus the offset); no FMA
// (-ffp-contract=off), no reassociation. The fp16 scales widen exactly (numpy's conversion,
// NaN payloads kept). Rows are independent: any split across threads gives the same bits.
#include <immintrin.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "ops.h"
#include "parallel.h"

namespace kvr {

namespace {

constexpr int64_t kMinElementsPerThread = 65536;
constexpr int kQK = 256;  // elements per K-quant super-block

// numpy's npy_halfbits_to_floatbits: exact, signaling NaNs stay signaling.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = h & 0x7c00u;
  uint32_t sig = h & 0x03ffu, bits;
  if (exp == 0x7c00u) {
    bits = sign | 0x7f800000u | (sig << 13);
  } else if (exp != 0) {
    bits = sign | ((static_cast<uint32_t>(h & 0x7fffu) + 0x1c000u) << 13);
  } else if (sig == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = 0;
    sig <<= 1;
    while ((sig & 0x400u) == 0) {
      sig <<= 1;
      ++e;
    }
    bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((sig & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

// Q4_0: d (fp16), 16 bytes of nibbles (low nibbles: elements 0..15, high: 16..31); d * (q - 8).
void q4_0(const uint8_t* __restrict b, float* __restrict o) {
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  // q - 8 in int or float: the same exact small integer
  for (int j = 0; j < 16; ++j) o[j] = d * (static_cast<float>(qs[j] & 0x0f) - 8.0f);
  for (int j = 0; j < 16; ++j) o[j + 16] = d * (static_cast<float>(qs[j] >> 4) - 8.0f);
}

// Q4_1: d, m (fp16), 16 bytes of nibbles; d * q + m.
void q4_1(const uint8_t* __restrict b, float* __restrict o) {
  const float d = half_at(b), m = half_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) o[j] = d * static_cast<float>(qs[j] & 0x0f) + m;
  for (int j = 0; j < 16; ++j) o[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
}

// Q5_0: d, 32 high bits (u32), 16 bytes of nibbles; d * ((low | high << 4) - 16).
void q5_0(const uint8_t* __restrict b, float* __restrict o) {
  const float d = half_at(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 0x0f) | static_cast<int>(((qh >> j) & 1u) << 4);
    const int hi = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
    o[j] = d * static_cast<float>(lo - 16);
    o[j + 16] = d * static_cast<float>(hi - 16);
  }
}

// Q5_1: d, m, 32 high bits, 16 bytes of nibbles; d * (low | high << 4) + m.
void q5_1(const uint8_t* __restrict b, float* __restrict o) {
  const float d = half_at(b), m = half_at(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 0x0f) | static_cast<int>(((qh >> j) & 1u) << 4);
    const int hi = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
    o[j] = d * static_cast<float>(lo) + m;
    o[j + 16] = d * static_cast<float>(hi) + m;
  }
}

// Q8_0: d, 32 int8; q * d.
void q8_0(const uint8_t* __restrict b, float* __restrict o) {
  const float d = half_at(b);
  const int8_t* x = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) o[j] = static_cast<float>(x[j]) * d;
}

// Q2_K: 16 scale bytes (low nibble: scale, high: min), 64 bytes of 2-bit q, d, dmin;
// (d * sc) * q - (dmin * mn), per 16 elements. Element j*128 + s*32 + l holds bits 2s of
// byte j*32 + l.
void q2_k(const uint8_t* __restrict b, float* __restrict o) {
  const uint8_t* sc = b;
  const uint8_t* qs = b + 16;
  const float d = half_at(b + 80), dmin = half_at(b + 82);
  for (int j = 0; j < 2; ++j) {
    for (int s = 0; s < 4; ++s) {
      for (int h = 0; h < 2; ++h) {
        const int k = j * 8 + s * 2 + h;
        const float dl = d * static_cast<float>(sc[k] & 0x0f);
        const float ml = dmin * static_cast<float>(sc[k] >> 4);
        const uint8_t* q = qs + j * 32 + h * 16;
        float* out = o + k * 16;
        for (int l = 0; l < 16; ++l) out[l] = dl * static_cast<float>((q[l] >> (2 * s)) & 3) - ml;
      }
    }
  }
}

// Q3_K: 32 bytes of high-bit masks, 64 bytes of 2-bit q, 12 bytes of 6-bit scales, d;
// (d * (scale - 32)) * (low - (high ? 0 : 4)), per 16 elements.
void q3_k(const uint8_t* __restrict b, float* __restrict o) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* sc = b + 96;
  const float d = half_at(b + 108);
  float dl[16];
  for (int k = 0; k < 16; ++k) {
    const int lo = k < 8 ? (sc[k] & 0x0f) : (sc[k - 8] >> 4);
    const int hi = (sc[8 + (k & 3)] >> (2 * (k >> 2))) & 3;
    dl[k] = d * static_cast<float>(static_cast<int8_t>(lo | (hi << 4)) - 32);
  }
  for (int j = 0; j < 2; ++j) {
    for (int s = 0; s < 4; ++s) {
      const int bit = j * 4 + s;
      for (int h = 0; h < 2; ++h) {
        const int k = j * 8 + s * 2 + h;
        const float scale = dl[k];
        const uint8_t* q = qs + j * 32 + h * 16;
        const uint8_t* m = hmask + h * 16;
        float* out = o + k * 16;
        for (int l = 0; l < 16; ++l) {
          const int v = ((q[l] >> (2 * s)) & 3) - ((((m[l] >> bit) & 1) ^ 1) << 2);
          out[l] = scale * static_cast<float>(v);
        }
      }
    }
  }
}

// Q4_K/Q5_K's 12 bytes of 6-bit scales and mins, 8 of each.
void scale_min_k4(const uint8_t* s, int* sc, int* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 0x3f;
    mn[j] = s[j + 4] & 0x3f;
    sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
  }
}

// Q4_K: d, dmin, 12 scale bytes, 128 bytes of nibbles; (d * sc) * q - (dmin * m), per 32
// elements. Sub-block 2j holds the low nibbles of bytes j*32.., 2j + 1 the high ones.
void q4_k(const uint8_t* __restrict b, float* __restrict o) {
  const float d = half_at(b), dmin = half_at(b + 2);
  int sc[8], mn[8];
  scale_min_k4(b + 4, sc, mn);
  const uint8_t* qs = b + 16;
  for (int g = 0; g < 8; ++g) {
    const float dl = d * static_cast<float>(sc[g]);
    const float ml = dmin * static_cast<float>(mn[g]);
    const uint8_t* q = qs + (g >> 1) * 32;
    const int shift = 4 * (g & 1);
    float* out = o + g * 32;
    for (int l = 0; l < 32; ++l) out[l] = dl * static_cast<float>((q[l] >> shift) & 0x0f) - ml;
  }
}

// Q5_K: Q4_K plus 32 bytes of fifth bits (sub-block g: bit g of byte l).
void q5_k(const uint8_t* __restrict b, float* __restrict o) {
  const float d = half_at(b), dmin = half_at(b + 2);
  int sc[8], mn[8];
  scale_min_k4(b + 4, sc, mn);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int g = 0; g < 8; ++g) {
    const float dl = d * static_cast<float>(sc[g]);
    const float ml = dmin * static_cast<float>(mn[g]);
    const uint8_t* q = qs + (g >> 1) * 32;
    const int shift = 4 * (g & 1);
    float* out = o + g * 32;
    for (int l = 0; l < 32; ++l) {
      const int v = ((q[l] >> shift) & 0x0f) | (((qh[l] >> g) & 1) << 4);
      out[l] = dl * static_cast<float>(v) - ml;
    }
  }
}

// Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d;
// (d * scale) * ((low | high << 4) - 32), per 16 elements. Element j*128 + r*32 + l: low
// nibble of byte j*64 + (r & 1)*32 + l (high nibble when r >= 2), bits 2r of byte j*32 + l.
void q6_k(const uint8_t* __restrict b, float* __restrict o) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int j = 0; j < 2; ++j) {
    for (int r = 0; r < 4; ++r) {
      const uint8_t* lo = ql + j * 64 + (r & 1) * 32;
      const int lshift = 4 * (r >> 1);
      const uint8_t* hi = qh + j * 32;
      for (int h = 0; h < 2; ++h) {
        const int k = j * 8 + r * 2 + h;
        const float scale = d * static_cast<float>(sc[k]);
        float* out = o + k * 16;
        const uint8_t* low = lo + h * 16;
        const uint8_t* high = hi + h * 16;
        for (int l = 0; l < 16; ++l) {
          const int v = ((low[l] >> lshift) & 0x0f) | (((high[l] >> (2 * r)) & 3) << 4);
          out[l] = scale * static_cast<float>(static_cast<int8_t>(v) - 32);
        }
      }
    }
  }
}

// F16 and BF16: plain widening (raw may sit at any byte address). F16 with F16C (exact; NaNs
// are redone to numpy's bits).
void f16_row(const uint8_t* __restrict raw, float* __restrict o, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(raw + 2 * i));
    _mm256_storeu_ps(o + i, _mm256_cvtph_ps(v));
    // a NaN of any kind: redo the 8 in software (vcvtph2ps quiets signaling NaNs)
    const __m128i nan = _mm_cmpgt_epi16(_mm_and_si128(v, _mm_set1_epi16(0x7fff)),
                                        _mm_set1_epi16(0x7c00));
    if (!_mm_testz_si128(nan, nan))
      for (int64_t k = i; k < i + 8; ++k) o[k] = half_at(raw + 2 * k);
  }
  for (; i < n; ++i) o[i] = half_at(raw + 2 * i);
}

void bf16_row(const uint8_t* __restrict raw, float* __restrict o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, raw + 2 * i, 2);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    std::memcpy(o + i, &bits, 4);
  }
}

// One row of `blocks` blocks of a block type: the block function inlined into the loop.
template <void (*Block)(const uint8_t*, float*), int BS, int TS>
void block_row(const uint8_t* __restrict raw, float* __restrict o, int64_t n) {
  const int64_t blocks = n / BS;
  for (int64_t k = 0; k < blocks; ++k) Block(raw + k * TS, o + k * BS);
}

using RowFn = void (*)(const uint8_t*, float*, int64_t);

struct BlockType {
  int type;
  int block_size, type_size;
  RowFn row;
};

constexpr BlockType kTypes[] = {
    {1, 1, 2, f16_row},                              // F16
    {30, 1, 2, bf16_row},                            // BF16
    {2, 32, 18, block_row<q4_0, 32, 18>},            // Q4_0
    {3, 32, 20, block_row<q4_1, 32, 20>},            // Q4_1
    {6, 32, 22, block_row<q5_0, 32, 22>},            // Q5_0
    {7, 32, 24, block_row<q5_1, 32, 24>},            // Q5_1
    {8, 32, 34, block_row<q8_0, 32, 34>},            // Q8_0
    {10, kQK, 84, block_row<q2_k, kQK, 84>},         // Q2_K
    {11, kQK, 110, block_row<q3_k, kQK, 110>},       // Q3_K
    {12, kQK, 144, block_row<q4_k, kQK, 144>},       // Q4_K
    {13, kQK, 176, block_row<q5_k, kQK, 176>},       // Q5_K
    {14, kQK, 210, block_row<q6_k, kQK, 210>},       // Q6_K
};

const BlockType* find_type(int ggml_type) {
  for (const BlockType& t : kTypes)
    if (t.type == ggml_type) return &t;
  return nullptr;
}

}  // namespace

void dequantize_gguf(const uint8_t* raw, int64_t raw_stride, int ggml_type, float* out,
                     int64_t out_stride, int64_t rows, int64_t cols) {
  const BlockType* t = find_type(ggml_type);
  if (t == nullptr)
    throw std::invalid_argument("no C++ dequantization for ggml type " + std::to_string(ggml_type));
  if (cols % t->block_size != 0)
    throw std::invalid_argument(std::to_string(cols) + " columns are not whole blocks of " +
                                std::to_string(t->block_size));
  const int64_t blocks = cols / t->block_size;
  if (raw_stride < blocks * t->type_size)
    throw std::invalid_argument("raw rows are shorter than their blocks");
  if (rows <= 0 || cols <= 0) return;
  const int64_t grain = cols >= kMinElementsPerThread ? 1 : kMinElementsPerThread / cols;
  parallel_for(rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) t->row(raw + r * raw_stride, out + r * out_stride, cols);
  });
}

}  // namespace kvr
