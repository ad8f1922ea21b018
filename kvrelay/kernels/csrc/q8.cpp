// Linear layer in llama.cpp's Q8_0 x Q8_0 arithmetic (`--quantization q8_0`): int8 weights with
// one fp32 scale per 32 consecutive k of each output column, activations quantized per row to
// int8 with one fp32 scale per 32 k, integer block dot products:
//   xd[m, b] = max_{k in b} |x[m, k]| / 127,  xq[m, k] = round_half_even(x[m, k] / xd[m, b])
//   (0 where xd is 0; a division, not a product by 1 / xd, which overflows for tiny blocks)
//   isum[m, n, b] = sum_{k in b} xq[m, k] * q[n, k]                     (int32, exact)
//   y[m, n] = fma(float(isum[m, n, b]), wd[n, b] * xd[m, b], y) for b in order, from 0 (+ bias)
//
// Every integer sum is exact, whichever instructions form it and in whatever order, so all code
// paths give the same bits: AMX tiles (TDPBSSD) for 16-row tiles on AMX hosts, AVX512-VNNI
// (VPDPBUSD with x offset to unsigned and the weights' sums subtracted), AVX-512BW and AVX2
// (VPMADDUBSW of |x| with the weights signed by x, then VPMADDWD: |x|, |q| <= 127 keep the pair
// sums below int16's limit). The fp32 part is the same operations on each output in its own
// vector lane. So a row's result is bitwise the same in any batch, tiling, thread count and ISA
// variant, and the same as this kernel computes on a machine without AMX.
//
// Packed weight layout: [ceil(N / 64) groups][Kp / 4][64 columns][4 k] int8 (Kp = K rounded up
// to 32, zero padded; N padded with zero columns): one AMX B tile row, one VNNI lane. Scales and
// the VNNI correction (128 * the block's weight sum) are [groups][Kp / 32][64], fp32 and int32.
#include <algorithm>
#include <cmath>
#include <cstring>  // memcpy
#include <vector>

#include "amx.h"
#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace kvr {

namespace {

constexpr int kGroup = 64;
constexpr int kBlock = 32;
constexpr int64_t kGroupBlockBytes = kBlock * kGroup;  // one block of one group: 2 KiB
constexpr int kTileRows = 16;  // rows of an AMX tile

// ---- activations ------------------------------------------------------------------------

// Quantize rows of x [m, k] into xq [m, ld] (zero padded to ld = blocks * 32) and xd [m, blocks].
// Element-wise arithmetic only (a max, divisions and round to nearest even), so
// the result does not depend on how it is vectorized. With `offset` xq holds xq + 128 as u8.
void quantize_x(const Q8Args& a, int8_t* xq, float* xd, int64_t ld, bool offset) {
  const int64_t blocks = ld / kBlock;
  parallel_for(a.m, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, a.k)),
               [&](int64_t begin, int64_t end) {
    alignas(32) float buf[kBlock];
    for (int64_t r = begin; r < end; ++r) {
      const float* x = a.x + r * a.x_stride;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t k0 = b * kBlock, n = std::min<int64_t>(kBlock, a.k - k0);
        for (int i = 0; i < kBlock; ++i) buf[i] = i < n ? x[k0 + i] : 0.0f;
        __m256 mx = _mm256_setzero_ps();
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        for (int i = 0; i < kBlock; i += 8)
          mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_load_ps(buf + i), abs_mask));
        alignas(32) float m8[8];
        _mm256_store_ps(m8, mx);
        float amax = 0.0f;
        for (float v : m8) amax = std::max(amax, v);
        const float d = amax / 127.0f;
        xd[r * blocks + b] = d;
        const __m256 dv = _mm256_set1_ps(d != 0.0f ? d : 1.0f);  // all-zero block: q = 0
        const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
        int8_t* q = xq + r * ld + k0;
        for (int i = 0; i < kBlock; i += 8) {
          const __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_load_ps(buf + i), dv),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          const __m256i iv = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(v), lo), hi);
          alignas(32) int32_t t[8];
          _mm256_store_si256(reinterpret_cast<__m256i*>(t), iv);
          for (int j = 0; j < 8; ++j)
            q[i + j] = static_cast<int8_t>(offset ? t[j] ^ 0x80 : t[j]);  // ^ 0x80: + 128 as u8
        }
      }
    }
  });
}

