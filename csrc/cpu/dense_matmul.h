// Float32 or bfloat16 weights times float32 activations, all computed in float32 (a bfloat16 weight is
// widened in registers: exact), a fragment of kernels.h (compiled once per instruction set like the
// rest). It includes nothing itself.
//
// Made for decode, where a step multiplies a few rows by every weight of the model: the weights
// stream from memory once per step and their bandwidth, not the multiply-adds, sets the pace. The
// packed weight (disagg.ops.linear.pack_tiles builds it): output rows in tiles of 32, [tiles, k, 32]
// of W (float or bf16), so that column i of a tile's 32 rows is 128 (64) contiguous bytes and a pass
// reads its tile front to back, fetching a few KB ahead. Rows past n in the last tile are zero. A
// bfloat16 weight is half the bytes to stream: where no bf16 dot product exists (AVX2), the model's
// bfloat16 weights run here rather than on torch's emulated bf16 GEMM.
//
// Each output is one chain of multiply-adds over the columns in order, fused where the build has FMA
// (the base build multiplies and adds): within k * 2^-24 * sum |x w| of the exact product, which
// tests/unit/test_ops.py asserts against float64.

constexpr int64_t kDenseTile = 32;
// Bytes of weights fetched ahead of the column a pass is at: 6 KB took SmolLM2's 30 layers at 16 rows
// from 13.0-13.2 to 10.7-11.0 ms (none: hardware prefetch only; 2 KB and 12 KB were slower).
constexpr int64_t kDensePrefetchBytes = 6144;
constexpr int64_t kDenseLine = 64;  // bytes in a cache line

// A pass works on P lanes of a tile with vectors of W floats, over R activation rows, so that its
// R * P / W accumulators stay in registers: AVX-512 all 32 lanes x 8 rows (16 of 32 zmm); AVX2 16
// lanes x 6 rows (12 of 16 ymm, 2 of weights, 1 broadcast: the shape of an AVX2 GEMM's inner block,
// 12 independent chains where two FMA ports of 4 cycles need 8, and 8 loads to 12 multiply-adds);
// the base build 8 lanes x 4 rows of SSE's 4-float vectors. AVX2 took 4 rows a pass before: SmolLM2's
// 121 matmuls at 16 rows 60-61 -> 41-45 ms, at 128 rows 378-390 -> 315-332 ms (two builds alternating).
#if defined(DISAGG_AVX512)
constexpr int kDenseWidth = 16;
constexpr int kDenseLanesPerPass = 32;
constexpr int kDenseRowsPerPass = 8;
#elif defined(DISAGG_AVX2)
constexpr int kDenseWidth = 8;
constexpr int kDenseLanesPerPass = 16;
constexpr int kDenseRowsPerPass = 6;
#else
constexpr int kDenseWidth = 4;
constexpr int kDenseLanesPerPass = 8;
constexpr int kDenseRowsPerPass = 4;
#endif

// From this many rows to kDenseRowsPerPass, AVX-512 splits the rows in two passes (with one pass over
// a tile there is no second to fetch the next tile behind): SmolLM2's 30 layers' matmuls at 8 rows
// 21.8-23.0 -> 18.9-20.5 ms, at 4 rows (2 + 2) 19.3-19.8 -> 18.0-18.6 (3 rows: 17.1 -> 17.5, left
// whole). On AVX2 a pass of 3 rows or more has two halves of a tile already (8 rows in 4 + 4 there:
// 20.6-21.1 -> 21.1-21.7).
#if defined(DISAGG_AVX512)
constexpr int64_t kDenseSplitRows = 4;
#else
constexpr int64_t kDenseSplitRows = kDenseRowsPerPass + 1;
#endif

// Lanes of a pass over R rows. One or two rows (a decode step of one or two sequences) read the
// whole tile in one pass where the registers hold it (AVX2: 4 ymm of weights, 8 of sums), so the
// weights stream from memory front to back once instead of in two interleaved halves. SmolLM2's 121
// matmuls at 1 row on an AVX2-only EPYC: 24.7-28.4 -> 20.3-24.2 ms (two builds alternating, 3 each).
constexpr int dense_lanes_per_pass(int rows) {
#if defined(DISAGG_AVX2)
  return rows <= 2 ? kDenseTile : kDenseLanesPerPass;
#else
  static_cast<void>(rows);  // AVX-512 passes take the whole tile already; the base build has too few registers
  return kDenseLanesPerPass;
#endif
}

typedef float dense_vec __attribute__((vector_size(4 * kDenseWidth)));

typedef uint16_t dense_half_vec __attribute__((vector_size(2 * kDenseWidth)));
typedef uint32_t dense_wide_vec __attribute__((vector_size(4 * kDenseWidth)));

