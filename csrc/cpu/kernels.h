// Kernel bodies and their table, compiled once per instruction set: kernels_<isa>.cpp sets
// `#pragma GCC target`, defines DISAGG_ISA (the namespace) and the features it has (DISAGG_AVX2,
// DISAGG_AVX512, DISAGG_FMA, DISAGG_VNNI), and includes this file. Loops are written for the
// auto-vectoriser (`omp simd`); no headers with inline functions may be included here, so that no
// AVX-512 copy of a shared inline function can leak into the rest of the library.
//
// Numerics follow the pure-torch ops in disagg/ops/reference.py: products and sums are rounded to
// the model dtype where torch would round them (so bfloat16 results match it), float32 math
// otherwise; the build uses -ffp-contract=off so that no multiply-add is fused behind our back
// (fma32 and fma_v fuse where a kernel asks for it).

#include <cstdint>

#include "table.h"

// OpenMP's thread queries, declared here rather than through <omp.h> (see above).
extern "C" int omp_get_num_threads(void);
extern "C" int omp_get_thread_num(void);

// NaN and infinities are values here (argmax_rows' first NaN, exp_approx's limits, to_bf16's NaN):
// a build that assumes finite math would silently break them.
#if defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__
#error "csrc kernels need NaN and infinities: build without -ffast-math / -ffinite-math-only"
#endif

namespace disagg {
namespace DISAGG_ISA {
namespace {

using bf16 = uint16_t;

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }

// Round to nearest even, as torch does (a NaN becomes the canonical quiet NaN).
inline bf16 to_bf16(float f) {
  const uint32_t u = __builtin_bit_cast(uint32_t, f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<bf16>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);  // a select, not a branch
}

template <typename T> inline T from_f32(float f);
template <> inline float from_f32<float>(float f) { return f; }
template <> inline bf16 from_f32<bf16>(float f) { return to_bf16(f); }

// f rounded to T and back: what storing a float32 result in a T tensor does.
template <typename T> inline float round_to(float f) { return to_f32(from_f32<T>(f)); }

// exp to ~2 ulp (Cephes' polynomial): 0 below -87, inf above 88. Plain arithmetic and selects on
// the result, so that loops over it vectorise (a clamp of x itself keeps GCC from vectorising).
inline float exp_approx(float x) {
  const float t = x * 1.44269504088896341f + 0.5f;
  const float truncated = static_cast<float>(static_cast<int32_t>(t));
  const float fn = truncated - (truncated > t ? 1.0f : 0.0f);  // floor(t)
  const int32_t n = static_cast<int32_t>(fn);
  float r = x - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = (p * r * r + r + 1.0f) * __builtin_bit_cast(float, static_cast<uint32_t>(n + 127) << 23);
  const float low = x < -87.0f ? 0.0f : y;
  return x > 88.0f ? __builtin_inff() : low;
}

// Below this many elements of work a parallel region costs more than it saves.
constexpr int64_t kParallelElems = 1 << 15;

// A fused multiply-add where the build has one (DISAGG_FMA: the avx2 and avx512 files; g++ defines
// no __FMA__ for a target pragma), else a multiply and an add.
#if defined(DISAGG_FMA)
inline float fma32(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#else
inline float fma32(float a, float b, float c) { return a * b + c; }
#endif

#include "attention.h"  // paged decode and prefill attention
#include "quant_matmul.h"  // quantized weights x int8 activations
#include "dequant_matmul.h"  // quantized weights x float32 activations
#include "dense_matmul.h"  // float32 weights x float32 activations, few rows

// ---- RMSNorm (with the residual add folded in) ----------------------------------------------

template <typename T>
void rms_norm_t(void* out_, const void* x_, void* residual_, const void* weight_, int64_t rows, int64_t dim,
                float eps) {
  T* out = static_cast<T*>(out_);
  const T* x = static_cast<const T*>(x_);
  T* residual = static_cast<T*>(residual_);
  const T* w = static_cast<const T*>(weight_);
#pragma omp parallel for schedule(static) if (rows * dim >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    T* src = residual ? residual + r * dim : const_cast<T*>(xr);
    if (residual) {
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) src[d] = from_f32<T>(to_f32(src[d]) + to_f32(xr[d]));
    }
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < dim; ++d) ss += to_f32(src[d]) * to_f32(src[d]);
    const float inv = 1.0f / __builtin_sqrtf(ss / static_cast<float>(dim) + eps);
    T* o = out + r * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) o[d] = from_f32<T>(to_f32(w[d]) * round_to<T>(to_f32(src[d]) * inv));
  }
}

