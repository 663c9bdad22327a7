// Quantized weights times float32 activations, a fragment of kernels.h (after quant_matmul.h, whose
// weight layout, lane types and helpers it shares). It includes nothing itself.
//
// The weight stays in quant_matmul's packed layout (disagg.ops.quant.pack_blocks) and is dequantized
// in registers, one column of a tile at a time (from kManyRows rows, a pair of tiles at a time into a
// buffer each thread reuses for the pass), exactly as disagg.ops.quant.dequantize computes it
// (one float32 rounding per operation): 4 bits d * q + m, 8 bits d * (q - 128), the stored byte less
// its offset. The activations stay float32: each column is multiplied into the rows' sums with fused
// multiply-adds, columns in order (in 4 interleaved chains under 4 rows). So a GGUF's blocks give the
// numbers of the dense weight they encode (`--quantization none`), summed in another order, while the
// weights a decode step reads from memory stay 4 or 8 bits. A decode step's passes (1 or 2 rows on avx512,
// every pass under kManyRows rows on AVX2 and base) take each block's scales out of its sum instead
// (dequant_tile_few: d * sum(q x) + m * sum(x), the same sum grouped by block, one fused multiply-add a
// column). (quant_matmul rounds the activations to int8 as
// llama.cpp does: faster on a prompt, further from the dense numbers.)

#if defined(DISAGG_VNNI)
constexpr int kDequantRows = 16;  // rows per pass: R accumulators, the column and its scales
#else
constexpr int kDequantRows = 8;
#endif

template <typename F>
inline F fma_lanes(F a, F b, F c) {
  F r;
#pragma omp simd
  for (int i = 0; i < static_cast<int>(sizeof(F) / sizeof(float)); ++i) r[i] = fma32(a[i], b[i], c[i]);
  return r;
}

template <typename F>
inline F splat_lanes(float x) {
  if constexpr (sizeof(F) == 64) {
    return F{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
  } else {
    return F{x, x, x, x, x, x, x, x};
  }
}

// acc[r][chain] += x[r * k] * column for the R rows of a pass (x: the column's activation in row 0).
template <int R, int Chains, typename F>
inline void add_column(F (*acc)[Chains], int chain, F column, const float* x, int64_t k) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][chain] = fma_lanes(splat_lanes<F>(x[r * k]), column, acc[r][chain]);
}

