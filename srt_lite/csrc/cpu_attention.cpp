// CPU attention for the torch_native backend's hottest path, one call per layer and step.
//
// A decode or verify step over a shared prefix (W3: eight requests on one 800-token prompt)
// runs cascade attention in every layer: store the new tokens' K/V, gather the rows'
// suffix keys, two flash-attention calls (the shared prefix once for all queries, the
// suffixes as one masked sequence) and a log-sum-exp merge. Written with torch's Python
// ops that is ~40 calls a layer whose dispatch costs more than their work for a few dozen
// tokens; here it is one call. The kernels are ATen's, so the result is bit-identical to
// TorchNativeAttnBackend._attend_token_cascade; only the K/V row copies (a few KB) are
// plain loops instead of index_copy_ / index_select, whose set-up dominates at this size.
// Built on first use by srt_lite/layers/attention/cpu_kernels.py.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstring>
#include <mutex>
#include <vector>

namespace {

// Row ids must address the buffer: a bad id would write outside it.
void check_ids(const at::Tensor& ids, int64_t n, int64_t rows) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), "slot ids: contiguous int64 [n]");
  TORCH_CHECK(ids.size(0) >= n, "fewer slot ids than rows");
  const int64_t* p = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < rows, "slot id ", p[i], " out of range [0, ", rows, ")");
  }
}

// buf[loc[t]] = src[t] for t < n; buf [N, Hkv, D] contiguous, src [>= n, Hkv * D] with
// contiguous rows (k, or v as a strided view of the fused qkv output).
void store_rows(at::Tensor& buf, const at::Tensor& loc, const at::Tensor& src, int64_t n) {
  const int64_t width = buf.size(1) * buf.size(2);
  if (!buf.is_contiguous() || src.dim() != 2 || src.size(1) != width || src.stride(1) != 1 ||
      src.scalar_type() != buf.scalar_type()) {
    buf.index_copy_(0, loc.narrow(0, 0, n), src.narrow(0, 0, n).view({n, buf.size(1), buf.size(2)}).to(buf.scalar_type()));
    return;
  }
  check_ids(loc, n, buf.size(0));
  const int64_t row_bytes = width * buf.element_size();
  const int64_t* ids = loc.data_ptr<int64_t>();
  auto* dst = static_cast<char*>(buf.data_ptr());
  const auto* from = static_cast<const char*>(src.data_ptr());
  const int64_t src_step = src.stride(0) * src.element_size();
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(dst + ids[t] * row_bytes, from + t * src_step, row_bytes);
  }
}

// buf[index] as [S, Hkv, D] (buf contiguous).
at::Tensor gather_rows(const at::Tensor& buf, const at::Tensor& index) {
  const int64_t n = index.size(0);
  check_ids(index, n, buf.size(0));
  at::Tensor out = at::empty({n, buf.size(1), buf.size(2)}, buf.options());
  const int64_t row_bytes = buf.size(1) * buf.size(2) * buf.element_size();
  const int64_t* ids = index.data_ptr<int64_t>();
  const auto* src = static_cast<const char*>(buf.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(dst + i * row_bytes, src + ids[i] * row_bytes, row_bytes);
  }
  return out;
}