// ---- RoPE (rotate-half) and the KV cache write ----------------------------------------------

template <typename T>
inline void rotate_head(T* x, const float* cos_sin, int64_t half) {
  const float* c = cos_sin;
  const float* s = cos_sin + half;
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) {
    const float x1 = to_f32(x[j]), x2 = to_f32(x[j + half]);
    const float cj = round_to<T>(c[j]), sj = round_to<T>(s[j]);
    x[j] = from_f32<T>(round_to<T>(x1 * cj) + round_to<T>(-x2 * sj));
    x[j + half] = from_f32<T>(round_to<T>(x2 * cj) + round_to<T>(x1 * sj));
  }
}

template <typename T, typename KV>
void rope_and_cache_t(void* q_, int64_t q_stride, void* k_, int64_t k_stride, const void* v_, int64_t v_stride,
                      const int64_t* positions, const float* cos_sin, CacheView kc, CacheView vc,
                      const int64_t* slot_blocks, const int64_t* slot_offsets, int64_t num_tokens, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (num_tokens * (num_heads + num_kv_heads) * head_dim >= kParallelElems)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* cs = cos_sin + positions[t] * head_dim;
    T* q = static_cast<T*>(q_) + t * q_stride;
    for (int64_t h = 0; h < num_heads; ++h) rotate_head<T>(q + h * head_dim, cs, half);
    T* k = static_cast<T*>(k_) + t * k_stride;
    const T* v = static_cast<const T*>(v_) + t * v_stride;
    KV* kd = static_cast<KV*>(kc.data) + slot_blocks[t] * kc.block_stride + slot_offsets[t] * kc.token_stride;
    KV* vd = static_cast<KV*>(vc.data) + slot_blocks[t] * vc.block_stride + slot_offsets[t] * vc.token_stride;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      rotate_head<T>(k + h * head_dim, cs, half);
      for (int64_t d = 0; d < head_dim; ++d) {
        kd[h * kc.head_stride + d] = from_f32<KV>(to_f32(k[h * head_dim + d]));
        vd[h * vc.head_stride + d] = from_f32<KV>(to_f32(v[h * head_dim + d]));
      }
    }
  }
}

// ---- SiLU and multiply --------------------------------------------------------------------

template <typename T>
inline float silu_mul(T gate, float e, T up) {  // e = exp(-gate)
  const float g = to_f32(gate);
  return round_to<T>(g / (1.0f + e)) * to_f32(up);
}

// exp a vector at a time, the same bits: a loop of exp_approx ran scalar on avx2, where SmolLM2's 30
// SiLUs of a 256-token prefill took 74 ms against torch's 24 (more than its prefill attention).
template <typename T>
inline void silu_mul_row(T* __restrict o, const T* __restrict gate, const T* __restrict up, int64_t dim) {
  int64_t d = 0;
  for (; d + kVL <= dim; d += kVL) {
    float e[kVL];
    store_v(e, exp_v(-load_v(gate + d)));
#pragma omp simd
    for (int i = 0; i < kVL; ++i) o[d + i] = from_f32<T>(silu_mul(gate[d + i], e[i], up[d + i]));
  }
  for (; d < dim; ++d) o[d] = from_f32<T>(silu_mul(gate[d], exp_approx(-to_f32(gate[d])), up[d]));
}

