// The kernels of kernels.h compiled for avx512; ops.cpp calls them only on a CPU that has it.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define DISAGG_ISA avx512
#include "kernels.h"

namespace disagg {

KernelTable kernels_avx512() {
  return {"avx512", avx512::paged_decode_attention, avx512::rms_norm,
          avx512::rope_and_cache, avx512::silu_and_mul, avx512::dequantize};
}

}  // namespace disagg
