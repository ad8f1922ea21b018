// Linear layer with int8 weights and fp32 activations (weight-only quantization), one scale per
// 32 consecutive k of each output column (like llama.cpp's Q8_0 blocks):
// y[m, n] = sum_b scale[n, b] * (sum_{k in block b} x[m, k] * q[n, k]) (+ bias[n]).
//
// Batch 1 decode reads every weight once per step, so its speed is the weights' bytes over the
// memory bandwidth: int8 reads a quarter of fp32 and half of fp16. The int8 values are widened
// to fp32 in registers (exact); the arithmetic is fp32 FMA.
//
// Invariance: each output (m, n) has a block sum that starts at 0 and takes the FMAs of
// x[m, k] * q[n, k] for the block's k in order, and a total that takes one FMA of each block
// sum by its scale, blocks in order, then one add of the bias.
// That sequence does not depend on the other rows, on how rows and columns are tiled or on the
// thread count, so a row's result is bitwise the same in any batch. Outputs sit in vector
// lanes (16 columns per block), never reduced across lanes, so the avx512 build variant
// (16-column zmm registers, other tiles) gives the same bits as the AVX2 code.
//
// Packed weight layout: [ceil(N / 64) groups][K][64] int8 (N padded with zero rows): a group's
// 64 columns at one k are one cache line, so batch 1 streams each group front to back. A tile
// takes 1, 2 or 4 consecutive 16-column sub-blocks of a group. Scales: [groups][ceil(K / 32)][64]
// fp32, the same walk.
#include <algorithm>

#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace kvr {

