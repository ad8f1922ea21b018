// Paged attention on CPU, fp32, reading K/V pages in place from the pool.
//
// Every (query row, head) gets a fixed sequence of float operations that depends only on its
// query, its position and its sequence's K/V:
// - per page (a tile of page_size keys): scores = q.k (explicit mul then FMAs over head_dim,
//   a fixed reduction tree), online softmax update of (max, sum, acc) in key order;
// - per chunk of chunk_pages pages, starting fresh: the state is stored as a partial;
// - the partials of chunks 0..c are merged in chunk order at the end.
// Which thread runs which (chunk, rows) item, and which rows share it, changes nothing.
#include <algorithm>
#include <atomic>
#include <limits>
#include <stdexcept>
#include <vector>

#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace kvr {

namespace {

constexpr int kMaxPage = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Args {
  const float* query;
  const float* pool;
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
template <int ND>
inline __m256 scores8(const __m256* q, const float* k, int64_t stride, int j0, int nvalid) {
  __m256 a[8];
  if (j0 + 8 <= nvalid) {
    for (int jj = 0; jj < 8; ++jj)
      a[jj] = _mm256_mul_ps(q[0], _mm256_loadu_ps(k + (j0 + jj) * stride));
    for (int d = 1; d < ND; ++d)
      for (int jj = 0; jj < 8; ++jj)
        a[jj] = _mm256_fmadd_ps(q[d], _mm256_loadu_ps(k + (j0 + jj) * stride + 8 * d), a[jj]);
    return reduce8(a);
  }
  alignas(32) float valid[8];
  for (int jj = 0; jj < 8; ++jj) {
    const int j = j0 + jj;
    a[jj] = _mm256_setzero_ps();
    valid[jj] = j < nvalid ? 0.0f : kNegInf;
    if (j >= nvalid) continue;
    a[jj] = _mm256_mul_ps(q[0], _mm256_loadu_ps(k + j * stride));
    for (int d = 1; d < ND; ++d)
      a[jj] = _mm256_fmadd_ps(q[d], _mm256_loadu_ps(k + j * stride + 8 * d), a[jj]);
  }
  // Adding -inf to invalid lanes masks them; valid lanes add +0 (exact).
  return _mm256_add_ps(reduce8(a), _mm256_load_ps(valid));
}

// One row meets one page: keys [0, nvalid) of k/v (stride between keys) update its state
// st = [max, sum, acc[head_dim]].
template <int ND>
inline void row_page(const float* qrow, __m256 scale, const float* k, const float* v,
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
    const float* vj = v + j * stride;
    for (int d = 0; d < ND; ++d) acc[d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * d), acc[d]);
  }
  st[0] = m_new;
  st[1] = l;
  for (int d = 0; d < ND; ++d) _mm256_storeu_ps(st + 2 + 8 * d, acc[d]);
}

