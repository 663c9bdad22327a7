// Quantized weights times int8 activations, a fragment of kernels.h (compiled once per instruction
// set like the rest). It includes nothing itself.
//
// The math of llama.cpp's Q4_1 x Q8_1 dot products. Activations are rounded to int8 in blocks of 32
// values with one float32 scale each; a weight block of 32 values is d * q + m (q in 0..15 for 4
// bits; for 8 bits q = the int8 value + 128 and m = -128 d). Then a block's product is
// d * (dx * sum(q * qx)) + m * (dx * sum(qx)): the sum of products is exact in int32; on
// AVX512-VNNI one vpdpbusd does 64 of its multiply-adds, on AVX2 a vpmaddubsw and a vpmaddwd do 32. Per output the blocks are summed in order,
// one float32 rounding per operation (no fused multiply-add), so every instruction set gives the
// same bits and TorchOps.quant_matmul is its exact twin.

// ---- activations to int8, one scale per block of 32 ------------------------------------------

constexpr int64_t kQ8Block = 32;
constexpr float kFloatMax = 3.40282347e+38f;

// q[r, k] = rint(x[r, k] * (1 / d[r, b])) with d = max|x| / 127 over block b (q = 0 where d = 0);
// s[r, b] = d * sum(q of block b). A NaN in a block makes its d NaN (so the product is NaN, as a
// float matmul's would be); q is clamped to -127..127 with NaN as 0, so that no cast is undefined
// (an inf makes d inf and 1 / d 0: q = 0 and s NaN; a block below ~4e-37 gets 1 / d = inf).

typedef int32_t q8_i32x16 __attribute__((vector_size(64)));
typedef int8_t q8_i8x16 __attribute__((vector_size(16)));

inline q8_i32x16 rint16(f32x16 v) {
  q8_i32x16 r;
#pragma omp simd
  for (int i = 0; i < kLanes; ++i) r[i] = static_cast<int32_t>(__builtin_rintf(v[i]));
  return r;
}

// One block of 32 finite values whose 1 / d is finite (|x / d| <= 127): two vectors, no clamp.
// False (nothing written) for any other block.
template <typename T>
inline bool quantize_block_finite(const T* xb, int8_t* qb, float* scale, int32_t* sum) {
  const f32x16 x0 = load_f32x16(xb), x1 = load_f32x16(xb + kLanes);
  if (!(sum16(x0 * 0.0f + x1 * 0.0f) == 0.0f)) return false;  // x * 0 is NaN for a NaN or an inf
  const f32x16 a0 = reinterpret_cast<f32x16>(reinterpret_cast<u32x16>(x0) & 0x7fffffffu);
  const f32x16 a1 = reinterpret_cast<f32x16>(reinterpret_cast<u32x16>(x1) & 0x7fffffffu);
  const float d = max16(max2(a0, a1)) / 127.0f;
  const float inv = d != 0.0f ? 1.0f / d : 0.0f;
  if (!(inv <= kFloatMax)) return false;
  const q8_i32x16 q0 = rint16(x0 * inv), q1 = rint16(x1 * inv);
  const q8_i32x16 both = q0 + q1;
  int32_t total = 0;
  for (int i = 0; i < kLanes; ++i) total += both[i];
  const q8_i8x16 b0 = __builtin_convertvector(q0, q8_i8x16), b1 = __builtin_convertvector(q1, q8_i8x16);
  __builtin_memcpy(qb, &b0, sizeof b0);
  __builtin_memcpy(qb + kLanes, &b1, sizeof b1);
  *scale = d;
  *sum = total;
  return true;
}

// Any block: a NaN makes d NaN, and q is clamped (NaN as 0) before its cast.
template <typename T>
inline void quantize_block_checked(const T* xb, int8_t* qb, float* scale, int32_t* sum) {
  float amax = 0.0f;
  bool nan = false;
  for (int64_t j = 0; j < kQ8Block; ++j) {
    const float a = __builtin_fabsf(to_f32(xb[j]));
    amax = a > amax ? a : amax;
    nan = nan || a != a;
  }
  const float d = nan ? __builtin_nanf("") : amax / 127.0f;
  const float inv = d != 0.0f ? 1.0f / d : 0.0f;
  int32_t total = 0;
  for (int64_t j = 0; j < kQ8Block; ++j) {
    float f = __builtin_rintf(to_f32(xb[j]) * inv);
    f = f != f ? 0.0f : f;
    f = f > 127.0f ? 127.0f : f;
    f = f < -127.0f ? -127.0f : f;
    qb[j] = static_cast<int8_t>(f);
    total += static_cast<int32_t>(f);
  }
  *scale = d;
  *sum = total;
}

