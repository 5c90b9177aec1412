// A Llama-family decoder stack's layers and the model's final norm in one call, for the CPU
// steps whose attention is one token cascade (every decode step, verify steps over a shared
// prefix, and with batch-invariant inference every step: its rows then share no prefix).
//
// Eager, each layer is a dozen Python calls (modules, views, the attention plan) around the
// C++ ops that do the work; at a few rows a step those calls cost as much as the arithmetic
// of the small models, and on two cores they also take the time the ops could run in. Here
// the same ops run in the same order with the same arguments, called from C++: the results
// equal the Python loop's bit for bit (tests/e2e/test_cpp_decoder.py).
//
// A stack is registered once per model (register_decoder_stack) with every layer's norm
// weights and, for each linear and each class of row counts, the product the layer would
// pick for that class in Python (PackableLinear.cpp_choice), so no choice is made here that
// Python does not make too. Built with the other ops into one extension (cpu_kernels.py).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace {

// How a linear computes: the products of PackableLinear.matmul (layers/linear.py, CPP_KINDS).
enum Kind : int64_t {
  kInt4 = 1,        // aten's CPU int4 matmul, group 32; the bias added after
  kAmxInt4 = 2,     // srt_lite_cpu::amx_int4_panel_linear
  kPanels = 3,      // srt_lite_cpu::panel_linear
  kAmxPanels = 4,   // srt_lite_cpu::amx_panel_linear
  kF32Panels = 5,   // srt_lite_cpu::f32_panel_linear on x in fp32, rounded back to x's dtype
  kBf16Kernel = 6,  // srt_lite_cpu::bf16_linear
  kTorch = 7,       // at::linear
  kInt4Panels = 8,  // srt_lite_cpu::int4_panel_linear
  kGguf = 9,        // srt_lite_cpu::gguf_linear_registered (n: the registered weight's key)
};
// Row-count classes a linear may choose differently for: up to bounds[0] rows, up to
// bounds[1], and more (layers/linear.py: cpp_row_bounds).
constexpr int64_t kRowClasses = 3;
constexpr int64_t kLinears = 4;  // qkv, o, gate_up, down: a layer's order in the tensor list
constexpr int64_t kInt4Group = 32;

struct Choice {
  int64_t kind = 0;
  at::Tensor a, b;  // the weight (packed, panels, codes) and its scales where it has them
  int64_t n = 0;    // output features (bf16_linear: its few-rows bound)
};

struct Linear {
  std::optional<at::Tensor> bias;
  // Added to the product's output instead of inside the product: a row-parallel layer adds
  // its bias after the all-reduce (RowParallelLinear.forward), which rounds apart.
  bool bias_after = false;
  Choice by_rows[kRowClasses];
};

struct Layer {
  at::Tensor in_norm, post_norm;  // RMSNorm weights
  Linear linears[kLinears];
};

struct Stack {
  std::vector<Layer> layers;
  int64_t bounds[kRowClasses - 1];
  int64_t heads, kv_heads, head_dim;
  double eps;
  at::Tensor final_norm;  // the model's norm after the last layer
  double final_eps;
  at::Tensor cos_table, sin_table;  // RoPE: fp32 [max_position, head_dim / 2] (RotaryEmbedding's caches)
};

// Registered stacks by key; a model releases its own (release_decoder_stack) when dropped.
std::mutex stacks_mutex;
std::vector<std::shared_ptr<const Stack>> stacks;

// The other ops through the dispatcher, resolved once (they live in the other sources).
template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using PanelSig = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t);
using Int4PanelSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                int64_t);

