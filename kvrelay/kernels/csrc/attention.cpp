// Paged attention on CPU, fp32 compute, reading K/V pages in place from the pool (fp32, bf16
// or fp16 elements: kv_types.h widens each K/V load to fp32 exactly, and nothing else
// depends on the element type, so a 16-bit pool gives bitwise the fp32 result on its
// widened values).
//
// Every (query row, head) gets a fixed sequence of float operations that depends only on its
// query, its position and its sequence's K/V:
// - per page (a tile of page_size keys): scores = q.k (explicit mul then FMAs over head_dim,
//   a fixed reduction tree), online softmax update of (max, sum, acc) in key order;
// - per chunk of chunk_pages pages, starting fresh: the state is stored as a partial;
// - the partials of chunks 0..c are merged in chunk order at the end.
// Which thread runs which (chunk, rows) item, and which rows share it, changes nothing.
//
// Work split (plan.cpp): an item is one key chunk for the row blocks of one or more sequences
// whose block ids in that chunk are the same (a shared prefix), so its K/V is read once for all
// of them. A step with fewer than 2 items per thread (decode at small batch: one item per 256
// keys of context) cuts each item into units of KV heads (run()), so that every
// thread gets work; heads are independent, so units change no bit. Within an item: page by
// page, KV head by KV head, the GQA rows of each query token go through the page together in
// tiles of up to 3 rows (rows_page; 4 = 2 + 2, single rows use row_page): each K and V vector
// is loaded once and feeds every row of the tile, while each row keeps row_page's operations
// in the same order (same FMA chains per key, reduce8's tree, masking, softmax update and P.V
// order), so tiles change no bit. AVX-512 builds at head_dim 128 and 256 run tiles of up to 4
// rows in 16-lane vectors instead (rows_page16: two rows per zmm in q.k, 16 dims per zmm in
// P.V, each lane the same chain: the same bits; Gemma 3's 4 rows on 1 KV head share each load),
// and the AVX2 build's single rows there take rows_page<ND, 1> (row_page's q[ND] and acc[ND]
// spilled out of 16 registers; the same operations). (Tiles of several query tokens, up to 6
// rows sharing each load, measured no faster on Zen 4 at a 2,048-token prefill: the tile is
// FMA-bound, not load-bound.) Decode reads a page once per layer and step from memory: a page
// is prefetched into L2 during the page before it (across items too: a thread claims its next
// item before running the current one), and each head's K/V rows into L1 while the previous
// head computes.
//
// Sliding window (window W > 0, plan.cpp): the row at position p sees keys [lo, p], lo =
// max(0, p - W + 1). Its chunks run from lo's chunk to p's, and within them only the pages it
// sees: a page it meets from key j_lo on is read from there (row_page on the keys [j_lo, ...],
// whose 8-key groups then start at j_lo); all of this depends only on p and W, so rows stay
// bitwise invariant, and W >= p + 1 is bitwise full attention. An item starts at the page of
// its first row's lo (`item_first_page`): pages wholly before every row's window are not read.
#include <algorithm>
#include <atomic>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "kv_types.h"
#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace kvr {

