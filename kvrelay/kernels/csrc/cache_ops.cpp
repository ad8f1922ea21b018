// KV writes into the paged pool (fp32) and the fused RoPE + KV write.
//
// Writes are plain copies, so bitwise equal to the torch reference. RoPE computes
// x1*cos - x2*sin and x2*cos + x1*sin as separate fp32 multiplies then a subtract/add, the
// torch model's exact arithmetic (the build's -ffp-contract=off forbids fusing them).
#include <cstring>

#include "ops.h"

namespace kvr {

namespace {

inline float* slot_row(const KVWriteArgs& a, int64_t slot) {
  const int64_t kv_stride = a.page_size * a.row;
  return a.pool + (slot / a.page_size) * a.num_layers * 2 * kv_stride + a.layer * 2 * kv_stride +
         (slot % a.page_size) * a.row;
}

inline void rotate(const float* x, const float* c, const float* s, int64_t half, float* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    out[i] = x1 * c[i] - x2 * s[i];
    out[i + half] = x2 * c[i] + x1 * s[i];
  }
}

}  // namespace

void write_kv(const KVWriteArgs& a) {
  const int64_t kv_stride = a.page_size * a.row;
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    if (a.slots[t] < 0) continue;
    float* dst = slot_row(a, a.slots[t]);
    std::memcpy(dst, a.key + t * a.key_stride, a.row * sizeof(float));
    std::memcpy(dst + kv_stride, a.value + t * a.value_stride, a.row * sizeof(float));
  }
}

void rope_write_kv(const RopeArgs& r, const KVWriteArgs& a) {
  const int64_t d = r.head_dim, half = d / 2, kv_stride = a.page_size * a.row;
  for (int64_t t = 0; t < r.num_tokens; ++t) {
    const float* x = r.qkv + t * r.qkv_stride;
    const float* c = r.cos + r.positions[t] * half;
    const float* s = r.sin + r.positions[t] * half;
    for (int64_t h = 0; h < r.heads; ++h)
      rotate(x + h * d, c, s, half, r.query_out + (t * r.heads + h) * d);
    if (a.slots[t] < 0) continue;
    float* dst = slot_row(a, a.slots[t]);
    for (int64_t h = 0; h < r.kv_heads; ++h) rotate(x + (r.heads + h) * d, c, s, half, dst + h * d);
    std::memcpy(dst + kv_stride, x + (r.heads + r.kv_heads) * d, a.row * sizeof(float));
  }
}

}  // namespace kvr