template <typename T>
void silu_and_mul_t(void* out_, const void* x_, int64_t rows, int64_t dim) {
  T* out = static_cast<T*>(out_);
  const T* x = static_cast<const T*>(x_);
#pragma omp parallel for schedule(static) if (rows * dim >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    silu_mul_row<T>(out + r * dim, x + r * 2 * dim, x + r * 2 * dim + dim, dim);
  }
}

// ---- argmax of each row (the greedy pick) ---------------------------------------------------

// Values a search step tests at once: one simd reduction, then a scalar look only in the step that holds the hit.
constexpr int64_t kArgmaxStep = 64;

// The first index in [0, n) where `hit` holds (n when none does).
template <typename Hit>
inline int64_t first_hit(const float* x, int64_t n, Hit hit) {
  for (int64_t i0 = 0; i0 < n; i0 += kArgmaxStep) {
    const int64_t end = n - i0 < kArgmaxStep ? n : i0 + kArgmaxStep;
    int any = 0;
#pragma omp simd reduction(| : any)
    for (int64_t i = i0; i < end; ++i) any |= hit(x[i]);
    if (!any) continue;
    for (int64_t i = i0; i < end; ++i)
      if (hit(x[i])) return i;
  }
  return n;
}

// The index of the row's largest value, the first of several equal ones, as torch.argmax: a NaN
// counts as the largest (the first NaN wins). torch's own scan ran at ~4.5 GB/s: 670 us a decode
// step for 16 rows of SmolLM2's 49152 logits.
inline int64_t argmax_row(const float* x, int64_t n) {
  float m = x[0];
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    m = x[i] > m ? x[i] : m;
    nan |= x[i] != x[i];
  }
  if (nan) return first_hit(x, n, [](float v) { return static_cast<int>(v != v); });
  return first_hit(x, n, [m](float v) { return static_cast<int>(v == m); });
}

void argmax_rows(int64_t* out, const float* x, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows > 1 && rows * cols >= 8 * kParallelElems)
  for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * cols, cols);
}

// ---- the table ------------------------------------------------------------------------------

// The kernel for a (model dtype, cache dtype) pair: the cache holds the model's dtype, or bfloat16
// under a float32 model (ops.cpp refuses the rest).
template <typename Fn>
inline Fn pick_kv(DType dtype, DType kv_dtype, Fn f32, Fn f32_bf16, Fn bf16) {
  if (dtype == DType::kBFloat16) return bf16;
  return kv_dtype == DType::kBFloat16 ? f32_bf16 : f32;
}

void paged_decode_attention(void* out, const void* q, CacheView k, CacheView v, const int64_t* block_tables,
                            int64_t max_blocks, const int64_t* context_lens, int64_t n, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, DType dtype,
                            DType kv_dtype, float* scratch, int64_t scratch_stride) {
  auto fn = pick_kv(dtype, kv_dtype, paged_decode_attention_t<float, float>, paged_decode_attention_t<float, bf16>,
                    paged_decode_attention_t<bf16, bf16>);
  fn(out, q, k, v, block_tables, max_blocks, context_lens, n, num_heads, num_kv_heads, head_dim, block_size, scale,
     scratch, scratch_stride);
}

void paged_prefill_attention(void* out, const void* q, CacheView k, CacheView v, const int64_t* block_ids,
                             int64_t start_pos, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t block_size, float scale, DType dtype, DType kv_dtype) {
  auto fn = pick_kv(dtype, kv_dtype, paged_prefill_attention_t<float, float>, paged_prefill_attention_t<float, bf16>,
                    paged_prefill_attention_t<bf16, bf16>);
  fn(out, q, k, v, block_ids, start_pos, num_tokens, num_heads, num_kv_heads, head_dim, block_size, scale);
}

