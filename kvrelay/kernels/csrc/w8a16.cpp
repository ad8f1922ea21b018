// Linear layer with int8 weights, one fp32 scale per output column, and bf16 activations on
// AMX bf16 tiles (`--quantization w8a16`, amx build variant only):
//   xb[m, k] = bf16(x[m, k])                               (round to nearest even)
//   acc[m, n] = TDPBF16PS over k in 32-k tiles, in order, from 0   (q[n, k] is exact in bf16)
//   y[m, n] = acc[m, n] * scale[n] (+ bias[n])
//
// Without per-block scales the tiles accumulate over all of K: no int32 block sums to widen and
// scale per 32 k (what bounds q8_linear on AMX), the same tile work per weight as vLLM's bf16
// GEMMs, with half their weight bytes. The weights are widened to bf16 as they are used (per k
// tile, or into a per-thread L1 panel of 8 k tiles); x's rows become bf16 A tiles stored one
// after another.
//
// Invariance: a C tile row takes only its own A row, k tiles in order, and the tile operation
// treats rows independently; the epilogue is per output. So a row's result is bitwise the same
// in any batch, row tiling and thread count.
//
// Packed weight layout: [ceil(N / 32) blocks][Kp / 32 k tiles][2 sub][16 k pairs][16 n][2 k]
// int8 (Kp = K rounded up to 32, zero padded; N padded with zero columns): one k tile of one
// block is two AMX B tiles (16 columns each) once widened to bf16.
//
// `w8a16_silu_linear` is a SwiGLU MLP's gate/up projection with its activation: the packed
// columns of block b are gate outputs [16b, 16b + 16) then up outputs [16b, 16b + 16)
// (`ops.pack_w8a16_gate_up`), so a block's two C tiles hold a gate and its up side by side and
// the epilogue writes SiLU(gate) * up with silu_mul's 16-lane operations (same bits as
// w8a16_linear then silu_mul) instead of both halves: half the output, no second pass.
#include <algorithm>
#include <stdexcept>
#include <vector>

#include "amx.h"
#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace kvr {

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)

namespace {

constexpr int kCols = 32;          // columns of a block: two B tiles
constexpr int kK = 32;             // k of a tile step (16 bf16 pairs)
constexpr int kTileRows = 16;      // rows of an A or C tile
constexpr int kChunkRows = 256;    // rows of x one unit covers (its bf16 rows stay in L2)
constexpr int kKBlock = 8;         // k tiles per widened panel: 16 KiB of bf16 B tiles, in L1
constexpr int kTileElems = 512;    // bf16 of one B tile: 16 pairs x 16 columns x 2
constexpr int kSmallRows = 16;     // up to here one A tile per step, two blocks at a time

// Per-thread scratch reused across calls (no allocation, no zeroing per call), 64-byte
// aligned (`line_aligned`).
template <typename T>
T* scratch(std::vector<T>& v, size_t n) {
  constexpr size_t kSlack = 64 / sizeof(T);
  if (v.size() < n + kSlack) v.resize(n + kSlack);
  return line_aligned(v.data());
}

// Tiles (load_full_tiles: every one 16 rows x 64 bytes). Large rows: 0-3 C (rows r0/r1 x
// columns c0/c1), 4-5 A, 6-7 B. Small rows: 0-3 C (four 16-column tiles of two blocks), 4 A,
// 6-7 B alternately.

// Rows of x to bf16 A tiles: [rows / 16][kp / 32][16 rows][32 k], so that the tiles a unit
// walks lie one after another in memory (the hardware prefetcher streams them); rows from a.m
// to `rows` and k from a.k to kp are zero.
void to_bf16_tiles(const WInt8Args& a, uint16_t* xb, int64_t rows, int64_t kp) {
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, a.k));
  parallel_for(rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* src = a.x + m * a.x_stride;
      uint16_t* dst = xb + (m / kTileRows) * kTileRows * kp + (m % kTileRows) * kK;
      for (int64_t k = 0; k < kp; k += 16) {
        const int64_t left = m < a.m ? a.k - k : 0;
        const __mmask16 mask = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (1u << left) - 1;
        const __m512 v = _mm512_maskz_loadu_ps(mask, src + k);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (k / kK) * kTileElems + k % kK),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
      }
    }
  });
}