// The product `c` of x; the bias inside it unless it comes after (see linear). A GGUF product
// writes into `out` where it fits (srt_lite_ops::gguf_linear_registered); the others allocate.
at::Tensor product(const Linear& l, const Choice& c, const at::Tensor& x, const at::Tensor& out) {
  const std::optional<at::Tensor> bias = l.bias_after ? std::nullopt : l.bias;
  switch (c.kind) {
    case kInt4: {
      at::Tensor y = at::_weight_int4pack_mm_for_cpu(x.contiguous(), c.a, kInt4Group, c.b);
      return bias ? y + *bias : y;
    }
    case kAmxInt4: {
      static const auto f = op<Int4PanelSig>("srt_lite_cpu::amx_int4_panel_linear");
      return f.call(x, c.a, c.b, bias, c.n);
    }
    case kInt4Panels: {
      static const auto f = op<Int4PanelSig>("srt_lite_cpu::int4_panel_linear");
      return f.call(x, c.a, c.b, bias, c.n);
    }
    case kPanels: {
      static const auto f = op<PanelSig>("srt_lite_cpu::panel_linear");
      return f.call(x, c.a, bias, c.n);
    }
    case kAmxPanels: {
      static const auto f = op<PanelSig>("srt_lite_cpu::amx_panel_linear");
      return f.call(x, c.a, bias, c.n);
    }
    case kF32Panels: {
      static const auto f = op<PanelSig>("srt_lite_cpu::f32_panel_linear");
      return f.call(x.to(at::kFloat), c.a, bias, c.n).to(x.scalar_type());
    }
    case kBf16Kernel: {
      static const auto f = op<PanelSig>("srt_lite_cpu::bf16_linear");
      return f.call(x, c.a, bias, c.n);
    }
    case kTorch:
      return at::linear(x, c.a, bias);
    case kGguf:
      return srt_lite_ops::gguf_linear_registered(x, c.n, bias, out);
    default:
      TORCH_CHECK(false, "decoder stack: no product for ", x.size(0), " rows");
  }
  return at::Tensor();
}

// y = x W^T + b for `cls`'s product, as PackableLinear.forward computes it at one rank, in
// `buf`: written into the tensor there where the product can (the same linear of the layer
// before left it), else a new one.
void linear(const Linear& l, int64_t cls, const at::Tensor& x, at::Tensor& buf) {
  if (l.bias_after && l.bias) {
    buf = product(l, l.by_rows[cls], x, at::Tensor()) + *l.bias;
  } else {
    buf = product(l, l.by_rows[cls], x, buf);
  }
}


// tensors: per layer, the input and post-attention norm weights, then per linear its bias
// (or none) and per row class its two tensors (the second none where the product has one);
// kinds: per layer, per linear, whether its bias is added after the product, then per row
// class (kind, n). bounds: the row classes' limits. final_norm / final_eps: the model's norm
// after the last layer; cos_table / sin_table: the RoPE tables the rows of a step's positions
// are taken from.
int64_t register_decoder_stack(const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef kinds,
                               at::IntArrayRef bounds, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                               const at::Tensor& final_norm, double final_eps, const at::Tensor& cos_table,
                               const at::Tensor& sin_table) {
  constexpr int64_t per_layer_tensors = 2 + kLinears * (1 + 2 * kRowClasses);
  constexpr int64_t per_layer_kinds = kLinears * (1 + kRowClasses * 2);
  const int64_t n_layers = static_cast<int64_t>(kinds.size()) / per_layer_kinds;
  TORCH_CHECK(n_layers > 0 && static_cast<int64_t>(kinds.size()) == n_layers * per_layer_kinds &&
                  static_cast<int64_t>(tensors.size()) == n_layers * per_layer_tensors &&
                  static_cast<int64_t>(bounds.size()) == kRowClasses - 1,
              "decoder stack: tensors and kinds do not describe whole layers");
  auto st = std::make_shared<Stack>();
  st->bounds[0] = bounds[0];
  st->bounds[1] = bounds[1];
  st->heads = heads;
  st->kv_heads = kv_heads;
  st->head_dim = head_dim;
  st->eps = eps;
  TORCH_CHECK(cos_table.dim() == 2 && cos_table.size(1) * 2 == head_dim && cos_table.scalar_type() == at::kFloat &&
                  cos_table.is_contiguous() && sin_table.sizes() == cos_table.sizes() &&
                  sin_table.scalar_type() == at::kFloat && sin_table.is_contiguous(),
              "decoder stack: RoPE tables fp32 [positions, head_dim / 2]");
  st->final_norm = final_norm;
  st->final_eps = final_eps;
  st->cos_table = cos_table;
  st->sin_table = sin_table;
  int64_t t = 0, k = 0;
  auto next = [&]() -> std::optional<at::Tensor> { return tensors.get(t++); };
  for (int64_t i = 0; i < n_layers; ++i) {
    Layer layer;
    auto in_norm = next(), post_norm = next();
    TORCH_CHECK(in_norm && post_norm, "decoder stack: a layer without its norm weights");
    layer.in_norm = *in_norm;
    layer.post_norm = *post_norm;
    for (Linear& l : layer.linears) {
      l.bias = next();
      l.bias_after = kinds[k++] != 0;
      for (Choice& c : l.by_rows) {
        auto a = next(), b = next();
        c.kind = kinds[k++];
        c.n = kinds[k++];
        TORCH_CHECK(c.kind >= kInt4 && c.kind <= kGguf && a, "decoder stack: unknown product ", c.kind);
        TORCH_CHECK((c.kind != kInt4 && c.kind != kAmxInt4 && c.kind != kInt4Panels) || b, "decoder stack: a 4-bit product without its scales");
        c.a = *a;
        if (b) c.b = *b;
      }
    }
    st->layers.push_back(std::move(layer));
  }
  std::lock_guard<std::mutex> lock(stacks_mutex);
  stacks.push_back(std::move(st));
  return static_cast<int64_t>(stacks.size()) - 1;
}