// ---- integer block dots in vector lanes (AVX2, AVX-512BW, AVX512-VNNI) ------------------

// One vector ISA: V int32 lanes = V columns; dot4 adds, per lane, the 4 products of one k-quad
// of x (broadcast) with that column's 4 weights.
struct Avx2 {
  using I = __m256i;
  using F = __m256;
  static constexpr int kLanes = 8;
  static constexpr bool kOffset = false;  // x as signed int8 (sign trick)
  static I zero() { return _mm256_setzero_si256(); }
  static I load(const void* p) { return _mm256_loadu_si256(static_cast<const I*>(p)); }
  static I dot4(I acc, int32_t quad, I w) {
    const I xb = _mm256_set1_epi32(quad);
    const I p = _mm256_maddubs_epi16(_mm256_abs_epi8(xb), _mm256_sign_epi8(w, xb));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
  }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
};

#if defined(__AVX512BW__)
struct Avx512 {
  using I = __m512i;
  using F = __m512;
  static constexpr int kLanes = 16;
  static constexpr bool kOffset = false;
  static I zero() { return _mm512_setzero_si512(); }
  static I load(const void* p) { return _mm512_loadu_si512(p); }
  static I dot4(I acc, int32_t quad, I w) {
    const I xb = _mm512_set1_epi32(quad);
    const __mmask64 neg = _mm512_movepi8_mask(xb);
    const I ws = _mm512_mask_sub_epi8(w, neg, _mm512_setzero_si512(), w);
    const I p = _mm512_maddubs_epi16(_mm512_abs_epi8(xb), ws);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
  }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#endif

#if defined(__AVX512VNNI__)
struct Vnni : Avx512 {
  static constexpr bool kOffset = true;  // x + 128 as u8; the block's 128 * sum(q) subtracted
  static I dot4(I acc, int32_t quad, I w) { return _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(quad), w); }
};
#endif

struct Q8Data {
  const Q8Args* a;
  const int8_t* xq;  // [m (padded), ld]
  const float* xd;   // [m (padded), blocks]
  int64_t ld, blocks;
};

// Writes tot + bias of columns [c, c + L) of one row; columns past n are not written.
template <class O>
inline void store_cols(const Q8Args& a, float* y, const float* tot, int64_t c) {
  alignas(64) float t[O::kLanes];
  const int64_t left = a.n - c;
  if (left <= 0) return;
  typename O::F v = O::loadf(tot);
  if (a.bias != nullptr) {
    if (left >= O::kLanes) {
      v = O::add(v, O::loadf(a.bias + c));
    } else {
      alignas(64) float b[O::kLanes] = {};
      for (int64_t i = 0; i < left; ++i) b[i] = a.bias[c + i];
      v = O::add(v, O::loadf(b));
    }
  }
  if (left >= O::kLanes) {
    O::storef(y + c, v);
    return;
  }
  O::storef(t, v);
  for (int64_t i = 0; i < left; ++i) y[c + i] = t[i];
}

// R rows x J vectors of columns, from column `col` (inside one group).
template <class O, int R, int J>
void vec_tile(const Q8Data& d, int64_t m0, int64_t group, int64_t col) {
  using I = typename O::I;
  using F = typename O::F;
  constexpr int L = O::kLanes;
  const Q8Args& a = *d.a;
  alignas(64) float tot[R][J][L] = {};
  const int8_t* w = a.packed + group * d.blocks * kGroupBlockBytes + col * 4;
  const float* sc = a.scale + group * d.blocks * kGroup + col;
  const int32_t* comp = a.comp + group * d.blocks * kGroup + col;
  for (int64_t b = 0; b < d.blocks; ++b, w += kGroupBlockBytes, sc += kGroup, comp += kGroup) {
    I acc[R][J];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < J; ++j) acc[r][j] = O::zero();
#pragma GCC unroll 8
    for (int i = 0; i < kBlock / 4; ++i) {
      I wv[J];
#pragma GCC unroll 8
      for (int j = 0; j < J; ++j) wv[j] = O::load(w + i * kGroup * 4 + j * L * 4);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, d.xq + (m0 + r) * d.ld + b * kBlock + i * 4, 4);
#pragma GCC unroll 8
        for (int j = 0; j < J; ++j) acc[r][j] = O::dot4(acc[r][j], quad, wv[j]);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) {
      const F sw = O::loadf(sc + j * L);
      I cv = O::zero();
      if constexpr (O::kOffset) cv = O::load(comp + j * L);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        I isum = acc[r][j];
        if constexpr (O::kOffset) isum = O::sub(isum, cv);
        const F s = O::mul(sw, O::set1(d.xd[(m0 + r) * d.blocks + b]));
        O::storef(tot[r][j], O::fma(O::cvt(isum), s, O::loadf(tot[r][j])));
      }
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < J; ++j)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
      store_cols<O>(a, a.y + (m0 + r) * a.y_stride, tot[r][j], group * kGroup + col + j * L);
}