namespace {

constexpr int kMaxPage = 256;
constexpr int kMaxHeadDim = 256;
// 16-bit pages: a page a head's rows meet at least this often is widened once (run_item).
constexpr int kWidenUsers = 8;
constexpr int kSplitWork = 16;  // fewest pages x query rows for cutting items by KV heads
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <class T>
struct Args {
  const float* query;
  const T* pool;
  const int* tables;
  const int* items;
  const int* entries;
  const int* tokpos;
  const int* chunk_off;
  float* partial;
  int64_t width, layer_stride, block_stride, kv_stride;
  int num_heads, kv_heads, group, head_dim, page_size, chunk_pages;
  float scale;
  int window;  // 0: full causal attention
};

// The chunk of the first key the row at `pos` sees.
template <class T>
inline int first_chunk(const Args<T>& a, int pos) {
  return window_lo(pos, a.window) / (a.page_size * a.chunk_pages);
}

// The partial (index into a.partial's rows of num_heads states) of token t's chunk `chunk`.
template <class T>
inline int64_t partial_of(const Args<T>& a, int t, int chunk) {
  return (int64_t)a.chunk_off[t] + chunk - first_chunk(a, a.tokpos[t]);
}

// The first page an item reads: its chunk's first, or the page of its rows' first key (all its
// entries have the same one: plan.cpp's item key holds it).
template <class T>
inline int item_first_page(const Args<T>& a, int index) {
  const int* item = a.items + 3 * index;
  return std::max(item[0] * a.chunk_pages,
                  window_lo(a.entries[4 * item[1] + 3], a.window) / a.page_size);
}

// Whether token t (at pos) has a partial in chunk c: its keys [lo, pos] meet the chunk.
template <class T>
inline bool meets_chunk(const Args<T>& a, int pos, int chunk) {
  const int ck = a.page_size * a.chunk_pages;
  return pos >= chunk * ck && window_lo(pos, a.window) < (chunk + 1) * ck;
}

// Scores of keys [j0, j0 + 8) (only j < nvalid are read; others are -inf) for one row.
template <int ND, class T>
inline __m256 scores8(const __m256* q, const T* k, int64_t stride, int j0, int nvalid) {
  __m256 a[8];
  if (j0 + 8 <= nvalid) {
    for (int jj = 0; jj < 8; ++jj)
      a[jj] = _mm256_mul_ps(q[0], load8(k + (j0 + jj) * stride));
    for (int d = 1; d < ND; ++d)
      for (int jj = 0; jj < 8; ++jj)
        a[jj] = _mm256_fmadd_ps(q[d], load8(k + (j0 + jj) * stride + 8 * d), a[jj]);
    return reduce8(a);
  }
  alignas(32) float valid[8];
  for (int jj = 0; jj < 8; ++jj) {
    const int j = j0 + jj;
    a[jj] = _mm256_setzero_ps();
    valid[jj] = j < nvalid ? 0.0f : kNegInf;
    if (j >= nvalid) continue;
    a[jj] = _mm256_mul_ps(q[0], load8(k + j * stride));
    for (int d = 1; d < ND; ++d)
      a[jj] = _mm256_fmadd_ps(q[d], load8(k + j * stride + 8 * d), a[jj]);
  }
  // Adding -inf to invalid lanes masks them; valid lanes add +0 (exact).
  return _mm256_add_ps(reduce8(a), _mm256_load_ps(valid));
}

// One row meets one page: keys [0, nvalid) of k/v (stride between keys) update its state
// st = [max, sum, acc[head_dim]].
template <int ND, class T>
inline void row_page(const float* qrow, __m256 scale, const T* k, const T* v,
                     int64_t stride, int nvalid, float* st) {
  __m256 q[ND];
  for (int d = 0; d < ND; ++d) q[d] = _mm256_mul_ps(_mm256_loadu_ps(qrow + 8 * d), scale);
  alignas(32) float s[kMaxPage];
  __m256 mx = _mm256_set1_ps(kNegInf);
  for (int j0 = 0; j0 < nvalid; j0 += 8) {
    __m256 sv = scores8<ND>(q, k, stride, j0, nvalid);
    _mm256_store_ps(s + j0, sv);
    mx = _mm256_max_ps(mx, sv);
  }
  const float m_old = st[0];
  const float m_new = std::max(m_old, hmax8(mx));
  __m256 acc[ND];
  for (int d = 0; d < ND; ++d) acc[d] = _mm256_loadu_ps(st + 2 + 8 * d);
  float l = st[1];
  if (m_new > m_old) {
    const float corr = exp1(m_old - m_new);
    const __m256 c = _mm256_set1_ps(corr);
    l = l * corr;
    for (int d = 0; d < ND; ++d) acc[d] = _mm256_mul_ps(acc[d], c);
  }
  const __m256 m = _mm256_set1_ps(m_new);
  __m256 lsum = _mm256_setzero_ps();
  for (int j0 = 0; j0 < nvalid; j0 += 8) {
    __m256 p = exp8(_mm256_sub_ps(_mm256_load_ps(s + j0), m));
    _mm256_store_ps(s + j0, p);
    lsum = _mm256_add_ps(lsum, p);
  }
  l = l + hsum8(lsum);
  for (int j = 0; j < nvalid; ++j) {
    const __m256 p = _mm256_set1_ps(s[j]);
    const T* vj = v + j * stride;
    for (int d = 0; d < ND; ++d) acc[d] = _mm256_fmadd_ps(p, load8(vj + 8 * d), acc[d]);
  }
  st[0] = m_new;
  st[1] = l;
  for (int d = 0; d < ND; ++d) _mm256_storeu_ps(st + 2 + 8 * d, acc[d]);
}

// Stands in for keys past nvalid (read, then masked): 512 zero bytes, a zero key of any type.
alignas(32) const float kZeroKey[128] = {};

// scores8 for R rows at once: each K vector is loaded once and used by every row. Per row and
// key the operations are scores8's (mul, FMAs over d in order, reduce8's tree, then the same
// masking add on a partial tile), so each lane is bitwise scores8's.
template <int ND, int R, class T>
inline void scores8_rows(const float* qs, const T* k, int64_t stride, int j0, int nvalid,
                         __m256* out) {
  const T* kp[8];
  const T* zero = reinterpret_cast<const T*>(kZeroKey);
  for (int jj = 0; jj < 8; ++jj) kp[jj] = j0 + jj < nvalid ? k + (j0 + jj) * stride : zero;
  // Keys in passes of KP: R * KP accumulators, R q vectors and KP K vectors in registers.
  // hadd of key pairs, then of the pairs, then low + high half: reduce8's tree per key.
  constexpr int KP = R >= 3 ? 2 : 4;
  __m128 half[R][2];
  for (int hf = 0; hf < 2; ++hf) {
    __m256 t[R][2];
    for (int p0 = 0; p0 < 4; p0 += KP) {
      const T* const* kk = kp + 4 * hf + p0;
      __m256 acc[R][KP];
      {
        __m256 kv[KP];
        for (int jj = 0; jj < KP; ++jj) kv[jj] = load8(kk[jj]);
        for (int r = 0; r < R; ++r) {
          const __m256 qv = _mm256_load_ps(qs + r * 8 * ND);
          for (int jj = 0; jj < KP; ++jj) acc[r][jj] = _mm256_mul_ps(qv, kv[jj]);
        }
      }
      for (int d = 1; d < ND; ++d) {
        __m256 kv[KP];
        for (int jj = 0; jj < KP; ++jj) kv[jj] = load8(kk[jj] + 8 * d);
        for (int r = 0; r < R; ++r) {
          const __m256 qv = _mm256_load_ps(qs + r * 8 * ND + 8 * d);
          for (int jj = 0; jj < KP; ++jj) acc[r][jj] = _mm256_fmadd_ps(qv, kv[jj], acc[r][jj]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int jj = 0; jj < KP; jj += 2)
          t[r][(p0 + jj) / 2] = _mm256_hadd_ps(acc[r][jj], acc[r][jj + 1]);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 u = _mm256_hadd_ps(t[r][0], t[r][1]);
      half[r][hf] = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm256_set_m128(half[r][1], half[r][0]);
  if (j0 + 8 <= nvalid) return;
  alignas(32) float valid[8];
  alignas(32) int invalid[8];
  for (int jj = 0; jj < 8; ++jj) {
    valid[jj] = j0 + jj < nvalid ? 0.0f : kNegInf;
    invalid[jj] = j0 + jj < nvalid ? 0 : -1;
  }
  const __m256 vadd = _mm256_load_ps(valid);
  const __m256 mask = _mm256_castsi256_ps(_mm256_load_si256((const __m256i*)invalid));
  // scores8 reduces zero accumulators for invalid keys: 0 + -inf; valid lanes get + 0.
  for (int r = 0; r < R; ++r)
    out[r] = _mm256_add_ps(_mm256_blendv_ps(out[r], _mm256_setzero_ps(), mask), vadd);
}

// The online-softmax step of R rows (states st0 + r * state: [max, sum, acc]) meeting their
// scores s[r][0, nvalid) with running maxima mx[r]: row_page's arithmetic per row. s[r] becomes
// p = exp(s - max); where the max rose, rescale[r] is set and corr[r] scales the old acc.
template <int R>
inline void softmax_rows(float (*s)[kMaxPage], const __m256* mx, int nvalid, float* st0,
                         int state, float* corr, bool* rescale) {
  for (int r = 0; r < R; ++r) {
    float* st = st0 + r * state;
    const float m_old = st[0];
    const float m_new = std::max(m_old, hmax8(mx[r]));
    float l = st[1];
    rescale[r] = m_new > m_old;
    if (rescale[r]) {
      corr[r] = exp1(m_old - m_new);
      l = l * corr[r];
    }
    const __m256 m = _mm256_set1_ps(m_new);
    __m256 lsum = _mm256_setzero_ps();
    for (int j0 = 0; j0 < nvalid; j0 += 8) {
      __m256 p = exp8(_mm256_sub_ps(_mm256_load_ps(s[r] + j0), m));
      _mm256_store_ps(s[r] + j0, p);
      lsum = _mm256_add_ps(lsum, p);
    }
    st[0] = m_new;
    st[1] = l + hsum8(lsum);
  }
}

// row_page for R rows of one KV head (consecutive query rows and states) on the same keys: the
// rows share every K and V load; each row's arithmetic is row_page's, in the same order.
template <int ND, int R, class T>
inline void rows_page(const float* qrow, __m256 scale, const T* k, const T* v,
                      int64_t stride, int nvalid, float* st0) {
  constexpr int kD = 8 * ND, kState = 2 + kD;
  alignas(32) float qs[R * kD];
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < ND; ++d)
      _mm256_store_ps(qs + r * kD + 8 * d,
                      _mm256_mul_ps(_mm256_loadu_ps(qrow + r * kD + 8 * d), scale));
  alignas(32) float s[R][kMaxPage];
  __m256 mx[R];
  for (int r = 0; r < R; ++r) mx[r] = _mm256_set1_ps(kNegInf);
  for (int j0 = 0; j0 < nvalid; j0 += 8) {
    __m256 sv[R];
    scores8_rows<ND, R>(qs, k, stride, j0, nvalid, sv);
    for (int r = 0; r < R; ++r) {
      _mm256_store_ps(s[r] + j0, sv[r]);
      mx[r] = _mm256_max_ps(mx[r], sv[r]);
    }
  }
  float corr[R];
  bool rescale[R];
  softmax_rows<R>(s, mx, nvalid, st0, kState, corr, rescale);
  constexpr int kB = ND < 4 ? ND : 4;  // d-vectors per pass: R * kB accumulators in registers
  for (int d0 = 0; d0 < ND; d0 += kB) {
    __m256 acc[R][kB];
    for (int r = 0; r < R; ++r) {
      const float* st = st0 + r * kState + 2 + 8 * d0;
      for (int i = 0; i < kB; ++i) acc[r][i] = _mm256_loadu_ps(st + 8 * i);
      if (rescale[r]) {
        const __m256 c = _mm256_set1_ps(corr[r]);
        for (int i = 0; i < kB; ++i) acc[r][i] = _mm256_mul_ps(acc[r][i], c);
      }
    }
    for (int j = 0; j < nvalid; ++j) {
      const T* vj = v + j * stride + 8 * d0;
      for (int i = 0; i < kB; ++i) {
        const __m256 vv = load8(vj + 8 * i);
        for (int r = 0; r < R; ++r)
          acc[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(s[r][j]), vv, acc[r][i]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kB; ++i)
        _mm256_storeu_ps(st0 + r * kState + 2 + 8 * (d0 + i), acc[r][i]);
  }
}

#if defined(__AVX512F__)
// ---- AVX-512 forms of rows_page (avx512 and amx builds): the same bits in 16-lane vectors ----
//
// q.k: a zmm holds two rows' 8-lane accumulators of one key (row 2p in the low half, 2p + 1 in
// the high half), K's 8 values broadcast to both halves: each lane takes exactly scores8's
// chain (mul, then FMAs over d in order), then each half goes through reduce8's tree and
// scores8_rows' masking. P.V: 16 consecutive dims per zmm, each lane row_page's FMA chain over
// the keys in order. So every row gets row_page's bits, with twice the lanes per instruction
// and up to 4 rows sharing each K/V load (head_dim 256: 16 zmm accumulators per pass).

// 8 elements of a key as fp32, in both 256-bit halves.
inline __m512 load8x2(const float* p) { return _mm512_broadcast_f32x8(_mm256_loadu_ps(p)); }
inline __m512 load8x2(const bf16* p) {
  const __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load8x2(const fp16* p) {
  return _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p)));
}

// 16 consecutive elements as fp32 (the same values as two load8).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256((const __m256i*)p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const fp16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}

// Scores of keys [j0, j0 + 8) for P row pairs (qp: per pair ND zmm of its two rows' scaled q),
// out[2p + half] = row 2p + half's scores: scores8_rows' bits for every row.
template <int ND, int P, class T>
inline void scores8_pairs(const float* qp, const T* k, int64_t stride, int j0, int nvalid,
                          __m256* out) {
  const T* kp[8];
  const T* zero = reinterpret_cast<const T*>(kZeroKey);
  for (int jj = 0; jj < 8; ++jj) kp[jj] = j0 + jj < nvalid ? k + (j0 + jj) * stride : zero;
  __m512 acc[P][8];
  {
    __m512 kv[8];
    for (int jj = 0; jj < 8; ++jj) kv[jj] = load8x2(kp[jj]);
    for (int p = 0; p < P; ++p) {
      const __m512 qv = _mm512_load_ps(qp + p * 16 * ND);
      for (int jj = 0; jj < 8; ++jj) acc[p][jj] = _mm512_mul_ps(qv, kv[jj]);
    }
  }
  for (int d = 1; d < ND; ++d) {
    __m512 kv[8];
    for (int jj = 0; jj < 8; ++jj) kv[jj] = load8x2(kp[jj] + 8 * d);
    for (int p = 0; p < P; ++p) {
      const __m512 qv = _mm512_load_ps(qp + p * 16 * ND + 16 * d);
      for (int jj = 0; jj < 8; ++jj) acc[p][jj] = _mm512_fmadd_ps(qv, kv[jj], acc[p][jj]);
    }
  }
  for (int p = 0; p < P; ++p) {
    __m256 lo[8], hi[8];
    for (int jj = 0; jj < 8; ++jj) {
      lo[jj] = _mm512_castps512_ps256(acc[p][jj]);
      hi[jj] = _mm512_extractf32x8_ps(acc[p][jj], 1);
    }
    out[2 * p] = reduce8(lo);
    out[2 * p + 1] = reduce8(hi);
  }
  if (j0 + 8 <= nvalid) return;
  alignas(32) float valid[8];
  alignas(32) int invalid[8];
  for (int jj = 0; jj < 8; ++jj) {
    valid[jj] = j0 + jj < nvalid ? 0.0f : kNegInf;
    invalid[jj] = j0 + jj < nvalid ? 0 : -1;
  }
  const __m256 vadd = _mm256_load_ps(valid);
  const __m256 mask = _mm256_castsi256_ps(_mm256_load_si256((const __m256i*)invalid));
  for (int r = 0; r < 2 * P; ++r)
    out[r] = _mm256_add_ps(_mm256_blendv_ps(out[r], _mm256_setzero_ps(), mask), vadd);
}

// rows_page for R <= 4 rows (ND even): row_page's bits per row.
template <int ND, int R, class T>
inline void rows_page16(const float* qrow, __m256 scale, const T* k, const T* v,
                        int64_t stride, int nvalid, float* st0) {
  constexpr int kD = 8 * ND, kState = 2 + kD, P = (R + 1) / 2;
  alignas(64) float qp[P * 2 * kD];
  for (int p = 0; p < P; ++p)
    for (int d = 0; d < ND; ++d) {
      float* dst = qp + p * 2 * kD + 16 * d;
      _mm256_store_ps(dst, _mm256_mul_ps(_mm256_loadu_ps(qrow + 2 * p * kD + 8 * d), scale));
      _mm256_store_ps(dst + 8, 2 * p + 1 < R ? _mm256_mul_ps(_mm256_loadu_ps(
                                                   qrow + (2 * p + 1) * kD + 8 * d), scale)
                                             : _mm256_setzero_ps());
    }
  alignas(32) float s[R][kMaxPage];
  __m256 mx[R];
  for (int r = 0; r < R; ++r) mx[r] = _mm256_set1_ps(kNegInf);
  for (int j0 = 0; j0 < nvalid; j0 += 8) {
    __m256 sv[2 * P];
    scores8_pairs<ND, P>(qp, k, stride, j0, nvalid, sv);
    for (int r = 0; r < R; ++r) {
      _mm256_store_ps(s[r] + j0, sv[r]);
      mx[r] = _mm256_max_ps(mx[r], sv[r]);
    }
  }
  float corr[R];
  bool rescale[R];
  softmax_rows<R>(s, mx, nvalid, st0, kState, corr, rescale);
  constexpr int NZ = ND / 2, kB = NZ < 4 ? NZ : 4;  // 16-dim vectors per pass
  for (int d0 = 0; d0 < NZ; d0 += kB) {
    __m512 acc[R][kB];
    for (int r = 0; r < R; ++r) {
      const float* st = st0 + r * kState + 2 + 16 * d0;
      for (int i = 0; i < kB; ++i) acc[r][i] = _mm512_loadu_ps(st + 16 * i);
      if (rescale[r]) {
        const __m512 c = _mm512_set1_ps(corr[r]);
        for (int i = 0; i < kB; ++i) acc[r][i] = _mm512_mul_ps(acc[r][i], c);
      }
    }
    for (int j = 0; j < nvalid; ++j) {
      const T* vj = v + j * stride + 16 * d0;
      __m512 pj[R];
      for (int r = 0; r < R; ++r) pj[r] = _mm512_set1_ps(s[r][j]);
      for (int i = 0; i < kB; ++i) {
        const __m512 vv = load16(vj + 16 * i);
        for (int r = 0; r < R; ++r) acc[r][i] = _mm512_fmadd_ps(pj[r], vv, acc[r][i]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kB; ++i)
        _mm512_storeu_ps(st0 + r * kState + 2 + 16 * (d0 + i), acc[r][i]);
  }
}
#endif

// The G query rows of one KV head, in tiles of up to 3 rows (4 = 2 + 2); AVX-512 builds at
// head_dim 128 and 256: tiles of up to 4 rows (rows_page16).
template <int ND, class T>
inline void group_page(const float* qrow, int group, __m256 scale, const T* k, const T* v,
                       int64_t stride, int nvalid, float* st) {
  constexpr int kD = 8 * ND, kState = 2 + kD;
#if defined(__AVX512F__)
  if constexpr (ND >= 16) {  // head_dim 128, 256 (at 64 and below: no faster, measured)
    for (int g = 0; g < group;) {
      const int r = std::min(4, group - g);
      const float* q = qrow + g * kD;
      float* s = st + g * kState;
      if (r == 4)
        rows_page16<ND, 4>(q, scale, k, v, stride, nvalid, s);
      else if (r == 3)
        rows_page16<ND, 3>(q, scale, k, v, stride, nvalid, s);
      else if (r == 2)
        rows_page16<ND, 2>(q, scale, k, v, stride, nvalid, s);
      else
        rows_page16<ND, 1>(q, scale, k, v, stride, nvalid, s);
      g += r;
    }
    return;
  }
#endif
  for (int g = 0; g < group;) {
    const int left = group - g, r = left == 4 ? 2 : std::min(3, left);
    const float* q = qrow + g * kD;
    float* s = st + g * kState;
    if (r == 3)
      rows_page<ND, 3>(q, scale, k, v, stride, nvalid, s);
    else if (r == 2)
      rows_page<ND, 2>(q, scale, k, v, stride, nvalid, s);
    else if constexpr (ND >= 16)  // row_page's q[ND] and acc[ND] do not fit in 16 registers
      rows_page<ND, 1>(q, scale, k, v, stride, nvalid, s);
    else
      row_page<ND>(q, scale, k, v, stride, nvalid, s);
    g += r;
  }
}

// Start of a page's K and V for this layer.
template <class T>
inline const char* page_span(const Args<T>& a, const int* table, int page) {
  return (const char*)(a.pool + table[page] * a.block_stride + a.layer_stride);
}

inline void prefetch_l2(const char* base, int64_t from, int64_t to) {
  for (int64_t off = from; off < to; off += 64) _mm_prefetch(base + off, _MM_HINT_T1);
}

// One KV head's K and V rows of a page into L1.
template <class T>
inline void prefetch_head(const Args<T>& a, const char* base, int h) {
  constexpr int64_t el = sizeof(T);
  const int64_t row = (int64_t)a.kv_heads * a.head_dim * el, kv = a.kv_stride * el;
  const char* k = base + (int64_t)h * a.head_dim * el;
  for (int j = 0; j < a.page_size; ++j, k += row)
    for (int off = 0; off < a.head_dim * el; off += 64) {
      _mm_prefetch(k + off, _MM_HINT_T0);
      _mm_prefetch(k + kv + off, _MM_HINT_T0);
    }
}

// KV heads [h0, h1) of work unit u: an item's heads cut into `split` parts (split = 1: all).
struct Unit {
  int item, h0, h1;
};

inline Unit unit_of(int u, int split, int kv_heads) {
  const int part = u % split;
  return Unit{u / split, part * kv_heads / split, (part + 1) * kv_heads / split};
}

// The pages [first, last] of an item's chunk (its entries share their block ids there), and
// the last position its rows reach.
struct ChunkPages {
  const int* table;
  int first, last, pmax;
};

template <class T>
inline ChunkPages chunk_pages_of(const Args<T>& a, int index) {
  const int* item = a.items + 3 * index;
  int pmax = 0;
  for (int e = item[1]; e < item[2]; ++e)
    pmax = std::max(pmax, a.entries[4 * e + 3] + a.entries[4 * e + 2] - 1);
  const int first = item_first_page(a, index);
  return ChunkPages{a.tables + a.width * a.entries[4 * item[1]], first,
                    std::min(pmax / a.page_size, (item[0] + 1) * a.chunk_pages - 1), pmax};
}

// The first page's K and V of a unit's item.
template <class T>
inline const char* first_span(const Args<T>& a, int index) {
  const ChunkPages cp = chunk_pages_of(a, index);
  return page_span(a, cp.table, cp.first);
}

// Every query row of the item's entries that reaches this page, for KV head h: K/V rows of the
// page at k/v (stride elements between keys).
template <int ND, class T, class KV>
inline void rows_of_page(const Args<T>& a, int e0, int e1, int chunk, int h, int kstart,
                         __m256 scale, const KV* k, const KV* v, int64_t stride, int state) {
  for (int e = e0; e < e1; ++e) {
    const int* en = a.entries + 4 * e;
    for (int j = 0; j < en[2]; ++j) {
      const int pos = en[3] + j, t = en[1] + j;
      if (pos < kstart) continue;
      // the row's keys on this page: [j_lo, nvalid) (j_lo > 0 only for its window's first page)
      const int j_lo = std::max(0, window_lo(pos, a.window) - kstart);
      if (j_lo >= a.page_size) continue;
      const int nvalid = std::min(a.page_size, pos - kstart + 1);
      const int64_t row0 = partial_of(a, t, chunk) * a.num_heads + h * a.group;
      float* st = a.partial + row0 * state;
      const float* qrow = a.query + ((int64_t)t * a.num_heads + h * a.group) * a.head_dim;
      group_page<ND>(qrow, a.group, scale, k + j_lo * stride, v + j_lo * stride, stride,
                     nvalid - j_lo, st);
    }
  }
}

// One unit: the item's chunk for its row blocks, KV heads [h0, h1) only. Heads are independent
// (each (row, head) state sees the same pages, tiles and order whichever unit holds its head),
// so cutting an item by heads changes no bit; it only gives a second thread work when a step
// has fewer items than threads (decode at batch 1: one item per 256 keys of context).
// kSplit = false: whole items (h0 = 0, h1 = kv_heads as constants of the loops: the compiler
// then emits the whole-item loop as before the cut, measured ~10% faster with avx512).
template <int ND, bool kSplit, class T>
void run_item(const Args<T>& a, Unit un, bool prefetched, const Unit* after) {
  const int* item = a.items + 3 * un.item;
  const int chunk = item[0], e0 = item[1], e1 = item[2];
  const int h0 = kSplit ? un.h0 : 0, h1 = kSplit ? un.h1 : a.kv_heads;
  const int state = 2 + a.head_dim;
  const int* table = a.tables + a.width * a.entries[4 * e0];
  int pmax = 0;
  for (int e = e0; e < e1; ++e) {
    const int* en = a.entries + 4 * e;
    pmax = std::max(pmax, en[3] + en[2] - 1);
    for (int t = en[1]; t < en[1] + en[2]; ++t) {
      // A row block may start before this chunk (its earlier rows have no partial here), or a
      // window may end before it ends (its later rows' windows start after it).
      if (!meets_chunk(a, a.tokpos[t], chunk)) continue;
      const int64_t row0 = partial_of(a, t, chunk) * a.num_heads + h0 * a.group;
      float* st = a.partial + row0 * state;
      for (int hq = h0 * a.group; hq < h1 * a.group; ++hq, st += state) {
        st[0] = kNegInf;
        std::fill(st + 1, st + state, 0.0f);
      }
    }
  }
  const int first = item_first_page(a, un.item);
  const int last = std::min(pmax / a.page_size, (chunk + 1) * a.chunk_pages - 1);
  const __m256 scale = _mm256_set1_ps(a.scale);
  const int64_t stride = (int64_t)a.kv_heads * a.head_dim;
  const int64_t span = 2 * a.kv_stride * (int64_t)sizeof(T);  // bytes of a page's K and V
  const int nh = h1 - h0;  // the unit's heads share the L2 prefetch of the next page
  const int64_t share = (span / 64 + nh - 1) / nh * 64;
  // Memory-bound in decode: keep misses in flight. A page goes to L2 one head's share at a time
  // during the page before it (an item's first page during the thread's previous item), and
  // each head's K/V rows go to L1 while the previous head computes. No arithmetic changes.
  if (!prefetched) {  // the thread's first item
    prefetch_l2(page_span(a, table, first), 0, span);
    prefetch_head(a, page_span(a, table, first), h0);
  }
  const char* following = after ? first_span(a, after->item) : nullptr;
  const int following_h = kSplit && after ? after->h0 : 0;
  for (int page = first; page <= last; ++page) {
    const char* base = page_span(a, table, page);
    const char* next = page < last ? page_span(a, table, page + 1) : following;
    const T* kbase = (const T*)base;
    const T* vbase = kbase + a.kv_stride;
    const int kstart = page * a.page_size;
    for (int h = h0; h < h1; ++h) {
      if (next) prefetch_l2(next, (h - h0) * share, std::min(span, (h - h0 + 1) * share));
      if (h + 1 < h1)
        prefetch_head(a, base, h + 1);
      else if (next)
        prefetch_head(a, next, page < last ? h0 : following_h);
      const T* kh = kbase + h * a.head_dim;
      const T* vh = vbase + h * a.head_dim;
      if constexpr (!std::is_same_v<T, float>) {
        // 16-bit pages in prefill: many query tokens meet this page, and widening each K/V
        // load for every one of them made prefill compute-bound on the conversions. Widen the
        // head's K and V rows once into fp32 (exact) and run the same tiles on those: each
        // row's arithmetic is unchanged, only where its K/V values are read from.
        int users = 0;
        for (int e = e0; e < e1; ++e) {
          const int* en = a.entries + 4 * e;
          users += std::max(0, std::min(en[2], en[3] + en[2] - kstart));
        }
        if (users >= kWidenUsers) {
          alignas(64) thread_local float kw[kMaxPage * kMaxHeadDim], vw[kMaxPage * kMaxHeadDim];
          for (int j = 0; j < a.page_size; ++j)
            for (int d = 0; d < ND; ++d) {
              _mm256_storeu_ps(kw + j * a.head_dim + 8 * d, load8(kh + j * stride + 8 * d));
              _mm256_storeu_ps(vw + j * a.head_dim + 8 * d, load8(vh + j * stride + 8 * d));
            }
          rows_of_page<ND>(a, e0, e1, chunk, h, kstart, scale, kw, vw, a.head_dim, state);
          continue;
        }
      }
      rows_of_page<ND>(a, e0, e1, chunk, h, kstart, scale, kh, vh, stride, state);
    }
  }
}

// Merge a row's chunk partials in chunk order and normalise.
template <int ND, class T>
void merge_row(const Args<T>& a, int t, float* out) {
  const int state = 2 + a.head_dim;
  // the token's partials: chunks first_chunk .. its position's
  const int chunks = a.tokpos[t] / (a.page_size * a.chunk_pages) - first_chunk(a, a.tokpos[t]) + 1;
  for (int hq = 0; hq < a.num_heads; ++hq) {
    const float* base = a.partial + ((int64_t)a.chunk_off[t] * a.num_heads + hq) * state;
    const int64_t step = (int64_t)a.num_heads * state;
    float m = kNegInf;
    for (int c = 0; c < chunks; ++c) m = std::max(m, base[c * step]);
    float l = 0.0f;
    __m256 o[ND];
    for (int d = 0; d < ND; ++d) o[d] = _mm256_setzero_ps();
    for (int c = 0; c < chunks; ++c) {
      const float* st = base + c * step;
      const float w = exp1(st[0] - m);
      l = l + st[1] * w;
      const __m256 wv = _mm256_set1_ps(w);
      for (int d = 0; d < ND; ++d)
        o[d] = _mm256_add_ps(o[d], _mm256_mul_ps(_mm256_loadu_ps(st + 2 + 8 * d), wv));
    }
    const __m256 lv = _mm256_set1_ps(l);
    float* dst = out + ((int64_t)t * a.num_heads + hq) * a.head_dim;
    for (int d = 0; d < ND; ++d) _mm256_storeu_ps(dst + 8 * d, _mm256_div_ps(o[d], lv));
  }
}

// How a step's items become units of work: each item cut into `split` parts by KV heads, on
// `threads` threads, claiming ahead (`ahead`) or not.
struct UnitPlan {
  int split, num_units, threads;
  bool ahead;
};

// Fewer than 2 items per thread (decode at batch 1 and under 256 * 2 * threads keys): cut each
// item by KV heads, so that every thread has work (bitwise the same; see run_item). A single
// thread keeps whole items, and so does a small step: under kSplitWork (pages x query rows) in
// all, or 4 times that for one item, whose thread the cut would wake (at batch 1, 256 keys:
// +3 us for -4 us, measured worse). More items already balance: cutting them measured slower
// (4 items on 2 threads). Claiming ahead needs 2 units per thread (claim_units).
template <class T>
UnitPlan plan_units(const Args<T>& a, int num_items, int num_threads) {
  int split = 1;
  if (num_threads > 1 && num_items < 2 * num_threads && a.kv_heads > 1) {
    int64_t work = 0;
    for (int i = 0; i < num_items; ++i) {
      const int* item = a.items + 3 * i;
      int rows = 0;
      for (int e = item[1]; e < item[2]; ++e) rows += a.entries[4 * e + 2];
      const ChunkPages cp = chunk_pages_of(a, i);
      work += (int64_t)rows * (cp.last - cp.first + 1);
    }
    if (work >= (num_items > 1 ? kSplitWork : 4 * kSplitWork))
      split = std::min(a.kv_heads, (4 * num_threads + num_items - 1) / num_items);
  }
  const int num_units = num_items * split;
  const int threads = std::max(1, std::min(num_threads, num_units));
  return UnitPlan{split, num_units, threads, num_units >= 2 * threads};
}

// One thread's share of the units: run_unit(unit, the unit it runs next or nullptr, whether
// the previous unit prefetched this one). With `ahead`, a thread claims its next unit before
// running the current one, so that the current unit can prefetch the next one's pages; not
// with fewer than 2 units per thread: the first thread would claim the units the others wake
// up for (2 items on 2 threads ran one after the other).
template <class F>
void claim_units(std::atomic<int>& next, const UnitPlan& plan, int kv_heads, F&& run_unit) {
  int i = next.fetch_add(1);
  for (bool prefetched = false; i < plan.num_units; prefetched = plan.ahead) {
    const int after = plan.ahead ? next.fetch_add(1) : plan.num_units;
    const Unit following = unit_of(after, plan.split, kv_heads);
    run_unit(unit_of(i, plan.split, kv_heads), after < plan.num_units ? &following : nullptr,
             prefetched);
    i = plan.ahead ? after : next.fetch_add(1);
  }
}

// Every token's rows: its chunk partials merged (merge_row), split over the threads.
template <int ND, class T>
void merge_rows(const Args<T>& a, int num_tokens, float* out) {
  parallel_for(num_tokens, 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) merge_row<ND>(a, (int)t, out);
  });
}

template <int ND, class T>
void run(const Args<T>& a, int num_items, int num_tokens, int num_threads, float* out) {
  const UnitPlan plan = plan_units(a, num_items, num_threads);
  std::atomic<int> next{0};
  parallel_for(plan.threads, 1, [&](int64_t, int64_t) {
    claim_units(next, plan, a.kv_heads, [&](Unit un, const Unit* then, bool prefetched) {
      if (plan.split > 1)
        run_item<ND, true>(a, un, prefetched, then);
      else
        run_item<ND, false>(a, un, prefetched, then);
    });
  });
  merge_rows<ND>(a, num_tokens, out);
}

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
// ---- bf16 dot products on AMX tiles (`bf16_dots`; the amx build variant) ----------------
//
// The same items, chunks and chunk merge as above, but each (row, head) takes these operations
// per chunk, which depend only on its own query, position and K/V (bf16 pool):
// - q is scaled in fp32 by scale * log2(e) and rounded to bf16 (RNE): scores in log2 units;
// - scores s = q.k of the chunk's keys as TDPBF16PS computes them (fp32 accumulation of exact
//   bf16 products, one tile op per 32 dims, dims in order), keys past the row's position -inf;
//   m = max s over the chunk; p = 2^(s - m) (exp2_p16); l = sum p in key order; the P.V sums
//   = p rounded to bf16 times V as TDPBF16PS computes them from zero, one op per 32 keys, keys
//   in order, over the whole chunk. The chunk's state is (m * ln 2, l, P.V): with the chunk's
//   max known before any exp, nothing is rescaled inside a chunk (the chunks' merge does that,
//   as for fp32).
// Rows share tiles: a score tile is S^T (16 keys x 16 rows: a lane per row, so the softmax is
// per lane with no cross-lane step), P.V is rows x 16 dims. A tile element depends only on its
// own A row, B column and initial value, and the key tiles a chunk computes beyond a row's
// position hold p = 0 for it (exact zero products: TDPBF16PS flushes denormal results, so its
// accumulators never hold a value that adding zeros would change; l adds exact zeros). So rows
// are bitwise the same in any batch, tile, chunking, decode or prefill and thread count, on
// AMX hosts; the fp32 kernel above gives other bits (q and p rounded), so the engine's
// fingerprint says which ran (`BF16_ATTENTION_SCHEME`).
constexpr int kChunkKeys = 256;  // keys of a chunk (chunk_pages x page_size, plan.py)
constexpr int kLanes = 16;       // query rows per tile (16 fp32 lanes)
constexpr int kTileKeys = 16;    // keys per score tile, and the page size unit

// Tiles (load_full_tiles: all 16 rows x 64 bytes): while a row block's scores are computed
// 0..1 = K A, 2..3 = q^T B (resident for head_dim <= 64, else reloaded), 4..7 = scores C in
// turn; then 0 = P rows A, 1..3 = V pairs B in turn, 4..7 = P.V C (16 dims each).

// 16 x 16 dwords transposed in registers: r[i][j] -> r[j][i].
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // u[4i + j], 128-bit lane L: column 4L + j of rows 4i..4i+3
  for (int j = 0; j < 4; ++j) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
    r[j] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
    r[12 + j] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
  }
}

// Word indices that interleave the two 16-word halves of a zmm: word 2i <- i, 2i + 1 <- 16 + i.
inline __m512i interleave_halves() {
  static const __m512i interleave = [] {
    alignas(64) int16_t idx[32];
    for (int i = 0; i < 16; ++i) {
      idx[2 * i] = static_cast<int16_t>(i);
      idx[2 * i + 1] = static_cast<int16_t>(16 + i);
    }
    return _mm512_load_si512(idx);
  }();
  return interleave;
}

// 16 dwords of bf16 pairs: dword i = (a[i], b[i]) rounded to bf16 (RNE), a in the low half;
// `interleave` = interleave_halves(), taken once by the caller's loop (not a static's guard
// check per pair).
inline __m512i bf16_pair(__m512 a, __m512 b, __m512i interleave) {
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// 32 consecutive fp32 as 16 dwords of bf16 pairs in order (RNE).
inline __m512i bf16_row(const float* x, __m512 scale) {
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + 16), scale),
                                      _mm512_mul_ps(_mm512_loadu_ps(x), scale));
}

