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
// order), so tiles change no bit. (Tiles of several query tokens, up to 6 rows sharing each
// load, measured no faster on Zen 4 at a 2,048-token prefill: the tile is FMA-bound, not
// load-bound.) Decode reads a page once per layer and step from memory: a page is prefetched
// into L2 during the page before it (across items too: a thread claims its next item before
// running the current one), and each head's K/V rows into L1 while the previous head computes.
#include <algorithm>
#include <atomic>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "kv_types.h"
#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace kvr {

namespace {

constexpr int kMaxPage = 256;
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
};

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
  for (int r = 0; r < R; ++r) {
    float* st = st0 + r * kState;
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

// The G query rows of one KV head, in tiles of up to 3 rows (4 = 2 + 2).
template <int ND, class T>
inline void group_page(const float* qrow, int group, __m256 scale, const T* k, const T* v,
                       int64_t stride, int nvalid, float* st) {
  constexpr int kD = 8 * ND, kState = 2 + kD;
  for (int g = 0; g < group;) {
    const int left = group - g, r = left == 4 ? 2 : std::min(3, left);
    const float* q = qrow + g * kD;
    float* s = st + g * kState;
    if (r == 3)
      rows_page<ND, 3>(q, scale, k, v, stride, nvalid, s);
    else if (r == 2)
      rows_page<ND, 2>(q, scale, k, v, stride, nvalid, s);
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

// The first page's K and V of a unit's item, and the unit's first KV head.
template <class T>
inline const char* first_span(const Args<T>& a, int index) {
  const int* item = a.items + 3 * index;
  const int* table = a.tables + a.width * a.entries[4 * item[1]];
  return page_span(a, table, item[0] * a.chunk_pages);
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
      const int nvalid = std::min(a.page_size, pos - kstart + 1);
      const int64_t row0 = (int64_t)(a.chunk_off[t] + chunk) * a.num_heads + h * a.group;
      float* st = a.partial + row0 * state;
      const float* qrow = a.query + ((int64_t)t * a.num_heads + h * a.group) * a.head_dim;
      group_page<ND>(qrow, a.group, scale, k, v, stride, nvalid, st);
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
      // A row block may start before this chunk: its earlier rows have no partial here.
      if (a.tokpos[t] < chunk * a.chunk_pages * a.page_size) continue;
      const int64_t row0 = (int64_t)(a.chunk_off[t] + chunk) * a.num_heads + h0 * a.group;
      float* st = a.partial + row0 * state;
      for (int hq = h0 * a.group; hq < h1 * a.group; ++hq, st += state) {
        st[0] = kNegInf;
        std::fill(st + 1, st + state, 0.0f);
      }
    }
  }
  const int first = chunk * a.chunk_pages;
  const int last = std::min(pmax / a.page_size, first + a.chunk_pages - 1);
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
          thread_local float kw[kMaxPage * 128], vw[kMaxPage * 128];
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
  const int chunks = a.tokpos[t] / (a.page_size * a.chunk_pages) + 1;
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

template <int ND, class T>
void run(const Args<T>& a, int num_items, int num_tokens, int num_threads, float* out) {
  std::atomic<int> next{0};
  // Fewer than 2 items per thread (decode at batch 1 and under 256 * 2 * threads keys): cut
  // each item by KV heads, so that every thread has work (bitwise the same; see run_item). A
  // single thread keeps whole items, and so does a small step: under kSplitWork (pages x query
  // rows) in all, or 4 times that for one item, whose thread the cut would wake (at batch 1,
  // 256 keys: +3 us for -4 us, measured worse). More items already balance: cutting them
  // measured slower (4 items on 2 threads).
  int split = 1;
  if (num_threads > 1 && num_items < 2 * num_threads && a.kv_heads > 1) {
    int64_t work = 0;
    for (int i = 0; i < num_items; ++i) {
      const int* item = a.items + 3 * i;
      int pmax = 0, rows = 0;
      for (int e = item[1]; e < item[2]; ++e) {
        pmax = std::max(pmax, a.entries[4 * e + 3] + a.entries[4 * e + 2] - 1);
        rows += a.entries[4 * e + 2];
      }
      const int first = item[0] * a.chunk_pages;
      const int last = std::min(pmax / a.page_size, first + a.chunk_pages - 1);
      work += (int64_t)rows * (last - first + 1);
    }
    if (work >= (num_items > 1 ? kSplitWork : 4 * kSplitWork))
      split = std::min(a.kv_heads, (4 * num_threads + num_items - 1) / num_items);
  }
  const int num_units = num_items * split;
  const int threads = std::max(1, std::min(num_threads, num_units));
  const bool ahead = num_units >= 2 * threads;
  parallel_for(threads, 1, [&](int64_t, int64_t) {
    // Each thread claims its next unit before running the current one, so that the current
    // unit's last page can prefetch the next unit's first page; but not with fewer than 2 units
    // per thread: the first thread would claim the units the others wake up for (2 items on
    // 2 threads ran one after the other).
    int i = next.fetch_add(1);
    for (bool prefetched = false; i < num_units; prefetched = ahead) {
      const int after = ahead ? next.fetch_add(1) : num_units;
      const Unit following = unit_of(after, split, a.kv_heads);
      const Unit* then = after < num_units ? &following : nullptr;
      if (split > 1)
        run_item<ND, true>(a, unit_of(i, split, a.kv_heads), prefetched, then);
      else
        run_item<ND, false>(a, unit_of(i, split, a.kv_heads), prefetched, then);
      i = ahead ? after : next.fetch_add(1);
    }
  });
  parallel_for(num_tokens, 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) merge_row<ND>(a, (int)t, out);
  });
}

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
            x.num_heads / x.kv_heads, x.head_dim, x.page_size, x.chunk_pages, x.scale};
  switch (x.head_dim / 8) {
    case 1: run<1>(a, x.num_items, x.num_tokens, num_threads, x.out); break;
    case 2: run<2>(a, x.num_items, x.num_tokens, num_threads, x.out); break;
    case 4: run<4>(a, x.num_items, x.num_tokens, num_threads, x.out); break;
    case 8: run<8>(a, x.num_items, x.num_tokens, num_threads, x.out); break;
    case 16: run<16>(a, x.num_items, x.num_tokens, num_threads, x.out); break;
    default: throw std::invalid_argument("head_dim must be 8, 16, 32, 64 or 128");
  }
}

}  // namespace

void paged_attention(const AttentionArgs& x, int num_threads) {
  if (x.page_size > kMaxPage || x.head_dim % 8 || x.head_dim > 128)
    throw std::invalid_argument("unsupported page_size or head_dim");
  switch (x.pool_type) {
    case KVType::f32: run_typed<float>(x, num_threads); break;
    case KVType::bf16: run_typed<bf16>(x, num_threads); break;
    case KVType::f16: run_typed<fp16>(x, num_threads); break;
    default: throw std::invalid_argument("kv pool dtype must be float32, bfloat16 or float16");
  }
}

}  // namespace kvr