template <class O, int J, int R = 1>
void rows_vec_tile(const Q8Data& d, int64_t m0, int rows, int64_t group, int64_t col) {
  constexpr int kMaxRows = 16 / J;
  if constexpr (R < kMaxRows) {
    if (rows > R) {
      rows_vec_tile<O, J, R + 1>(d, m0, rows, group, col);
      return;
    }
  }
  vec_tile<O, R, J>(d, m0, group, col);
}

// Units of J vectors of columns (whole groups split in 64 / (J * lanes) parts), rows in tiles
// of up to 16 / J rows (16 accumulators), balanced.
template <class O, int J>
void vec_linear(const Q8Data& d) {
  const Q8Args& a = *d.a;
  constexpr int kCols = J * O::kLanes;
  constexpr int kParts = kGroup / kCols;
  const int64_t groups = (a.n + kGroup - 1) / kGroup;
  const int64_t units = groups * kParts;
  const int max_rows = 16 / J;
  const int64_t tiles = (a.m + max_rows - 1) / max_rows;
  const int rows = static_cast<int>((a.m + tiles - 1) / tiles);
  const int64_t work = std::max<int64_t>(1, a.m * a.k * kCols);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / work);
  parallel_for(units, grain, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t group = u / kParts, col = (u % kParts) * kCols;
      if (group * kGroup + col >= a.n) continue;  // padding only
      for (int64_t m0 = 0; m0 < a.m; m0 += rows) {
        const int r = static_cast<int>(std::min<int64_t>(rows, a.m - m0));
        rows_vec_tile<O, J>(d, m0, r, group, col);
      }
    }
  });
}

// ---- AMX tiles --------------------------------------------------------------------------

#if defined(__AMX_INT8__)

// Tiles 0-3: C, 16 rows x 16 int32 columns each (64 columns); 4: A, 16 rows x 32 k;
// 5, 6: B, 8 k-quads x 16 columns x 4.
void tile_config() {
  TileConfig c;
  for (int t = 0; t < 4; ++t) {
    c.rows[t] = kTileRows;
    c.colsb[t] = 64;
  }
  c.rows[4] = kTileRows;
  c.colsb[4] = kBlock;
  c.rows[5] = c.rows[6] = kBlock / 4;
  c.colsb[5] = c.colsb[6] = 64;
  _tile_loadconfig(&c);
}