// 2^x for the bf16 path's softmax (x <= 0: scores minus their chunk's max, in log2 units: q
// carries log2 e in its scale, so no multiply here), 9 operations against exp16's 17: 2^n *
// 2^f, f in [-1/2, 1/2] by its degree-5 Taylor polynomial (relative error below 3e-6; p is
// rounded to bf16, 2^-9, right after), n applied by VSCALEFPS. kClamp: x below -288 (masked
// keys: -inf; NaN from -inf - -inf takes the bound too) gives exactly 0. Without it x must be
// finite (keys every row of the tile sees), and each finite x gives the same result.
template <bool kClamp>
inline __m512 exp2_p16(__m512 x) {
  const __m512 t = kClamp ? _mm512_max_ps(x, _mm512_set1_ps(-288.0f)) : x;
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 y = _mm512_set1_ps(1.3333558146e-3f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291076e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504108665e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650696e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718056e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// The next unit's pages into L2, a few lines at a time between the current unit's tile and
// vector work. A decode unit's bytes come from memory: one burst of prefetches per page (as
// before) fills the core's line fill buffers and stalls it until they drain, so the compute
// waited on memory instead of running beside it; lines issued at about the pace the work
// goes keep misses in flight all along. Measured on an AMX host (2 threads, SmolLM2 shapes,
// both builds in one process, calls alternated): decode attention 32 x 2,048 -22%, 8 x 4,096
// over 30 layers -14%, an engine decode step's attention at 8 x 4.2k -16%. Alone (and with a
// thread-local lookup per hook) it made prefill chunks 9-15% slower; with the tile overlap in
// bf16_rows the prefill chunk is 7-9% faster than before both. Prefetches change no
// arithmetic.
struct PageStream {
  const char* const* spans = nullptr;  // the pages' first bytes
  int n = 0, i = 0;                    // spans, the current one
  int64_t off = 0, span = 0;           // the next line's offset in it, a span's bytes
  // the next `lines` lines
  inline void step(int lines) {
    while (lines-- > 0 && i < n) {
      _mm_prefetch(spans[i] + off, _MM_HINT_T1);
      off += 64;
      if (off >= span) {
        off = 0;
        ++i;
      }
    }
  }
  void finish() {
    while (i < n) step(64);
  }
};
constexpr int kMaxStreamSpans = 64;  // a chunk's pages (256 keys, pages of >= 16 keys: 16)

// Lines of the next unit per piece of work: a 16-key score tile, a key pair's p, a key pair's
// V row. With 16-page chunks of SmolLM2's 3 KV heads x 64 dims this spreads a unit's 3,072
// lines (16 pages x 12 KB) over its heads' work.
constexpr int kLinesPerScoreTile = 16, kLinesPerP = 4, kLinesPerVRow = 2;

template <int D>
struct Bf16Work {
  // V of the chunk's keys for one KV head as B tiles: [32-key half][16-dim tile][16 key pairs]
  // [16 dims] dwords (V[2j][d], V[2j + 1][d]).
  alignas(64) uint32_t vp[kChunkKeys / 32][D / 16][16][16];
  alignas(64) uint32_t qt[D / 32][16][16];  // q^T: [32-dim tile][dim pair][row]
  alignas(64) float s[kChunkKeys][kLanes];  // the chunk's scores: [key][row]
  alignas(64) uint32_t pa[kChunkKeys / 32][16][16];  // p as A tiles: [32-key half][row][pair]
  alignas(64) float acc[kLanes][D];                  // P.V
};

// Tile instructions on a tile number given as a template argument (the <immintrin.h> macros
// paste their tile number into the instruction text, so it must be a literal there); the same
// instructions and operands as those macros.
template <int T>
inline void tile_zero() {
  __asm__ volatile("tilezero %%tmm%c0" ::"n"(T));
}
template <int T>
inline void tile_load(const void* base, int64_t stride) {
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"((long)stride), "n"(T));
}
template <int T>
inline void tile_store(void* base, int64_t stride) {
  __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"((long)stride), "n"(T)
                   : "memory");
}
template <int C, int A, int B>  // C += A . B
inline void tile_dp() {
  __asm__ volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"n"(C), "n"(A), "n"(B));
}

