// Python bindings of the kvrelay CPU kernels: tensors in, raw pointers to the kernels.
// Callers (kvrelay/kernels/cpu_paged.py) pass contiguous CPU tensors of checked shapes: fp32
// everywhere but the KV pool, which may also be bf16 or fp16.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "ops.h"
#include "parallel.h"

namespace kvr {

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
  at::parallel_for(0, n, grain, body);
}

int num_threads() { return at::in_parallel_region() ? 1 : at::get_num_threads(); }

namespace {

torch::Tensor to_tensor(const std::vector<int>& v, int64_t cols) {
  auto t = torch::empty({(int64_t)v.size() / cols, cols}, torch::kInt32);
  std::copy(v.begin(), v.end(), t.data_ptr<int>());
  return cols == 1 ? t.view(-1) : t;
}

std::vector<torch::Tensor> plan(const torch::Tensor& tables, const torch::Tensor& ctx,
                                const torch::Tensor& qsl, int64_t num_tokens, int64_t page_size,
                                int64_t chunk_pages, int64_t num_blocks, int64_t window) {
  PlanOut p = build_plan(tables.data_ptr<int>(), ctx.size(0), tables.size(1),
                         ctx.data_ptr<int>(), qsl.data_ptr<int>(), num_tokens, page_size,
                         chunk_pages, num_blocks, (int)window);
  return {to_tensor(p.items, 3), to_tensor(p.entries, 4), to_tensor(p.positions, 1),
          to_tensor(p.chunk_off, 1)};
}

KVType kv_type(const torch::Tensor& pool) {
  switch (pool.scalar_type()) {
    case torch::kFloat32: return KVType::f32;
    case torch::kBFloat16: return KVType::bf16;
    case torch::kFloat16: return KVType::f16;
    default: throw std::invalid_argument("kv pool dtype must be float32, bfloat16 or float16");
  }
}

torch::Tensor attention(const torch::Tensor& query, const torch::Tensor& pool, int64_t layer,
                        const torch::Tensor& tables, const torch::Tensor& items,
                        const torch::Tensor& entries, const torch::Tensor& positions,
                        const torch::Tensor& chunk_off, int64_t chunk_pages, double scale,
                        bool bf16_dots, int64_t window) {
  auto out = torch::empty_like(query);
  AttentionArgs a{query.data_ptr<float>(), pool.data_ptr(), out.data_ptr<float>(),
                  tables.data_ptr<int>(), items.data_ptr<int>(), entries.data_ptr<int>(),
                  positions.data_ptr<int>(), chunk_off.data_ptr<int>(), tables.size(1), layer,
                  (int)items.size(0), (int)query.size(0), (int)pool.size(1), (int)query.size(1),
                  (int)pool.size(4), (int)query.size(2), (int)pool.size(3), (int)chunk_pages,
                  (float)scale, kv_type(pool), bf16_dots, (int)window};
  paged_attention(a, at::get_num_threads());
  return out;
}

KVWriteArgs kv_args(torch::Tensor& pool, int64_t layer, const torch::Tensor& slots) {
  return KVWriteArgs{pool.data_ptr(), kv_type(pool), layer, pool.size(1), pool.size(3),
                     pool.size(4) * pool.size(5), nullptr, nullptr, 0, 0,
                     slots.data_ptr<int64_t>(), slots.size(0)};
}

void kv_write(torch::Tensor& pool, int64_t layer, const torch::Tensor& key,
              const torch::Tensor& value, const torch::Tensor& slots) {
  KVWriteArgs a = kv_args(pool, layer, slots);
  a.key = key.data_ptr<float>();
  a.value = value.data_ptr<float>();
  a.key_stride = key.stride(0);
  a.value_stride = value.stride(0);
  write_kv(a);
}

torch::Tensor rope_kv_write(const torch::Tensor& qkv, const torch::Tensor& positions,
                            const torch::Tensor& cos, const torch::Tensor& sin,
                            torch::Tensor& pool, int64_t layer, const torch::Tensor& slots,
                            int64_t heads) {
  const int64_t kv_heads = pool.size(4), head_dim = pool.size(5);
  auto q = torch::empty({qkv.size(0), heads, head_dim}, qkv.options());
  RopeArgs r{qkv.data_ptr<float>(), qkv.stride(0), positions.data_ptr<int64_t>(),
             cos.data_ptr<float>(), sin.data_ptr<float>(), q.data_ptr<float>(), qkv.size(0),
             heads, kv_heads, head_dim};
  rope_write_kv(r, kv_args(pool, layer, slots));
  return q;
}

RowArgs rows_of(const torch::Tensor& x, int64_t dim, torch::Tensor& out) {
  return RowArgs{x.data_ptr<float>(), x.stride(0), nullptr, 0, out.data_ptr<float>(),
                 out.stride(0), x.size(0), dim};
}

torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  auto out = torch::empty_like(x);
  rms_norm(rows_of(x, x.size(1), out), weight.data_ptr<float>(), (float)eps);
  return out;
}