inline dense_vec dense_fma(dense_vec a, float b, dense_vec c) {
  dense_vec r;
#pragma omp simd
  for (int i = 0; i < kDenseWidth; ++i) r[i] = fma32(a[i], b, c[i]);
  return r;
}

// kDenseWidth weights of a column as floats: a copy, or bfloat16 widened (its bits, 16 places up).
inline dense_vec dense_load(const float* w) {
  dense_vec v;
  __builtin_memcpy(&v, w, sizeof(v));
  return v;
}

inline dense_vec dense_load(const bf16* w) {
  dense_half_vec h;
  __builtin_memcpy(&h, w, sizeof(h));
  return __builtin_bit_cast(dense_vec, __builtin_convertvector(h, dense_wide_vec) << 16);
}

// One column of a pass: its V vectors of weights times each of the R rows' activations (xi: the
// column's R values), added into acc. Inlined, so that acc stays in registers.
template <typename W, int R, int V>
[[gnu::always_inline]] inline void dense_column(dense_vec (&acc)[R][V], const W* wi, const float* xi) {
  dense_vec wv[V];
  for (int v = 0; v < V; ++v) wv[v] = dense_load(wi + v * kDenseWidth);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = dense_fma(wv[v], xi[r], acc[r][v]);
}

// R activation rows (xt: [k, R], the pass's rows transposed) times lanes [lane0, lane0 + P) of one
// tile: out[r, j] for the tile's columns j in that range below `cols` (<= 32). With `ahead`, the pass
// also fetches `ahead_lines` (<= k) lines from `ahead` on into L2 (its share of the next tile), evenly
// over its columns. A pass without `Fetch` issues no prefetch at all (a later pass over a tile already
// in cache: a prompt's many rows).
template <typename W, int R, bool Fetch>
void dense_pass(float* out, int64_t out_stride, int64_t cols, int64_t lane0, const float* xt, int64_t k,
                const W* tile, const char* ahead, int64_t ahead_lines) {
  constexpr int P = dense_lanes_per_pass(R);
  constexpr int V = P / kDenseWidth;
  constexpr int64_t kLineWeights = kDenseLine / sizeof(W);
  constexpr int64_t kPrefetchColumns = kDensePrefetchBytes / (kDenseTile * sizeof(W));
  const W* w = tile + lane0;
  const int64_t n = cols - lane0 < P ? cols - lane0 : P;
  dense_vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = dense_vec{};
  if constexpr (Fetch) {
    int64_t due = 0;  // ahead_lines per k columns, as a line drawn between them: one more line each k
    for (int64_t i = 0; i < k; ++i) {
      const W* wi = w + i * kDenseTile;
      for (int line = 0; line < P; line += kLineWeights)
        __builtin_prefetch(wi + kPrefetchColumns * kDenseTile + line);
      due += ahead_lines;
      if (due >= k) {  // to L2: read after this tile
        due -= k;
        __builtin_prefetch(ahead, 0, 2);
        ahead += kDenseLine;
      }
      dense_column<W, R, V>(acc, wi, xt + i * R);
    }
  } else {  // four columns an iteration (a fetching pass's loop so unrolled ran 16 rows 4% slower)
#pragma GCC unroll 4
    for (int64_t i = 0; i < k; ++i) dense_column<W, R, V>(acc, w + i * kDenseTile, xt + i * R);
  }
  if (n == P) {  // whole vectors: lane by lane, the stores took ~15% of a 576-column pass
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v)
        __builtin_memcpy(out + r * out_stride + lane0 + v * kDenseWidth, &acc[r][v], sizeof(dense_vec));
    return;
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < n; ++j) out[r * out_stride + lane0 + j] = acc[r][j / kDenseWidth][j % kDenseWidth];
}

// The passes over a tile that fetch (its columns ahead, the next tile into L2): the first this many.
// The rest find the tile in cache and run the bare loop (a prompt's 128-row block: 22 passes a tile
// on AVX2, 16 on AVX-512). SmolLM2's four layer matmuls x 30 at 256 rows, one thread, as avx2: 603-630
// -> 560-570 ms, 1.06-1.12x MKL's sgemm in the same runs -> 0.99-1.00x (docs/engine.md).
constexpr int64_t kDenseFetchPasses = 8;