// The A tile of rows [m0, m0 + 16) (m0 a multiple of 16) and k tile t; rows 64 bytes apart.
inline const uint16_t* a_tile(const uint16_t* xb, int64_t kp, int64_t m0, int64_t t) {
  return xb + m0 * kp + t * kTileElems;
}

// `tiles` B tiles of int8 weights widened to bf16 (exact: |q| <= 127), in order. The weights
// stream from memory: lines kAhead bytes further on are prefetched (tile instructions keep the
// out-of-order core from running far ahead on its own).
constexpr int64_t kAhead = 8192;
inline void widen(const int8_t* q, uint16_t* out, int64_t tiles) {
  for (int64_t r = 0; r < tiles * kTileRows; ++r) {
    if ((r & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(q + r * 32 + kAhead), _MM_HINT_T0);
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * 32));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    _mm512_storeu_si512(out + r * 32, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
}

// y rows [m0, m0 + rows) x 16 columns from c0 of the sums in `acc` (row stride `ld` floats).
void store_tile(const WInt8Args& a, const float* acc, int64_t ld, int64_t m0, int rows,
                int64_t c0) {
  if (c0 >= a.n) return;
  const int64_t left = a.n - c0;
  const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
  const __m512 s = _mm512_maskz_loadu_ps(mask, a.scale + c0);
  const __m512 b = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + c0) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(acc + r * ld), s);
    if (a.bias) v = _mm512_add_ps(v, b);
    _mm512_mask_storeu_ps(a.y + (m0 + r) * a.y_stride + c0, mask, v);
  }
}

// What a block's sums become: the linear's 32 outputs, or (kSilu) the 16 SiLU(gate) * up of
// a gate/up block (`w8a16_silu_linear`).
enum Epilogue { kLinear, kSilu };

// y rows [m0, m0 + rows) of block `block` from its two 16-column sum tiles `gate` and `up`
// (row stride `ld` floats): SiLU(gate) * up with each side scaled (and biased) as
// `store_tile` does, then silu_mul's 16-lane operations (rowwise.cpp): the same bits as the
// linear's output followed by silu_mul.
void store_silu(const WInt8Args& a, const float* gate, const float* up, int64_t ld, int64_t m0,
                int rows, int64_t block) {
  const int64_t c0 = block * kCols, o0 = block * 16;
  const __m512 sg = _mm512_loadu_ps(a.scale + c0), su = _mm512_loadu_ps(a.scale + c0 + 16);
  const __m512 bg = a.bias ? _mm512_loadu_ps(a.bias + c0) : _mm512_setzero_ps();
  const __m512 bu = a.bias ? _mm512_loadu_ps(a.bias + c0 + 16) : _mm512_setzero_ps();
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    __m512 g = _mm512_mul_ps(_mm512_loadu_ps(gate + r * ld), sg);
    __m512 u = _mm512_mul_ps(_mm512_loadu_ps(up + r * ld), su);
    if (a.bias) {
      g = _mm512_add_ps(g, bg);
      u = _mm512_add_ps(u, bu);
    }
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(zero, g))));
    _mm512_storeu_ps(a.y + (m0 + r) * a.y_stride + o0, _mm512_mul_ps(s, u));
  }
}

// Rows [m0, m0 + rows) of block `block` from its sums: columns 0-15 at `acc`, 16-31 at
// `acc + second` (row stride `ld`).
template <Epilogue E>
void store_block(const WInt8Args& a, const float* acc, int64_t second, int64_t ld, int64_t m0,
                 int rows, int64_t block) {
  if (E == kSilu) {
    store_silu(a, acc, acc + second, ld, m0, rows, block);
  } else {
    store_tile(a, acc, ld, m0, rows, block * kCols);
    store_tile(a, acc + second, ld, m0, rows, block * kCols + 16);
  }
}

// Accumulator tiles 0-3 from zero.
inline void zero_acc() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// Accumulator tiles 0-3 to acc [4][16 rows][16 columns].
inline void store_acc(float* acc) {
  _tile_stored(0, acc, 64);
  _tile_stored(1, acc + 256, 64);
  _tile_stored(2, acc + 512, 64);
  _tile_stored(3, acc + 768, 64);
}