void release_decoder_stack(int64_t key) {
  std::lock_guard<std::mutex> lock(stacks_mutex);
  if (key >= 0 && key < static_cast<int64_t>(stacks.size())) stacks[key].reset();
}

// The RoPE rows of `positions` [T] in `dtype`, as RotaryEmbedding._lookup_cos_sin builds them:
// cos [T, 1, D] = [c, c] and sin = [-s, s], each table value rounded to dtype first.
std::pair<at::Tensor, at::Tensor> rope_rows(const Stack& st, const at::Tensor& positions, at::ScalarType dtype) {
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong, "decoder stack: positions [T] int64");
  const at::Tensor pos = positions.contiguous();
  const int64_t T = pos.size(0), half = st.cos_table.size(1), max_pos = st.cos_table.size(0);
  at::Tensor cos = at::empty({T, 1, 2 * half}, st.cos_table.options().dtype(dtype));  // [T, 1, D]
  at::Tensor sin = at::empty_like(cos);
  const int64_t* p = pos.data_ptr<int64_t>();
  const float* ct = st.cos_table.data_ptr<float>();
  const float* stab = st.sin_table.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "rope_rows", [&] {
    scalar_t* c = cos.data_ptr<scalar_t>();
    scalar_t* s = sin.data_ptr<scalar_t>();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(p[t] >= 0 && p[t] < max_pos, "decoder stack: position ", p[t], " outside the RoPE table");
      for (int64_t i = 0; i < half; ++i) {
        const scalar_t cv = static_cast<scalar_t>(ct[p[t] * half + i]);
        const scalar_t sv = static_cast<scalar_t>(stab[p[t] * half + i]);
        c[t * 2 * half + i] = c[t * 2 * half + half + i] = cv;
        s[t * 2 * half + i] = -sv;
        s[t * 2 * half + half + i] = sv;
      }
    }
  });
  return {cos, sin};
}

