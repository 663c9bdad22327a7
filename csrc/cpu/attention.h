// Attention kernels (paged decode, paged prefill), a fragment of kernels.h: included there inside
// namespace disagg::DISAGG_ISA (anonymous), after the shared helpers (to_f32, from_f32, round_to,
// exp_approx, fma32), so that it is compiled once per instruction set like the rest. It includes
// nothing itself.
//
// T is the model dtype (q and out), KV the cache's (T, or bfloat16 under a float32 model): cache rows
// are widened to float32 as they load, and every rounding follows T, as the reference does after
// `.to(q.dtype)`.

// ---- float vectors (GCC vector extensions) loaded from float32 or bfloat16 ------------------

// V's lanes from p: float32 as they are, bfloat16 widened (its bits the high half of a float32's).
template <typename V>
inline V load_floats(const float* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

template <typename V, typename Half, typename Word>  // Half, Word: uint16 and uint32 vectors of V's lanes
inline V load_floats(const bf16* p) {
  Half h;
  __builtin_memcpy(&h, p, sizeof h);
  return reinterpret_cast<V>(__builtin_convertvector(h, Word) << 16);
}

// 16-lane vectors: quant_matmul.h's blocks of 32 activations.
constexpr int kLanes = 16;
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline f32x16 load_f32x16(const float* p) { return load_floats<f32x16>(p); }
inline f32x16 load_f32x16(const bf16* p) { return load_floats<f32x16, u16x16, u32x16>(p); }

// ---- native vectors: one register of the build's instruction set (16 floats on avx512, 8 elsewhere)
// The attention kernels work in these: 16-lane vectors on avx2 spilled, moved halves through xmm
// registers and ran exp lane by lane (prefill attention at 8 GFLOP/s, decode attention 4x avx512's
// time on one core).
#if defined(DISAGG_AVX512)
constexpr int kVL = 16;
#else
constexpr int kVL = 8;
#endif
typedef float fvec __attribute__((vector_size(kVL * 4)));
typedef int32_t i32vec __attribute__((vector_size(kVL * 4)));
typedef uint16_t u16vec __attribute__((vector_size(kVL * 2)));
typedef uint32_t u32vec __attribute__((vector_size(kVL * 4)));

inline fvec load_v(const float* p) { return load_floats<fvec>(p); }
inline fvec load_v(const bf16* p) { return load_floats<fvec, u16vec, u32vec>(p); }

inline void store_v(float* p, fvec v) { __builtin_memcpy(p, &v, sizeof v); }

// One broadcast (`fvec{} + x` would add 0.0 first; a loop over the lanes became 16 masked moves).
inline fvec splat_v(float x) {
#if defined(DISAGG_AVX512)
  return fvec{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
  return fvec{x, x, x, x, x, x, x, x};
#endif
}

// A lane-wise loop, which GCC turns into one vector instruction.
inline fvec fma_v(fvec a, fvec b, fvec c) {
  fvec r;
#pragma omp simd
  for (int i = 0; i < kVL; ++i) r[i] = fma32(a[i], b[i], c[i]);
  return r;
}

// exp_approx lane by lane, the same operations in the same order (a loop of exp_approx ran scalar on
// avx2).
inline fvec exp_v(fvec x) {
  const fvec t = x * 1.44269504088896341f + 0.5f;
  const fvec truncated = __builtin_convertvector(__builtin_convertvector(t, i32vec), fvec);
  const fvec fn = truncated - (truncated > t ? splat_v(1.0f) : fvec{});  // floor(t)
  const i32vec n = __builtin_convertvector(fn, i32vec);
  fvec r = x - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  fvec p = splat_v(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const fvec y = (p * r * r + r + 1.0f) * reinterpret_cast<fvec>((n + 127) << 23);
  const fvec low = x < -87.0f ? fvec{} : y;
  return x > 88.0f ? splat_v(__builtin_inff()) : low;
}

inline fvec max_v(fvec a, fvec b) { return a > b ? a : b; }

// ---- paged decode attention ----------------------------------------------------------------

// Softmax over scores[0, ctx) in place, probabilities rounded to T as `.to(values.dtype)` does.
template <typename T>
inline void softmax_row(float* s, int64_t ctx) {
  float m = s[0];
#pragma omp simd reduction(max : m)
  for (int64_t t = 1; t < ctx; ++t) m = s[t] > m ? s[t] : m;
  int64_t t = 0;  // exp a vector at a time (a loop of exp_approx ran scalar on avx2), the same bits
  for (const fvec mv = splat_v(m); t + kVL <= ctx; t += kVL) store_v(s + t, exp_v(load_v(s + t) - mv));
  for (; t < ctx; ++t) s[t] = exp_approx(s[t] - m);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (t = 0; t < ctx; ++t) sum += s[t];
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t t = 0; t < ctx; ++t) s[t] = round_to<T>(s[t] * inv);
}

// One (request, KV head), any group and head size: the group of query heads that share it, over the request's blocks.
template <typename T, typename KV>
void attend_group_any(T* out, const T* q, const KV* k_base, const KV* v_base, CacheView k, CacheView v,
                      const int64_t* blocks, int64_t ctx, int64_t group, int64_t head_dim, int64_t block_size,
                      float scale, float* scores) {
  // Pass 1: scores[g][t] = round(q_g . k_t) * scale, as matmul in T then .float() * scale.
  for (int64_t t = 0; t < ctx; ++t) {
    const KV* kt = k_base + blocks[t / block_size] * k.block_stride + (t % block_size) * k.token_stride;
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
    const KV* vt = v_base + blocks[t / block_size] * v.block_stride + (t % block_size) * v.token_stride;
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
// from 570 to 261 us per layer call on SmolLM2 shapes, float32). The rows go to L2, not L1
// (prefetcht1): a fetch into L1 holds one of L1's few miss buffers until its line lands, which
// likely capped the rows on their way. On a Zen 4 core that took the same cold call from 790-960
// to 510-640 us on one thread and from 440-650 to 320-400 on two (L2 holds far more: the rows still
// wait there when their turn comes; 16, 24 and 32 tokens ahead measured the same).
constexpr int64_t kPrefetchTokens = 32;

// A request's cache rows in token order, block by block, with no division per token. With it and the
// value sums kept in registers (they were a stack array, reloaded and stored per token), a batch-16
// float32 layer call of SmolLM2 at 272 tokens went from 210 to 156 us (cache cold; 131 to 70 warm),
// the same bits.
template <typename T>
struct TokenRows {
  const T* base;
  CacheView c;
  const int64_t* blocks;
  int64_t block_size;
  int64_t block = 0, offset = 0;

  const T* row() const { return base + blocks[block] * c.block_stride + offset * c.token_stride; }
  void next() {
    if (++offset == block_size) {
      offset = 0;
      ++block;
    }
  }
};

template <typename T, int D>
inline void prefetch_row(const T* row) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t line = 0; line < static_cast<int64_t>(D * sizeof(T)); line += 64) __builtin_prefetch(p + line, 0, 2);
}

// Rows `ahead` tokens past a cursor, fetched as the cursor moves (none past the context).
template <typename T, int D>
struct RowsAhead {
  TokenRows<T> rows;
  int64_t t, ctx;

  RowsAhead(TokenRows<T> start, int64_t ahead, int64_t ctx_) : rows(start), t(0), ctx(ctx_) {
    for (; t < ahead; ++t) rows.next();
  }
  void next() {
    if (t < ctx) prefetch_row<T, D>(rows.row());
    rows.next();
    ++t;
  }
};

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

// transpose_sum for native vectors: on avx512 the one above; on 8 lanes, three rounds of the same
// pairing, so that lane j = the sum of the lanes of v[kBitReversedV[j]].
#if defined(DISAGG_AVX512)
constexpr const int* kBitReversedV = kBitReversed;
inline fvec transpose_sum_v(const fvec* v) { return transpose_sum(v); }
#else
constexpr int kBitReversedV[kVL] = {0, 4, 2, 6, 1, 5, 3, 7};
inline fvec transpose_sum_v(const fvec* v) {
  fvec a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(b[0], b[1], 0, 8, 2, 10, 4, 12, 6, 14) +
         __builtin_shufflevector(b[0], b[1], 1, 9, 3, 11, 5, 13, 7, 15);
}
#endif

// attend_group_any with the group size and head size known at compile time: the query rows and
// the accumulators stay in registers and every loop over the head unrolls.
template <typename T, typename KV, int G, int D>
void attend_group_fixed(T* out, const T* q, const KV* k_base, const KV* v_base, CacheView k, CacheView v,
                        const int64_t* blocks, int64_t ctx, int64_t block_size, float scale, float* scores) {
  constexpr int C = D / kVL;  // vectors per head
  fvec qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = load_v(q + g * D + c * kVL);
  // Scores a tile of kVL tokens at a time: each dot stays a vector of partial sums until one
  // transpose_sum reduces the tile's (a horizontal sum per dot was latency-bound: a batch-16
  // bfloat16 layer call at 280 tokens took 297 us, now 127).
  TokenRows<KV> keys{k_base, k, blocks, block_size};
  RowsAhead<KV, D> keys_ahead(keys, kPrefetchTokens, ctx);
  for (int64_t t0 = 0; t0 < ctx; t0 += kVL) {
    const int64_t tile = ctx - t0 < kVL ? ctx - t0 : kVL;
    fvec partial[G][kVL];
    for (int64_t j = 0; j < kVL; ++j) {
      const int slot = kBitReversedV[j];
      if (j >= tile) {
        for (int g = 0; g < G; ++g) partial[g][slot] = fvec{};
        continue;
      }
      const KV* kt = keys.row();
      keys.next();
      keys_ahead.next();
      fvec kv[C];
      for (int c = 0; c < C; ++c) kv[c] = load_v(kt + c * kVL);
      for (int g = 0; g < G; ++g) {
        fvec acc = qv[g][0] * kv[0];
        for (int c = 1; c < C; ++c) acc += qv[g][c] * kv[c];
        partial[g][slot] = acc;
      }
    }
    for (int g = 0; g < G; ++g) {
      const fvec dots = transpose_sum_v(partial[g]);
      for (int64_t j = 0; j < tile; ++j) scores[g * ctx + t0 + j] = round_to<T>(dots[j]) * scale;
    }
  }
  for (int g = 0; g < G; ++g) softmax_row<T>(scores + g * ctx, ctx);
  // out_g = sum_t p[g][t] v_t: one fused multiply-add per value and token, in token order, the
  // accumulators in registers (G * D / kVL vectors).
  fvec acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = fvec{};
  TokenRows<KV> values{v_base, v, blocks, block_size};
  RowsAhead<KV, D> values_ahead(values, 0, ctx);
  for (int64_t t = 0; t < kPrefetchTokens; ++t) values_ahead.next();  // the first rows, then kPrefetchTokens ahead
  for (int64_t t = 0; t < ctx; ++t) {
    const KV* vt = values.row();
    values.next();
    values_ahead.next();
    fvec vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load_v(vt + c * kVL);
    for (int g = 0; g < G; ++g) {
      const fvec p = splat_v(scores[g * ctx + t]);
      for (int c = 0; c < C; ++c) acc[g][c] = fma_v(p, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < kVL; ++i) out[g * D + c * kVL + i] = from_f32<T>(acc[g][c][i]);
}

template <typename T, typename KV>
void attend_group(T* out, const T* q, const KV* k_base, const KV* v_base, CacheView k, CacheView v,
                  const int64_t* blocks, int64_t ctx, int64_t group, int64_t head_dim, int64_t block_size,
                  float scale, float* scores) {
#define DISAGG_FIXED(G, D)                                                                         \
  if (group == G && head_dim == D)                                                                 \
    return attend_group_fixed<T, KV, G, D>(out, q, k_base, v_base, k, v, blocks, ctx, block_size, scale, scores);
  DISAGG_FIXED(1, 64) DISAGG_FIXED(2, 64) DISAGG_FIXED(3, 64) DISAGG_FIXED(4, 64) DISAGG_FIXED(8, 64)
  DISAGG_FIXED(1, 128) DISAGG_FIXED(2, 128) DISAGG_FIXED(4, 128) DISAGG_FIXED(8, 128)
#undef DISAGG_FIXED
  attend_group_any<T, KV>(out, q, k_base, v_base, k, v, blocks, ctx, group, head_dim, block_size, scale, scores);
}

template <typename T, typename KV>
void paged_decode_attention_t(void* out, const void* q, CacheView k, CacheView v, const int64_t* block_tables,
                              int64_t max_blocks, const int64_t* context_lens, int64_t n, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                              float* scratch, int64_t scratch_stride) {
  const int64_t group = num_heads / num_kv_heads;
#pragma omp parallel for collapse(2) schedule(static) if (n * num_kv_heads > 1 && n * num_heads * head_dim * 8 >= kParallelElems)
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t offset = (i * num_heads + h * group) * head_dim;
      attend_group<T, KV>(static_cast<T*>(out) + offset, static_cast<const T*>(q) + offset,
                          static_cast<const KV*>(k.data) + h * k.head_stride,
                          static_cast<const KV*>(v.data) + h * v.head_stride, k, v, block_tables + i * max_blocks,
                          context_lens[i], group, head_dim, block_size, scale,
                          scratch + (i * num_kv_heads + h) * scratch_stride);
    }
  }
}

// ---- paged prefill attention (flash-style) ----------------------------------------------------

// 16-lane reductions (quant_matmul.h's activation blocks of 32 values).

inline f32x16 max2(f32x16 a, f32x16 b) { return a > b ? a : b; }

// The largest lane, and the sum of the lanes (pairwise: halves, then quarters, ...).
inline float max16(f32x16 v) {
  v = max2(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = max2(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = max2(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = max2(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

inline float sum16(f32x16 v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

constexpr int64_t kKeyTile = 32;                 // keys per step of the online softmax
constexpr int64_t kMaxQueries = 64;              // query vectors (tokens x heads of a group) per work item
constexpr int kQueryVecs = kMaxQueries / kVL;    // the work item's queries as lanes of its vectors
constexpr int kScoreVecs = 4;                    // query vectors scored together
constexpr int kKeyBlock = kVL == 16 ? 4 : 2;     // keys whose scores share each load of the queries
constexpr int kOutVecs = 4;                      // output vectors of a row accumulated together
constexpr int kOutRows = kVL == 16 ? 4 : 2;      // rows whose outputs share each value load

// Scores of keys [j0, j0 + kKeyBlock) for the NV query vectors from v0: p[j][i] = qt[:, i] . kf[j],
// the queries in lanes, so that the softmax below works lane by lane (no horizontal reductions).
template <int NV, int D>
inline void score_block(float (*p)[kMaxQueries], const float (*qt)[kMaxQueries], const float (*kf)[D], int v0,
                        int64_t j0) {
  fvec s[NV][kKeyBlock] = {};
  for (int d = 0; d < D; ++d) {
    fvec qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = load_v(qt[d] + (v0 + v) * kVL);
    for (int j = 0; j < kKeyBlock; ++j) {
      const fvec kb = splat_v(kf[j0 + j][d]);
      for (int v = 0; v < NV; ++v) s[v][j] = fma_v(qv[v], kb, s[v][j]);
    }
  }
  for (int j = 0; j < kKeyBlock; ++j)
    for (int v = 0; v < NV; ++v) store_v(p[j0 + j] + (v0 + v) * kVL, s[v][j]);
}

template <int D>
void score_tile(float (*p)[kMaxQueries], const float (*qt)[kMaxQueries], const float (*kf)[D], int nv, int64_t nk) {
  for (int v0 = 0; v0 < nv; v0 += kScoreVecs) {
    for (int64_t j0 = 0; j0 < nk; j0 += kKeyBlock) {
      switch (nv - v0 < kScoreVecs ? nv - v0 : kScoreVecs) {
        case 1: score_block<1, D>(p, qt, kf, v0, j0); break;
        case 2: score_block<2, D>(p, qt, kf, v0, j0); break;
        case 3: score_block<3, D>(p, qt, kf, v0, j0); break;
        default: score_block<kScoreVecs, D>(p, qt, kf, v0, j0); break;
      }
    }
  }
}

// The online softmax of one key tile for the queries of vector v: masks the keys past each lane's
// `sees` (when `masked`), turns p's scores into exp(score - running max), and returns the factor
// that rescales what the vector's lanes summed before.
inline fvec softmax_tile(float (*p)[kMaxQueries], int v, int64_t nk, bool masked, fvec sees, fvec& m, fvec& l) {
  fvec tile_max = m;
  for (int64_t j = 0; j < nk; ++j) {
    fvec s = load_v(p[j] + v * kVL);
    if (masked) {
      s = splat_v(static_cast<float>(j)) < sees ? s : splat_v(-__builtin_inff());
      store_v(p[j] + v * kVL, s);
    }
    tile_max = max_v(tile_max, s);
  }
  const fvec corr = exp_v(m - tile_max);
  fvec sum = fvec{};
  for (int64_t j = 0; j < nk; ++j) {
    const fvec e = exp_v(load_v(p[j] + v * kVL) - tile_max);
    sum += e;
    store_v(p[j] + v * kVL, e);
  }
  l = l * corr + sum;
  m = tile_max;
  return corr;
}

// o[i][c0 ..] = o[i][c0 ..] * corr[i] + sum_j p[j][i] v[j][c0 ..] for the rows [i0, i0 + kOutRows)
// and kOutVecs vectors from column c0: the accumulators stay in registers while the values stream past.
template <int D>
inline void accumulate_rows(float (*o)[D], const float* corr, const float (*p)[kMaxQueries], const float (*vf)[D],
                            int64_t i0, int c0, int64_t nk) {
  fvec acc[kOutRows][kOutVecs];
  for (int r = 0; r < kOutRows; ++r)
    for (int c = 0; c < kOutVecs; ++c) acc[r][c] = load_v(o[i0 + r] + c0 + c * kVL) * corr[i0 + r];
  for (int64_t j = 0; j < nk; ++j) {
    fvec vv[kOutVecs];
    for (int c = 0; c < kOutVecs; ++c) vv[c] = load_v(vf[j] + c0 + c * kVL);
    for (int r = 0; r < kOutRows; ++r) {
      const fvec pr = splat_v(p[j][i0 + r]);
      for (int c = 0; c < kOutVecs; ++c) acc[r][c] = fma_v(pr, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kOutRows; ++r)
    for (int c = 0; c < kOutVecs; ++c) store_v(o[i0 + r] + c0 + c * kVL, acc[r][c]);
}

// One work item: query tokens [t0, t0 + nt) of a segment, the `group` heads that share one KV head,
// against keys [0, position of its last token]: scores and probabilities in float32 (online softmax),
// keys and values read in place from the cache blocks, kKeyTile keys at a time. Query i (token
// t0 + i / group, head i % group) is lane i % kVL of vector i / kVL while scores and probabilities
// are computed, and row i of the outputs.
template <typename T, typename KV, int D>
void prefill_item(T* out, const T* q, int64_t tok_stride, const KV* k_base, const KV* v_base, CacheView k, CacheView v,
                  const int64_t* blocks, int64_t block_size, int64_t start_pos, int64_t t0, int64_t nt, int64_t group,
                  float scale) {
  static_assert(D % (kOutVecs * kVL) == 0 && kMaxQueries % kOutRows == 0, "the output passes tile the item");
  const int64_t nq = nt * group;
  const int nv = static_cast<int>((nq + kVL - 1) / kVL);
  const int64_t rows = (nq + kOutRows - 1) / kOutRows * kOutRows;
  alignas(64) float qt[D][kMaxQueries];        // q * scale, transposed; lanes past nq are zero
  alignas(64) float o[kMaxQueries][D];
  alignas(64) float p[kKeyTile][kMaxQueries];  // a tile's scores, then its probabilities
  alignas(64) float kf[kKeyTile][D];
  alignas(64) float vf[kKeyTile][D];
  alignas(64) float corr[kMaxQueries];
  alignas(64) float pos[kMaxQueries];  // each lane's position past first_pos (a padding lane: the last query's)
  for (int64_t i = 0; i < kMaxQueries; ++i) {
    const T* qi = q + (t0 + i / group) * tok_stride + (i % group) * D;
    for (int d = 0; d < D; ++d) qt[d][i] = i < nq ? to_f32(qi[d]) * scale : 0.0f;
    for (int d = 0; d < D; ++d) o[i][d] = 0.0f;
    pos[i] = static_cast<float>((i < nq ? i : nq - 1) / group);
  }
  fvec m[kQueryVecs], l[kQueryVecs];
  for (int v = 0; v < kQueryVecs; ++v) {
    m[v] = splat_v(-__builtin_inff());
    l[v] = fvec{};
  }
  const int64_t first_pos = start_pos + t0, end = first_pos + nt;  // keys [0, end) are seen by some query
  for (int64_t k0 = 0; k0 < end; k0 += kKeyTile) {
    const int64_t nk = end - k0 < kKeyTile ? end - k0 : kKeyTile;
    for (int64_t j = 0; j < kKeyTile; ++j) {
      if (j >= nk) {  // whole key blocks are scored: rows past the tile score 0 and are never used
        for (int d = 0; d < D; ++d) kf[j][d] = 0.0f;
        continue;
      }
      const int64_t t = k0 + j;
      const KV* kr = k_base + blocks[t / block_size] * k.block_stride + (t % block_size) * k.token_stride;
      const KV* vr = v_base + blocks[t / block_size] * v.block_stride + (t % block_size) * v.token_stride;
      for (int c = 0; c < D; c += kVL) {
        store_v(kf[j] + c, load_v(kr + c));
        store_v(vf[j] + c, load_v(vr + c));
      }
    }
    score_tile<D>(p, qt, kf, nv, nk);
    // A tile that reaches past the item's first query is masked: lane i sees keys k0 .. its position.
    const bool masked = k0 + nk - 1 > first_pos;
    const fvec offset = splat_v(static_cast<float>(masked ? first_pos - k0 + 1 : 0));
    for (int v = 0; v < nv; ++v) store_v(corr + v * kVL, softmax_tile(p, v, nk, masked, load_v(pos + v * kVL) + offset, m[v], l[v]));
    for (int64_t i0 = 0; i0 < rows; i0 += kOutRows)
      for (int c0 = 0; c0 < D; c0 += kOutVecs * kVL) accumulate_rows<D>(o, corr, p, vf, i0, c0, nk);
  }
  for (int64_t i = 0; i < nq; ++i) {
    T* oi = out + (t0 + i / group) * tok_stride + (i % group) * D;
    const float inv = 1.0f / l[i / kVL][i % kVL];
    for (int d = 0; d < D; ++d) oi[d] = from_f32<T>(o[i][d] * inv);
  }
}

// q and out [num_tokens, num_heads, D] (contiguous): the segment's tokens at positions start_pos + t,
// each attending causally to keys [0, its position] in the blocks of block_ids.
template <typename T, typename KV, int D>
void paged_prefill_attention_d(T* out, const T* q, CacheView k, CacheView v, const int64_t* block_ids,
                               int64_t start_pos, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                               int64_t block_size, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t tile = kMaxQueries / group > 0 ? kMaxQueries / group : 1;
  const int64_t tiles = (num_tokens + tile - 1) / tile;
  // Later tiles see more keys: hand them out longest first, one at a time.
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t it = 0; it < tiles; ++it) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t t0 = (tiles - 1 - it) * tile;
      const int64_t nt = num_tokens - t0 < tile ? num_tokens - t0 : tile;
      prefill_item<T, KV, D>(out + h * group * D, q + h * group * D, num_heads * D,
                             static_cast<const KV*>(k.data) + h * k.head_stride,
                             static_cast<const KV*>(v.data) + h * v.head_stride, k, v, block_ids, block_size, start_pos,
                             t0, nt, group, scale);
    }
  }
}

template <typename T, typename KV>
void paged_prefill_attention_t(void* out, const void* q, CacheView k, CacheView v, const int64_t* block_ids,
                               int64_t start_pos, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, float scale) {
  auto fn = head_dim == 64 ? paged_prefill_attention_d<T, KV, 64> : paged_prefill_attention_d<T, KV, 128>;
  fn(static_cast<T*>(out), static_cast<const T*>(q), k, v, block_ids, start_pos, num_tokens, num_heads, num_kv_heads,
     block_size, scale);
}
