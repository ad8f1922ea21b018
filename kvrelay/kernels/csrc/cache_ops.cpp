// KV writes into the paged pool (fp32, bf16 or fp16 elements) and the fused RoPE + KV write.
//
// fp32 writes are plain copies, 16-bit writes round to nearest even (kv_types.h): both bitwise
// equal to the torch reference's `pool[...] = x.to(pool.dtype)`. RoPE computes
// x1*cos - x2*sin and x2*cos + x1*sin as separate fp32 multiplies then a subtract/add, the
// torch model's exact arithmetic (the build's -ffp-contract=off forbids fusing them).
#include <stdexcept>
#include <vector>

#include "kv_types.h"
#include "ops.h"
#include "parallel.h"

namespace kvr {

namespace {

template <class T>
inline T* slot_row(const KVWriteArgs& a, int64_t slot) {
  const int64_t kv_stride = a.page_size * a.row;
  return static_cast<T*>(a.pool) + (slot / a.page_size) * a.num_layers * 2 * kv_stride +
         a.layer * 2 * kv_stride + (slot % a.page_size) * a.row;
}

inline void rotate(const float* x, const float* c, const float* s, int64_t half, float* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    out[i] = x1 * c[i] - x2 * s[i];
    out[i + half] = x2 * c[i] + x1 * s[i];
  }
}

template <class T>
void write_typed(const KVWriteArgs& a) {
  const int64_t kv_stride = a.page_size * a.row;
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    if (a.slots[t] < 0) continue;
    T* dst = slot_row<T>(a, a.slots[t]);
    narrow_row(a.key + t * a.key_stride, dst, a.row);
    narrow_row(a.value + t * a.value_stride, dst + kv_stride, a.row);
  }
}

// Tokens are independent (each writes its own query rows and its own slot), so they are split
// over the threads: the same operations per token, in any split. A 496-token prefill chunk's
// call ran on one thread while the other waited: 125 -> 61 us a call on an AMX host, ~1.9 ms
// of the chunk's 30 layers (benchmarks/attention_ab.py).
template <class T>
void rope_write_typed(const RopeArgs& r, const KVWriteArgs& a) {
  const int64_t d = r.head_dim, half = d / 2, kv_stride = a.page_size * a.row;
  parallel_for(r.num_tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> krow(a.row);  // rotated k of one token, narrowed into the pool
    for (int64_t t = begin; t < end; ++t) {
      const float* x = r.qkv + t * r.qkv_stride;
      const float* c = r.cos + r.positions[t] * half;
      const float* s = r.sin + r.positions[t] * half;
      for (int64_t h = 0; h < r.heads; ++h)
        rotate(x + h * d, c, s, half, r.query_out + (t * r.heads + h) * d);
      if (a.slots[t] < 0) continue;
      T* dst = slot_row<T>(a, a.slots[t]);
      for (int64_t h = 0; h < r.kv_heads; ++h)
        rotate(x + (r.heads + h) * d, c, s, half, krow.data() + h * d);
      narrow_row(krow.data(), dst, a.row);
      narrow_row(x + (r.heads + r.kv_heads) * d, dst + kv_stride, a.row);
    }
  });
}

[[noreturn]] void bad_type() {
  throw std::invalid_argument("kv pool dtype must be float32, bfloat16 or float16");
}

}  // namespace

void write_kv(const KVWriteArgs& a) {
  switch (a.pool_type) {
    case KVType::f32: return write_typed<float>(a);
    case KVType::bf16: return write_typed<bf16>(a);
    case KVType::f16: return write_typed<fp16>(a);
  }
  bad_type();
}

void rope_write_kv(const RopeArgs& r, const KVWriteArgs& a) {
  switch (a.pool_type) {
    case KVType::f32: return rope_write_typed<float>(r, a);
    case KVType::bf16: return rope_write_typed<bf16>(r, a);
    case KVType::f16: return rope_write_typed<fp16>(r, a);
  }
  bad_type();
}

}  // namespace kvr
