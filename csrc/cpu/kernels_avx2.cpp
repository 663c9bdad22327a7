// The kernels of kernels.h compiled for avx2; ops.cpp calls them only on a CPU that has it.
#pragma GCC target("avx2,fma,f16c")
#define DISAGG_ISA avx2
#include "kernels.h"

namespace disagg {

KernelTable kernels_avx2() {
  return {"avx2", avx2::paged_decode_attention, avx2::rms_norm,
          avx2::rope_and_cache, avx2::silu_and_mul, avx2::dequantize};
}

}  // namespace disagg