namespace {

constexpr int kGroup = 64;
constexpr int kSub = 16;
constexpr int kScaleBlock = 32;  // consecutive k sharing one scale

inline __m256 widen8(const int8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

// The bias of 8 columns from n0; columns past n read as 0.
inline __m256 load8(const float* v, int64_t n0, int64_t n) {
  if (n0 + 8 <= n) return _mm256_loadu_ps(v + n0);
  alignas(32) float t[8];
  for (int i = 0; i < 8; ++i) t[i] = n0 + i < n ? v[n0 + i] : 0.0f;
  return _mm256_load_ps(t);
}

inline void store8(float* y, __m256 v, int64_t n0, int64_t n) {
  if (n0 + 8 <= n) {
    _mm256_storeu_ps(y + n0, v);
    return;
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  for (int i = 0; n0 + i < n; ++i) y[n0 + i] = t[i];
}

// R rows x NB sub-blocks: acc[r][j] holds 8 columns (j / 2 sub-block, j % 2 half) of the
// current 32-k block's sum; at the block's end it is folded into tot with one FMA by the
// block's scale (tot lives in L1: it is touched once per 32 k).
template <int R, int NB>
void tile(const WInt8Args& a, int64_t m0, int64_t group, int sub0) {
  constexpr int J = 2 * NB;
  alignas(32) float tot[R][J][8] = {};
  const int64_t K = a.k, xs = a.x_stride, blocks = (K + kScaleBlock - 1) / kScaleBlock;
  const int8_t* w = a.packed + group * K * kGroup + sub0 * kSub;
  const float* sc = a.scale + group * blocks * kGroup + sub0 * kSub;
  const float* x = a.x + m0 * xs;
  for (int64_t k0 = 0; k0 < K; k0 += kScaleBlock, sc += kGroup) {
    __m256 acc[R][J];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < J; ++j) acc[r][j] = _mm256_setzero_ps();
    const int64_t k1 = std::min<int64_t>(K, k0 + kScaleBlock);
    for (int64_t k = k0; k < k1; ++k, w += kGroup) {
      __m256 wv[J];
#pragma GCC unroll 8
      for (int j = 0; j < J; ++j) wv[j] = widen8(w + 8 * j);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * xs + k);
#pragma GCC unroll 8
        for (int j = 0; j < J; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) {
      const __m256 s = _mm256_loadu_ps(sc + 8 * j);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        _mm256_store_ps(tot[r][j], _mm256_fmadd_ps(acc[r][j], s, _mm256_load_ps(tot[r][j])));
    }
  }
  const int64_t n0 = group * kGroup + sub0 * kSub;
#pragma GCC unroll 8
  for (int j = 0; j < J; ++j) {
    const int64_t c = n0 + 8 * j;
    if (c >= a.n) break;
    const __m256 b = a.bias != nullptr ? load8(a.bias, c, a.n) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 t = _mm256_load_ps(tot[r][j]);
      store8(a.y + (m0 + r) * a.y_stride, a.bias != nullptr ? _mm256_add_ps(t, b) : t, c, a.n);
    }
  }
}

// `rows` (1-6) rows of one sub-block.
void rows_tile(const WInt8Args& a, int64_t m0, int rows, int64_t group, int sub0) {
  switch (rows) {
    case 1: tile<1, 1>(a, m0, group, sub0); break;
    case 2: tile<2, 1>(a, m0, group, sub0); break;
    case 3: tile<3, 1>(a, m0, group, sub0); break;
    case 4: tile<4, 1>(a, m0, group, sub0); break;
    case 5: tile<5, 1>(a, m0, group, sub0); break;
    default: tile<6, 1>(a, m0, group, sub0); break;
  }
}


#if defined(__AVX512F__)
// The avx512 variant: 16 columns per zmm register, the same per-lane operations as `tile` (a
// block sum from 0 over the block's k in order, one FMA by the scale per block, blocks in
// order, then the bias add), so every output has the same bits as in the AVX2 code. With 32
// registers a tile holds up to 24 accumulators: more rows share each widened weight load.

inline __m512 widen16(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

// R rows x J sub-blocks (J divides 4: one group) from sub-block `sub` on (global index: group
// sub / 4, part sub % 4).
template <int R, int J>
void tile16(const WInt8Args& a, int64_t m0, int64_t sub) {
  alignas(64) float tot[R][J][16] = {};
  const int64_t K = a.k, xs = a.x_stride, blocks = (K + kScaleBlock - 1) / kScaleBlock;
  const int64_t group = sub / 4, part = sub % 4;
  const int8_t* w = a.packed + group * K * kGroup + part * kSub;
  const float* sc = a.scale + group * blocks * kGroup + part * kSub;
  const float* x = a.x + m0 * xs;
  for (int64_t k0 = 0, b = 0; k0 < K; k0 += kScaleBlock, ++b) {
    __m512 acc[R][J];
#pragma GCC unroll 24
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
    const int64_t k1 = std::min<int64_t>(K, k0 + kScaleBlock);
    for (int64_t k = k0; k < k1; ++k) {
      __m512 wv[J];
#pragma GCC unroll 8
      for (int j = 0; j < J; ++j) wv[j] = widen16(w + k * kGroup + j * kSub);
#pragma GCC unroll 24
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * xs + k]);
#pragma GCC unroll 8
        for (int j = 0; j < J; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) {
      const __m512 s = _mm512_loadu_ps(sc + b * kGroup + j * kSub);
#pragma GCC unroll 24
      for (int r = 0; r < R; ++r)
        _mm512_store_ps(tot[r][j], _mm512_fmadd_ps(acc[r][j], s, _mm512_load_ps(tot[r][j])));
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < J; ++j) {
    const int64_t c = (sub + j) * kSub;
    if (c >= a.n) break;
    const __mmask16 mask = mask16(a.n - c);
    const __m512 bias = a.bias != nullptr ? _mm512_maskz_loadu_ps(mask, a.bias + c)
                                          : _mm512_setzero_ps();
#pragma GCC unroll 24
    for (int r = 0; r < R; ++r) {
      const __m512 t = _mm512_load_ps(tot[r][j]);
      _mm512_mask_storeu_ps(a.y + (m0 + r) * a.y_stride + c, mask,
                            a.bias != nullptr ? _mm512_add_ps(t, bias) : t);
    }
  }
}

// A tile of `rows` (1 to kMaxRows) rows and J sub-blocks.
template <int J, int R = 1>
void rows_tile16(const WInt8Args& a, int64_t m0, int rows, int64_t sub) {
  constexpr int kMaxRows = 24 / J;
  if constexpr (R < kMaxRows) {
    if (rows > R) {
      rows_tile16<J, R + 1>(a, m0, rows, sub);
      return;
    }
  }
  tile16<R, J>(a, m0, sub);
}

template <int J>
void linear16(const WInt8Args& a, int max_rows) {
  const int64_t subs = (a.n + kSub - 1) / kSub;  // sub-blocks holding real columns
  const int64_t units = (subs + J - 1) / J;
  const int64_t work = std::max<int64_t>(1, a.m * a.k * kSub * J);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / work);
  const int64_t tiles = (a.m + max_rows - 1) / max_rows;
  const int rows = static_cast<int>((a.m + tiles - 1) / tiles);  // balanced tiles
  parallel_for(units, grain, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      for (int64_t m0 = 0; m0 < a.m; m0 += rows) {
        const int r = static_cast<int>(std::min<int64_t>(rows, a.m - m0));
        rows_tile16<J>(a, m0, r, u * J);
      }
    }
  });
}
#endif

}  // namespace

