// torch.ops.disagg.*: shape and dtype checks, then the kernel table this CPU supports.
//
// Registered with TORCH_LIBRARY, so Python loads the library with torch.ops.load_library and calls
// torch.ops.disagg.<op>; disagg/ops/__init__.py is the only caller and holds the torch fallbacks.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "table.h"

namespace disagg {
namespace {

bool cpu_has(const char* isa) {
  __builtin_cpu_init();
  if (std::strcmp(isa, "avx512") == 0) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma");
  }
  if (std::strcmp(isa, "avx2") == 0) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return std::strcmp(isa, "base") == 0;
}

KernelTable best_table() {
  if (cpu_has("avx512")) return kernels_avx512();
  if (cpu_has("avx2")) return kernels_avx2();
  return kernels_base();
}

KernelTable& table() {
  static KernelTable t = best_table();
  return t;
}

DType dtype_of(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "disagg ops support float32 and bfloat16, got ", t.scalar_type());
  return t.scalar_type() == at::kFloat ? DType::kFloat32 : DType::kBFloat16;
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

// A [num_blocks, block_size, heads, head_dim] cache view whose last dimension is contiguous, of the
// model's dtype (`like`'s) or bfloat16 under a float32 model.
CacheView cache_view(const at::Tensor& c, const at::Tensor& like, const char* name) {
  check_cpu(c, name);
  TORCH_CHECK(c.dim() == 4 && c.stride(3) == 1, name, " must be [num_blocks, block_size, heads, head_dim] with a contiguous last dimension");
  TORCH_CHECK(c.scalar_type() == like.scalar_type() || (c.scalar_type() == at::kBFloat16 && like.scalar_type() == at::kFloat),
              name, " dtype ", c.scalar_type(), " does not fit ", like.scalar_type(),
              " (a cache holds the model's dtype, or bfloat16 under float32)");
  return {c.data_ptr(), c.stride(0), c.stride(1), c.stride(2)};
}

void check_ids(const at::Tensor& ids, int64_t num_blocks);

at::Tensor long_contiguous(const at::Tensor& t, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64");
  return t.contiguous();
}

std::string isa() { return table().isa; }

void set_isa(const std::string& name) {
  TORCH_CHECK(cpu_has(name.c_str()), "this CPU cannot run the '", name, "' kernels");
  table() = name == "avx512" ? kernels_avx512() : name == "avx2" ? kernels_avx2() : kernels_base();
}

// q [tokens, heads, head_dim] (made contiguous) and the caches it attends to, checked alike for both
// attention ops.
struct Attention {
  at::Tensor q;
  DType dtype, kv_dtype;
  CacheView k, v;
  int64_t tokens, heads, head_dim, kv_heads, block_size;
};

Attention attention_args(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  check_cpu(q_in, "q");
  TORCH_CHECK(q_in.dim() == 3, "q must be [n, num_heads, head_dim]");
  const DType dtype = dtype_of(q_in);
  at::Tensor q = q_in.contiguous();
  const CacheView k = cache_view(k_cache, q, "k_cache"), v = cache_view(v_cache, q, "v_cache");
  const int64_t heads = q.size(1), head_dim = q.size(2), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache differ in shape or dtype");
  TORCH_CHECK(k_cache.size(3) == head_dim && kv_heads > 0 && heads > 0 && heads % kv_heads == 0,
              "q heads ", heads, " x ", head_dim, " do not fit the cache's ", kv_heads, " x ", k_cache.size(3));
  return {q, dtype, dtype_of(k_cache), k, v, q.size(0), heads, head_dim, kv_heads, k_cache.size(1)};
}

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables_in, const at::Tensor& context_lens_in, double scale) {
  const Attention a = attention_args(q_in, k_cache, v_cache);
  const at::Tensor& q = a.q;
  const CacheView k = a.k, v = a.v;
  const DType dtype = a.dtype;
  const int64_t n = a.tokens, num_heads = a.heads, head_dim = a.head_dim;
  const int64_t block_size = a.block_size, num_kv_heads = a.kv_heads;
  at::Tensor block_tables = long_contiguous(block_tables_in, "block_tables");
  at::Tensor context_lens = long_contiguous(context_lens_in, "context_lens");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == n && context_lens.numel() == n,
              "block_tables must be [n, max_blocks] and context_lens [n]");
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  int64_t max_ctx = 1;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= max_blocks * block_size, "context length ", lens[i], " of row ", i,
                " does not fit its ", max_blocks, " blocks");
    for (int64_t b = 0; b < (lens[i] + block_size - 1) / block_size; ++b) {
      TORCH_CHECK(tables[i * max_blocks + b] >= 0 && tables[i * max_blocks + b] < k_cache.size(0),
                  "block id ", tables[i * max_blocks + b], " out of range [0, ", k_cache.size(0), ")");
    }
    max_ctx = lens[i] > max_ctx ? lens[i] : max_ctx;
  }
  const int64_t group = num_heads / num_kv_heads;
  const int64_t stride = group * (max_ctx + head_dim);
  at::Tensor scratch = at::empty({n * num_kv_heads * stride}, q.options().dtype(at::kFloat));
  at::Tensor out = at::empty_like(q);
  table().paged_decode_attention(out.data_ptr(), q.data_ptr(), k, v, tables, max_blocks, lens, n, num_heads,
                                 num_kv_heads, head_dim, block_size, static_cast<float>(scale), dtype, a.kv_dtype,
                                 scratch.data_ptr<float>(), stride);
  return out;
}