// Scores of one 16-key tile for the row block: S^T into out rows [16 kt, 16 kt + 16), summed
// on tile C (4..7: the P.V sums are not live while the chunk's scores are computed). The
// caller rotates C over 4..7 and K's A tiles alternate between 0 and 1, so consecutive score
// tiles do not wait on each other's tiles (zero, loads, dot products, store: one tile's chain
// is several times a dot product's issue interval); the same operations per tile.
template <int D, int C>
inline void score_tile(Bf16Work<D>& w, const bf16* k, int64_t row_bytes, int kt,
                       float (*out)[kLanes]) {
  tile_zero<C>();
  if constexpr (D == 32) {
    constexpr int A = C % 2;
    tile_load<A>(k, row_bytes);
    tile_dp<C, A, 2>();
  } else if constexpr (D == 64) {
    tile_load<0>(k, row_bytes);
    tile_dp<C, 0, 2>();
    tile_load<1>(k + 32, row_bytes);
    tile_dp<C, 1, 3>();
  } else {
    for (int t = 0; t < D / 32; t += 2) {
      tile_load<0>(k + 32 * t, row_bytes);
      tile_load<2>(w.qt[t], 64);
      tile_dp<C, 0, 2>();
      tile_load<1>(k + 32 * (t + 1), row_bytes);
      tile_load<3>(w.qt[t + 1], 64);
      tile_dp<C, 1, 3>();
    }
  }
  tile_store<C>(out[kTileKeys * kt], 64);
}

