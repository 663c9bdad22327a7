// The kernels of kernels.h compiled for base, and their table; ops.cpp calls them only on a CPU that has it.
#define DISAGG_ISA base
#include "kernels.h"