torch::Tensor add_norm(torch::Tensor& residual, const torch::Tensor& delta,
                       const torch::Tensor& weight, double eps) {
  auto out = torch::empty_like(residual);
  RowArgs a = rows_of(residual, residual.size(1), out);
  a.delta = delta.data_ptr<float>();
  a.delta_stride = delta.stride(0);
  rms_norm(a, weight.data_ptr<float>(), (float)eps);
  return out;
}

torch::Tensor swiglu(const torch::Tensor& gate_up) {
  const int64_t dim = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), dim}, gate_up.options());
  silu_mul(rows_of(gate_up, dim, out));
  return out;
}

torch::Tensor geglu(const torch::Tensor& gate_up) {
  const int64_t dim = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), dim}, gate_up.options());
  gelu_tanh_mul(rows_of(gate_up, dim, out));
  return out;
}

std::vector<torch::Tensor> quantize(const torch::Tensor& x, double qmax, int64_t zero_point) {
  auto q = torch::empty({x.size(0), x.size(1)}, x.options().dtype(torch::kUInt8));
  auto scales = torch::empty({x.size(0), 1}, x.options());
  RowArgs a{x.data_ptr<float>(), x.stride(0), nullptr, 0, nullptr, 0, x.size(0), x.size(1)};
  quantize_rows(a, q.data_ptr<uint8_t>(), scales.data_ptr<float>(), (float)qmax, (int)zero_point);
  return {q, scales};
}

// The drawn token of each row of logits [rows, vocab]; settings [rows, 4] fp32 (temperature,
// top_p, min_p, u) and top_k [rows] int64.
torch::Tensor sample(const torch::Tensor& logits, const torch::Tensor& settings,
                     const torch::Tensor& top_k) {
  const int64_t rows = logits.size(0);
  std::vector<SampleParams> params(rows);
  const float* s = settings.data_ptr<float>();
  const int64_t* k = top_k.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    params[r] = SampleParams{s[4 * r], s[4 * r + 1], s[4 * r + 2], s[4 * r + 3], k[r]};
  }
  auto out = torch::empty({rows}, top_k.options());
  sample_rows(logits.data_ptr<float>(), rows, logits.size(1), logits.stride(0), params.data(),
              out.data_ptr<int64_t>());
  return out;
}

// raw uint8 [rows, bytes per row] (a GGUF tensor's blocks) into out fp32 [rows, cols].
void gguf_dequant_op(const torch::Tensor& raw, int64_t ggml_type, torch::Tensor& out) {
  dequantize_gguf(raw.data_ptr<uint8_t>(), raw.stride(0), (int)ggml_type, out.data_ptr<float>(),
                  out.stride(0), out.size(0), out.size(1));
}

// fp32 weight [n, k] (contiguous) -> (int8 q [n, k], fp32 scales [n, ceil(k / 32)]).
std::vector<torch::Tensor> int8_blocks_op(const torch::Tensor& w) {
  if (w.dim() != 2 || w.scalar_type() != torch::kFloat32 || !w.is_contiguous())
    throw std::invalid_argument("need a contiguous 2-D float32 weight");
  const int64_t n = w.size(0), k = w.size(1);
  auto q = torch::empty({n, k}, w.options().dtype(torch::kInt8));
  auto scales = torch::empty({n, (k + 31) / 32}, w.options());
  quantize_int8_blocks(w.data_ptr<float>(), n, k, q.data_ptr<int8_t>(), scales.data_ptr<float>());
  return {q, scales};
}