template <typename W>
void dense_matmul_block(float* out, const float* x, const W* w, float* xt, int64_t rows, int64_t n, int64_t k) {
  using Pass = void (*)(float*, int64_t, int64_t, int64_t, const float*, int64_t, const W*, const char*, int64_t);
  static constexpr Pass kPasses[2][9] = {
      {nullptr, dense_pass<W, 1, false>, dense_pass<W, 2, false>, dense_pass<W, 3, false>, dense_pass<W, 4, false>,
       dense_pass<W, 5, false>, dense_pass<W, 6, false>, dense_pass<W, 7, false>, dense_pass<W, 8, false>},
      {nullptr, dense_pass<W, 1, true>, dense_pass<W, 2, true>, dense_pass<W, 3, true>, dense_pass<W, 4, true>,
       dense_pass<W, 5, true>, dense_pass<W, 6, true>, dense_pass<W, 7, true>, dense_pass<W, 8, true>}};
  static_assert(kDenseRowsPerPass <= 8, "kPasses holds passes of up to 8 rows");
  constexpr int64_t R = kDenseRowsPerPass;
  const int64_t tiles = (n + kDenseTile - 1) / kDenseTile;
  const bool split = rows >= kDenseSplitRows && rows <= R;
  const int64_t passes = split ? 2 : (rows + R - 1) / R;
  auto first_row = [rows, split](int64_t p) { return split ? rows * p / 2 : (p * R < rows ? p * R : rows); };
  const int64_t tile_lines = k * kDenseTile * static_cast<int64_t>(sizeof(W)) / kDenseLine;
  const bool threaded = rows * n * k >= 8 * kParallelElems;  // from one row of a 576 x 576 weight, as quant_matmul
#pragma omp parallel if (threaded)
  {
#pragma omp for schedule(static)
    for (int64_t p = 0; p < passes; ++p) {  // each pass's rows transposed: xt + r0 k is [k, its rows]
      const int64_t r0 = first_row(p), nr = first_row(p + 1) - r0;
      for (int64_t i = 0; i < k; ++i)
        for (int64_t r = 0; r < nr; ++r) xt[r0 * k + i * nr + r] = x[(r0 + r) * k + i];
    }
    // Tiles outer, in order: a thread streams one run of tiles; its passes over a tile reread it from
    // L1/L2. The runs are split as `omp for schedule(static)` would, but each thread knows its next tile.
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t share = tiles / threads, extra = tiles % threads;
    const int64_t first = me * share + (me < extra ? me : extra), end = first + share + (me < extra ? 1 : 0);
    for (int64_t t = first; t < end; ++t) {
      const int64_t cols = n - t * kDenseTile < kDenseTile ? n - t * kDenseTile : kDenseTile;
      // With two passes or more over a tile, they share the fetch of the thread's next tile into L2,
      // each its even part at an even pace, so that memory streams while they compute (with one pass
      // there is no second to hide it behind). Before, the first two passes fetched it alone, a line
      // a column: SmolLM2's 30 layers' matmuls at 16 rows as avx2 (six passes a tile) 29.2-29.4 ->
      // 24.8-25.8 ms, on both threads; avx512 (two) 21.3-21.6 -> 20.8-21.8.
      int64_t count = 0;
      for (int64_t p = 0; p < passes; ++p) {
        const int64_t nr = first_row(p + 1) - first_row(p);
        const int64_t lanes = dense_lanes_per_pass(static_cast<int>(nr));
        count += (cols + lanes - 1) / lanes;
      }
      const char* next =
          count > 1 && t + 1 < end ? reinterpret_cast<const char*>(w + (t + 1) * k * kDenseTile) : nullptr;
      const int64_t fetchers = count < kDenseFetchPasses ? count : kDenseFetchPasses;
      int64_t q = 0;
      for (int64_t p = 0; p < passes; ++p) {
        const int64_t r0 = first_row(p), nr = first_row(p + 1) - r0;
        for (int64_t lane0 = 0; lane0 < cols; lane0 += dense_lanes_per_pass(static_cast<int>(nr)), ++q) {
          const int64_t from = tile_lines * q / fetchers, to = tile_lines * (q + 1) / fetchers;
          const bool fetch = q < fetchers;
          kPasses[fetch][nr](out + r0 * n + t * kDenseTile, n, cols, lane0, xt + r0 * k, k, w + t * k * kDenseTile,
                             next && fetch ? next + from * kDenseLine : nullptr, next && fetch ? to - from : 0);
        }
      }
    }
  }
}

// Rows in blocks of 128, each through every tile before the next: a block's activations (128 k floats)
// stay in L2 while the tiles stream. Without blocks, a 4096-row prefill chunk reread all its rows per
// tile (the engine's batch-16 prefill: 1009-1071 tok/s, 1172-1185 with them).
constexpr int64_t kDenseRowBlock = 128;

template <typename W>
void dense_matmul_t(float* out, const float* x, const W* w, float* xt, int64_t rows, int64_t n, int64_t k) {
  for (int64_t r0 = 0; r0 < rows; r0 += kDenseRowBlock) {
    const int64_t nr = rows - r0 < kDenseRowBlock ? rows - r0 : kDenseRowBlock;
    dense_matmul_block(out + r0 * n, x + r0 * k, w, xt + r0 * k, nr, n, k);
  }
}
