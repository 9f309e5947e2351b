#include "../../csrc/cuda_shim.c"