// P.V sums in tiles 4 .. 3 + N (dims [16 c0, 16 c0 + 16 N)): one 32-key half added. The V
// tiles rotate over 1..3 (q^T's tiles are free once the scores are done), so a V load need
// not wait for the dot product that read the previous one.
template <int D, int C0, int N>
inline void pv_half(Bf16Work<D>& w, int kh) {
  _tile_loadd(0, w.pa[kh], 64);
  _tile_loadd(1, w.vp[kh][C0], 64);
  _tile_dpbf16ps(4, 0, 1);
  if constexpr (N > 1) {
    _tile_loadd(2, w.vp[kh][C0 + 1], 64);
    _tile_dpbf16ps(5, 0, 2);
  }
  if constexpr (N > 2) {
    _tile_loadd(3, w.vp[kh][C0 + 2], 64);
    _tile_dpbf16ps(6, 0, 3);
  }
  if constexpr (N > 3) {
    _tile_loadd(1, w.vp[kh][C0 + 3], 64);
    _tile_dpbf16ps(7, 0, 1);
  }
}

template <int N>
inline void pv_zero() {
  _tile_zero(4);
  if constexpr (N > 1) _tile_zero(5);
  if constexpr (N > 2) _tile_zero(6);
  if constexpr (N > 3) _tile_zero(7);
}

