// The CPU kernels' entry points, one table per instruction set (kernels_<isa>.cpp fill them).
//
// Plain pointers and sizes only: the kernel translation units are compiled for different
// instruction sets and must not share inline functions with the rest of the library, so they
// include no torch headers. ops.cpp checks shapes and picks the table the CPU supports.
#pragma once

#include <cstdint>

namespace disagg {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1 };

// One layer's view of the block-contiguous KV cache: element strides of [block, token, head].
struct CacheView {
  void* data;
  int64_t block_stride;
  int64_t token_stride;
  int64_t head_stride;
};

struct KernelTable {
  const char* isa;
  // The cache's dtype (kv_dtype, below) is the model's (dtype), or bfloat16 under a float32 model.
  //
  // out[n, num_heads, head_dim] = softmax(q k^T * scale) v over each row's first context_lens[i]
  // tokens, read in place from the blocks in block_tables[i] (num_heads % num_kv_heads == 0).
  // scratch: n * num_kv_heads slices of scratch_stride floats, scratch_stride >=
  // (num_heads / num_kv_heads) * (max(context_lens) + head_dim).
  void (*paged_decode_attention)(void* out, const void* q, CacheView k, CacheView v, const int64_t* block_tables,
                                 int64_t max_blocks, const int64_t* context_lens, int64_t n, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, DType dtype,
                                 DType kv_dtype, float* scratch, int64_t scratch_stride);
  // out[T, num_heads, head_dim] for q [T, num_heads, head_dim] (contiguous) of tokens at positions
  // start_pos + t: each attends causally to keys [0, its position], read in place from the blocks
  // in block_ids; scores and probabilities in float32. head_dim 64 or 128, at most 64 query heads
  // per KV head (a work item holds one group's heads).
  void (*paged_prefill_attention)(void* out, const void* q, CacheView k, CacheView v, const int64_t* block_ids,
                                  int64_t start_pos, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                                  int64_t head_dim, int64_t block_size, float scale, DType dtype, DType kv_dtype);
  // residual (if not null) += x, rounded to dtype; out = weight * round(norm(residual or x)).
  void (*rms_norm)(void* out, const void* x, void* residual, const void* weight, int64_t rows, int64_t dim,
                   float eps, DType dtype);
  // Rotate-half RoPE of q [T, num_heads, head_dim] and k [T, num_kv_heads, head_dim] in place (row
  // strides given), cos/sin from cos_sin[position] ([max_pos, head_dim]: cos half, then sin half),
  // then k and v [T, num_kv_heads, head_dim] written to slot (slot_blocks[t], slot_offsets[t]),
  // rounded to the cache's dtype.
  void (*rope_and_cache)(void* q, int64_t q_stride, void* k, int64_t k_stride, const void* v, int64_t v_stride,
                         const int64_t* positions, const float* cos_sin, CacheView k_cache, CacheView v_cache,
                         const int64_t* slot_blocks, const int64_t* slot_offsets, int64_t num_tokens,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, DType dtype, DType kv_dtype);
  // out[T, d] = silu(x[:, :d]) * x[:, d:] for x [T, 2d].
  void (*silu_and_mul)(void* out, const void* x, int64_t rows, int64_t dim, DType dtype);
  // Activations x [rows, cols] (row stride x_stride) to int8 in blocks of 32: q int8 [rows, cols],
  // d and s float32 [rows, cols / 32] with d = max|x| / 127, q = rint(x * (1 / d)) (0 where d = 0)
  // and s = d * sum(q) per block.
  void (*quantize_q8)(int8_t* q, float* d, float* s, const void* x, int64_t rows, int64_t cols, int64_t x_stride,
                      DType dtype);
  // out[rows, n] = x [rows, k] (as quantize_q8 left it) times a weight [n, k] of `bits` (4 or 8)
  // packed in tiles of 16 rows (quant_matmul.h gives the layout), rounded to dtype.
  void (*quant_matmul)(void* out, const int8_t* xq, const float* xd, const float* xs, const uint8_t* w,
                       const float* ws, int64_t rows, int64_t n, int64_t k, int bits, DType dtype);
  // out[rows, n] = x [rows, k] float32 times the weight quant_matmul takes, dequantized in registers
  // (from 22 rows, a pair of tiles at a time into a buffer; dequant_matmul.h), all float32.
  void (*dequant_matmul)(float* out, const float* x, const uint8_t* w, const float* ws, int64_t rows, int64_t n,
                         int64_t k, int bits);
  // out[rows, n] = x [rows, k] times a float32 or bfloat16 (w_dtype) weight [n, k] packed in tiles of
  // 32 rows (dense_matmul.h gives the layout), computed in float32; xt: rows * k floats of scratch.
  void (*dense_matmul)(float* out, const float* x, const void* w, DType w_dtype, float* xt, int64_t rows, int64_t n,
                       int64_t k);
  // out[r] = the index of row r's largest value in x [rows, cols] float32 (cols >= 1), as torch.argmax:
  // the first of equal ones, and the first NaN where the row has one.
  void (*argmax_rows)(int64_t* out, const float* x, int64_t rows, int64_t cols);
};

KernelTable kernels_base();
KernelTable kernels_avx2();
KernelTable kernels_avx512();

}  // namespace disagg