// One group (64 columns) x 16 rows from m0 (rows past `rows` are computed on zero padding and
// not written).
void amx_tile(const Q8Data& d, int64_t m0, int rows, int64_t group, int32_t* isum, float* tot) {
  const Q8Args& a = *d.a;
  const int8_t* w = a.packed + group * d.blocks * kGroupBlockBytes;
  const float* sc = a.scale + group * d.blocks * kGroup;
  std::fill(tot, tot + kTileRows * kGroup, 0.0f);
  for (int64_t b = 0; b < d.blocks; ++b, w += kGroupBlockBytes, sc += kGroup) {
    _tile_loadd(4, d.xq + m0 * d.ld + b * kBlock, d.ld);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(5, w, kGroup * 4);
    _tile_loadd(6, w + 64, kGroup * 4);
    _tile_dpbssd(0, 4, 5);
    _tile_dpbssd(1, 4, 6);
    _tile_loadd(5, w + 128, kGroup * 4);
    _tile_loadd(6, w + 192, kGroup * 4);
    _tile_dpbssd(2, 4, 5);
    _tile_dpbssd(3, 4, 6);
    _tile_stored(0, isum, kGroup * 4);
    _tile_stored(1, isum + 16, kGroup * 4);
    _tile_stored(2, isum + 32, kGroup * 4);
    _tile_stored(3, isum + 48, kGroup * 4);
    __m512 sw[4];
    for (int j = 0; j < 4; ++j) sw[j] = _mm512_loadu_ps(sc + 16 * j);
    for (int r = 0; r < rows; ++r) {
      const __m512 xs = _mm512_set1_ps(d.xd[(m0 + r) * d.blocks + b]);
      for (int j = 0; j < 4; ++j) {
        float* t = tot + r * kGroup + 16 * j;
        const __m512 f = _mm512_cvtepi32_ps(_mm512_loadu_si512(isum + r * kGroup + 16 * j));
        _mm512_storeu_ps(t, _mm512_fmadd_ps(f, _mm512_mul_ps(sw[j], xs), _mm512_loadu_ps(t)));
      }
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < 4; ++j)
      store_cols<Avx512>(a, a.y + (m0 + r) * a.y_stride, tot + r * kGroup + 16 * j,
                         group * kGroup + 16 * j);
}

void amx_linear(const Q8Data& d) {
  const Q8Args& a = *d.a;
  const int64_t groups = (a.n + kGroup - 1) / kGroup;
  const int64_t work = std::max<int64_t>(1, a.m * a.k * kGroup);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / work);
  parallel_for(groups, grain, [&](int64_t begin, int64_t end) {
    tile_config();
    alignas(64) int32_t isum[kTileRows * kGroup];
    alignas(64) float tot[kTileRows * kGroup];
    for (int64_t g = begin; g < end; ++g)
      for (int64_t m0 = 0; m0 < a.m; m0 += kTileRows)
        amx_tile(d, m0, static_cast<int>(std::min<int64_t>(kTileRows, a.m - m0)), g, isum, tot);
    _tile_release();
  });
}
#endif

enum class Path { kAmx, kVnni, kAvx512bw, kAvx2 };

// Rows from which the AMX variant uses tiles (below, VPDPBUSD; the bits are the same).
constexpr int64_t kAmxRows = 16;

Path path_for(int64_t m) {
#if defined(__AMX_INT8__)
  return m >= kAmxRows && amx_permitted() ? Path::kAmx : Path::kVnni;
#elif defined(__AVX512BW__)
  (void)m;
  return Path::kAvx512bw;
#else
  (void)m;
  return Path::kAvx2;
#endif
}

}  // namespace

const char* q8_path(int64_t m) {
  switch (path_for(m)) {
    case Path::kAmx: return "amx";
    case Path::kVnni: return "vnni";
    case Path::kAvx512bw: return "avx512bw";
    default: return "avx2";
  }
}

void q8_linear(const Q8Args& a) {
  if (a.m == 0 || a.n == 0) return;
  const int64_t blocks = (a.k + kBlock - 1) / kBlock, ld = blocks * kBlock;
  const Path path = path_for(a.m);
  const bool amx = path == Path::kAmx;
  // AMX loads whole 16-row tiles: the padding rows stay zero (xq 0, xd 0) and are not written.
  const int64_t rows = amx ? (a.m + kTileRows - 1) / kTileRows * kTileRows : a.m;
  std::vector<int8_t> xq_buffer(rows * ld + 64, 0);
  int8_t* xq = line_aligned(xq_buffer.data());  // AMX tile rows on whole cache lines
  std::vector<float> xd(rows * blocks, 0.0f);
  quantize_x(a, xq, xd.data(), ld, path == Path::kVnni);
  const Q8Data d{&a, xq, xd.data(), ld, blocks};
#if defined(__AMX_INT8__)
  if (amx) {
    amx_linear(d);
    return;
  }
  if (a.m <= 2) {
    vec_linear<Vnni, 4>(d);
  } else {
    vec_linear<Vnni, 2>(d);
  }
#elif defined(__AVX512BW__)
  if (a.m <= 2) {
    vec_linear<Avx512, 4>(d);
  } else {
    vec_linear<Avx512, 2>(d);
  }
#else
  if (a.m <= 2) {
    vec_linear<Avx2, 4>(d);
  } else {
    vec_linear<Avx2, 2>(d);
  }
#endif
}

}  // namespace kvr