template <typename T>
void quantize_q8_t(int8_t* q, float* d, float* s, const void* x_, int64_t rows, int64_t cols, int64_t x_stride) {
  const int64_t blocks = cols / kQ8Block;
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = static_cast<const T*>(x_) + r * x_stride;
    for (int64_t b = 0; b < blocks; ++b) {
      const T* xb = x + b * kQ8Block;
      int8_t* qb = q + r * cols + b * kQ8Block;
      float scale;
      int32_t sum;
      if (!quantize_block_finite<T>(xb, qb, &scale, &sum)) quantize_block_checked<T>(xb, qb, &scale, &sum);
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

// A pass works on L lanes of a tile: all 16 with VNNI (zmm), half a tile at a time elsewhere (8
// lanes, so that the unpacked weights and the accumulators fit AVX2's 16 ymm registers), over R
// activation rows, unpacking the weights once per pass.
#if defined(DISAGG_VNNI)
constexpr int kLanesPerPass = 16;
constexpr int kRowsPerPass = 8;
#else
constexpr int kLanesPerPass = 8;
constexpr int kRowsPerPass = 4;
#endif

template <int L> struct Lanes;
template <> struct Lanes<16> {
  typedef int32_t i32 __attribute__((vector_size(64)));
  typedef uint32_t u32 __attribute__((vector_size(64)));
  typedef float f32 __attribute__((vector_size(64)));
};
template <> struct Lanes<8> {
  typedef int32_t i32 __attribute__((vector_size(32)));
  typedef uint32_t u32 __attribute__((vector_size(32)));
  typedef float f32 __attribute__((vector_size(32)));
};

// acc + the sum of each lane's 4 bytes of w (unsigned, at most 15 unless DISAGG_VNNI) times its 4
// bytes of x (int8). VNNI does it in one vpdpbusd; AVX2 pairs products with vpmaddubsw (16-bit sums:
// 15 * 127 * 2 cannot saturate) and vpmaddwd; the base build shifts bytes out of each lane.
template <typename I, typename U>
inline I dot4(I acc, U w, I x) {
  const I wi = reinterpret_cast<I>(w);
#if defined(DISAGG_VNNI)
  return __builtin_ia32_vpdpbusd_v16si(acc, wi, x);
#elif defined(DISAGG_AVX2)
  typedef char i8x32 __attribute__((vector_size(32)));
  typedef short i16x16 __attribute__((vector_size(32)));
  const i16x16 ones = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  return acc + __builtin_ia32_pmaddwd256(
                   __builtin_ia32_pmaddubsw256(reinterpret_cast<i8x32>(wi), reinterpret_cast<i8x32>(x)), ones);
#else
  acc += (wi & 0xFF) * ((x << 24) >> 24);
  acc += ((wi >> 8) & 0xFF) * ((x << 16) >> 24);
  acc += ((wi >> 16) & 0xFF) * ((x << 8) >> 24);
  return acc + ((wi >> 24) & 0xFF) * (x >> 24);
#endif
}

// dot4 for bytes of w up to 255: without VNNI, as its two nibbles (w = 16 hi + lo).
template <typename I, typename U>
inline I dot4_bytes(I acc, U w, I x) {
#if defined(DISAGG_VNNI)
  return dot4(acc, w, x);
#else
  return dot4(acc, w & 0x0F0F0F0Fu, x) + (dot4(I{}, (w >> 4) & 0x0F0F0F0Fu, x) << 4);
#endif
}

template <typename I>
inline I broadcast4(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, sizeof v);
  return I{} + v;
}

template <typename V>
inline V load_lanes(const void* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// The L lanes of v to out[0, L), rounded to T.
template <typename T, int L, typename F>
inline void store_lanes(T* out, F v) {
  if constexpr (sizeof(T) == sizeof(float)) {
    __builtin_memcpy(out, &v, sizeof v);
  } else {
    T lanes[L];
#pragma omp simd
    for (int j = 0; j < L; ++j) lanes[j] = from_f32<T>(v[j]);
    __builtin_memcpy(out, lanes, sizeof lanes);
  }
}

// R activation rows times lanes [lane0, lane0 + L) of one tile: out[r, j] for the tile's columns j
// in that range below `cols` (<= 16).
template <typename T, int R, int Bits, int L>
void quant_tile(T* out, int64_t out_stride, int64_t cols, int64_t lane0, const int8_t* xq, const float* xd,
                const float* xs, int64_t k, const uint8_t* w, const float* ws) {
  using I = typename Lanes<L>::i32;
  using U = typename Lanes<L>::u32;
  using F = typename Lanes<L>::f32;
  constexpr int64_t kBlockBytes = kTileRows * kQ8Block * Bits / 8;
  const int64_t blocks = k / kQ8Block;
  F acc[R];
  for (int r = 0; r < R; ++r) acc[r] = F{};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * kBlockBytes + 4 * lane0;
    U wv[8];  // wv[v] multiplies the activations at 4v
    if constexpr (Bits == 4) {
      for (int c = 0; c < 4; ++c) {
        const U v = load_lanes<U>(wb + 64 * c);
        wv[2 * c] = v & 0x0F0F0F0Fu;
        wv[2 * c + 1] = (v >> 4) & 0x0F0F0F0Fu;
      }
    } else {
      for (int c = 0; c < 8; ++c) wv[c] = load_lanes<U>(wb + 64 * c);
    }
    const F dw = load_lanes<F>(ws + b * 2 * kTileRows + lane0);
    const F mw = load_lanes<F>(ws + b * 2 * kTileRows + kTileRows + lane0);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {  // unrolled, so that acc stays in registers
      const int8_t* xb = xq + r * k + b * kQ8Block;
      I s0 = {}, s1 = {};  // two chains: vpdpbusd's latency, not its rate, would bound one
      for (int c = 0; c < 4; ++c) {
        if constexpr (Bits == 4) {
          s0 = dot4(s0, wv[2 * c], broadcast4<I>(xb + 8 * c));
          s1 = dot4(s1, wv[2 * c + 1], broadcast4<I>(xb + 8 * c + 4));
        } else {
          s0 = dot4_bytes(s0, wv[2 * c], broadcast4<I>(xb + 8 * c));
          s1 = dot4_bytes(s1, wv[2 * c + 1], broadcast4<I>(xb + 8 * c + 4));
        }
      }
      const float dx = xd[r * blocks + b], sx = xs[r * blocks + b];
      acc[r] = acc[r] + __builtin_convertvector(s0 + s1, F) * (dw * dx);
      acc[r] = acc[r] + mw * sx;
    }
  }
  const int64_t n = cols - lane0 < L ? cols - lane0 : L;
  if (n == L) {  // whole lanes: one vector store per row (an element loop took ~15% of a prefill's tiles)
    for (int r = 0; r < R; ++r) store_lanes<T, L>(out + r * out_stride + lane0, acc[r]);
    return;
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < n; ++j) out[r * out_stride + lane0 + j] = from_f32<T>(acc[r][j]);
}

// Every (tile of 16 output columns, pass of up to `per_pass` rows, L lanes of the tile) of a rows x n
// output: fn(t, r0, rows in the pass, the tile's columns, lane0). Tiles outer: a thread's passes over
// one tile reread its weights from L1, the activations from L2. From one row of a 576 x 576 weight up
// (262144 multiply-adds) the threads split it: batch-1 gguf decode went from 161-173 to 182-203 tok/s
// against a threshold 8x higher.
template <typename Fn>
inline void each_tile_pass(int64_t rows, int64_t n, int64_t k, int64_t per_pass, Fn fn) {
  const int64_t tiles = (n + kTileRows - 1) / kTileRows, passes = (rows + per_pass - 1) / per_pass;
#pragma omp parallel for collapse(2) schedule(static) if (rows * n * k >= 8 * kParallelElems)
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t p = 0; p < passes; ++p) {
      const int64_t r0 = p * per_pass;
      const int64_t nr = rows - r0 < per_pass ? rows - r0 : per_pass;
      const int64_t cols = n - t * kTileRows < kTileRows ? n - t * kTileRows : kTileRows;
      for (int64_t lane0 = 0; lane0 < cols; lane0 += kLanesPerPass) fn(t, r0, nr, cols, lane0);
    }
  }
}