// Up to 16 rows: per k tile one A tile against the four B tiles of blocks b and b + 1 (four
// independent accumulators), widened as they are used.
template <Epilogue E>
void small_rows(const WInt8Args& a, const uint16_t* xb, int64_t kp, int64_t block,
                int64_t blocks) {
  const int64_t ktiles = kp / kK, tiles = block + 1 < blocks ? 4 : 2;
  const int64_t block_bytes = ktiles * 2 * kTileElems;
  const int8_t* q0 = a.packed + block * block_bytes;
  alignas(64) uint16_t w[4 * kTileElems];
  alignas(64) float acc[4 * kTileRows * 16];
  zero_acc();
  for (int64_t t = 0; t < ktiles; ++t) {
    widen(q0 + t * 2 * kTileElems, w, 2);
    if (tiles == 4) widen(q0 + block_bytes + t * 2 * kTileElems, w + 2 * kTileElems, 2);
    _tile_loadd(4, a_tile(xb, kp, 0, t), 64);
    _tile_loadd(6, w, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, w + kTileElems, 64);
    _tile_dpbf16ps(1, 4, 7);
    if (tiles == 4) {
      _tile_loadd(6, w + 2 * kTileElems, 64);
      _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(7, w + 3 * kTileElems, 64);
      _tile_dpbf16ps(3, 4, 7);
    }
  }
  const int rows = static_cast<int>(a.m);
  store_acc(acc);
  store_block<E>(a, acc, 256, 16, 0, rows, block);
  if (tiles == 4) store_block<E>(a, acc + 512, 256, 16, 0, rows, block + 1);
}

// 17 to 32 rows: per k tile two A tiles against the block's two B tiles, widened as they are
// used (the sums stay in tiles for all of K).
template <Epilogue E>
void pair_rows(const WInt8Args& a, const uint16_t* xb, int64_t kp, int64_t block) {
  const int64_t ktiles = kp / kK;
  const int8_t* q = a.packed + block * ktiles * 2 * kTileElems;
  alignas(64) uint16_t w[2 * kTileElems];
  alignas(64) float acc[4 * kTileRows * 16];
  zero_acc();
  for (int64_t t = 0; t < ktiles; ++t) {
    widen(q + t * 2 * kTileElems, w, 2);
    _tile_loadd(4, a_tile(xb, kp, 0, t), 64);
    _tile_loadd(5, a_tile(xb, kp, kTileRows, t), 64);
    _tile_loadd(6, w, 64);
    _tile_loadd(7, w + kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  const int rows1 = static_cast<int>(a.m - kTileRows);
  store_acc(acc);
  store_block<E>(a, acc, 256, 16, 0, kTileRows, block);
  store_block<E>(a, acc + 512, 256, 16, kTileRows, rows1, block);
}

// The epilogue of the row pair at m0 (of a chunk from r0) of `block`: its final sums in
// `acc` [rows][32] to y.
template <Epilogue E>
void store_pair(const WInt8Args& a, const float* acc, int64_t r0, int64_t m0, int64_t block) {
  for (int64_t m = m0; m < std::min(m0 + 2 * kTileRows, a.m); m += kTileRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kTileRows, a.m - m));
    store_block<E>(a, acc + (m - r0) * kCols, 16, kCols, m, rows, block);
  }
}