at::Tensor paged_prefill_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_ids_in, int64_t start_pos, double scale) {
  const Attention a = attention_args(q_in, k_cache, v_cache);
  const int64_t num_tokens = a.tokens, block_size = a.block_size;
  TORCH_CHECK(a.head_dim == 64 || a.head_dim == 128, "prefill attention takes head_dim 64 or 128, not ", a.head_dim);
  TORCH_CHECK(a.heads / a.kv_heads <= 64, "prefill attention takes at most 64 query heads per KV head, not ",
              a.heads / a.kv_heads);
  at::Tensor ids = long_contiguous(block_ids_in, "block_ids").view(-1);
  TORCH_CHECK(start_pos >= 0 && start_pos <= ids.numel() * block_size - num_tokens, "start_pos ", start_pos,
              " and ", num_tokens, " tokens do not fit ", ids.numel(), " blocks of ", block_size);
  check_ids(ids, k_cache.size(0));
  at::Tensor out = at::empty_like(a.q);
  if (num_tokens == 0) return out;
  table().paged_prefill_attention(out.data_ptr(), a.q.data_ptr(), a.k, a.v, ids.data_ptr<int64_t>(), start_pos,
                                  num_tokens, a.heads, a.kv_heads, a.head_dim, block_size, static_cast<float>(scale),
                                  a.dtype, a.kv_dtype);
  return out;
}

at::Tensor norm_impl(const at::Tensor& x_in, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                     double eps) {
  check_cpu(x_in, "x");
  const DType dtype = dtype_of(x_in);
  TORCH_CHECK(weight.scalar_type() == x_in.scalar_type() && weight.dim() == 1 && weight.is_contiguous(),
              "weight must be a contiguous 1-d tensor of the input's dtype");
  const int64_t dim = weight.size(0);
  TORCH_CHECK(x_in.size(-1) == dim, "x's last dimension ", x_in.size(-1), " differs from weight's ", dim);
  at::Tensor x = x_in.contiguous();
  void* res = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                residual->scalar_type() == x.scalar_type(), "residual must be contiguous and shaped like x");
    res = residual->data_ptr();
  }
  at::Tensor out = at::empty_like(x);
  table().rms_norm(out.data_ptr(), x.data_ptr(), res, weight.data_ptr(), x.numel() / dim, dim,
                   static_cast<float>(eps), dtype);
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return norm_impl(x, c10::nullopt, weight, eps);
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  return norm_impl(x, residual, weight, eps);
}

// [T, heads, head_dim] with a contiguous [heads, head_dim] per token; returns the token stride.
int64_t token_stride(const at::Tensor& t, int64_t heads, int64_t head_dim, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.dim() == 3 && t.size(1) == heads && t.size(2) == head_dim && t.stride(2) == 1 &&
              t.stride(1) == head_dim, name, " must be [T, ", heads, ", ", head_dim, "] with contiguous tokens");
  return t.stride(0);
}

