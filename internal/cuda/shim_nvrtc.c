#include "../../csrc/nvrtc_shim.c"
