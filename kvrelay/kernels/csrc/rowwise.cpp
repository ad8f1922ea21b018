// Row-wise layer ops of the decoder (fp32): RMSNorm (optionally after the residual add),
// SwiGLU's SiLU(gate) * up, GeGLU's GELU-tanh(gate) * up, and per-row symmetric int8
// quantization of activations.
//
// Every output row depends only on its own input row, in a fixed operation order, so the
// results are the same whatever the batch, the chunking, the thread count or the ISA variant.
// Rows are split across torch's threads only when there is enough work to pay for waking them.
#include <cmath>

#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace kvr {

namespace {

constexpr int64_t kMinElementsPerThread = 32768;

int64_t grain(int64_t dim) {
  return dim >= kMinElementsPerThread ? 1 : kMinElementsPerThread / dim;
}

// Sum of squares in 8 lanes over full vectors, then the lanes in a fixed tree, then the tail.
// AVX2 in every variant: 16 lanes would sum other elements together (other bits).
float sum_squares(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float s = hsum8(acc);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

void norm_row(const float* x, const float* w, float* out, int64_t dim, float eps) {
  const float inv = 1.0f / std::sqrt(sum_squares(x, dim) / static_cast<float>(dim) + eps);
  for (int64_t i = 0; i < dim; ++i) out[i] = (x[i] * inv) * w[i];
}

}  // namespace

void rms_norm(const RowArgs& a, const float* weight, float eps) {
  parallel_for(a.rows, grain(a.dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* x = a.x + r * a.x_stride;
      if (a.delta != nullptr) {
        const float* d = a.delta + r * a.delta_stride;
        for (int64_t i = 0; i < a.dim; ++i) x[i] = x[i] + d[i];
      }
      norm_row(x, weight, a.out + r * a.out_stride, a.dim, eps);
    }
  });
}

void head_rms_norm(float* x, int64_t tokens, int64_t stride, int64_t heads, int64_t dim,
                   const float* weight, float eps) {
  // norm_row in place on each head's row: the bits rms_norm gives those rows as its own rows
  parallel_for(tokens * heads, grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = x + (r / heads) * stride + (r % heads) * dim;
      norm_row(row, weight, row, dim, eps);
    }
  });
}

void silu_mul(const RowArgs& a) {
  // x rows are [gate (dim) | up (dim)]; out = gate / (1 + exp(-gate)) * up.
  parallel_for(a.rows, grain(a.dim), [&](int64_t begin, int64_t end) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t r = begin; r < end; ++r) {
      const float* g = a.x + r * a.x_stride;
      const float* u = g + a.dim;
      float* o = a.out + r * a.out_stride;
      int64_t i = 0;
#if defined(__AVX512F__)
      // 16 lanes, each with the 8-lane loop's operations: the same bits (vec.h's exp16).
      const __m512 one16 = _mm512_set1_ps(1.0f), zero16 = _mm512_setzero_ps();
      for (; i + 16 <= a.dim; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 s =
            _mm512_div_ps(gv, _mm512_add_ps(one16, exp16(_mm512_sub_ps(zero16, gv))));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
      }
#endif
      for (; i + 8 <= a.dim; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
      }
      for (; i < a.dim; ++i) o[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
    }
  });
}

// GeGLU (Gemma): gelu_tanh(gate) * up with gelu_tanh(x) = 0.5 x (1 + tanh(u)), u = sqrt(2 / pi)
// (x + 0.044715 x^3), computed as x / (1 + exp(-2u)) (the same function: 1 + tanh(u) =
// 2 / (1 + exp(-2u)); no cancellation where tanh(u) is near -1), 2u = x (c1 + c2 x^2). Each
// element: t = x * x, z = x * fma(c2, t, c1), s = x / (1 + exp(0 - z)), out = s * up; the
// AVX-512 lanes, AVX2 lanes and the scalar tail take these operations (exp16 / exp8 / exp1:
// the same polynomial), so every path and variant gives the same bits.
constexpr float kGeluC1 = 1.5957691216057308f;    // 2 sqrt(2 / pi)
constexpr float kGeluC2 = 0.07135481627260025f;   // 2 sqrt(2 / pi) * 0.044715

void gelu_tanh_mul(const RowArgs& a) {
  parallel_for(a.rows, grain(a.dim), [&](int64_t begin, int64_t end) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const __m256 c1 = _mm256_set1_ps(kGeluC1), c2 = _mm256_set1_ps(kGeluC2);
    for (int64_t r = begin; r < end; ++r) {
      const float* g = a.x + r * a.x_stride;
      const float* u = g + a.dim;
      float* o = a.out + r * a.out_stride;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one16 = _mm512_set1_ps(1.0f), zero16 = _mm512_setzero_ps();
      const __m512 c1_16 = _mm512_set1_ps(kGeluC1), c2_16 = _mm512_set1_ps(kGeluC2);
      for (; i + 16 <= a.dim; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 z = _mm512_mul_ps(x, _mm512_fmadd_ps(c2_16, _mm512_mul_ps(x, x), c1_16));
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one16, exp16(_mm512_sub_ps(zero16, z))));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
      }
#endif
      for (; i + 8 <= a.dim; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 z = _mm256_mul_ps(x, _mm256_fmadd_ps(c2, _mm256_mul_ps(x, x), c1));
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, z))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
      }
      for (; i < a.dim; ++i) {
        const float x = g[i];
        const float z = x * std::fma(kGeluC2, x * x, kGeluC1);
        o[i] = x / (1.0f + exp1(0.0f - z)) * u[i];
      }
    }
  });
}

void quantize_rows(const RowArgs& a, uint8_t* q, float* scales, float qmax, int zero_point) {
  // scale = max|x| / qmax (at least 1e-30 / qmax); q = round_half_even(x / scale) + zero_point.
  parallel_for(a.rows, grain(a.dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = a.x + r * a.x_stride;
      float m = 0.0f;
      for (int64_t i = 0; i < a.dim; ++i) m = std::fmax(m, std::fabs(x[i]));
      const float scale = std::fmax(m, 1e-30f) / qmax;
      uint8_t* qr = q + r * a.dim;
      for (int64_t i = 0; i < a.dim; ++i) {
        const int v = static_cast<int>(std::nearbyint(x[i] / scale));
        qr[i] = static_cast<uint8_t>(v + zero_point);
      }
      scales[r] = scale;
    }
  });
}

}  // namespace kvr