// fp32 weight [n, k] (contiguous) -> (int8 q [n, k], fp32 scales [n]).
std::vector<torch::Tensor> int8_channels_op(const torch::Tensor& w, int64_t qmax) {
  if (w.dim() != 2 || w.scalar_type() != torch::kFloat32 || !w.is_contiguous())
    throw std::invalid_argument("need a contiguous 2-D float32 weight");
  if (qmax < 1 || qmax > 127)
    throw std::invalid_argument("qmax must lie in [1, 127], got " + std::to_string(qmax));
  const int64_t n = w.size(0), k = w.size(1);
  auto q = torch::empty({n, k}, w.options().dtype(torch::kInt8));
  auto scales = torch::empty({n}, w.options());
  quantize_int8_channels(w.data_ptr<float>(), n, k, (int)qmax, q.data_ptr<int8_t>(),
                         scales.data_ptr<float>());
  return {q, scales};
}

// y = x . W^T for the kernels taking WInt8Args (int8 weights and fp32 scales, each its layout).
template <void (*Kernel)(const WInt8Args&)>
torch::Tensor scaled_int8_linear(const torch::Tensor& x, const torch::Tensor& packed,
                                 const torch::Tensor& scale,
                                 const c10::optional<torch::Tensor>& bias, int64_t n) {
  auto y = torch::empty({x.size(0), n}, x.options());
  WInt8Args a{x.data_ptr<float>(), x.stride(0), packed.data_ptr<int8_t>(), scale.data_ptr<float>(),
              bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(),
              y.stride(0), x.size(0), n, x.size(1)};
  Kernel(a);
  return y;
}

// SiLU(gate) * up of x's gate/up projection: y [m, n / 2] (`w8a16_silu_linear`).
torch::Tensor w8a16_silu_op(const torch::Tensor& x, const torch::Tensor& packed,
                            const torch::Tensor& scale, const c10::optional<torch::Tensor>& bias,
                            int64_t n) {
  auto y = torch::empty({x.size(0), n / 2}, x.options());
  WInt8Args a{x.data_ptr<float>(), x.stride(0), packed.data_ptr<int8_t>(), scale.data_ptr<float>(),
              bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(),
              y.stride(0), x.size(0), n, x.size(1)};
  w8a16_silu_linear(a);
  return y;
}

torch::Tensor q8_linear_op(const torch::Tensor& x, const torch::Tensor& packed,
                           const torch::Tensor& scale, const torch::Tensor& comp,
                           const c10::optional<torch::Tensor>& bias, int64_t n) {
  auto y = torch::empty({x.size(0), n}, x.options());
  Q8Args a{x.data_ptr<float>(), x.stride(0), packed.data_ptr<int8_t>(), scale.data_ptr<float>(),
           comp.data_ptr<int32_t>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
           y.data_ptr<float>(), y.stride(0), x.size(0), n, x.size(1)};
  q8_linear(a);
  return y;
}

std::string q8_linear_path(int64_t m) { return q8_path(m); }

// A decoder's layers run in one call (`kvrelay.kernels.cpu_decoder`): per layer the same
// kernel entry points, in the same order, as the model's Python loop calls one by one, so the
// bits are the same; what goes is the interpreter between them (~0.3 ms per layer on a 2-core
// host, with the other thread idle in its barrier meanwhile).
enum LinearKind : int64_t { kW8A16 = 0, kW8A16GateUpSilu = 1, kInt8 = 2, kQ8 = 3 };

// One linear: kind, packed weight, scales, Q8_0 block sums (or undefined), bias, outputs.
using LinearSpec = std::tuple<int64_t, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>,
                              c10::optional<torch::Tensor>, int64_t>;