int simd_width() {
#if defined(__AVX512F__)
  return 16;
#else
  return 8;
#endif
}

void wint8_linear(const WInt8Args& a) {
  if (a.m == 0 || a.n == 0) return;  // nothing to compute (and no tile size to derive)
#if defined(__AVX512F__)
  // Measured on Zen 4 (one thread, SmolLM2's shapes): batch 1 and 2 take a whole group per
  // tile (4 or 8 independent FMA chains); up to 95 rows one 16-column sub-block and tiles of
  // up to 24 rows (each widened weight feeds 24 FMAs); more rows a whole group and 6-row tiles
  // (each x load feeds 4 FMAs: x streams through the cache less often).
  if (a.m <= 2) {
    linear16<4>(a, 2);
  } else if (a.m <= 6 && a.n >= 8192) {
    // A few rows (a verified draft) of a wide layer (the LM head): whole-group tiles give
    // 4 x rows independent FMA chains where one sub-block gives only `rows`; narrower layers
    // keep one sub-block per unit, which spreads their few groups over the threads.
    linear16<4>(a, 6);
  } else if (a.m < 96) {
    linear16<1>(a, 24);
  } else {
    linear16<4>(a, 6);
  }
  return;
#endif
  const int64_t groups = (a.n + kGroup - 1) / kGroup;
  // One row: a whole group (8 accumulators) keeps enough independent FMA chains in flight.
  // Two rows: half a group. More: one sub-block and tiles of up to six rows (12
  // accumulators), balanced in size; the sub-block's weights stay in L1 across the tiles.
  const int nb = a.m == 1 ? 4 : (a.m == 2 ? 2 : 1);
  const int64_t tiles = (a.m + 5) / 6;
  const int max_rows = static_cast<int>((a.m + tiles - 1) / tiles);
  const int per_group = 4 / nb;
  const int64_t units = groups * per_group;
  const int64_t work = std::max<int64_t>(1, a.m * a.k * kSub * nb);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / work);
  parallel_for(units, grain, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t group = u / per_group;
      const int sub0 = static_cast<int>(u % per_group) * nb;
      if (group * kGroup + sub0 * kSub >= a.n) continue;  // padding only
      if (nb == 4) {
        tile<1, 4>(a, 0, group, sub0);
      } else if (nb == 2) {
        tile<2, 2>(a, 0, group, sub0);
      } else {
        for (int64_t m0 = 0; m0 < a.m; m0 += max_rows) {
          const int rows = static_cast<int>(std::min<int64_t>(max_rows, a.m - m0));
          rows_tile(a, m0, rows, group, sub0);
        }
      }
    }
  });
}

}  // namespace kvr
