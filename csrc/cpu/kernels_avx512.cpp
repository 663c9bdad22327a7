// The kernels of kernels.h compiled for avx512, and their table; ops.cpp calls them only on a CPU that has it.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")
#define DISAGG_ISA avx512
#define DISAGG_AVX512 1
#define DISAGG_FMA 1
#define DISAGG_VNNI 1  // g++ defines no __AVX512VNNI__ or __FMA__ for a target pragma
#include "kernels.h"
