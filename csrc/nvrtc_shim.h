// nvrtc_shim.h: the NVRTC entry points mooncake-go uses, declared here (no
// CUDA headers on the build machines) and resolved with dlsym at run time.
#ifndef MOONCAKE_NVRTC_SHIM_H
#define MOONCAKE_NVRTC_SHIM_H

#include <stddef.h>

typedef int nvrtcResult;
typedef struct _nvrtcProgram *nvrtcProgram;

#define MC_NVRTC_SYMBOL_NOT_FOUND (-302)

int mc_nvrtc_bind(void *lib, char *missing, int missing_len);

const char *mc_nvrtcGetErrorString(nvrtcResult r);
nvrtcResult mc_nvrtcVersion(int *major, int *minor);
nvrtcResult mc_nvrtcCreateProgram(nvrtcProgram *p, const char *src, const char *name);
nvrtcResult mc_nvrtcCompileProgram(nvrtcProgram p, int nopts, const char *const *opts);
nvrtcResult mc_nvrtcGetProgramLogSize(nvrtcProgram p, size_t *n);
nvrtcResult mc_nvrtcGetProgramLog(nvrtcProgram p, char *log);
nvrtcResult mc_nvrtcGetCUBINSize(nvrtcProgram p, size_t *n);
nvrtcResult mc_nvrtcGetCUBIN(nvrtcProgram p, char *out);
nvrtcResult mc_nvrtcGetPTXSize(nvrtcProgram p, size_t *n);
nvrtcResult mc_nvrtcGetPTX(nvrtcProgram p, char *out);
nvrtcResult mc_nvrtcDestroyProgram(nvrtcProgram *p);

#endif