// R activation rows times lanes [lane0, lane0 + L) of one tile: out[r, j] for the tile's columns j
// in that range below `cols` (<= 16).
template <typename T, int R, int Bits, int L>
void dequant_tile(T* out, int64_t out_stride, int64_t cols, int64_t lane0, const float* x, const float* /*xs*/,
                  int64_t k, const uint8_t* w, const float* ws) {
  using I = typename Lanes<L>::i32;
  using U = typename Lanes<L>::u32;
  using F = typename Lanes<L>::f32;
  constexpr int64_t kBlockBytes = kTileRows * kQ8Block * Bits / 8;
  // Under 4 rows a row's sums form 4 chains (column j of every 4 in chain j), so that the fused
  // multiply-adds' latency does not bound a decode step's few rows; the chains add up at the end.
  constexpr int C = R >= 4 ? 1 : 4;
  const int64_t blocks = k / kQ8Block;
  F acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = F{};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * kBlockBytes + 4 * lane0;
    const F dw = load_lanes<F>(ws + b * 2 * kTileRows + lane0);
    const F mw = load_lanes<F>(ws + b * 2 * kTileRows + kTileRows + lane0);
    const float* xb = x + b * kQ8Block;
    if constexpr (Bits == 4) {
      for (int c = 0; c < 4; ++c) {  // chunk c: columns 8c .. 8c + 3 in the low nibbles, 8c + 4 .. in the high
        const U v = load_lanes<U>(wb + 64 * c);
        for (int h = 0; h < 2; ++h)
          for (int j = 0; j < 4; ++j) {
            const I q = reinterpret_cast<I>((v >> (8 * j + 4 * h)) & 0x0Fu);
            add_column<R, C>(acc, j % C, __builtin_convertvector(q, F) * dw + mw, xb + 8 * c + 4 * h + j, k);
          }
      }
    } else {
      for (int c = 0; c < 8; ++c) {  // chunk c: columns 4c .. 4c + 3, each the value plus 128
        const U v = load_lanes<U>(wb + 64 * c);
        for (int j = 0; j < 4; ++j) {
          const I q = reinterpret_cast<I>((v >> (8 * j)) & 0xFFu) - 128;
          add_column<R, C>(acc, j % C, __builtin_convertvector(q, F) * dw, xb + 4 * c + j, k);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 1; c < C; ++c) acc[r][0] += acc[r][c];
  const int64_t n = cols - lane0 < L ? cols - lane0 : L;
  if (n == L) {
    for (int r = 0; r < R; ++r) store_lanes<T, L>(out + r * out_stride + lane0, acc[r][0]);
    return;
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < n; ++j) out[r * out_stride + lane0 + j] = from_f32<T>(acc[r][0][j]);
}

// dequant_tile with each block's scales taken out of its sum (passes of up to kFewRows rows, below):
// out[r, j] = sum over blocks of d_j * (sum_i q_ij x_ri) + m_j * (sum_i x_ri), the inner sums in chains of
// fused multiply-adds over the block's integers (4 a row at 1 or 2 rows, 2 at 3 or 4, else 1), so a column
// costs its extraction, a conversion and one fused multiply-add (dequant_tile's also scale it, and 8 bits
// subtract the offset). `xs`: each row's block sums of x (row r's at xs + r * blocks), for 4 bits. Fed the
// rows of the identity it gives d * q + m with the roundings of disagg.ops.quant.dequantize still (one sum
// holds one integer).
template <typename T, int R, int Bits, int L>
void dequant_tile_few(T* out, int64_t out_stride, int64_t cols, int64_t lane0, const float* x, const float* xs,
                      int64_t k, const uint8_t* w, const float* ws) {
  using I = typename Lanes<L>::i32;
  using U = typename Lanes<L>::u32;
  using F = typename Lanes<L>::f32;
  constexpr int64_t kBlockBytes = kTileRows * kQ8Block * Bits / 8;
  constexpr int C = R <= 2 ? 4 : R <= 4 ? 2 : 1;  // chains a row: enough fused multiply-adds in flight
  const int64_t blocks = k / kQ8Block;
  F acc[R];
  for (int r = 0; r < R; ++r) acc[r] = F{};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * kBlockBytes + 4 * lane0;
    const F dw = load_lanes<F>(ws + b * 2 * kTileRows + lane0);
    const float* xb = x + b * kQ8Block;
    F sums[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) sums[r][c] = F{};
    if constexpr (Bits == 4) {
      for (int c = 0; c < 4; ++c) {  // chunk c: columns 8c .. 8c + 3 in the low nibbles, 8c + 4 .. in the high
        const U v = load_lanes<U>(wb + 64 * c);
        for (int h = 0; h < 2; ++h)
          for (int j = 0; j < 4; ++j) {
            const I q = reinterpret_cast<I>((v >> (8 * j + 4 * h)) & 0x0Fu);
            add_column<R, C>(sums, j % C, __builtin_convertvector(q, F), xb + 8 * c + 4 * h + j, k);
          }
      }
    } else {
      for (int c = 0; c < 8; ++c) {  // chunk c: columns 4c .. 4c + 3, each the value plus 128
        const I v = reinterpret_cast<I>(load_lanes<U>(wb + 64 * c) ^ 0x80808080u);  // each byte the value, signed
        for (int j = 0; j < 4; ++j)
          add_column<R, C>(sums, j % C, __builtin_convertvector((v << (24 - 8 * j)) >> 24, F), xb + 4 * c + j, k);
      }
    }
    for (int r = 0; r < R; ++r) {
      F block = sums[r][0];
      for (int c = 1; c < C; ++c) block += sums[r][c];
      if constexpr (Bits == 4) {
        const F mw = load_lanes<F>(ws + b * 2 * kTileRows + kTileRows + lane0);
        acc[r] = acc[r] + (dw * block + mw * splat_lanes<F>(xs[r * blocks + b]));
      } else {
        acc[r] = acc[r] + dw * block;
      }
    }
  }
  const int64_t n = cols - lane0 < L ? cols - lane0 : L;
  if (n == L) {
    for (int r = 0; r < R; ++r) store_lanes<T, L>(out + r * out_stride + lane0, acc[r]);
    return;
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < n; ++j) out[r * out_stride + lane0 + j] = from_f32<T>(acc[r][j]);
}

// ---- many rows (a prompt): two tiles dequantized once into a buffer, then rows x 32 columns ----

// Two tiles from tile t (the second all zero past the last) as float32 [k][32]: column kk of tile t's
// 16 output rows, then tile t + 1's, each value as dequant_tile computes it.
template <int Bits>
void dequantize_pair(float* buf, const uint8_t* w, const float* ws, int64_t t, int64_t tiles, int64_t k) {
  using I = typename Lanes<kLanesPerPass>::i32;
  using U = typename Lanes<kLanesPerPass>::u32;
  using F = typename Lanes<kLanesPerPass>::f32;
  constexpr int64_t kBlockBytes = kTileRows * kQ8Block * Bits / 8;
  const int64_t blocks = k / kQ8Block;
  for (int64_t half = 0; half < 2; ++half) {
    for (int64_t lane0 = 0; lane0 < kTileRows; lane0 += kLanesPerPass) {
      float* col = buf + half * kTileRows + lane0;
      if (t + half >= tiles) {
        const F zero{};
        for (int64_t kk = 0; kk < k; ++kk) __builtin_memcpy(col + kk * 2 * kTileRows, &zero, sizeof zero);
        continue;
      }
      const uint8_t* wt = w + (t + half) * blocks * kBlockBytes + 4 * lane0;
      const float* st = ws + (t + half) * blocks * 2 * kTileRows + lane0;
      for (int64_t b = 0; b < blocks; ++b) {
        const F dw = load_lanes<F>(st + b * 2 * kTileRows), mw = load_lanes<F>(st + b * 2 * kTileRows + kTileRows);
        for (int c = 0; c < Bits; ++c) {  // 4 bits: 4 chunks of 8 columns; 8 bits: 8 chunks of 4
          const U v = load_lanes<U>(wt + b * kBlockBytes + 64 * c);
          for (int e = 0; e < 32 / Bits; ++e) {  // column 8c + e (4 bits) or 4c + e (8 bits)
            F value;
            if constexpr (Bits == 4) {
              const int shift = 8 * (e % 4) + 4 * (e / 4);
              value = __builtin_convertvector(reinterpret_cast<I>((v >> shift) & 0x0Fu), F) * dw + mw;
            } else {
              value = __builtin_convertvector(reinterpret_cast<I>((v >> (8 * e)) & 0xFFu) - 128, F) * dw;
            }
            const int64_t kk = b * kQ8Block + c * (32 / Bits) + e;
            __builtin_memcpy(col + kk * 2 * kTileRows, &value, sizeof value);
          }
        }
      }
    }
  }
}

// R rows times V vectors of columns of a dequantized pair, from column c0 (V * kLanesPerPass of its 32):
// the sums in registers, one load of each buffer vector per column for all R rows.
template <int R, int V>
void pair_rows(float* out, int64_t out_stride, int64_t cols, const float* x, int64_t k, const float* buf,
               int64_t c0) {
  using F = typename Lanes<kLanesPerPass>::f32;
  F acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = F{};
#if defined(DISAGG_AVX2)  // four columns an iteration: 256 rows 638-716 -> 565-631 ms (docs/engine.md); avx512's
#pragma GCC unroll 4     // 24 accumulators leave no registers for it (11-13% slower unrolled)
#endif
  for (int64_t kk = 0; kk < k; ++kk) {
    F wv[V];
    for (int v = 0; v < V; ++v) wv[v] = load_lanes<F>(buf + kk * 2 * kTileRows + c0 + v * kLanesPerPass);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const F xr = splat_lanes<F>(x[r * k + kk]);
      for (int v = 0; v < V; ++v) acc[r][v] = fma_lanes(xr, wv[v], acc[r][v]);
    }
  }
  const int64_t n = cols - c0 < V * kLanesPerPass ? cols - c0 : V * kLanesPerPass;
  for (int r = 0; r < R; ++r) {
    float row[V * kLanesPerPass];
    __builtin_memcpy(row, acc[r], sizeof row);
    for (int64_t j = 0; j < n; ++j) out[r * out_stride + c0 + j] = row[j];
  }
}