template <int ND>
void run_item(const Args& a, int index) {
  const int* item = a.items + 3 * index;
  const int chunk = item[0], e0 = item[1], e1 = item[2];
  const int state = 2 + a.head_dim;
  const int* table = a.tables + a.width * a.entries[4 * e0];
  int pmax = 0;
  for (int e = e0; e < e1; ++e) {
    const int* en = a.entries + 4 * e;
    pmax = std::max(pmax, en[3] + en[2] - 1);
    for (int t = en[1]; t < en[1] + en[2]; ++t) {
      // A row block may start before this chunk: its earlier rows have no partial here.
      if (a.tokpos[t] < chunk * a.chunk_pages * a.page_size) continue;
      float* st = a.partial + ((int64_t)(a.chunk_off[t] + chunk) * a.num_heads) * state;
      for (int hq = 0; hq < a.num_heads; ++hq, st += state) {
        st[0] = kNegInf;
        std::fill(st + 1, st + state, 0.0f);
      }
    }
  }
  const int first = chunk * a.chunk_pages;
  const int last = std::min(pmax / a.page_size, first + a.chunk_pages - 1);
  const __m256 scale = _mm256_set1_ps(a.scale);
  const int64_t stride = (int64_t)a.kv_heads * a.head_dim;
  for (int page = first; page <= last; ++page) {
    if (page + 1 <= last) {  // the next page's K and V: one contiguous span
      const char* next = (const char*)(a.pool + table[page + 1] * a.block_stride + a.layer_stride);
      for (int64_t off = 0; off < 2 * a.kv_stride * 4; off += 64)
        _mm_prefetch(next + off, _MM_HINT_T0);
    }
    const float* kbase = a.pool + table[page] * a.block_stride + a.layer_stride;
    const float* vbase = kbase + a.kv_stride;
    const int kstart = page * a.page_size;
    for (int h = 0; h < a.kv_heads; ++h) {
      for (int e = e0; e < e1; ++e) {
        const int* en = a.entries + 4 * e;
        for (int j = 0; j < en[2]; ++j) {
          const int pos = en[3] + j, t = en[1] + j;
          if (pos < kstart) continue;
          const int nvalid = std::min(a.page_size, pos - kstart + 1);
          const int64_t row0 = (int64_t)(a.chunk_off[t] + chunk) * a.num_heads + h * a.group;
          float* st = a.partial + row0 * state;
          const float* qrow = a.query + ((int64_t)t * a.num_heads + h * a.group) * a.head_dim;
          for (int g = 0; g < a.group; ++g, st += state, qrow += a.head_dim)
            row_page<ND>(qrow, scale, kbase + h * a.head_dim, vbase + h * a.head_dim, stride,
                         nvalid, st);
        }
      }
    }
  }
}

// Merge a row's chunk partials in chunk order and normalise.
template <int ND>
void merge_row(const Args& a, int t, float* out) {
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

template <int ND>
void run(const Args& a, int num_items, int num_tokens, int num_threads, float* out) {
  std::atomic<int> next{0};
  const int threads = std::max(1, std::min(num_threads, num_items));
  parallel_for(threads, 1, [&](int64_t, int64_t) {
    for (int i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) run_item<ND>(a, i);
  });
  parallel_for(num_tokens, 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) merge_row<ND>(a, (int)t, out);
  });
}

thread_local std::vector<float> partial_buffer;  // reused: fresh MBs would page-fault per call

}  // namespace

void paged_attention(const AttentionArgs& x, int num_threads) {
  if (x.page_size > kMaxPage || x.head_dim % 8 || x.head_dim > 128)
    throw std::invalid_argument("unsupported page_size or head_dim");
  const int64_t total = x.chunk_off[x.num_tokens];
  const size_t need = total * x.num_heads * (2 + x.head_dim);
  if (partial_buffer.size() < need) partial_buffer.resize(need);
  const int64_t kv_stride = (int64_t)x.page_size * x.kv_heads * x.head_dim;
  Args a{x.query, x.pool, x.block_tables, x.items, x.entries, x.positions, x.chunk_off,
         partial_buffer.data(), x.width, x.layer * 2 * kv_stride, x.num_layers * 2 * kv_stride,
         kv_stride, x.num_heads, x.kv_heads, x.num_heads / x.kv_heads, x.head_dim, x.page_size,
         x.chunk_pages, x.scale};
  switch (x.head_dim / 8) {
    case 1: run<1>(a, x.num_items, x.num_tokens, num_threads, x.out); break;
    case 2: run<2>(a, x.num_items, x.num_tokens, num_threads, x.out); break;
    case 4: run<4>(a, x.num_items, x.num_tokens, num_threads, x.out); break;
    case 8: run<8>(a, x.num_items, x.num_tokens, num_threads, x.out); break;
    case 16: run<16>(a, x.num_items, x.num_tokens, num_threads, x.out); break;
    default: throw std::invalid_argument("head_dim must be 8, 16, 32, 64 or 128");
  }
}

}  // namespace kvr