// Rows [r0, r1) of a chunk x one block: per k block the block's B tiles are widened into an
// L1 panel and every row pair takes them; sums carry across k blocks in `acc` [rows][32].
template <Epilogue E>
void large_rows(const WInt8Args& a, const uint16_t* xb, int64_t kp, int64_t block, int64_t r0,
                int64_t r1, uint16_t* panel, float* acc) {
  const int64_t ktiles = kp / kK;
  const int8_t* q = a.packed + block * ktiles * 2 * kTileElems;
  // A tile store and the load of the same sums right after it stall: with few row pairs the
  // panel holds all of K (L2) and the sums never leave their tiles.
  const int64_t kblock = r1 - r0 > 4 * kTileRows ? kKBlock : ktiles;
  for (int64_t kb = 0; kb < ktiles; kb += kblock) {
    const int64_t kn = std::min<int64_t>(kblock, ktiles - kb);
    widen(q + kb * 2 * kTileElems, panel, 2 * kn);
    for (int64_t m0 = r0; m0 < r1; m0 += 2 * kTileRows) {
      float* c = acc + (m0 - r0) * kCols;
      const bool two = m0 + kTileRows < r1;
      if (kb == 0) {
        zero_acc();
      } else {
        _tile_loadd(0, c, kCols * 4);
        _tile_loadd(1, c + 16, kCols * 4);
        if (two) {
          _tile_loadd(2, c + kTileRows * kCols, kCols * 4);
          _tile_loadd(3, c + kTileRows * kCols + 16, kCols * 4);
        }
      }
      for (int64_t t = 0; t < kn; ++t) {
        const uint16_t* w = panel + t * 2 * kTileElems;
        _tile_loadd(4, a_tile(xb, kp, m0, kb + t), 64);
        _tile_loadd(6, w, 64);
        _tile_loadd(7, w + kTileElems, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
          _tile_loadd(5, a_tile(xb, kp, m0 + kTileRows, kb + t), 64);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c, kCols * 4);
      _tile_stored(1, c + 16, kCols * 4);
      if (two) {
        _tile_stored(2, c + kTileRows * kCols, kCols * 4);
        _tile_stored(3, c + kTileRows * kCols + 16, kCols * 4);
      }
      // In the last k block the previous pair's sums are final: its epilogue's stores to y
      // (cache misses) drain while this pair's tiles run, instead of in one burst at the end
      // (read a pair behind: a vector load right after a tile store of the same lines waits)
      if (kb + kn == ktiles && m0 > r0) store_pair<E>(a, acc, r0, m0 - 2 * kTileRows, block);
    }
  }
  store_pair<E>(a, acc, r0, r0 + (r1 - 1 - r0) / (2 * kTileRows) * (2 * kTileRows), block);
}

thread_local std::vector<uint16_t> t_xb, t_panel;
thread_local std::vector<float> t_acc;

}  // namespace

template <Epilogue E>
void w8a16_run(const WInt8Args& a) {
  if (a.m == 0 || a.n == 0) return;
  const int64_t kp = (a.k + kK - 1) / kK * kK;
  const int64_t blocks = (a.n + kCols - 1) / kCols;
  // x as A tiles (`to_bf16_tiles`), whole 16-row tiles, 32-row pairs past kSmallRows: padding
  // rows are zero and never written back.
  const int64_t pad = a.m <= kSmallRows ? kTileRows : 2 * kTileRows;
  const int64_t rows = (a.m + pad - 1) / pad * pad;
  uint16_t* xb = scratch(t_xb, rows * kp);
  to_bf16_tiles(a, xb, rows, kp);
  if (a.m <= kSmallRows) {
    parallel_on_full_tiles((blocks + 1) / 2, [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) small_rows<E>(a, xb, kp, 2 * u, blocks);
    });
    return;
  }
  if (a.m <= 2 * kTileRows) {
    parallel_on_full_tiles(blocks, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) pair_rows<E>(a, xb, kp, b);
    });
    return;
  }
  // Units: (chunk of rows, block), chunk-major so a thread's x rows stay in its L2 while it
  // walks the blocks of its share; claimed one by one (claim_on_full_tiles).
  const int64_t chunks = (a.m + kChunkRows - 1) / kChunkRows;
  claim_on_full_tiles(chunks * blocks, [&](int64_t u) {
    uint16_t* panel = scratch(t_panel, 2 * std::max<int64_t>(kKBlock, kp / kK) * kTileElems);
    float* acc = scratch(t_acc, kChunkRows * kCols);
    const int64_t chunk = u / blocks, block = u % blocks;
    large_rows<E>(a, xb, kp, block, chunk * kChunkRows, std::min(a.m, (chunk + 1) * kChunkRows),
                  panel, acc);
  });
}

bool w8a16_available() { return amx_permitted(); }

void w8a16_linear(const WInt8Args& a) { w8a16_run<kLinear>(a); }

void w8a16_silu_linear(const WInt8Args& a) {
  if (a.n % kCols != 0)
    throw std::invalid_argument("w8a16_silu_linear needs gate/up blocks of 16 + 16 columns");
  w8a16_run<kSilu>(a);
}

#else

bool w8a16_available() { return false; }

void w8a16_linear(const WInt8Args&) {
  throw std::runtime_error("w8a16_linear needs the amx kernel variant (AMX-BF16, AVX512-BF16)");
}

void w8a16_silu_linear(const WInt8Args&) {
  throw std::runtime_error(
      "w8a16_silu_linear needs the amx kernel variant (AMX-BF16, AVX512-BF16)");
}

#endif

}  // namespace kvr
