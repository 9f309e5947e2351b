//go:build ignore

// nvrtc_shim.c: compiled into internal/cuda through an including .c file.

#include <dlfcn.h>
#include <string.h>
#include "nvrtc_shim.h"

static struct {
	const char *(*nvrtcGetErrorString)(nvrtcResult);
	nvrtcResult (*nvrtcVersion)(int *, int *);
	nvrtcResult (*nvrtcCreateProgram)(nvrtcProgram *, const char *, const char *, int,
	                                  const char *const *, const char *const *);
	nvrtcResult (*nvrtcCompileProgram)(nvrtcProgram, int, const char *const *);
	nvrtcResult (*nvrtcGetProgramLogSize)(nvrtcProgram, size_t *);
	nvrtcResult (*nvrtcGetProgramLog)(nvrtcProgram, char *);
	nvrtcResult (*nvrtcGetCUBINSize)(nvrtcProgram, size_t *);
	nvrtcResult (*nvrtcGetCUBIN)(nvrtcProgram, char *);
	nvrtcResult (*nvrtcGetPTXSize)(nvrtcProgram, size_t *);
	nvrtcResult (*nvrtcGetPTX)(nvrtcProgram, char *);
	nvrtcResult (*nvrtcDestroyProgram)(nvrtcProgram *);
} mc_nv;

#define NVREQ(f)                                                               \
	do {                                                                   \
		*(void **)(&mc_nv.f) = dlsym(lib, #f);                         \
		if (!mc_nv.f && !first_missing) first_missing = #f;            \
	} while (0)

int mc_nvrtc_bind(void *lib, char *missing, int missing_len) {
	const char *first_missing = NULL;
	memset(&mc_nv, 0, sizeof(mc_nv));
	NVREQ(nvrtcGetErrorString);
	NVREQ(nvrtcVersion);
	NVREQ(nvrtcCreateProgram);
	NVREQ(nvrtcCompileProgram);
	NVREQ(nvrtcGetProgramLogSize);
	NVREQ(nvrtcGetProgramLog);
	NVREQ(nvrtcGetPTXSize);
	NVREQ(nvrtcGetPTX);
	NVREQ(nvrtcDestroyProgram);
	/* CUBIN output exists since NVRTC 11.1; optional so PTX still works. */
	*(void **)(&mc_nv.nvrtcGetCUBINSize) = dlsym(lib, "nvrtcGetCUBINSize");
	*(void **)(&mc_nv.nvrtcGetCUBIN) = dlsym(lib, "nvrtcGetCUBIN");
	if (first_missing) {
		if (missing && missing_len > 0) {
			strncpy(missing, first_missing, (size_t)missing_len - 1);
			missing[missing_len - 1] = 0;
		}
		return -1;
	}
	return 0;
}

#define NVCALL(f, ...) (mc_nv.f ? mc_nv.f(__VA_ARGS__) : MC_NVRTC_SYMBOL_NOT_FOUND)

const char *mc_nvrtcGetErrorString(nvrtcResult r) {
	return mc_nv.nvrtcGetErrorString ? mc_nv.nvrtcGetErrorString(r) : NULL;
}
nvrtcResult mc_nvrtcVersion(int *a, int *b) { return NVCALL(nvrtcVersion, a, b); }
nvrtcResult mc_nvrtcCreateProgram(nvrtcProgram *p, const char *src, const char *name) {
	return NVCALL(nvrtcCreateProgram, p, src, name, 0, NULL, NULL);
}
nvrtcResult mc_nvrtcCompileProgram(nvrtcProgram p, int n, const char *const *o) { return NVCALL(nvrtcCompileProgram, p, n, o); }
nvrtcResult mc_nvrtcGetProgramLogSize(nvrtcProgram p, size_t *n) { return NVCALL(nvrtcGetProgramLogSize, p, n); }
nvrtcResult mc_nvrtcGetProgramLog(nvrtcProgram p, char *l) { return NVCALL(nvrtcGetProgramLog, p, l); }
nvrtcResult mc_nvrtcGetCUBINSize(nvrtcProgram p, size_t *n) { return NVCALL(nvrtcGetCUBINSize, p, n); }
nvrtcResult mc_nvrtcGetCUBIN(nvrtcProgram p, char *o) { return NVCALL(nvrtcGetCUBIN, p, o); }
nvrtcResult mc_nvrtcGetPTXSize(nvrtcProgram p, size_t *n) { return NVCALL(nvrtcGetPTXSize, p, n); }
nvrtcResult mc_nvrtcGetPTX(nvrtcProgram p, char *o) { return NVCALL(nvrtcGetPTX, p, o); }
nvrtcResult mc_nvrtcDestroyProgram(nvrtcProgram *p) { return NVCALL(nvrtcDestroyProgram, p); }