void rope_and_cache(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const at::Tensor& positions_in,
                    const at::Tensor& cos_sin, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_blocks_in, const at::Tensor& slot_offsets_in) {
  const DType dtype = dtype_of(q);
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k.size(1);
  const int64_t q_stride = token_stride(q, num_heads, head_dim, "q");
  const int64_t k_stride = token_stride(k, num_kv_heads, head_dim, "k");
  const int64_t v_stride = token_stride(v, num_kv_heads, head_dim, "v");
  TORCH_CHECK(k.size(0) == num_tokens && v.size(0) == num_tokens, "q, k and v differ in tokens");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k and v differ in dtype");
  const CacheView kc = cache_view(k_cache, q, "k_cache"), vc = cache_view(v_cache, q, "v_cache");
  TORCH_CHECK(k_cache.size(2) == num_kv_heads && k_cache.size(3) == head_dim && v_cache.sizes() == k_cache.sizes(),
              "the caches do not hold ", num_kv_heads, " x ", head_dim, " heads");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache differ in dtype");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() && cos_sin.dim() == 2 &&
              cos_sin.size(1) == head_dim, "cos_sin must be a contiguous float32 [max_pos, head_dim] table");
  at::Tensor positions = long_contiguous(positions_in, "positions");
  at::Tensor slot_blocks = long_contiguous(slot_blocks_in, "slot_blocks");
  at::Tensor slot_offsets = long_contiguous(slot_offsets_in, "slot_offsets");
  TORCH_CHECK(positions.numel() == num_tokens && slot_blocks.numel() == num_tokens && slot_offsets.numel() == num_tokens,
              "positions and slots must have one entry per token");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_sin.size(0), "position ", pos[t], " is past the RoPE table");
    TORCH_CHECK(blocks[t] >= 0 && blocks[t] < k_cache.size(0) && offsets[t] >= 0 && offsets[t] < k_cache.size(1),
                "slot (", blocks[t], ", ", offsets[t], ") is outside the cache");
  }
  table().rope_and_cache(q.data_ptr(), q_stride, k.data_ptr(), k_stride, v.data_ptr(), v_stride, pos,
                         cos_sin.data_ptr<float>(), kc, vc, blocks, offsets, num_tokens, num_heads, num_kv_heads,
                         head_dim, dtype, dtype_of(k_cache));
}

at::Tensor silu_and_mul(const at::Tensor& x_in) {
  check_cpu(x_in, "x");
  const DType dtype = dtype_of(x_in);
  TORCH_CHECK(x_in.size(-1) % 2 == 0, "silu_and_mul needs an even last dimension");
  at::Tensor x = x_in.contiguous();
  const int64_t dim = x.size(-1) / 2;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = dim;
  at::Tensor out = at::empty(shape, x.options());
  table().silu_and_mul(out.data_ptr(), x.data_ptr(), x.numel() / (2 * dim), dim, dtype);
  return out;
}

#include "matmul_ops.h"  // quantize_q8, quant_matmul, dequant_matmul, dense_matmul

// logits [rows, vocab] float32 → int64 [rows]: each row's argmax, as torch.argmax(dim=-1).
at::Tensor argmax_rows(const at::Tensor& logits_in) {
  check_cpu(logits_in, "logits");
  TORCH_CHECK(logits_in.scalar_type() == at::kFloat && logits_in.dim() == 2 && logits_in.size(1) > 0,
              "argmax_rows takes float32 logits [rows, vocab] with vocab > 0, got ", logits_in.scalar_type(), " ",
              logits_in.sizes());
  at::Tensor logits = logits_in.contiguous();
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  table().argmax_rows(out.data_ptr<int64_t>(), logits.data_ptr<float>(), logits.size(0), logits.size(1));
  return out;
}