template <int D, int C0, int N>
inline void pv_store(Bf16Work<D>& w) {
  constexpr int64_t ld = D * sizeof(float);
  _tile_stored(4, &w.acc[0][16 * C0], ld);
  if constexpr (N > 1) _tile_stored(5, &w.acc[0][16 * (C0 + 1)], ld);
  if constexpr (N > 2) _tile_stored(6, &w.acc[0][16 * (C0 + 2)], ld);
  if constexpr (N > 3) _tile_stored(7, &w.acc[0][16 * (C0 + 3)], ld);
}

// head_dim over 64: the P.V sums of dim tiles [C0, C0 + 4), then the next four, ... (each pass
// over every half, 4 sums on tiles 4..7).
template <int D, int C0>
inline void pv_passes(Bf16Work<D>& w, int nh) {
  pv_zero<4>();
  for (int kh = 0; kh < nh; ++kh) pv_half<D, C0, 4>(w, kh);
  pv_store<D, C0, 4>(w);
  if constexpr (C0 + 4 < D / 16) pv_passes<D, C0 + 4>(w, nh);
}

// One KV head's V pairs for keys [key0, key0 + nkeys) (pairs past nkeys, and the `skip` keys
// before the item's first page, are zero: their p is 0 for every row, and 0 * a finite V is 0).
template <int D>
void build_v_pairs(Bf16Work<D>& w, PageStream& next, const Args<bf16>& a, const int* table,
                   int key0, int skip, int h, int nkeys) {
  const __m512i interleave = interleave_halves();
  const int64_t stride = (int64_t)a.kv_heads * D;
  const int halves = (nkeys + 31) / 32;
  for (int kh = 0; kh < halves; ++kh)
    for (int j = 0; j < 16; ++j) {
      const int key = 32 * kh + 2 * j;
      if (key >= nkeys || key < skip) {
        for (int c = 0; c < D / 16; ++c) _mm512_store_si512(w.vp[kh][c][j], _mm512_setzero_si512());
        continue;
      }
      const int page = (key0 + key) / a.page_size, off = (key0 + key) % a.page_size;
      const bf16* v = (const bf16*)page_span(a, table, page) + a.kv_stride + off * stride + h * D;
      const bool second = key + 1 < nkeys;  // keys come in pairs within a page (page % 16 == 0)
      for (int c = 0; c < D / 16; ++c) {
        const __m256i v0 = _mm256_loadu_si256((const __m256i*)(v + 16 * c));
        const __m256i v1 =
            second ? _mm256_loadu_si256((const __m256i*)(v + stride + 16 * c)) : _mm256_setzero_si256();
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(v0), v1, 1);
        _mm512_store_si512(w.vp[kh][c][j], _mm512_permutexvar_epi16(interleave, both));
      }
      next.step(kLinesPerVRow);
    }
}

