// The kernels of kernels.h compiled for base; ops.cpp calls them only on a CPU that has it.

#define DISAGG_ISA base
#include "kernels.h"

namespace disagg {

KernelTable kernels_base() {
  return {"base", base::paged_decode_attention, base::rms_norm,
          base::rope_and_cache, base::silu_and_mul, base::dequantize};
}

}  // namespace disagg