// One layer: input norm, post-attention norm, qkv, o, gate/up, down, then a family's own:
// q and k head norms (Qwen3; both or neither) and whether RoPE rotates q and k (SmolLM3's NoPE).
using LayerSpec =
    std::tuple<torch::Tensor, torch::Tensor, LinearSpec, LinearSpec, LinearSpec, LinearSpec,
               c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, bool>;
// A layer's Gemma 3 fields and KV place (optional, all layers or none): the attention window
// (0: full), the RoPE table pair, RMSNorms of the o and down projections' outputs, the MLP's
// activation, its KV group (an index into forward's groups) and its slot in the pool's dim 1.
using LayerExtra = std::tuple<int64_t, int64_t, c10::optional<torch::Tensor>,
                              c10::optional<torch::Tensor>, int64_t, int64_t, int64_t>;
enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };
// One attention plan of the step for the layers of one KV group (kvrelay.core.kv_layout) and
// window: group, window, the group's block tables and slot mapping, then the plan
// (cpu_paged.CppPlan for the group's metadata and that window: items, entries, positions, chunk
// offsets, chunk pages). A model of one group may mix windows: one plan per window.
using GroupPlan = std::tuple<int64_t, int64_t, torch::Tensor, torch::Tensor, torch::Tensor,
                             torch::Tensor, torch::Tensor, torch::Tensor, int64_t>;

torch::Tensor run_linear(const LinearSpec& l, const torch::Tensor& x) {
  const auto& [kind, packed, scales, comp, bias, n] = l;
  switch (kind) {
    case kW8A16: return scaled_int8_linear<w8a16_linear>(x, packed, scales, bias, n);
    case kW8A16GateUpSilu: return w8a16_silu_op(x, packed, scales, bias, n);
    case kInt8: return scaled_int8_linear<wint8_linear>(x, packed, scales, bias, n);
    case kQ8: return q8_linear_op(x, packed, scales, comp.value(), bias, n);
    default: throw std::invalid_argument("unknown linear kind " + std::to_string(kind));
  }
}

class CpuDecoder {
 public:
  CpuDecoder(std::vector<LayerSpec> layers, double eps, int64_t heads,
             std::vector<LayerExtra> extras)
      : layers_(std::move(layers)), extras_(std::move(extras)), eps_(eps), heads_(heads) {
    if (extras_.empty())
      for (size_t i = 0; i < layers_.size(); ++i)
        extras_.emplace_back(0, 0, c10::nullopt, c10::nullopt, kSilu, 0, (int64_t)i);
    if (extras_.size() != layers_.size())
      throw std::invalid_argument("one LayerExtra per layer, or none");
    for (size_t i = 0; i < layers_.size(); ++i) {
      const auto& layer = layers_[i];
      for (const LinearSpec* l : {&std::get<2>(layer), &std::get<3>(layer), &std::get<5>(layer)})
        if (std::get<0>(*l) == kW8A16GateUpSilu)
          throw std::invalid_argument("only a gate/up projection may fuse its activation");
      const auto& [window, rope_table, attn_out_norm, mlp_out_norm, act, group, slot] =
          extras_[i];
      if (act != kSilu && act != kGeluTanh)
        throw std::invalid_argument("unknown activation " + std::to_string(act));
      if (act == kGeluTanh && std::get<0>(std::get<4>(layer)) == kW8A16GateUpSilu)
        throw std::invalid_argument("a gelu_tanh layer's gate/up cannot fuse SiLU");
      if (window < 0 || rope_table < 0)
        throw std::invalid_argument("a layer's window and RoPE table must be >= 0");
      if (group < 0 || slot < 0)
        throw std::invalid_argument("a layer's KV group and slot must be >= 0");
    }
  }

