// Quantized weights times int8 activations, a fragment of kernels.h: included there after
// attention.h, whose 16-lane vector types (f32x16, u32x16, load_f32x16) it uses. It includes nothing.
//
// The math of llama.cpp's Q4_1 x Q8_1 dot products. Activations are rounded to int8 in blocks of 32
// values with one float32 scale each; a weight block of 32 values is d * q + m (q in 0..15 for 4
// bits; for 8 bits q = the int8 value + 128 and m = -128 d). Then a block's product is
// d * (dx * sum(q * qx)) + m * (dx * sum(qx)): the sum of products is exact in int32, and on
// AVX512-VNNI one vpdpbusd does 64 of its multiply-adds. Per output the blocks are summed in order,
// one float32 rounding per operation (no fused multiply-add), so every instruction set gives the
// same bits and TorchOps.quant_matmul is its exact twin.

// ---- activations to int8, one scale per block of 32 ------------------------------------------

constexpr int64_t kQ8Block = 32;

// q[r, k] = rint(x[r, k] * (1 / d[r, b])) with d = max|x| / 127 over block b (q = 0 where d = 0);
// s[r, b] = d * sum(q of block b).
template <typename T>
void quantize_q8_t(int8_t* q, float* d, float* s, const void* x_, int64_t rows, int64_t cols, int64_t x_stride) {
  const int64_t blocks = cols / kQ8Block;
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = static_cast<const T*>(x_) + r * x_stride;
    for (int64_t b = 0; b < blocks; ++b) {
      const T* xb = x + b * kQ8Block;
      float amax = 0.0f;
#pragma omp simd reduction(max : amax)
      for (int64_t j = 0; j < kQ8Block; ++j) {
        const float a = __builtin_fabsf(to_f32(xb[j]));
        amax = a > amax ? a : amax;
      }
      const float scale = amax / 127.0f;
      const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
      int8_t* qb = q + r * cols + b * kQ8Block;
      int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < kQ8Block; ++j) {
        const int32_t v = static_cast<int32_t>(__builtin_rintf(to_f32(xb[j]) * inv));
        qb[j] = static_cast<int8_t>(v);
        sum += v;
      }
      d[r * blocks + b] = scale;
      s[r * blocks + b] = scale * static_cast<float>(sum);
    }
  }
}

// ---- the matmul ----------------------------------------------------------------------------

// The packed weight (disagg.ops.quant.pack_blocks builds it): output rows in tiles of 16, one int32
// lane each; per (tile, block of 32 columns) 16 x 32 x bits / 8 bytes in chunks of 64, so that one
// chunk (or one nibble of it) times 4 activations broadcast is one vpdpbusd:
// - 4 bits: 4 chunks; byte 4i + j of chunk c holds column 8c + j of row i in its low nibble and
//   column 8c + 4 + j in its high one.
// - 8 bits: 8 chunks; byte 4i + j of chunk c holds column 4c + j of row i, plus 128 (vpdpbusd wants
//   unsigned bytes on one side: the weight's m = -128 d takes the offset back out).
// Scales: float32 [tiles, blocks, 2, 16], the 16 rows' d, then their m.
constexpr int64_t kTileRows = 16;
// Activation rows per pass over a tile's weights: each pass unpacks them once.
constexpr int kRowsPerPass = 8;

typedef int32_t i32x16 __attribute__((vector_size(64)));

// acc + the sum of each lane's 4 bytes of w (unsigned) times its 4 bytes of x (int8).
inline i32x16 dot4(i32x16 acc, u32x16 w, i32x16 x) {
#if defined(DISAGG_VNNI)
  return __builtin_ia32_vpdpbusd_v16si(acc, reinterpret_cast<i32x16>(w), x);
#else
  const i32x16 wi = reinterpret_cast<i32x16>(w);
  acc += (wi & 0xFF) * ((x << 24) >> 24);
  acc += ((wi >> 8) & 0xFF) * ((x << 16) >> 24);
  acc += ((wi >> 16) & 0xFF) * ((x << 8) >> 24);
  return acc + ((wi >> 24) & 0xFF) * (x >> 24);
#endif
}