// A pass's rows and vectors of columns: the sums, the column's vectors and a row's broadcast fill the
// registers (32 zmm; 16 ymm, where 3 rows x 4 vectors spilled: 6 x 2, BLIS's AVX2 shape, runs SmolLM2's
// matmuls at 256 rows at 196-210 GFLOP/s on an AVX-512 Xeon core held to avx2, against 138-145; the base
// build 38 -> 49).
#if defined(DISAGG_VNNI)
constexpr int kPairRows = 12, kPairVecs = 2;  // 12 rows x 2 zmm (the pair's 32 columns): 24 accumulators
#else
constexpr int kPairRows = 6, kPairVecs = 2;   // 6 rows x 2 ymm (half the pair's columns): 12 accumulators
#endif
constexpr int kPairCols = kPairVecs * kLanesPerPass;
// From this many rows a pair's dequantizing pays for its buffer. SmolLM2's four layer matmuls x 30, two
// threads, a Zen 4, three rounds alternating: equal at 18-20 rows; at 22, 24 and 28 the buffer took avx512
// 31.0 -> 29.9, 33.3 -> 31.9, 38.0 -> 35.7 ms and avx2 35.4 -> 33.7, 37.7 -> 35.0, 44.4 -> 39.5 (it began at
// 32 rows before).
constexpr int64_t kManyRows = 22;