  // Every layer on x (the first layer's normed input); hidden (the residual stream) is
  // updated in place, as the Python loop does.
  // cos/sin: the RoPE table pairs (a layer takes its rope_table's); plans: one per KV group and
  // window its layers use (a layer writes its K/V at its group's slots into its pool slot and
  // attends with its group's tables and the plan for its window).
  void forward(torch::Tensor& hidden, torch::Tensor x, const torch::Tensor& positions,
               const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
               torch::Tensor& pool, const std::vector<GroupPlan>& plans, double scale,
               bool bf16_dots) const {
    const int64_t n = static_cast<int64_t>(layers_.size());
    std::vector<const GroupPlan*> plan_of(n, nullptr);
    for (int64_t i = 0; i < n; ++i) {  // every check before the first layer runs
      const auto& [window, rope_table, attn_out_norm, mlp_out_norm, activation, group, slot] =
          extras_[i];
      for (const auto& p : plans)
        if (std::get<0>(p) == group && std::get<1>(p) == window) plan_of[i] = &p;
      if (plan_of[i] == nullptr)
        throw std::invalid_argument("no attention plan for KV group " + std::to_string(group) +
                                    " and window " + std::to_string(window));
      if (std::get<3>(*plan_of[i]).size(0) != positions.size(0))
        throw std::invalid_argument("a slot mapping per KV group, one slot per token");
      if (slot >= pool.size(1))
        throw std::invalid_argument("KV slot " + std::to_string(slot) + " outside the pool");
      if (std::get<8>(layers_[i]) &&
          (rope_table >= (int64_t)cos.size() || rope_table >= (int64_t)sin.size()))
        throw std::invalid_argument("no RoPE table " + std::to_string(rope_table));
    }
    for (int64_t i = 0; i < n; ++i) {
      const auto& [input_norm, post_norm, qkv, o, gate_up, down, q_norm, k_norm, rope] =
          layers_[i];
      const auto& [window, rope_table, attn_out_norm, mlp_out_norm, activation, group, slot] =
          extras_[i];
      const auto& [plan_group, plan_window, tables, slots, items, entries, qpos, chunk_off,
                   chunk_pages] = *plan_of[i];
      auto proj = run_linear(qkv, x);
      const int64_t kv_heads = pool.size(4), head_dim = pool.size(5);
      if (q_norm.has_value()) {  // the Python loop's project_qkv: each head row normed in place
        float* rows = proj.data_ptr<float>();
        const int64_t tokens = proj.size(0), stride = proj.stride(0);
        head_rms_norm(rows, tokens, stride, heads_, head_dim, q_norm->data_ptr<float>(),
                      (float)eps_);
        head_rms_norm(rows + heads_ * head_dim, tokens, stride, kv_heads, head_dim,
                      k_norm->data_ptr<float>(), (float)eps_);
      }
      torch::Tensor q;
      if (rope) {
        q = rope_kv_write(proj, positions, cos[rope_table], sin[rope_table], pool, slot, slots,
                          heads_);
      } else {  // NoPE: k and v written as projected, q as is (the loop's write_kv)
        const int64_t tokens = proj.size(0), qw = heads_ * head_dim, kw = kv_heads * head_dim;
        kv_write(pool, slot, proj.narrow(1, qw, kw).view({tokens, kv_heads, head_dim}),
                 proj.narrow(1, qw + kw, kw).view({tokens, kv_heads, head_dim}), slots);
        q = proj.narrow(1, 0, qw).reshape({tokens, heads_, head_dim}).contiguous();
      }
      auto attn = attention(q, pool, slot, tables, items, entries, qpos, chunk_off, chunk_pages,
                            scale, bf16_dots, plan_window);
      auto o_out = run_linear(o, attn.view({attn.size(0), -1}));
      if (attn_out_norm.has_value()) o_out = norm(o_out, *attn_out_norm, eps_);
      x = add_norm(hidden, o_out, post_norm, eps_);
      auto act = run_linear(gate_up, x);
      if (activation == kGeluTanh)
        act = geglu(act);
      else if (std::get<0>(gate_up) != kW8A16GateUpSilu)
        act = swiglu(act);
      auto out = run_linear(down, act);
      if (mlp_out_norm.has_value()) out = norm(out, *mlp_out_norm, eps_);
      if (i + 1 < n) {
        x = add_norm(hidden, out, std::get<0>(layers_[i + 1]), eps_);
      } else {
        hidden.add_(out);
      }
    }
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

 private:
  std::vector<LayerSpec> layers_;
  std::vector<LayerExtra> extras_;
  double eps_;
  int64_t heads_;
};

}  // namespace

}  // namespace kvr

