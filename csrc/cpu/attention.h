// Attention kernels, a fragment of kernels.h: included there inside namespace disagg::DISAGG_ISA
// (anonymous), after the shared helpers (to_f32, from_f32, round_to, exp_approx, fma32), so that it
// is compiled once per instruction set like the rest. It includes nothing itself.

// ---- paged decode attention ----------------------------------------------------------------

// Softmax over scores[0, ctx) in place, probabilities rounded to T as `.to(values.dtype)` does.
template <typename T>
inline void softmax_row(float* s, int64_t ctx) {
  float m = s[0];
  for (int64_t t = 1; t < ctx; ++t) m = s[t] > m ? s[t] : m;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < ctx; ++t) {
    s[t] = exp_approx(s[t] - m);
    sum += s[t];
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t t = 0; t < ctx; ++t) s[t] = round_to<T>(s[t] * inv);
}

// One (request, KV head), any group and head size: the group of query heads that share it, over the request's blocks.
template <typename T>
void attend_group_any(T* out, const T* q, const T* k_base, const T* v_base, CacheView k, CacheView v,
                  const int64_t* blocks, int64_t ctx, int64_t group, int64_t head_dim, int64_t block_size,
                  float scale, float* scores) {
  // Pass 1: scores[g][t] = round(q_g . k_t) * scale, as matmul in T then .float() * scale.
  for (int64_t t = 0; t < ctx; ++t) {
    const T* kt = k_base + blocks[t / block_size] * k.block_stride + (t % block_size) * k.token_stride;
    for (int64_t g = 0; g < group; ++g) {
      const T* qg = q + g * head_dim;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot = fma32(to_f32(qg[d]), to_f32(kt[d]), dot);
      scores[g * ctx + t] = round_to<T>(dot) * scale;
    }
  }
  // Pass 2: softmax per query head.
  for (int64_t g = 0; g < group; ++g) softmax_row<T>(scores + g * ctx, ctx);
  // Pass 3: out_g = sum_t p[g][t] v_t, accumulated in float32 (after the scores in the scratch).
  float* acc = scores + group * ctx;
  for (int64_t i = 0; i < group * head_dim; ++i) acc[i] = 0.0f;
  for (int64_t t = 0; t < ctx; ++t) {
    const T* vt = v_base + blocks[t / block_size] * v.block_stride + (t % block_size) * v.token_stride;
    for (int64_t g = 0; g < group; ++g) {
      float p = scores[g * ctx + t];
      float* a = acc + g * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] = fma32(p, to_f32(vt[d]), a[d]);
    }
  }
  for (int64_t i = 0; i < group * head_dim; ++i) out[i] = from_f32<T>(acc[i]);
}

// Rows are read in block order, but blocks sit anywhere in the cache: fetch a few tokens ahead
// (a cold decode step reads every layer's KV from memory: 16 tokens ahead took batch-16 attention
// from 570 to 261 us per layer call on SmolLM2 shapes, float32).
constexpr int64_t kPrefetchTokens = 16;

template <typename T, int D>
inline void prefetch_row(const T* base, CacheView c, const int64_t* blocks, int64_t t, int64_t ctx,
                         int64_t block_size) {
  if (t >= ctx) return;
  const char* row = reinterpret_cast<const char*>(base + blocks[t / block_size] * c.block_stride +
                                                  (t % block_size) * c.token_stride);
  for (int64_t line = 0; line < static_cast<int64_t>(D * sizeof(T)); line += 64) __builtin_prefetch(row + line);
}

// ---- 16-lane vectors (GCC vector extensions: every instruction set lowers them its own way) ----