// One layer of cascade attention for T query tokens (a batch's short rows over a prefix
// they all share). q [>= T, H * D], k and v [>= T, Hkv * D] (rows past T only pad the
// token axis), stored at slots loc [T] of k_buf / v_buf [N, Hkv, D]. The prefix is
// prefix_len slots starting at prefix_start, or the slots prefix_index [Lp] when
// prefix_start < 0; suffix_index [S] lists every row's own slots, and bias [1, 1, T * G, S]
// (0 / -inf, query row t * G + g) keeps each query on its own row's keys up to its
// position. Writes the result into out [>= T, H * D] (rows T.. are left as they are).
void cascade_attention(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_buf, at::Tensor v_buf,
    const at::Tensor& loc, const at::Tensor& suffix_index, const at::Tensor& bias, int64_t prefix_start,
    int64_t prefix_len, const at::Tensor& prefix_index, int64_t num_heads, double scale, at::Tensor out) {
  const int64_t T = loc.size(0), Hkv = k_buf.size(1), D = k_buf.size(2), G = num_heads / Hkv;
  TORCH_CHECK(k_buf.dim() == 3 && v_buf.sizes() == k_buf.sizes() && num_heads % Hkv == 0, "KV buffers [N, Hkv, D]");
  TORCH_CHECK(q.size(0) >= T && q.size(1) == num_heads * D && out.size(0) >= T && out.size(1) == num_heads * D, "q / out [T, H * D]");
  store_rows(k_buf, loc, k, T);
  store_rows(v_buf, loc, v, T);
  // Query row t * G + g of KV head h is head h * G + g of token t.
  at::Tensor q_seq = q.narrow(0, 0, T).view({T, Hkv, G, D}).transpose(0, 1).reshape({1, Hkv, T * G, D});
  const int64_t S = suffix_index.size(0);
  at::Tensor k_suf = gather_rows(k_buf, suffix_index).view({1, S, Hkv, D}).transpose(1, 2);  // [1, Hkv, S, D]
  at::Tensor v_suf = gather_rows(v_buf, suffix_index).view({1, S, Hkv, D}).transpose(1, 2);
  auto [o_suf, lse_suf] = at::_scaled_dot_product_flash_attention_for_cpu(q_seq, k_suf, v_suf, 0.0, false, bias, scale);
  at::Tensor k_pre, v_pre;
  if (prefix_start >= 0) {
    k_pre = k_buf.narrow(0, prefix_start, prefix_len);
    v_pre = v_buf.narrow(0, prefix_start, prefix_len);
  } else {
    k_pre = gather_rows(k_buf, prefix_index);
    v_pre = gather_rows(v_buf, prefix_index);
  }
  k_pre = k_pre.view({1, prefix_len, Hkv, D}).transpose(1, 2);  // [1, Hkv, Lp, D]
  v_pre = v_pre.view({1, prefix_len, Hkv, D}).transpose(1, 2);
  auto [o_pre, lse_pre] = at::_scaled_dot_product_flash_attention_for_cpu(q_seq, k_pre, v_pre, 0.0, false, std::nullopt, scale);
  // Softmax over both key sets: the prefix's share of the mass is sigmoid(lse_pre - lse_suf).
  at::Tensor w_pre = at::sigmoid(lse_pre - lse_suf).view({Hkv, T, G, 1}).to(o_suf.scalar_type());
  at::Tensor dst = out.narrow(0, 0, T).view({T, Hkv, G, D}).transpose(0, 1);  // [Hkv, T, G, D]
  at::lerp_out(dst, o_suf.view({Hkv, T, G, D}), o_pre.view({Hkv, T, G, D}), w_pre);
}

// oneDNN-packed weights by key (PackableLinear.pack_for_cpu), held weakly: the layer owns
// its weight, so a dropped model is freed. The compiled graph names a weight by its key,
// as an opaque packed tensor cannot be a graph input.
std::mutex packed_mutex;
std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> packed_weights;

int64_t register_packed_weight(const at::Tensor& weight) {
  std::lock_guard<std::mutex> lock(packed_mutex);
  packed_weights.emplace_back(weight.getIntrusivePtr());
  return static_cast<int64_t>(packed_weights.size()) - 1;
}