// The rows past the last whole pass run as one pass of their own (kTail), where they ran one at a time:
// SmolLM2's four layer matmuls x 30, the two builds alternating in separate processes (medians of 4-6):
// avx512 34 rows 52.6 -> 42.0 ms, 40 rows 51.5 -> 47.5, 64 rows 77.5 -> 69.5; avx2 34 rows 50.2 -> 46.7,
// 40 rows 56.2 -> 52.8, 100 rows 118.7 -> 114.2.
template <int Bits>
void dequant_matmul_many(float* out, const float* x, const uint8_t* w, const float* ws, int64_t rows, int64_t n,
                         int64_t k) {
  const int64_t tiles = (n + kTileRows - 1) / kTileRows, pairs = (tiles + 1) / 2;
  using Tail = void (*)(float*, int64_t, int64_t, const float*, int64_t, const float*, int64_t);
  static constexpr Tail kTail[12] = {nullptr,
                                     pair_rows<1, kPairVecs>, pair_rows<2, kPairVecs>, pair_rows<3, kPairVecs>,
                                     pair_rows<4, kPairVecs>, pair_rows<5, kPairVecs>, pair_rows<6, kPairVecs>,
                                     pair_rows<7, kPairVecs>, pair_rows<8, kPairVecs>, pair_rows<9, kPairVecs>,
                                     pair_rows<10, kPairVecs>, pair_rows<11, kPairVecs>};
  static_assert(kPairRows <= 12, "kTail holds the passes under kPairRows rows");
#pragma omp parallel
  {
    float* buf = new float[k * 2 * kTileRows];
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; ++p) {
      dequantize_pair<Bits>(buf, w, ws, 2 * p, tiles, k);
      const int64_t c0 = p * 2 * kTileRows, cols = n - c0 < 2 * kTileRows ? n - c0 : 2 * kTileRows;
      int64_t r0 = 0;
      for (; r0 + kPairRows <= rows; r0 += kPairRows)
        for (int64_t part = 0; part < cols; part += kPairCols)
          pair_rows<kPairRows, kPairVecs>(out + r0 * n + c0, n, cols, x + r0 * k, k, buf, part);
      if (r0 < rows)
        for (int64_t part = 0; part < cols; part += kPairCols)
          kTail[rows - r0](out + r0 * n + c0, n, cols, x + r0 * k, k, buf, part);
    }
    delete[] buf;
  }
}