inline i32x16 broadcast4(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, sizeof v);
  return i32x16{} + v;
}

// R activation rows times one tile: out[r, 0..cols) for the tile's first `cols` (<= 16) outputs.
template <typename T, int R, int Bits>
void quant_tile(T* out, int64_t out_stride, int64_t cols, const int8_t* xq, const float* xd, const float* xs,
                int64_t k, const uint8_t* w, const float* ws) {
  constexpr int64_t kBlockBytes = kTileRows * kQ8Block * Bits / 8;
  const int64_t blocks = k / kQ8Block;
  f32x16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = f32x16{};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * kBlockBytes;
    u32x16 wv[8];  // wv[v] multiplies the activations at 4v
    if constexpr (Bits == 4) {
      for (int c = 0; c < 4; ++c) {
        u32x16 v;
        __builtin_memcpy(&v, wb + 64 * c, sizeof v);
        wv[2 * c] = v & 0x0F0F0F0Fu;
        wv[2 * c + 1] = (v >> 4) & 0x0F0F0F0Fu;
      }
    } else {
      for (int c = 0; c < 8; ++c) __builtin_memcpy(&wv[c], wb + 64 * c, sizeof wv[c]);
    }
    const f32x16 dw = load_f32x16(ws + b * 2 * kTileRows), mw = load_f32x16(ws + b * 2 * kTileRows + kTileRows);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {  // unrolled, so that acc stays in registers
      const int8_t* xb = xq + r * k + b * kQ8Block;
      i32x16 s0 = {}, s1 = {};  // two chains: vpdpbusd's latency, not its rate, would bound one
      for (int c = 0; c < 4; ++c) {
        s0 = dot4(s0, wv[2 * c], broadcast4(xb + 8 * c));
        s1 = dot4(s1, wv[2 * c + 1], broadcast4(xb + 8 * c + 4));
      }
      const float dx = xd[r * blocks + b], sx = xs[r * blocks + b];
      acc[r] = acc[r] + __builtin_convertvector(s0 + s1, f32x16) * (dw * dx);
      acc[r] = acc[r] + mw * sx;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < cols; ++j) out[r * out_stride + j] = from_f32<T>(acc[r][j]);
}

template <typename T, int Bits>
void quant_matmul_t(void* out_, const int8_t* xq, const float* xd, const float* xs, const uint8_t* w,
                    const float* ws, int64_t rows, int64_t n, int64_t k) {
  using Tile = void (*)(T*, int64_t, int64_t, const int8_t*, const float*, const float*, int64_t, const uint8_t*,
                        const float*);
  static constexpr Tile kTiles[kRowsPerPass + 1] = {
      nullptr, quant_tile<T, 1, Bits>, quant_tile<T, 2, Bits>, quant_tile<T, 3, Bits>, quant_tile<T, 4, Bits>,
      quant_tile<T, 5, Bits>, quant_tile<T, 6, Bits>, quant_tile<T, 7, Bits>, quant_tile<T, 8, Bits>};
  T* out = static_cast<T*>(out_);
  const int64_t blocks = k / kQ8Block, tiles = (n + kTileRows - 1) / kTileRows;
  const int64_t tile_bytes = blocks * kTileRows * kQ8Block * Bits / 8;
  const int64_t passes = (rows + kRowsPerPass - 1) / kRowsPerPass;
  // Tiles outer: a thread's passes over one tile reread its weights from L1, the activations from L2.
#pragma omp parallel for collapse(2) schedule(static) if (rows * n * k >= 64 * kParallelElems)
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t p = 0; p < passes; ++p) {
      const int64_t r0 = p * kRowsPerPass;
      const int64_t nr = rows - r0 < kRowsPerPass ? rows - r0 : kRowsPerPass;
      const int64_t cols = n - t * kTileRows < kTileRows ? n - t * kTileRows : kTileRows;
      kTiles[nr](out + r0 * n + t * kTileRows, n, cols, xq + r0 * k, xd + r0 * blocks, xs + r0 * blocks, k,
                 w + t * tile_bytes, ws + t * blocks * 2 * kTileRows);
    }
  }
}