// x [n, in] -> [n, out] through the packed weight `key`: the product torch.compile's graph
// calls in every linear layer (4 per decoder layer). From the graph's C++ wrapper this is a
// dispatcher call with no Python (a Python custom op cost ~25 us a call).
at::Tensor packed_linear(const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t key) {
  c10::intrusive_ptr<c10::TensorImpl> impl;
  {
    std::lock_guard<std::mutex> lock(packed_mutex);
    TORCH_CHECK(key >= 0 && key < static_cast<int64_t>(packed_weights.size()), "no packed weight ", key);
    impl = packed_weights[key].lock();
  }
  TORCH_CHECK(impl, "packed weight ", key, " was freed");
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{
      x, at::Tensor(std::move(impl)), bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
      std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// The compiled graph's attention (`srt_lite_cpu::attention`): a step whose attention is one
// token cascade (set_cascade_step, before the forward) runs in C++ without any Python; every
// other step goes to the Python op `srt_lite::attention` through the dispatcher.
struct CascadeStep {
  at::Tensor loc, suffix_index, bias, prefix_index;
  int64_t prefix_start = -1, prefix_len = 0, num_heads = 0;
  double scale = 1.0;
  std::vector<at::Tensor> k_bufs, v_bufs;  // by layer id
};
std::optional<CascadeStep> cascade_step;

void set_cascade_step(
    const at::Tensor& loc, const at::Tensor& suffix_index, const at::Tensor& bias, int64_t prefix_start,
    int64_t prefix_len, const at::Tensor& prefix_index, int64_t num_heads, double scale, at::TensorList k_bufs,
    at::TensorList v_bufs) {
  TORCH_CHECK(k_bufs.size() == v_bufs.size(), "one V buffer per K buffer");
  cascade_step = CascadeStep{
      loc, suffix_index, bias, prefix_index, prefix_start, prefix_len, num_heads, scale, k_bufs.vec(), v_bufs.vec()};
}

void clear_cascade_step() { cascade_step.reset(); }

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer_id) {
  if (!cascade_step) {
    static const c10::OperatorHandle fallback = c10::Dispatcher::singleton().findSchemaOrThrow("srt_lite::attention", "");
    std::vector<c10::IValue> stack{q, k, v, layer_id};
    fallback.callBoxed(&stack);
    return stack[0].toTensor();
  }
  const CascadeStep& st = *cascade_step;
  TORCH_CHECK(layer_id >= 0 && layer_id < static_cast<int64_t>(st.k_bufs.size()), "no KV buffer for layer ", layer_id);
  const int64_t T = st.loc.size(0);
  at::Tensor out = at::empty({q.size(0), q.size(1)}, q.options());  // rows past T pad the token axis
  if (q.size(0) > T) {
    out.narrow(0, T, q.size(0) - T).zero_();
  }
  cascade_attention(
      q, k, v, st.k_bufs[layer_id], st.v_bufs[layer_id], st.loc, st.suffix_index, st.bias, st.prefix_start,
      st.prefix_len, st.prefix_index, st.num_heads, st.scale, out);
  return out;
}

}  // namespace

TORCH_LIBRARY(srt_lite_cpu, m) {
  m.def(
      "set_cascade_step(Tensor loc, Tensor suffix_index, Tensor bias, int prefix_start, int prefix_len, "
      "Tensor prefix_index, int num_heads, float scale, Tensor[] k_bufs, Tensor[] v_bufs) -> ()");
  m.def("clear_cascade_step() -> ()");
  m.def("attention(Tensor q, Tensor k, Tensor v, int layer_id) -> Tensor");
  m.def("register_packed_weight(Tensor weight) -> int");
  m.def("packed_linear(Tensor x, Tensor? bias, int key) -> Tensor");
  m.def(
      "cascade_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor loc, "
      "Tensor suffix_index, Tensor bias, int prefix_start, int prefix_len, Tensor prefix_index, int num_heads, "
      "float scale, Tensor(c!) out) -> ()");
}

TORCH_LIBRARY_IMPL(srt_lite_cpu, CPU, m) {
  m.impl("cascade_attention", &cascade_attention);
  m.impl("packed_linear", &packed_linear);
  m.impl("set_cascade_step", &set_cascade_step);
  m.impl("attention", &attention);
}

// Takes no tensor that picks a backend by device.
TORCH_LIBRARY_IMPL(srt_lite_cpu, CompositeExplicitAutograd, m) {
  m.impl("register_packed_weight", &register_packed_weight);
  m.impl("clear_cascade_step", &clear_cascade_step);
}