// Blocks of `cache` (dimension 0; everything inside a block contiguous) to and from a packed tensor.
int64_t block_bytes(const at::Tensor& cache) {
  TORCH_CHECK(cache.dim() >= 2 && cache.select(0, 0).is_contiguous(), "cache blocks must be contiguous inside");
  return cache.select(0, 0).numel() * cache.element_size();
}

void check_ids(const at::Tensor& ids, int64_t num_blocks) {
  const int64_t* p = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < num_blocks, "block id ", p[i], " out of range [0, ", num_blocks, ")");
  }
}

at::Tensor gather_blocks(const at::Tensor& cache, const at::Tensor& block_ids_in) {
  check_cpu(cache, "cache");
  at::Tensor ids = long_contiguous(block_ids_in, "block_ids").view(-1);
  const int64_t bytes = block_bytes(cache);
  check_ids(ids, cache.size(0));
  std::vector<int64_t> shape(cache.sizes().begin(), cache.sizes().end());
  shape[0] = ids.numel();
  at::Tensor out = at::empty(shape, cache.options());
  const char* src = static_cast<const char*>(cache.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t* p = ids.data_ptr<int64_t>();
  const int64_t stride = cache.stride(0) * cache.element_size();
  at::parallel_for(0, ids.numel(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(dst + i * bytes, src + p[i] * stride, bytes);
  });
  return out;
}

void scatter_blocks(at::Tensor& cache, const at::Tensor& block_ids_in, const at::Tensor& src_in) {
  check_cpu(cache, "cache");
  at::Tensor ids = long_contiguous(block_ids_in, "block_ids").view(-1);
  const int64_t bytes = block_bytes(cache);
  check_ids(ids, cache.size(0));
  TORCH_CHECK(src_in.scalar_type() == cache.scalar_type() && src_in.size(0) == ids.numel() &&
              src_in.numel() * src_in.element_size() == ids.numel() * bytes,
              "src must hold one block of the cache's dtype per block id");
  at::Tensor src = src_in.contiguous();
  char* dst = static_cast<char*>(cache.data_ptr());
  const char* from = static_cast<const char*>(src.data_ptr());
  const int64_t* p = ids.data_ptr<int64_t>();
  const int64_t stride = cache.stride(0) * cache.element_size();
  at::parallel_for(0, ids.numel(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(dst + p[i] * stride, from + i * bytes, bytes);
  });
}

}  // namespace
}  // namespace disagg

TORCH_LIBRARY(disagg, m) {
  m.def("isa() -> str", &disagg::isa);
  m.def("set_isa(str name) -> ()", &disagg::set_isa);
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, float scale) -> Tensor");
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_ids, int start_pos, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rope_and_cache(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor positions, Tensor cos_sin, Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_blocks, Tensor slot_offsets) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("quantize_q8(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("quant_matmul(Tensor x, Tensor weight, Tensor scales, int n, int bits) -> Tensor");
  m.def("dequant_matmul(Tensor x, Tensor weight, Tensor scales, int n, int bits) -> Tensor");
  m.def("dense_matmul(Tensor x, Tensor weight, int n) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("gather_blocks(Tensor cache, Tensor block_ids) -> Tensor");
  m.def("scatter_blocks(Tensor(a!) cache, Tensor block_ids, Tensor src) -> ()");
}

TORCH_LIBRARY_IMPL(disagg, CPU, m) {
  m.impl("paged_decode_attention", &disagg::paged_decode_attention);
  m.impl("paged_prefill_attention", &disagg::paged_prefill_attention);
  m.impl("rms_norm", &disagg::rms_norm);
  m.impl("add_rms_norm", &disagg::add_rms_norm);
  m.impl("rope_and_cache", &disagg::rope_and_cache);
  m.impl("silu_and_mul", &disagg::silu_and_mul);
  m.impl("quantize_q8", &disagg::quantize_q8);
  m.impl("quant_matmul", &disagg::quant_matmul);
  m.impl("dequant_matmul", &disagg::dequant_matmul);
  m.impl("dense_matmul", &disagg::dense_matmul);
  m.impl("argmax_rows", &disagg::argmax_rows);
  m.impl("gather_blocks", &disagg::gather_blocks);
  m.impl("scatter_blocks", &disagg::scatter_blocks);
}