void rms_norm(void* out, const void* x, void* residual, const void* weight, int64_t rows, int64_t dim, float eps,
              DType dtype) {
  auto fn = dtype == DType::kFloat32 ? rms_norm_t<float> : rms_norm_t<bf16>;
  fn(out, x, residual, weight, rows, dim, eps);
}

void rope_and_cache(void* q, int64_t q_stride, void* k, int64_t k_stride, const void* v, int64_t v_stride,
                    const int64_t* positions, const float* cos_sin, CacheView kc, CacheView vc,
                    const int64_t* slot_blocks, const int64_t* slot_offsets, int64_t num_tokens, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, DType dtype, DType kv_dtype) {
  auto fn = pick_kv(dtype, kv_dtype, rope_and_cache_t<float, float>, rope_and_cache_t<float, bf16>,
                    rope_and_cache_t<bf16, bf16>);
  fn(q, q_stride, k, k_stride, v, v_stride, positions, cos_sin, kc, vc, slot_blocks, slot_offsets, num_tokens,
     num_heads, num_kv_heads, head_dim);
}

void silu_and_mul(void* out, const void* x, int64_t rows, int64_t dim, DType dtype) {
  auto fn = dtype == DType::kFloat32 ? silu_and_mul_t<float> : silu_and_mul_t<bf16>;
  fn(out, x, rows, dim);
}

void quantize_q8(int8_t* q, float* d, float* s, const void* x, int64_t rows, int64_t cols, int64_t x_stride,
                 DType dtype) {
  auto fn = dtype == DType::kFloat32 ? quantize_q8_t<float> : quantize_q8_t<bf16>;
  fn(q, d, s, x, rows, cols, x_stride);
}

void quant_matmul(void* out, const int8_t* xq, const float* xd, const float* xs, const uint8_t* w, const float* ws,
                  int64_t rows, int64_t n, int64_t k, int bits, DType dtype) {
  auto fn = dtype == DType::kFloat32 ? (bits == 4 ? quant_matmul_t<float, 4> : quant_matmul_t<float, 8>)
                                     : (bits == 4 ? quant_matmul_t<bf16, 4> : quant_matmul_t<bf16, 8>);
  fn(out, xq, xd, xs, w, ws, rows, n, k);
}

void dequant_matmul(float* out, const float* x, const uint8_t* w, const float* ws, int64_t rows, int64_t n, int64_t k,
                    int bits) {
  auto fn = bits == 4 ? dequant_matmul_t<4> : dequant_matmul_t<8>;
  fn(out, x, w, ws, rows, n, k);
}

void dense_matmul(float* out, const float* x, const void* w, DType w_dtype, float* xt, int64_t rows, int64_t n,
                  int64_t k) {
  if (w_dtype == DType::kFloat32) dense_matmul_t(out, x, static_cast<const float*>(w), xt, rows, n, k);
  else dense_matmul_t(out, x, static_cast<const bf16*>(w), xt, rows, n, k);
}

}  // namespace
}  // namespace DISAGG_ISA

// The table of this instruction set's kernels: kernels_<isa>() (table.h declares all three).
#define DISAGG_PASTE2(a, b) a##b
#define DISAGG_PASTE(a, b) DISAGG_PASTE2(a, b)
#define DISAGG_STRING2(x) #x
#define DISAGG_STRING(x) DISAGG_STRING2(x)
KernelTable DISAGG_PASTE(kernels_, DISAGG_ISA)() {
  return {DISAGG_STRING(DISAGG_ISA), DISAGG_ISA::paged_decode_attention, DISAGG_ISA::paged_prefill_attention,
          DISAGG_ISA::rms_norm,
          DISAGG_ISA::rope_and_cache, DISAGG_ISA::silu_and_mul,
          DISAGG_ISA::quantize_q8, DISAGG_ISA::quant_matmul, DISAGG_ISA::dequant_matmul, DISAGG_ISA::dense_matmul,
          DISAGG_ISA::argmax_rows};
}

}  // namespace disagg
