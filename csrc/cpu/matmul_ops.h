// The matmul ops of torch.ops.disagg (quantize_q8, quant_matmul, dequant_matmul, dense_matmul), a
// fragment of ops.cpp: included there inside namespace disagg (anonymous), after its shared checks
// (check_cpu, dtype_of, table()). It includes nothing itself.

// x [rows, k] to int8 in blocks of 32: (q int8 [rows, k], d and s float32 [rows, k / 32]); table.h says how.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_q8(const at::Tensor& x_in) {
  check_cpu(x_in, "x");
  const DType dtype = dtype_of(x_in);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % 32 == 0, "x must be [rows, k] with k a multiple of 32, got ",
              x_in.sizes());
  at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({rows, k}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({rows, k / 32}, x.options().dtype(at::kFloat));
  at::Tensor s = at::empty({rows, k / 32}, x.options().dtype(at::kFloat));
  table().quantize_q8(q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>(), x.data_ptr(), rows, k, k, dtype);
  return {q, d, s};
}

// Checks a weight of n output rows and `bits` (4 or 8) packed in tiles of 16 (quant_matmul.h) against
// x [rows, k].
void check_packed(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, int64_t n, int64_t bits) {
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  check_cpu(scales, "scales");
  TORCH_CHECK(bits == 4 || bits == 8, "weights of 4 or 8 bits, not ", bits);
  const int64_t block_bytes = 16 * 32 * bits / 8;
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 3 && weight.size(2) == block_bytes &&
              weight.is_contiguous(), "weight must be contiguous uint8 [tiles, k / 32, ", block_bytes, "]");
  const int64_t tiles = weight.size(0), k = weight.size(1) * 32;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be [rows, ", k, "], got ", x.sizes());
  TORCH_CHECK(n > (tiles - 1) * 16 && n <= tiles * 16, n, " output rows do not fill ", tiles, " tiles of 16");
  const std::vector<int64_t> scale_shape = {tiles, k / 32, 2, 16};
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.sizes() == scale_shape,
              "scales must be contiguous float32 [", tiles, ", ", k / 32, ", 2, 16]");
}

// x [rows, k] @ a packed weight of n output rows (check_packed), x rounded to int8 → [rows, n] in x's dtype.
at::Tensor quant_matmul(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scales, int64_t n,
                        int64_t bits) {
  check_packed(x_in, weight, scales, n, bits);
  const DType dtype = dtype_of(x_in);
  at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  at::Tensor q = at::empty({rows, k}, x.options().dtype(at::kChar));
  at::Tensor ds = at::empty({2, rows, k / 32}, x.options().dtype(at::kFloat));
  float* d = ds.data_ptr<float>();
  float* s = d + rows * (k / 32);
  table().quantize_q8(q.data_ptr<int8_t>(), d, s, x.data_ptr(), rows, k, k, dtype);
  table().quant_matmul(out.data_ptr(), q.data_ptr<int8_t>(), d, s, weight.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                       rows, n, k, static_cast<int>(bits), dtype);
  return out;
}

// x [rows, k] @ a packed weight of n output rows (check_packed) dequantized in registers, in float32
// → [rows, n] in x's dtype (a bfloat16 x is widened first and the result rounded back).
at::Tensor dequant_matmul(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scales, int64_t n,
                          int64_t bits) {
  check_packed(x_in, weight, scales, n, bits);
  dtype_of(x_in);  // float32 or bfloat16
  at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows > 0)
    table().dequant_matmul(out.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<uint8_t>(),
                           scales.data_ptr<float>(), rows, n, k, static_cast<int>(bits));
  return out.to(x_in.scalar_type());
}

// x [rows, k] @ a float32 or bfloat16 weight of n output rows packed in tiles of 32 ([tiles, k, 32],
// dense_matmul.h) → [rows, n], computed in float32.
at::Tensor dense_matmul(const at::Tensor& x_in, const at::Tensor& weight, int64_t n) {
  check_cpu(x_in, "x");
  check_cpu(weight, "weight");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "dense_matmul takes float32 x, got ", x_in.scalar_type());
  const DType w_dtype = dtype_of(weight);
  TORCH_CHECK(weight.dim() == 3 && weight.size(2) == 32 && weight.size(1) > 0 && weight.is_contiguous(),
              "weight must be contiguous [tiles, k, 32]");
  const int64_t tiles = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k, "x must be [rows, ", k, "], got ", x_in.sizes());
  TORCH_CHECK(n > (tiles - 1) * 32 && n <= tiles * 32, n, " output rows do not fill ", tiles, " tiles of 32");
  at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  // The transposed activations live in a buffer kept per calling thread: a fresh at::empty of a
  // prefill chunk's megabytes page-faulted on every call.
  static thread_local std::vector<float> xt;
  if (xt.size() < static_cast<size_t>(rows * k)) xt.resize(rows * k);
  table().dense_matmul(out.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr(), w_dtype, xt.data(), rows, n, k);
  return out;
}
