// Token draws of sampled rows: temperature, min-p, top-k, top-p, then the inverse CDF of a
// uniform number the caller derives from (seed, position).
//
// Per row, over its (already penalised and masked) logits x: w_i = exp((x_i - max x) / T)
// (vec.h's exp8, 8 lanes in every variant, so every ISA gives the same bits); tokens with
// w_i < min_p are dropped (min-p relative to the most likely token, whose w is 1). Then:
// - top_k > 0: the k largest w (ties: lower id first), and top_p over their renormalised mass;
// - top_p < 1: the smallest prefix of all tokens sorted by w (ties: lower id first) whose mass
//   reaches top_p of the total;
// - otherwise every token, in id order.
// The draw takes the first entry whose running sum (in list order) exceeds u times the list's
// sum. Only the tokens above a threshold are sorted, the threshold lowered until the prefix is
// inside them: the prefix and its sums do not depend on which threshold found it.
// Each row is computed alone, in a fixed order: the same token in any batch, thread count or
// ISA variant.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace kvr {

namespace {

struct Candidate {
  float w;
  int32_t id;
};

inline bool before(const Candidate& a, const Candidate& b) {
  return a.w > b.w || (a.w == b.w && a.id < b.id);
}

// Thresholds on w (= exp(d), d <= 0) the candidate search tries in turn; the last takes all.
constexpr float kThresholds[] = {0.0498f /* e^-3 */, 0.00248f /* e^-6 */, 6.1e-6f /* e^-12 */,
                                 3.8e-11f /* e^-24 */, 0.0f};

float row_max(const float* x, int64_t n) {
  __m256 m8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(x + i));
  float m = hmax8(m8);
  for (; i < n; ++i) m = std::fmax(m, x[i]);
  return m;
}

// w = exp((x - m) / t) into `w`, zero below min_p; returns the sum of w (8 lanes, fixed tree).
float weights(const float* x, int64_t n, float m, float t, float min_p, float* w) {
  const __m256 mv = _mm256_set1_ps(m), tv = _mm256_set1_ps(t), pv = _mm256_set1_ps(min_p);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp8(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv), tv));
    e = _mm256_and_ps(e, _mm256_cmp_ps(e, pv, _CMP_GE_OQ));  // below min_p (or NaN): 0
    _mm256_storeu_ps(w + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float s = hsum8(acc);
  for (; i < n; ++i) {
    float e = exp1((x[i] - m) / t);
    if (!(e >= min_p)) e = 0.0f;
    w[i] = e;
    s += e;
  }
  return s;
}

// Tokens with w >= threshold (and w > 0), in id order.
void collect(const float* w, int64_t n, float threshold, std::vector<Candidate>& out) {
  out.clear();
  for (int64_t i = 0; i < n; ++i) {
    if (w[i] >= threshold && w[i] > 0.0f) out.push_back({w[i], static_cast<int32_t>(i)});
  }
}

// The smallest prefix of `c` in sorted order whose running sum reaches `mass`: its length, or
// 0 if the whole list falls short. `c` is sorted only as far as it is read: chunks of growing
// size are selected (nth_element) and sorted in turn, which gives a full sort's order.
size_t prefix_reaching(std::vector<Candidate>& c, float mass, bool sorted) {
  float run = 0.0f;
  size_t done = 0, chunk = 256;
  while (done < c.size()) {
    const size_t end = std::min(c.size(), done + chunk);
    if (!sorted) {
      if (end < c.size()) std::nth_element(c.begin() + done, c.begin() + end, c.end(), before);
      std::sort(c.begin() + done, c.begin() + end, before);
    }
    for (size_t j = done; j < end; ++j) {
      if (run >= mass) return j;  // the exclusive sum reached it: entry j is not kept
      run += c[j].w;
    }
    done = end;
    chunk *= 2;
  }
  return run >= mass ? c.size() : 0;
}

// The top-p prefix over all tokens, sorted.
void top_p_prefix(const float* w, int64_t n, float mass, std::vector<Candidate>& c) {
  for (float threshold : kThresholds) {
    collect(w, n, threshold, c);
    const size_t keep = prefix_reaching(c, mass, false);
    if (keep > 0 || threshold == 0.0f) {
      if (keep > 0) {
        c.resize(keep);
      } else {  // every token: rounding left the sum just short of the mass
        std::sort(c.begin(), c.end(), before);
      }
      return;
    }
  }
}

// The k largest, sorted.
void top_k(const float* w, int64_t n, int64_t k, std::vector<Candidate>& c) {
  for (float threshold : kThresholds) {
    collect(w, n, threshold, c);
    if (static_cast<int64_t>(c.size()) >= k || threshold == 0.0f) break;
  }
  if (static_cast<int64_t>(c.size()) > k) {
    std::nth_element(c.begin(), c.begin() + k, c.end(), before);
    c.resize(k);
  }
  std::sort(c.begin(), c.end(), before);
}

int64_t draw(const std::vector<Candidate>& c, float u) {
  float total = 0.0f;
  for (const Candidate& e : c) total += e.w;
  const float target = u * total;
  float run = 0.0f;
  size_t pos = c.size() - 1;
  for (size_t j = 0; j < c.size(); ++j) {
    run += c[j].w;
    if (run > target) {
      pos = j;
      break;
    }
  }
  while (c[pos].w == 0.0f && pos > 0) --pos;  // rounding at the very top: step back
  return c[pos].id;
}

// Every token in id order (no top-k, no top-p).
int64_t draw_in_id_order(const float* w, int64_t n, float total, float u) {
  const float target = u * total;
  float run = 0.0f;
  int64_t pos = n - 1;
  for (int64_t i = 0; i < n; ++i) {
    run += w[i];
    if (run > target) {
      pos = i;
      break;
    }
  }
  while (w[pos] == 0.0f && pos > 0) --pos;
  return pos;
}

int64_t sample_row(const float* x, int64_t n, const SampleParams& p, std::vector<float>& w,
                   std::vector<Candidate>& c) {
  const float m = row_max(x, n);
  if (!std::isfinite(m)) return 0;  // every token masked (or a NaN row): nothing to draw from
  w.resize(n);
  const float total = weights(x, n, m, p.temperature, p.min_p, w.data());
  if (p.top_k > 0) {
    top_k(w.data(), n, std::min<int64_t>(p.top_k, n), c);
    if (p.top_p < 1.0f) {
      float kept = 0.0f;
      for (const Candidate& e : c) kept += e.w;
      const size_t keep = prefix_reaching(c, p.top_p * kept, true);
      if (keep > 0) c.resize(keep);
    }
  } else if (p.top_p < 1.0f) {
    top_p_prefix(w.data(), n, p.top_p * total, c);
  } else {
    return draw_in_id_order(w.data(), n, total, p.u);
  }
  if (c.empty()) return 0;
  return draw(c, p.u);
}

}  // namespace

void sample_rows(const float* logits, int64_t rows, int64_t vocab, int64_t stride,
                 const SampleParams* params, int64_t* out) {
  parallel_for(rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w;
    std::vector<Candidate> c;
    for (int64_t r = begin; r < end; ++r) {
      out[r] = sample_row(logits + r * stride, vocab, params[r], w, c);
    }
  });
}

}  // namespace kvr