// Up to 16 rows of KV head h through the item's keys of chunk `chunk` from key0 (the item's
// first page, or 16 keys before it: 32-key halves stay aligned to the chunk) up to page last;
// their states into the partials.
template <int D>
void bf16_rows(Bf16Work<D>& w, PageStream& next, const Args<bf16>& a, const int* table,
               int chunk, int key0, int skip, int last, int h, const int* tok, const int* grp,
               int nr) {
  const int chunk_start = key0;  // keys below are relative to key0
  const int64_t stride = (int64_t)a.kv_heads * D, row_bytes = stride * sizeof(bf16);
  const __m512 scale = _mm512_set1_ps(a.scale * 1.44269504088896341f);  // log2 units
  alignas(64) int pos[kLanes], lo[kLanes];
  int maxpos = 0, minpos = std::numeric_limits<int>::max(), maxlo = 0;
  // q^T: each row's scaled q as bf16 pairs, transposed per 32-dim tile
  for (int t = 0; t < D / 32; ++t) {
    __m512i r[16];
    for (int n = 0; n < kLanes; ++n) {
      if (n >= nr) {
        r[n] = _mm512_setzero_si512();
        continue;
      }
      const float* q = a.query + ((int64_t)tok[n] * a.num_heads + h * a.group + grp[n]) * D;
      r[n] = bf16_row(q + 32 * t, scale);
    }
    transpose16(r);
    for (int j = 0; j < 16; ++j) _mm512_store_si512(w.qt[t][j], r[j]);
  }
  for (int n = 0; n < kLanes; ++n) {
    pos[n] = n < nr ? a.tokpos[tok[n]] : -1;
    lo[n] = n < nr ? window_lo(pos[n], a.window) : 0;
    if (n < nr) {
      maxpos = std::max(maxpos, pos[n]);
      minpos = std::min(minpos, pos[n]);
      maxlo = std::max(maxlo, lo[n]);
    }
  }
  if constexpr (D <= 64) {
    _tile_loadd(2, w.qt[0], 64);
    if constexpr (D == 64) _tile_loadd(3, w.qt[1], 64);
  }
  const __m512i posv = _mm512_load_si512(pos), lov = _mm512_load_si512(lo);
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  // every key tile a row of the tile sees: the item's, up to the last row's position
  const int keys_end = std::min((last + 1) * a.page_size, (chunk + 1) * a.chunk_pages * a.page_size);
  const int ntiles = std::min((maxpos - chunk_start) / kTileKeys + 1,
                              (keys_end - chunk_start) / kTileKeys);
  const int nkeys = kTileKeys * ntiles, nh = (nkeys + 31) / 32;
  // the chunk's max; keys [open_lo, open) (from the latest row's window start up to the
  // earliest row's position) are visible to every row: no mask. A tile's keys are taken two
  // tiles after it is issued, so the vector work runs beside the later tiles' dot products
  // instead of waiting for the last store (max is exact in any order).
  __m512 m = ninf;
  const int open = std::min(nkeys, minpos - chunk_start + 1);
  const int open_lo = std::max(0, maxlo - chunk_start);
  auto take_max = [&](int j0, int j1) {
    for (int j = j0; j < j1; ++j) {
      if (j >= open_lo && j < open) {
        m = _mm512_max_ps(m, _mm512_load_ps(w.s[j]));
        continue;
      }
      const __m512i key = _mm512_set1_epi32(chunk_start + j);
      const __mmask16 sees =
          _mm512_cmpge_epi32_mask(posv, key) & _mm512_cmple_epi32_mask(lov, key);
      const __m512 sj = _mm512_mask_mov_ps(ninf, sees, _mm512_load_ps(w.s[j]));
      _mm512_store_ps(w.s[j], sj);
      m = _mm512_max_ps(m, sj);
    }
  };
  constexpr int kMaxLag = 2;  // tiles between a tile's issue and its keys' max
  for (int kt = 0; kt < ntiles; ++kt) {
    const int key = chunk_start + kTileKeys * kt;
    if (kTileKeys * kt < skip) {  // before the item's first page, not read: no row sees them
      for (int j = kTileKeys * kt; j < kTileKeys * (kt + 1); ++j) _mm512_store_ps(w.s[j], ninf);
    } else {
      const int page = key / a.page_size, off = key % a.page_size;
      const bf16* k = (const bf16*)page_span(a, table, page) + off * stride + h * D;
      switch (kt % 4) {
        case 0: score_tile<D, 4>(w, k, row_bytes, kt, w.s); break;
        case 1: score_tile<D, 5>(w, k, row_bytes, kt, w.s); break;
        case 2: score_tile<D, 6>(w, k, row_bytes, kt, w.s); break;
        default: score_tile<D, 7>(w, k, row_bytes, kt, w.s); break;
      }
      next.step(kLinesPerScoreTile);
    }
    if (kt >= kMaxLag) take_max(kTileKeys * (kt - kMaxLag), kTileKeys * (kt - kMaxLag + 1));
  }
  take_max(kTileKeys * std::max(ntiles - kMaxLag, 0), nkeys);
  // p, l, and p as A tiles half by half; each half's P.V goes onto the tiles as soon as it is
  // packed (its tile work overlaps the next half's vector work)
  if constexpr (D <= 64) pv_zero<D / 16>();
  const __m512i interleave = interleave_halves();
  __m512 l = _mm512_setzero_ps();
  for (int kh = 0; kh < nh; ++kh) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) {
      const int k0 = 32 * kh + 2 * j;  // nkeys is even: keys come in whole pairs
      if (k0 >= nkeys) {
        r[j] = _mm512_setzero_si512();
        continue;
      }
      const __m512 x0 = _mm512_sub_ps(_mm512_load_ps(w.s[k0]), m);
      const __m512 x1 = _mm512_sub_ps(_mm512_load_ps(w.s[k0 + 1]), m);
      const bool seen = k0 >= open_lo && k0 + 1 < open;  // both keys seen by every row: finite
      const __m512 p0 = seen ? exp2_p16<false>(x0) : exp2_p16<true>(x0);
      const __m512 p1 = seen ? exp2_p16<false>(x1) : exp2_p16<true>(x1);
      l = _mm512_add_ps(_mm512_add_ps(l, p0), p1);
      r[j] = bf16_pair(p0, p1, interleave);
      next.step(kLinesPerP);
    }
    transpose16(r);
    for (int n = 0; n < 16; ++n) _mm512_store_si512(w.pa[kh][n], r[n]);
    if constexpr (D <= 64)
      if (kh >= 1) pv_half<D, 0, D / 16>(w, kh - 1);
  }
  if constexpr (D <= 64) {
    if (nh >= 1) pv_half<D, 0, D / 16>(w, nh - 1);
    pv_store<D, 0, D / 16>(w);
  } else {  // 8 or 16 dim tiles: passes over the halves, 4 sums each
    pv_passes<D, 0>(w, nh);
  }
  alignas(64) float ms[kLanes], ls[kLanes];
  _mm512_store_ps(ms, m);
  _mm512_store_ps(ls, l);
  const int state = 2 + D;
  for (int n = 0; n < nr; ++n) {
    const int64_t row = partial_of(a, tok[n], chunk) * a.num_heads + h * a.group + grp[n];
    float* st = a.partial + row * state;
    st[0] = ms[n] * 0.693147180559945309f;  // the chunk's max in natural units, for the merge
    st[1] = ls[n];
    for (int c = 0; c < D; c += 16)  // inline: a memmove call per row cost ~5% of a prefill
      _mm512_storeu_ps(st + 2 + c, _mm512_load_ps(&w.acc[n][c]));
  }
}