// Every layer of stack `key` for the step's T tokens, then the model's final norm: hidden
// [T, hidden] (the embedding's output), positions [T] (the RoPE rows' indices), the cascade's
// metadata as srt_lite_cpu::cascade_attention takes it, and each layer's KV buffers. Returns
// the final norm's output [T, hidden].
at::Tensor decoder_layers(
    int64_t key, const at::Tensor& hidden, const at::Tensor& positions, const at::Tensor& loc,
    const at::Tensor& suffix_index, const at::Tensor& q_off, const at::Tensor& k_off, int64_t prefix_start,
    int64_t prefix_len, const at::Tensor& prefix_index, double scale, at::TensorList k_bufs, at::TensorList v_bufs) {
  std::shared_ptr<const Stack> st;
  {
    std::lock_guard<std::mutex> lock(stacks_mutex);
    TORCH_CHECK(key >= 0 && key < static_cast<int64_t>(stacks.size()) && stacks[key], "no decoder stack ", key);
    st = stacks[key];
  }
  const int64_t n_layers = static_cast<int64_t>(st->layers.size());
  TORCH_CHECK(static_cast<int64_t>(k_bufs.size()) == n_layers && static_cast<int64_t>(v_bufs.size()) == n_layers,
              "decoder stack: one K and one V buffer per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.size(0) == loc.size(0),
              "decoder stack: hidden [T, hidden], one row per token");
  const int64_t T = hidden.size(0), n = hidden.size(1), H = st->heads, Hkv = st->kv_heads, D = st->head_dim;
  const int64_t q_size = H * D, kv_size = Hkv * D;
  const int64_t cls = T <= st->bounds[0] ? 0 : T <= st->bounds[1] ? 1 : 2;
  TORCH_CHECK(positions.numel() == T, "decoder stack: one position per token");
  const auto [cos, sin] = rope_rows(*st, positions, hidden.scalar_type());
  // The step's activations, each written by every layer in turn (the ops in between are
  // called directly: see cpu_ops.h).
  const auto opts = hidden.options();
  at::Tensor normed = at::empty({T, n}, opts);        // a sublayer's normalised input
  at::Tensor residual = at::empty({T, n}, opts);      // the residual stream after the first sublayer
  at::Tensor qk = at::empty({T, H + Hkv, D}, opts);   // query and key heads, rotated
  at::Tensor attn = at::empty({T, q_size}, opts);     // [T, H * D]
  at::Tensor act = at::empty({T, 0}, opts);           // SiLU(gate) * up, sized by the first layer
  const at::Tensor q = qk.view({T, (H + Hkv) * D}).narrow(1, 0, q_size);
  const at::Tensor k = qk.view({T, (H + Hkv) * D}).narrow(1, q_size, kv_size);
  at::Tensor qkv, o, gate_up, h;  // the products' outputs (see linear)
  for (int64_t i = 0; i < n_layers; ++i) {
    const Layer& layer = st->layers[i];
    if (i == 0) {
      srt_lite_ops::rms_norm_into(hidden, nullptr, layer.in_norm, st->eps, normed, nullptr);
    } else {
      srt_lite_ops::rms_norm_into(h, &residual, layer.in_norm, st->eps, normed, &residual);
    }
    linear(layer.linears[0], cls, normed, qkv);  // [T, (H + 2 Hkv) * D]
    // Query and key heads rotate in one pass; v is a view (LlamaAttention.forward).
    srt_lite_ops::rope_into(qkv.narrow(1, 0, q_size + kv_size).view({T, H + Hkv, D}), cos, sin, qk);
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
    srt_lite_ops::cascade_attention(q, k, v, k_bufs[i], v_bufs[i], loc, suffix_index, q_off, k_off, prefix_start,
                                    prefix_len, prefix_index, H, scale, attn);
    linear(layer.linears[1], cls, attn, o);
    // The first layer's residual is the embedding, which stays the caller's.
    srt_lite_ops::rms_norm_into(o, i == 0 ? &hidden : &residual, layer.post_norm, st->eps, normed, &residual);
    linear(layer.linears[2], cls, normed, gate_up);
    if (act.size(1) != gate_up.size(1) / 2) act = at::empty({T, gate_up.size(1) / 2}, opts);
    srt_lite_ops::silu_and_mul_into(gate_up, act);
    linear(layer.linears[3], cls, act, h);
  }
  // The residual's last sum is dropped, as the model's forward drops it.
  srt_lite_ops::rms_norm_into(h, &residual, st->final_norm, st->final_eps, normed, &residual);
  return normed;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(srt_lite_cpu, m) {
  m.def(
      "register_decoder_stack(Tensor?[] tensors, int[] kinds, int[] bounds, int heads, int kv_heads, int head_dim, "
      "float eps, Tensor final_norm, float final_eps, Tensor cos_table, Tensor sin_table) -> int");
  m.def("release_decoder_stack(int key) -> ()");
  m.def(
      "decoder_layers(int key, Tensor hidden, Tensor positions, Tensor loc, Tensor suffix_index, Tensor q_off, "
      "Tensor k_off, int prefix_start, int prefix_len, Tensor prefix_index, float scale, Tensor(a!)[] k_bufs, "
      "Tensor(b!)[] v_bufs) -> Tensor");
}

TORCH_LIBRARY_IMPL(srt_lite_cpu, CPU, m) { m.impl("decoder_layers", &decoder_layers); }

// Take no tensor that picks a backend by device.
TORCH_LIBRARY_IMPL(srt_lite_cpu, CompositeExplicitAutograd, m) {
  m.impl("register_decoder_stack", &register_decoder_stack);
  m.impl("release_decoder_stack", &release_decoder_stack);
}
