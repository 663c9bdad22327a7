// The kernels of kernels.h compiled for avx2, and their table; ops.cpp calls them only on a CPU that has it.
#pragma GCC target("avx2,fma")
#define DISAGG_ISA avx2
#define DISAGG_AVX2 1
#define DISAGG_FMA 1  // g++ defines no __AVX2__ or __FMA__ for a target pragma
#include "kernels.h"