// The compute ops release the GIL, like torch's own ops: the engine's IO threads keep running.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("build_plan", &kvr::plan, "Work items of a step's paged attention", py::arg("tables"),
        py::arg("context_lens"), py::arg("query_start_loc"), py::arg("num_tokens"),
        py::arg("page_size"), py::arg("chunk_pages"), py::arg("num_blocks"),
        py::arg("window") = 0);
  m.def("paged_attention", &kvr::attention, release(), "Causal paged attention, pages in place",
        py::arg("query"), py::arg("pool"), py::arg("layer"), py::arg("tables"), py::arg("items"),
        py::arg("entries"), py::arg("positions"), py::arg("chunk_off"), py::arg("chunk_pages"),
        py::arg("scale"), py::arg("bf16_dots"), py::arg("window") = 0);
  m.def("write_kv", &kvr::kv_write, release(), "Write K/V rows into the pool at their slots");
  m.def("rope_write_kv", &kvr::rope_kv_write, release(), "RoPE on q and k, k and v to the pool");
  m.def("rms_norm", &kvr::norm, release(), "RMSNorm of each row");
  m.def("add_rms_norm", &kvr::add_norm, release(), "residual += delta, then RMSNorm of each row");
  m.def("silu_mul", &kvr::swiglu, release(), "SiLU(gate) * up of rows [gate | up]");
  m.def("gelu_tanh_mul", &kvr::geglu, release(), "GELU-tanh(gate) * up of rows [gate | up]");
  m.def("int8_linear", &kvr::scaled_int8_linear<kvr::wint8_linear>, release(),
        "x . (W * scales)^T (+ bias), W packed int8");
  m.def("q8_linear", &kvr::q8_linear_op, release(), "Q8_0 x Q8_0 linear (int8 x and W, scales)");
  m.def("q8_path", &kvr::q8_linear_path, "q8_linear's code path for m rows");
  m.def("w8a16_linear", &kvr::scaled_int8_linear<kvr::w8a16_linear>, release(),
        "x (as bf16) . (int8 W * column scales)^T on AMX bf16 tiles");
  m.def("w8a16_silu_linear", &kvr::w8a16_silu_op, release(),
        "SiLU(gate) * up of x's gate/up projection packed by pack_w8a16_gate_up");
  m.def("w8a16_available", &kvr::w8a16_available, "Whether w8a16_linear runs here");
  m.def("quantize_rows", &kvr::quantize, release(), "Symmetric int8 per row: (uint8 q, scale)");
  m.def("dequantize_gguf", &kvr::gguf_dequant_op, release(),
        "fp32 values of GGUF block rows, gguf-py's numpy bits", py::arg("raw"),
        py::arg("ggml_type"), py::arg("out"));
  m.def("quantize_int8_weight", &kvr::int8_blocks_op, release(),
        "Symmetric int8 weight, one scale per 32 inputs of each row: (int8 q, fp32 scales)",
        py::arg("weight"));
  m.def("quantize_channel_weight", &kvr::int8_channels_op, release(),
        "Symmetric int8 weight, one scale per row: (int8 q, fp32 scales)", py::arg("weight"),
        py::arg("qmax"));
  m.def("sample_rows", &kvr::sample, release(),
        "The token drawn for each row (temperature, min-p, top-k, top-p, inverse CDF of u)");
  m.def("bf16_attention_available", &kvr::bf16_attention_available,
        "Whether paged_attention can take bf16 dots on AMX tiles here");
  py::class_<kvr::CpuDecoder>(m, "CpuDecoder", "A decoder's layers run in one call")
      .def(py::init<std::vector<kvr::LayerSpec>, double, int64_t, std::vector<kvr::LayerExtra>>(),
           py::arg("layers"), py::arg("eps"), py::arg("heads"),
           py::arg("extras") = std::vector<kvr::LayerExtra>{})
      .def("forward", &kvr::CpuDecoder::forward, release())
      .def("__len__", &kvr::CpuDecoder::size);
  m.def("simd_width", &kvr::simd_width, "Floats per vector of this build (8 AVX2, 16 AVX-512)");
}
