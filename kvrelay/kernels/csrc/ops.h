// Entry points of the kvrelay CPU kernels (fp32 compute, AVX2/FMA/F16C; AVX-512 in the avx512
// build variant; the KV pool may hold fp32, bf16 or fp16 elements, kv_types.h). Torch-free: only
// bindings.cpp includes the (slow to compile) torch headers.
#pragma once
#include <cstdint>
#include <vector>

#include "kv_types.h"

namespace kvr {

struct PlanOut {
  std::vector<int> items;      // [N, 3]: chunk, first entry, end entry
  std::vector<int> entries;    // [M, 4]: sequence, first token, positions, first position
  std::vector<int> positions;  // [T]
  std::vector<int> chunk_off;  // [T + 1]: first partial of each token
};

// The first key position the row at `pos` sees with attention window `window` (0: none).
inline int window_lo(int pos, int window) {
  return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

// Throws std::invalid_argument (a Python ValueError) on inconsistent metadata. window > 0: the
// plan of sliding-window attention (plan.cpp).
PlanOut build_plan(const int* block_tables, int num_seqs, int width, const int* context_lens,
                   const int* query_start_loc, int num_tokens, int page_size, int chunk_pages,
                   int64_t num_blocks, int window);

struct AttentionArgs {
  const float* query;  // [T, heads, head_dim] contiguous
  const void* pool;    // [blocks, layers, 2, page, kv_heads, head_dim] contiguous, pool_type
  float* out;          // [T, heads, head_dim]
  const int* block_tables;
  const int* items;
  const int* entries;
  const int* positions;
  const int* chunk_off;
  int64_t width, layer;
  int num_items, num_tokens, num_layers, num_heads, kv_heads, head_dim, page_size, chunk_pages;
  float scale;
  KVType pool_type;
  bool bf16_dots = false;  // q.k and p.v on AMX-BF16 tiles (bf16 pool only; attention.cpp)
  int window = 0;          // sliding window (keys pos - window < k <= pos); the plan's own
};

void paged_attention(const AttentionArgs& args, int num_threads);
// Whether this build and process can run bf16_dots: compiled for AMX-BF16, tiles granted.
bool bf16_attention_available();

struct KVWriteArgs {
  void* pool;  // elements of pool_type; writes round to nearest even
  KVType pool_type;
  int64_t layer, num_layers, page_size, row;  // row = kv_heads * head_dim
  const float* key;
  const float* value;
  int64_t key_stride, value_stride;  // between tokens; a token's row is contiguous
  const int64_t* slots;
  int64_t num_tokens;
};

void write_kv(const KVWriteArgs& args);

struct RopeArgs {
  const float* qkv;  // [T, (heads + 2 * kv_heads) * head_dim], rows at qkv_stride
  int64_t qkv_stride;
  const int64_t* positions;
  const float* cos;  // [N, head_dim / 2]
  const float* sin;
  float* query_out;  // [T, heads, head_dim]
  int64_t num_tokens, heads, kv_heads, head_dim;
};

// Rotates q (into query_out) and k (in the KV write); v is copied as is.
void rope_write_kv(const RopeArgs& rope, const KVWriteArgs& kv);

// Row-wise ops over `rows` rows of `dim` floats (strides in floats between rows).
struct RowArgs {
  float* x;            // input rows (rms_norm with delta: updated in place, x += delta)
  int64_t x_stride;
  const float* delta;  // optional residual to add first (nullptr: none)
  int64_t delta_stride;
  float* out;
  int64_t out_stride;
  int64_t rows, dim;
};

void rms_norm(const RowArgs& args, const float* weight, float eps);
// RMSNorm in place of `heads` rows of `dim` floats at the start of each of `tokens` rows
// (`stride` floats apart): Qwen3's norm of each q or k head, rms_norm's bits per head row.
void head_rms_norm(float* x, int64_t tokens, int64_t stride, int64_t heads, int64_t dim,
                   const float* weight, float eps);
void silu_mul(const RowArgs& args);  // x rows [gate | up], each dim wide
// GELU (tanh approximation) of gate times up, x rows [gate | up]: x * sigmoid(2u) with
// u = sqrt(2 / pi) (x + 0.044715 x^3), which is 0.5 x (1 + tanh(u)).
void gelu_tanh_mul(const RowArgs& args);
void quantize_rows(const RowArgs& args, uint8_t* q, float* scales, float qmax, int zero_point);

// y [m, n] = x [m, k] . (q * scale)^T (+ bias): q packed as [ceil(n / 64)][k][64] int8, one
// scale per 32 k of a column, packed as [ceil(n / 64)][ceil(k / 32)][64] fp32.
struct WInt8Args {
  const float* x;
  int64_t x_stride;
  const int8_t* packed;
  const float* scale;
  const float* bias;   // [n] or nullptr
  float* y;
  int64_t y_stride;
  int64_t m, n, k;
};

void wint8_linear(const WInt8Args& args);

// y [m, n] = Q8_0 x Q8_0 linear (q8.cpp): x quantized per row to int8, one scale per 32 k;
// q packed as [ceil(n / 64)][kp / 4][64][4] int8 (kp = k rounded up to 32), scale and comp
// (128 * each block's weight sum) as [ceil(n / 64)][kp / 32][64].
struct Q8Args {
  const float* x;
  int64_t x_stride;
  const int8_t* packed;
  const float* scale;
  const int32_t* comp;
  const float* bias;  // [n] or nullptr
  float* y;
  int64_t y_stride;
  int64_t m, n, k;
};

void q8_linear(const Q8Args& args);
// The code path q8_linear takes for m rows: "amx", "vnni", "avx512bw" or "avx2".
const char* q8_path(int64_t m);

// y [m, n] = x . (q * scale)^T (+ bias) with x rounded to bf16 on AMX bf16 tiles (w8a16.cpp),
// the arguments of wint8_linear in another layout: q packed as
// [ceil(n / 32)][kp / 32][2][16][16][2] int8 (kp = k rounded up to 32), one scale per column [n].
void w8a16_linear(const WInt8Args& args);
// y [m, n / 2] = SiLU(gate) * up of a gate/up weight packed by `ops.pack_w8a16_gate_up` (block b:
// gate columns [16b, 16b + 16), then the same up columns; n a multiple of 32): the same bits as
// w8a16_linear on the unpermuted weight followed by silu_mul.
void w8a16_silu_linear(const WInt8Args& args);
// Whether w8a16_linear runs here (the amx variant, and Linux granted the tiles).
bool w8a16_available();

// One sampled row's settings (sampling.cpp): temperature > 0, top_k 0 for none, top_p in
// (0, 1], min_p in [0, 1], u the row's uniform number in [0, 1).
struct SampleParams {
  float temperature, top_p, min_p, u;
  int64_t top_k;
};

// out[r] = the token drawn for row r of logits [rows, vocab] (rows `stride` floats apart).
void sample_rows(const float* logits, int64_t rows, int64_t vocab, int64_t stride,
                 const SampleParams* params, int64_t* out);

// fp32 values of GGUF rows (gguf_dequant.cpp): `rows` rows of `cols` elements of ggml type
// `ggml_type`, each row's blocks as stored in the file (`raw_stride` bytes apart), written
// `out_stride` floats apart; the same bits as gguf-py's numpy dequantization. Types: F16, BF16,
// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K; others throw std::invalid_argument.
void dequantize_gguf(const uint8_t* raw, int64_t raw_stride, int ggml_type, float* out,
                     int64_t out_stride, int64_t rows, int64_t cols);

// Symmetric int8 quantization of fp32 weights w [rows, cols] (contiguous; weight_quant.cpp),
// the same bits as ops.py's torch code: q [rows, cols] int8 and scales, scale = max(amax,
// 1e-12) / qmax, q = clamp(round_half_even(w / scale), -qmax, qmax). quantize_int8_blocks: one
// scale per 32 inputs of each row (qmax 127), scales [rows, ceil(cols / 32)];
// quantize_int8_channels: one per row, scales [rows], qmax in [1, 127].
void quantize_int8_blocks(const float* w, int64_t rows, int64_t cols, int8_t* q, float* scales);
void quantize_int8_channels(const float* w, int64_t rows, int64_t cols, int qmax, int8_t* q,
                            float* scales);

// Floats per vector of this build (8: AVX2, 16: AVX-512), to tell the ISA variants apart.
int simd_width();

}  // namespace kvr