// Passes of up to kFewRows rows take the blocks' scales out of their sums (dequant_tile_few). On AVX2 and base
// that pays at every size (SmolLM2's four layer matmuls, one thread, held to avx2: 1 row 155 -> 115 us at 4
// bits; 4 rows 345 -> 278 us at 4 bits, 284 -> 245 at 8; 8 rows 484 -> 462, 449 -> 417); on avx512 only at 1
// and 2 (1 row 128 -> 96 us; 4 rows took 191-210 us against dequant_tile's 181-191 at 4 bits).
#if defined(DISAGG_VNNI)
constexpr int kFewRows = 2;
#else
constexpr int kFewRows = 16;
#endif
#define DISAGG_DEQUANT_TILE(R) \
  (R <= kFewRows ? dequant_tile_few<float, R, Bits, kLanesPerPass> : dequant_tile<float, R, Bits, kLanesPerPass>)

template <int Bits>
void dequant_matmul_t(float* out, const float* x, const uint8_t* w, const float* ws, int64_t rows, int64_t n,
                      int64_t k) {
  using Tile = void (*)(float*, int64_t, int64_t, int64_t, const float*, const float*, int64_t, const uint8_t*,
                        const float*);
  static constexpr Tile kTiles[17] = {
      nullptr,                 DISAGG_DEQUANT_TILE(1),  DISAGG_DEQUANT_TILE(2),  DISAGG_DEQUANT_TILE(3),
      DISAGG_DEQUANT_TILE(4),  DISAGG_DEQUANT_TILE(5),  DISAGG_DEQUANT_TILE(6),  DISAGG_DEQUANT_TILE(7),
      DISAGG_DEQUANT_TILE(8),  DISAGG_DEQUANT_TILE(9),  DISAGG_DEQUANT_TILE(10), DISAGG_DEQUANT_TILE(11),
      DISAGG_DEQUANT_TILE(12), DISAGG_DEQUANT_TILE(13), DISAGG_DEQUANT_TILE(14), DISAGG_DEQUANT_TILE(15),
      DISAGG_DEQUANT_TILE(16)};
  static_assert(kDequantRows <= 16, "kTiles holds passes of up to 16 rows");
  if (rows >= kManyRows) return dequant_matmul_many<Bits>(out, x, w, ws, rows, n, k);
  const int64_t blocks = k / kQ8Block, tile_bytes = blocks * kTileRows * kQ8Block * Bits / 8;
  float* xs = nullptr;  // each row's block sums of x, for dequant_tile_few's 4-bit mins
  if constexpr (Bits == 4) {
    xs = new float[rows * blocks];
    for (int64_t i = 0; i < rows * blocks; ++i) {
      float part[8] = {};  // 8 sums in lanes (a chain of 32 additions would be bound by their latency)
      for (int64_t j = 0; j < kQ8Block; ++j) part[j % 8] += x[i * kQ8Block + j];
      xs[i] = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    }
  }
  each_tile_pass(rows, n, k, kDequantRows, [&](int64_t t, int64_t r0, int64_t nr, int64_t cols, int64_t lane0) {
    kTiles[nr](out + r0 * n + t * kTileRows, n, cols, lane0, x + r0 * k, xs ? xs + r0 * blocks : nullptr, k,
               w + t * tile_bytes, ws + t * blocks * 2 * kTileRows);
  });
  delete[] xs;  // (nullptr: nothing)
}

#undef DISAGG_DEQUANT_TILE