// One unit of the bf16 path: the item's chunk for KV heads [h0, h1), rows in tiles of 16.
// Decode is memory-bound: while it runs, the next unit's pages (`after`, if any) go to L2 at
// the pace of its work (PageStream), so that they are there when that unit starts. No
// arithmetic changes.
template <int D>
void run_item_bf16(const Args<bf16>& a, Unit un, const Unit* after) {
  thread_local Bf16Work<D> w;
  const int* item = a.items + 3 * un.item;
  const int e0 = item[1], e1 = item[2];
  const ChunkPages cp = chunk_pages_of(a, un.item);
  const int* table = cp.table;
  const int chunk = item[0], last = cp.last, chunk_start = chunk * a.chunk_pages * a.page_size;
  // the item's first key, rounded down to a 32-key half of the chunk (a window's first page
  // may start at an odd 16 keys): a row's halves are the same whichever item it is in
  const int key0 = chunk_start + (cp.first * a.page_size - chunk_start) / 32 * 32;
  const int skip = cp.first * a.page_size - key0;  // 0, or 16 keys of a page not read
  const int nkeys = std::min(cp.pmax + 1, (last + 1) * a.page_size) - key0;
  ChunkPages np{};
  if (after) np = chunk_pages_of(a, after->item);
  const int64_t span = 2 * a.kv_stride * (int64_t)sizeof(bf16);  // a page's K and V bytes
  const char* spans[kMaxStreamSpans];
  int nspans = 0;
  if (after)
    for (int p = np.first; p <= np.last && nspans < kMaxStreamSpans; ++p)
      spans[nspans++] = page_span(a, np.table, p);
  PageStream next{spans, nspans, 0, 0, span};  // the next unit's pages
  int tok[kLanes], grp[kLanes];
  for (int h = un.h0; h < un.h1; ++h) {
    build_v_pairs<D>(w, next, a, table, key0, skip, h, nkeys);
    int nr = 0;
    for (int e = e0; e < e1; ++e) {
      const int* en = a.entries + 4 * e;
      for (int t = en[1]; t < en[1] + en[2]; ++t) {
        if (!meets_chunk(a, a.tokpos[t], chunk)) continue;
        for (int g = 0; g < a.group; ++g) {
          tok[nr] = t;
          grp[nr] = g;
          if (++nr == kLanes) {
            bf16_rows<D>(w, next, a, table, chunk, key0, skip, last, h, tok, grp, nr);
            nr = 0;
          }
        }
      }
    }
    if (nr) bf16_rows<D>(w, next, a, table, chunk, key0, skip, last, h, tok, grp, nr);
  }
  next.finish();  // what the unit's work did not pace out (a short chunk)
}

template <int D>
void run_bf16(const Args<bf16>& a, int num_items, int num_tokens, int num_threads, float* out) {
  const UnitPlan plan = plan_units(a, num_items, num_threads);
  std::atomic<int> next{0};
  parallel_on_full_tiles(plan.threads, [&](int64_t, int64_t) {
    claim_units(next, plan, a.kv_heads, [&](Unit un, const Unit* then, bool) {
      run_item_bf16<D>(a, un, then);
    });
  });
  merge_rows<D / 8>(a, num_tokens, out);
}
#endif

thread_local std::vector<float> partial_buffer;  // reused: fresh MBs would page-fault per call

template <class T>
void run_typed(const AttentionArgs& x, int num_threads) {
  const int64_t total = x.chunk_off[x.num_tokens];
  const size_t need = total * x.num_heads * (2 + x.head_dim);
  if (partial_buffer.size() < need) partial_buffer.resize(need);
  const int64_t kv_stride = (int64_t)x.page_size * x.kv_heads * x.head_dim;
  Args<T> a{x.query, static_cast<const T*>(x.pool), x.block_tables, x.items, x.entries,
            x.positions, x.chunk_off, partial_buffer.data(), x.width, x.layer * 2 * kv_stride,
            x.num_layers * 2 * kv_stride, kv_stride, x.num_heads, x.kv_heads,
            x.num_heads / x.kv_heads, x.head_dim, x.page_size, x.chunk_pages, x.scale, x.window};
  if (x.bf16_dots) {
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, bf16>) {
      switch (x.head_dim) {
        case 32: run_bf16<32>(a, x.num_items, x.num_tokens, num_threads, x.out); return;
        case 64: run_bf16<64>(a, x.num_items, x.num_tokens, num_threads, x.out); return;
        case 128: run_bf16<128>(a, x.num_items, x.num_tokens, num_threads, x.out); return;
        case 256: run_bf16<256>(a, x.num_items, x.num_tokens, num_threads, x.out); return;
        default:
          throw std::invalid_argument("bf16 attention: head_dim must be 32, 64, 128 or 256");
      }
    }
#endif
    throw std::invalid_argument("bf16 attention needs a bfloat16 pool on an AMX-BF16 build");
  }
  switch (x.head_dim / 8) {
    case 1: run<1>(a, x.num_items, x.num_tokens, num_threads, x.out); break;
    case 2: run<2>(a, x.num_items, x.num_tokens, num_threads, x.out); break;
    case 4: run<4>(a, x.num_items, x.num_tokens, num_threads, x.out); break;
    case 8: run<8>(a, x.num_items, x.num_tokens, num_threads, x.out); break;
    case 16: run<16>(a, x.num_items, x.num_tokens, num_threads, x.out); break;
    case 32: run<32>(a, x.num_items, x.num_tokens, num_threads, x.out); break;
    default: throw std::invalid_argument("head_dim must be 8, 16, 32, 64, 128 or 256");
  }
}

}  // namespace

bool bf16_attention_available() {
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
  return amx_permitted();
#else
  return false;
#endif
}

void paged_attention(const AttentionArgs& x, int num_threads) {
  if (x.page_size > kMaxPage || x.head_dim % 8 || x.head_dim > kMaxHeadDim)
    throw std::invalid_argument("unsupported page_size or head_dim");
  if (x.window < 0) throw std::invalid_argument("window must be >= 0");
  if (x.bf16_dots && (!bf16_attention_available() || x.page_size % 16))
    throw std::invalid_argument(
        "bf16 attention needs AMX-BF16 tiles (the amx build, granted by the OS) and a page "
        "size that is a multiple of 16");
  switch (x.pool_type) {
    case KVType::f32: run_typed<float>(x, num_threads); break;
    case KVType::bf16: run_typed<bf16>(x, num_threads); break;
    case KVType::f16: run_typed<fp16>(x, num_threads); break;
    default: throw std::invalid_argument("kv pool dtype must be float32, bfloat16 or float16");
  }
}

}  // namespace kvr