template <typename T, int Bits>
void quant_matmul_t(void* out_, const int8_t* xq, const float* xd, const float* xs, const uint8_t* w,
                    const float* ws, int64_t rows, int64_t n, int64_t k) {
  using Tile = void (*)(T*, int64_t, int64_t, int64_t, const int8_t*, const float*, const float*, int64_t,
                        const uint8_t*, const float*);
  constexpr int L = kLanesPerPass;
  static constexpr Tile kTiles[9] = {
      nullptr, quant_tile<T, 1, Bits, L>, quant_tile<T, 2, Bits, L>, quant_tile<T, 3, Bits, L>,
      quant_tile<T, 4, Bits, L>, quant_tile<T, 5, Bits, L>, quant_tile<T, 6, Bits, L>, quant_tile<T, 7, Bits, L>,
      quant_tile<T, 8, Bits, L>};
  static_assert(kRowsPerPass <= 8, "kTiles holds passes of up to 8 rows");
  T* out = static_cast<T*>(out_);
  const int64_t blocks = k / kQ8Block, tile_bytes = blocks * kTileRows * kQ8Block * Bits / 8;
  each_tile_pass(rows, n, k, kRowsPerPass, [&](int64_t t, int64_t r0, int64_t nr, int64_t cols, int64_t lane0) {
    kTiles[nr](out + r0 * n + t * kTileRows, n, cols, lane0, xq + r0 * k, xd + r0 * blocks, xs + r0 * blocks, k,
               w + t * tile_bytes, ws + t * blocks * 2 * kTileRows);
  });
}