constexpr int kLanes = 16;
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline f32x16 load_f32x16(const float* p) {
  f32x16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline f32x16 load_f32x16(const bf16* p) {
  u16x16 h;
  __builtin_memcpy(&h, p, sizeof h);
  return reinterpret_cast<f32x16>(__builtin_convertvector(h, u32x16) << 16);
}

// transpose_sum's input order: the vector of lane j's sum goes in slot kBitReversed[j].
constexpr int kBitReversed[kLanes] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

// Lane j = the sum of the 16 lanes of v[kBitReversed[j]]: four rounds of pairing halves, 15 adds.
inline f32x16 transpose_sum(const f32x16* v) {
  f32x16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// attend_group_any with the group size and head size known at compile time: the query rows and
// the accumulators stay in registers and every loop over the head unrolls.
template <typename T, int G, int D>
void attend_group_fixed(T* out, const T* q, const T* k_base, const T* v_base, CacheView k, CacheView v,
                        const int64_t* blocks, int64_t ctx, int64_t block_size, float scale, float* scores) {
  constexpr int C = D / kLanes;  // vectors per head
  f32x16 qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = load_f32x16(q + g * D + c * kLanes);
  // Scores a tile of kLanes tokens at a time: each dot stays a vector of partial sums until one
  // transpose_sum reduces the tile's (a horizontal sum per dot was latency-bound: a batch-16
  // bfloat16 layer call at 280 tokens took 297 us, now 127).
  for (int64_t t0 = 0; t0 < ctx; t0 += kLanes) {
    const int64_t tile = ctx - t0 < kLanes ? ctx - t0 : kLanes;
    f32x16 partial[G][kLanes];
    for (int64_t j = 0; j < kLanes; ++j) {
      const int slot = kBitReversed[j];
      if (j >= tile) {
        for (int g = 0; g < G; ++g) partial[g][slot] = f32x16{};
        continue;
      }
      const int64_t t = t0 + j;
      const T* kt = k_base + blocks[t / block_size] * k.block_stride + (t % block_size) * k.token_stride;
      prefetch_row<T, D>(k_base, k, blocks, t + kPrefetchTokens, ctx, block_size);
      f32x16 kv[C];
      for (int c = 0; c < C; ++c) kv[c] = load_f32x16(kt + c * kLanes);
      for (int g = 0; g < G; ++g) {
        f32x16 acc = qv[g][0] * kv[0];
        for (int c = 1; c < C; ++c) acc += qv[g][c] * kv[c];
        partial[g][slot] = acc;
      }
    }
    for (int g = 0; g < G; ++g) {
      const f32x16 dots = transpose_sum(partial[g]);
      for (int64_t j = 0; j < tile; ++j) scores[g * ctx + t0 + j] = round_to<T>(dots[j]) * scale;
    }
  }
  for (int g = 0; g < G; ++g) softmax_row<T>(scores + g * ctx, ctx);
  float acc[G][D] = {};
  for (int64_t t = 0; t < kPrefetchTokens; ++t) prefetch_row<T, D>(v_base, v, blocks, t, ctx, block_size);
  for (int64_t t = 0; t < ctx; ++t) {
    const T* vt = v_base + blocks[t / block_size] * v.block_stride + (t % block_size) * v.token_stride;
    prefetch_row<T, D>(v_base, v, blocks, t + kPrefetchTokens, ctx, block_size);
    float vf[D];
    for (int d = 0; d < D; ++d) vf[d] = to_f32(vt[d]);
    for (int g = 0; g < G; ++g) {
      const float p = scores[g * ctx + t];
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[g][d] = fma32(p, vf[d], acc[g][d]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) out[g * D + d] = from_f32<T>(acc[g][d]);
}

template <typename T>
void attend_group(T* out, const T* q, const T* k_base, const T* v_base, CacheView k, CacheView v,
                  const int64_t* blocks, int64_t ctx, int64_t group, int64_t head_dim, int64_t block_size,
                  float scale, float* scores) {
#define DISAGG_FIXED(G, D)                                                                         \
  if (group == G && head_dim == D)                                                                 \
    return attend_group_fixed<T, G, D>(out, q, k_base, v_base, k, v, blocks, ctx, block_size, scale, scores);
  DISAGG_FIXED(1, 64) DISAGG_FIXED(2, 64) DISAGG_FIXED(3, 64) DISAGG_FIXED(4, 64) DISAGG_FIXED(8, 64)
  DISAGG_FIXED(1, 128) DISAGG_FIXED(2, 128) DISAGG_FIXED(4, 128) DISAGG_FIXED(8, 128)
#undef DISAGG_FIXED
  attend_group_any<T>(out, q, k_base, v_base, k, v, blocks, ctx, group, head_dim, block_size, scale, scores);
}

template <typename T>
void paged_decode_attention_t(void* out, const void* q, CacheView k, CacheView v, const int64_t* block_tables,
                              int64_t max_blocks, const int64_t* context_lens, int64_t n, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                              float* scratch, int64_t scratch_stride) {
  const int64_t group = num_heads / num_kv_heads;
#pragma omp parallel for collapse(2) schedule(static) if (n * num_kv_heads > 1 && n * num_heads * head_dim * 8 >= kParallelElems)
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t offset = (i * num_heads + h * group) * head_dim;
      attend_group<T>(static_cast<T*>(out) + offset, static_cast<const T*>(q) + offset,
                      static_cast<const T*>(k.data) + h * k.head_stride,
                      static_cast<const T*>(v.data) + h * v.head_stride, k, v, block_tables + i * max_blocks,
                      context_lens[i], group, head_dim, block_size, scale,
                      scratch + (i * num_kv_heads + h) * scratch_stride);
    }
  }
}
