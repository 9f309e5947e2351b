//go:build ignore

// cuda_shim.c: compiled as part of internal/cuda (through a one-line .c file
// there that includes it); the build line above keeps the go tool from
// compiling it into package csrc.

#include <dlfcn.h>
#include <string.h>
#include "cuda_shim.h"

static mc_cuda_table mc_cu;

/* Resolve the first of up to three names that the driver exports. */
static void *mc_sym(void *lib, const char *a, const char *b, const char *c) {
	void *p = NULL;
	if (a) p = dlsym(lib, a);
	if (!p && b) p = dlsym(lib, b);
	if (!p && c) p = dlsym(lib, c);
	return p;
}

#define REQ(field, ...)                                                        \
	do {                                                                   \
		*(void **)(&mc_cu.field) = mc_sym(lib, __VA_ARGS__);            \
		if (!mc_cu.field && !first_missing) first_missing = #field;     \
	} while (0)
#define OPT(field, ...) do { *(void **)(&mc_cu.field) = mc_sym(lib, __VA_ARGS__); } while (0)

int mc_cuda_bind(void *lib, char *missing, int missing_len) {
	const char *first_missing = NULL;
	memset(&mc_cu, 0, sizeof(mc_cu));
	REQ(cuInit, "cuInit", NULL, NULL);
	REQ(cuDriverGetVersion, "cuDriverGetVersion", NULL, NULL);
	REQ(cuGetErrorName, "cuGetErrorName", NULL, NULL);
	REQ(cuGetErrorString, "cuGetErrorString", NULL, NULL);
	REQ(cuDeviceGetCount, "cuDeviceGetCount", NULL, NULL);
	REQ(cuDeviceGet, "cuDeviceGet", NULL, NULL);
	REQ(cuDeviceGetName, "cuDeviceGetName", NULL, NULL);
	REQ(cuDeviceGetAttribute, "cuDeviceGetAttribute", NULL, NULL);
	REQ(cuDeviceTotalMem, "cuDeviceTotalMem_v2", "cuDeviceTotalMem", NULL);
	REQ(cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId", NULL, NULL);
	REQ(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer", NULL, NULL);
	REQ(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", NULL, NULL);
	REQ(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease", NULL);
	REQ(cuCtxSetCurrent, "cuCtxSetCurrent", NULL, NULL);
	REQ(cuCtxGetCurrent, "cuCtxGetCurrent", NULL, NULL);
	REQ(cuCtxSynchronize, "cuCtxSynchronize", NULL, NULL);
	REQ(cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess", NULL, NULL);
	REQ(cuMemGetInfo, "cuMemGetInfo_v2", "cuMemGetInfo", NULL);
	REQ(cuStreamCreate, "cuStreamCreate", NULL, NULL);
	REQ(cuStreamDestroy, "cuStreamDestroy_v2", "cuStreamDestroy", NULL);
	REQ(cuStreamSynchronize, "cuStreamSynchronize", NULL, NULL);
	REQ(cuStreamQuery, "cuStreamQuery", NULL, NULL);
	REQ(cuStreamWaitEvent, "cuStreamWaitEvent", NULL, NULL);
	REQ(cuEventCreate, "cuEventCreate", NULL, NULL);
	REQ(cuEventDestroy, "cuEventDestroy_v2", "cuEventDestroy", NULL);
	REQ(cuEventRecord, "cuEventRecord", NULL, NULL);
	REQ(cuEventSynchronize, "cuEventSynchronize", NULL, NULL);
	REQ(cuEventQuery, "cuEventQuery", NULL, NULL);
	REQ(cuEventElapsedTime, "cuEventElapsedTime_v2", "cuEventElapsedTime", NULL);
	REQ(cuMemAlloc, "cuMemAlloc_v2", "cuMemAlloc", NULL);
	REQ(cuMemFree, "cuMemFree_v2", "cuMemFree", NULL);
	REQ(cuMemcpy, "cuMemcpy", NULL, NULL);
	REQ(cuMemcpyAsync, "cuMemcpyAsync", NULL, NULL);
	REQ(cuMemcpyHtoD, "cuMemcpyHtoD_v2", "cuMemcpyHtoD", NULL);
	REQ(cuMemcpyDtoH, "cuMemcpyDtoH_v2", "cuMemcpyDtoH", NULL);
	REQ(cuMemcpyDtoD, "cuMemcpyDtoD_v2", "cuMemcpyDtoD", NULL);
	REQ(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync", NULL);
	REQ(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync", NULL);
	REQ(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync", NULL);
	REQ(cuMemcpy2DAsync, "cuMemcpy2DAsync_v2", "cuMemcpy2DAsync", NULL);
	REQ(cuMemcpyPeer, "cuMemcpyPeer", NULL, NULL);
	REQ(cuMemcpyPeerAsync, "cuMemcpyPeerAsync", NULL, NULL);
	REQ(cuMemsetD8, "cuMemsetD8_v2", "cuMemsetD8", NULL);
	REQ(cuMemsetD8Async, "cuMemsetD8Async", NULL, NULL);
	REQ(cuMemHostAlloc, "cuMemHostAlloc", NULL, NULL);
	REQ(cuMemFreeHost, "cuMemFreeHost", NULL, NULL);
	REQ(cuMemHostRegister, "cuMemHostRegister_v2", "cuMemHostRegister", NULL);
	REQ(cuMemHostUnregister, "cuMemHostUnregister", NULL, NULL);
	REQ(cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer", NULL);
	REQ(cuIpcGetMemHandle, "cuIpcGetMemHandle", NULL, NULL);
	REQ(cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle", NULL);
	REQ(cuIpcCloseMemHandle, "cuIpcCloseMemHandle", NULL, NULL);
	REQ(cuPointerGetAttribute, "cuPointerGetAttribute", NULL, NULL);
	REQ(cuModuleLoadData, "cuModuleLoadData", NULL, NULL);
	REQ(cuModuleUnload, "cuModuleUnload", NULL, NULL);
	REQ(cuModuleGetFunction, "cuModuleGetFunction", NULL, NULL);
	REQ(cuFuncGetAttribute, "cuFuncGetAttribute", NULL, NULL);
	REQ(cuLaunchKernel, "cuLaunchKernel", NULL, NULL);
	/* Optional: older drivers lack VMM (10.2+) or cuFuncSetAttribute (9.0+). */
	OPT(cuFuncSetAttribute, "cuFuncSetAttribute", NULL, NULL);
	OPT(cuLaunchKernelEx, "cuLaunchKernelEx", NULL, NULL);
	OPT(cuMemCreate, "cuMemCreate", NULL, NULL);
	OPT(cuMemRelease, "cuMemRelease", NULL, NULL);
	OPT(cuMemAddressReserve, "cuMemAddressReserve", NULL, NULL);
	OPT(cuMemAddressFree, "cuMemAddressFree", NULL, NULL);
	OPT(cuMemMap, "cuMemMap", NULL, NULL);
	OPT(cuMemUnmap, "cuMemUnmap", NULL, NULL);
	OPT(cuMemSetAccess, "cuMemSetAccess", NULL, NULL);
	OPT(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity", NULL, NULL);
	OPT(cuMemExportToShareableHandle, "cuMemExportToShareableHandle", NULL, NULL);
	OPT(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle", NULL, NULL);
	OPT(cuMemGetHandleForAddressRange, "cuMemGetHandleForAddressRange", NULL, NULL);
	/* Graphs: the _v2 capture call takes the mode (the unversioned symbol
	 * is the CUDA 10.0 one without it); exec update _v2 is CUDA 12's. */
	OPT(cuStreamBeginCapture, "cuStreamBeginCapture_v2", NULL, NULL);
	OPT(cuStreamEndCapture, "cuStreamEndCapture", NULL, NULL);
	OPT(cuStreamIsCapturing, "cuStreamIsCapturing", NULL, NULL);
	OPT(cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags", NULL, NULL);
	OPT(cuGraphUpload, "cuGraphUpload", NULL, NULL);
	OPT(cuGraphLaunch, "cuGraphLaunch", NULL, NULL);
	OPT(cuGraphExecUpdate, "cuGraphExecUpdate_v2", NULL, NULL);
	OPT(cuGraphExecDestroy, "cuGraphExecDestroy", NULL, NULL);
	OPT(cuGraphDestroy, "cuGraphDestroy", NULL, NULL);
	OPT(cuGraphGetNodes, "cuGraphGetNodes", NULL, NULL);
	if (first_missing) {
		if (missing && missing_len > 0) {
			strncpy(missing, first_missing, (size_t)missing_len - 1);
			missing[missing_len - 1] = 0;
		}
		return -1;
	}
	return 0;
}

#define CALL(fn, ...) (mc_cu.fn ? mc_cu.fn(__VA_ARGS__) : MC_CUDA_ERROR_SYMBOL_NOT_FOUND)
#define WITH_CTX(c)                                                            \
	do {                                                                   \
		if (c) {                                                       \
			CUresult r_ = CALL(cuCtxSetCurrent, c);                \
			if (r_ != MC_CUDA_SUCCESS) return r_;                  \
		}                                                              \
	} while (0)

CUresult mc_cuInit(void) { return CALL(cuInit, 0); }
CUresult mc_cuDriverGetVersion(int *v) { return CALL(cuDriverGetVersion, v); }

const char *mc_cuErrorName(CUresult r) {
	const char *s = NULL;
	if (mc_cu.cuGetErrorName && mc_cu.cuGetErrorName(r, &s) == MC_CUDA_SUCCESS) return s;
	return NULL;
}
const char *mc_cuErrorString(CUresult r) {
	const char *s = NULL;
	if (mc_cu.cuGetErrorString && mc_cu.cuGetErrorString(r, &s) == MC_CUDA_SUCCESS) return s;
	return NULL;
}

CUresult mc_cuDeviceGetCount(int *n) { return CALL(cuDeviceGetCount, n); }
CUresult mc_cuDeviceGet(CUdevice *d, int o) { return CALL(cuDeviceGet, d, o); }
CUresult mc_cuDeviceGetName(char *b, int l, CUdevice d) { return CALL(cuDeviceGetName, b, l, d); }
CUresult mc_cuDeviceGetAttribute(int *v, int a, CUdevice d) { return CALL(cuDeviceGetAttribute, v, a, d); }
CUresult mc_cuDeviceTotalMem(size_t *v, CUdevice d) { return CALL(cuDeviceTotalMem, v, d); }
CUresult mc_cuDeviceGetPCIBusId(char *b, int l, CUdevice d) { return CALL(cuDeviceGetPCIBusId, b, l, d); }
CUresult mc_cuDeviceCanAccessPeer(int *v, CUdevice d, CUdevice p) { return CALL(cuDeviceCanAccessPeer, v, d, p); }

CUresult mc_cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { return CALL(cuDevicePrimaryCtxRetain, c, d); }
CUresult mc_cuDevicePrimaryCtxRelease(CUdevice d) { return CALL(cuDevicePrimaryCtxRelease, d); }
CUresult mc_cuCtxSetCurrent(CUcontext c) { return CALL(cuCtxSetCurrent, c); }
CUresult mc_cuCtxSynchronize(CUcontext c) { WITH_CTX(c); return CALL(cuCtxSynchronize); }
CUresult mc_cuCtxEnablePeerAccess(CUcontext c, CUcontext peer) {
	WITH_CTX(c);
	CUresult r = CALL(cuCtxEnablePeerAccess, peer, 0);
	return r == MC_CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED ? MC_CUDA_SUCCESS : r;
}
CUresult mc_cuMemGetInfo(CUcontext c, size_t *f, size_t *t) { WITH_CTX(c); return CALL(cuMemGetInfo, f, t); }

CUresult mc_cuStreamCreate(CUcontext c, CUstream *s, unsigned int fl) { WITH_CTX(c); return CALL(cuStreamCreate, s, fl); }
CUresult mc_cuStreamDestroy(CUcontext c, CUstream s) { WITH_CTX(c); return CALL(cuStreamDestroy, s); }
CUresult mc_cuStreamSynchronize(CUcontext c, CUstream s) { WITH_CTX(c); return CALL(cuStreamSynchronize, s); }
CUresult mc_cuStreamQuery(CUcontext c, CUstream s) { WITH_CTX(c); return CALL(cuStreamQuery, s); }
CUresult mc_cuStreamWaitEvent(CUcontext c, CUstream s, CUevent e) { WITH_CTX(c); return CALL(cuStreamWaitEvent, s, e, 0); }

CUresult mc_cuEventCreate(CUcontext c, CUevent *e, unsigned int fl) { WITH_CTX(c); return CALL(cuEventCreate, e, fl); }
CUresult mc_cuEventDestroy(CUcontext c, CUevent e) { WITH_CTX(c); return CALL(cuEventDestroy, e); }
CUresult mc_cuEventRecord(CUcontext c, CUevent e, CUstream s) { WITH_CTX(c); return CALL(cuEventRecord, e, s); }
CUresult mc_cuEventSynchronize(CUcontext c, CUevent e) { WITH_CTX(c); return CALL(cuEventSynchronize, e); }
CUresult mc_cuEventQuery(CUcontext c, CUevent e) { WITH_CTX(c); return CALL(cuEventQuery, e); }
CUresult mc_cuEventElapsedTime(CUcontext c, float *ms, CUevent a, CUevent b) { WITH_CTX(c); return CALL(cuEventElapsedTime, ms, a, b); }

CUresult mc_cuMemAlloc(CUcontext c, CUdeviceptr *p, size_t n) { WITH_CTX(c); return CALL(cuMemAlloc, p, n); }
CUresult mc_cuMemFree(CUcontext c, CUdeviceptr p) { WITH_CTX(c); return CALL(cuMemFree, p); }
CUresult mc_cuMemcpy(CUcontext c, CUdeviceptr d, CUdeviceptr s, size_t n) { WITH_CTX(c); return CALL(cuMemcpy, d, s, n); }
CUresult mc_cuMemcpyAsync(CUcontext c, CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) { WITH_CTX(c); return CALL(cuMemcpyAsync, d, s, n, st); }
CUresult mc_cuMemcpyHtoD(CUcontext c, CUdeviceptr d, uintptr_t s, size_t n) { WITH_CTX(c); return CALL(cuMemcpyHtoD, d, (const void *)s, n); }
CUresult mc_cuMemcpyDtoH(CUcontext c, uintptr_t d, CUdeviceptr s, size_t n) { WITH_CTX(c); return CALL(cuMemcpyDtoH, (void *)d, s, n); }
CUresult mc_cuMemcpyDtoD(CUcontext c, CUdeviceptr d, CUdeviceptr s, size_t n) { WITH_CTX(c); return CALL(cuMemcpyDtoD, d, s, n); }
CUresult mc_cuMemcpyHtoDAsync(CUcontext c, CUdeviceptr d, uintptr_t s, size_t n, CUstream st) { WITH_CTX(c); return CALL(cuMemcpyHtoDAsync, d, (const void *)s, n, st); }
CUresult mc_cuMemcpyDtoHAsync(CUcontext c, uintptr_t d, CUdeviceptr s, size_t n, CUstream st) { WITH_CTX(c); return CALL(cuMemcpyDtoHAsync, (void *)d, s, n, st); }
CUresult mc_cuMemcpyDtoDAsync(CUcontext c, CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) { WITH_CTX(c); return CALL(cuMemcpyDtoDAsync, d, s, n, st); }
CUresult mc_cuMemcpy2DDtoDAsync(CUcontext c, CUdeviceptr d, size_t dp, CUdeviceptr s, size_t sp, size_t w, size_t h, CUstream st) {
	mc_CUDA_MEMCPY2D m = {0};
	m.srcMemoryType = m.dstMemoryType = 2; /* CU_MEMORYTYPE_DEVICE */
	m.srcDevice = s;
	m.srcPitch = sp;
	m.dstDevice = d;
	m.dstPitch = dp;
	m.WidthInBytes = w;
	m.Height = h;
	WITH_CTX(c);
	return CALL(cuMemcpy2DAsync, &m, st);
}
CUresult mc_cuMemcpyPeer(CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n) { WITH_CTX(sc); return CALL(cuMemcpyPeer, d, dc, s, sc, n); }
CUresult mc_cuMemcpyPeerAsync(CUcontext c, CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream st) { WITH_CTX(c); return CALL(cuMemcpyPeerAsync, d, dc, s, sc, n, st); }
CUresult mc_cuMemsetD8(CUcontext c, CUdeviceptr d, unsigned char v, size_t n) { WITH_CTX(c); return CALL(cuMemsetD8, d, v, n); }
CUresult mc_cuMemsetD8Async(CUcontext c, CUdeviceptr d, unsigned char v, size_t n, CUstream st) { WITH_CTX(c); return CALL(cuMemsetD8Async, d, v, n, st); }

CUresult mc_cuMemHostAlloc(CUcontext c, void **p, size_t n, unsigned int fl) { WITH_CTX(c); return CALL(cuMemHostAlloc, p, n, fl); }
CUresult mc_cuMemFreeHost(CUcontext c, void *p) { WITH_CTX(c); return CALL(cuMemFreeHost, p); }
CUresult mc_cuMemHostRegister(CUcontext c, uintptr_t p, size_t n, unsigned int fl) { WITH_CTX(c); return CALL(cuMemHostRegister, (void *)p, n, fl); }
CUresult mc_cuMemHostUnregister(CUcontext c, uintptr_t p) { WITH_CTX(c); return CALL(cuMemHostUnregister, (void *)p); }
CUresult mc_cuMemHostGetDevicePointer(CUcontext c, CUdeviceptr *d, uintptr_t p) { WITH_CTX(c); return CALL(cuMemHostGetDevicePointer, d, (void *)p, 0); }

static void mc_prop(mc_CUmemAllocationProp *prop, CUdevice d, int handle_types) {
	int rdma = 0;
	memset(prop, 0, sizeof(*prop));
	prop->type = 1;          /* CU_MEM_ALLOCATION_TYPE_PINNED */
	prop->location.type = 1; /* CU_MEM_LOCATION_TYPE_DEVICE */
	prop->location.id = d;
	prop->requestedHandleTypes = handle_types;
	/* A NIC may register the memory (GPUDirect RDMA through a dma-buf or
	 * peer memory) only if it was allocated so; devices that support that
	 * for VMM say so (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED). */
	if (mc_cu.cuDeviceGetAttribute && mc_cu.cuDeviceGetAttribute(&rdma, 110, d) == MC_CUDA_SUCCESS && rdma)
		prop->allocFlags.gpuDirectRDMACapable = 1;
}

CUresult mc_cuMemGetAllocationGranularity(size_t *g, CUdevice d, int ht, int option) {
	mc_CUmemAllocationProp prop;
	mc_prop(&prop, d, ht);
	return CALL(cuMemGetAllocationGranularity, g, &prop, option);
}
CUresult mc_cuMemCreate(CUcontext c, CUmemGenericAllocationHandle *h, size_t n, CUdevice d, int ht) {
	mc_CUmemAllocationProp prop;
	WITH_CTX(c);
	mc_prop(&prop, d, ht);
	return CALL(cuMemCreate, h, n, &prop, 0);
}
CUresult mc_cuMemRelease(CUmemGenericAllocationHandle h) { return CALL(cuMemRelease, h); }
CUresult mc_cuMemAddressReserve(CUcontext c, CUdeviceptr *p, size_t n, size_t align) { WITH_CTX(c); return CALL(cuMemAddressReserve, p, n, align, 0, 0); }
CUresult mc_cuMemAddressFree(CUdeviceptr p, size_t n) { return CALL(cuMemAddressFree, p, n); }
CUresult mc_cuMemMap(CUcontext c, CUdeviceptr p, size_t n, size_t off, CUmemGenericAllocationHandle h) { WITH_CTX(c); return CALL(cuMemMap, p, n, off, h, 0); }
CUresult mc_cuMemUnmap(CUdeviceptr p, size_t n) { return CALL(cuMemUnmap, p, n); }
CUresult mc_cuMemSetAccess(CUcontext c, CUdeviceptr p, size_t n, const int *devices, int nd) {
	mc_CUmemAccessDesc desc[64];
	int i;
	if (nd <= 0 || nd > 64) return 1; /* CUDA_ERROR_INVALID_VALUE */
	WITH_CTX(c);
	memset(desc, 0, sizeof(desc));
	for (i = 0; i < nd; i++) {
		desc[i].location.type = 1; /* device */
		desc[i].location.id = devices[i];
		desc[i].flags = 3; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE */
	}
	return CALL(cuMemSetAccess, p, n, desc, (size_t)nd);
}
CUresult mc_cuMemExportFD(int *fd, CUmemGenericAllocationHandle h) {
	*fd = -1;
	return CALL(cuMemExportToShareableHandle, (void *)fd, h, 1 /* POSIX_FILE_DESCRIPTOR */, 0);
}
CUresult mc_cuMemExportFabric(mc_CUmemFabricHandle *out, CUmemGenericAllocationHandle h) {
	return CALL(cuMemExportToShareableHandle, (void *)out, h, 8 /* FABRIC */, 0);
}
CUresult mc_cuMemImportFD(CUcontext c, CUmemGenericAllocationHandle *h, int fd) {
	WITH_CTX(c);
	return CALL(cuMemImportFromShareableHandle, h, (void *)(uintptr_t)fd, 1);
}
CUresult mc_cuMemImportFabric(CUcontext c, CUmemGenericAllocationHandle *h, const mc_CUmemFabricHandle *in) {
	WITH_CTX(c);
	return CALL(cuMemImportFromShareableHandle, h, (void *)in, 8);
}
/* The range must be aligned to the host page size. */
CUresult mc_cuMemGetDmabufFD(CUcontext c, int *fd, CUdeviceptr p, size_t n) {
	*fd = -1;
	WITH_CTX(c);
	return CALL(cuMemGetHandleForAddressRange, (void *)fd, p, n, 1 /* CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD */, 0);
}

CUresult mc_cuIpcGetMemHandle(CUcontext c, mc_CUipcMemHandle *h, CUdeviceptr p) { WITH_CTX(c); return CALL(cuIpcGetMemHandle, h, p); }
CUresult mc_cuIpcOpenMemHandle(CUcontext c, CUdeviceptr *p, const mc_CUipcMemHandle *h, unsigned int fl) { WITH_CTX(c); return CALL(cuIpcOpenMemHandle, p, *h, fl); }
CUresult mc_cuIpcCloseMemHandle(CUcontext c, CUdeviceptr p) { WITH_CTX(c); return CALL(cuIpcCloseMemHandle, p); }

CUresult mc_cuPointerGetAttributeU64(CUcontext c, unsigned long long *v, int attr, CUdeviceptr p) {
	unsigned long long buf[2] = {0, 0};
	CUresult r;
	WITH_CTX(c);
	r = CALL(cuPointerGetAttribute, (void *)buf, attr, p);
	*v = buf[0];
	return r;
}

CUresult mc_cuModuleLoadData(CUcontext c, CUmodule *m, const void *img) { WITH_CTX(c); return CALL(cuModuleLoadData, m, img); }
CUresult mc_cuModuleUnload(CUcontext c, CUmodule m) { WITH_CTX(c); return CALL(cuModuleUnload, m); }
CUresult mc_cuModuleGetFunction(CUcontext c, CUfunction *f, CUmodule m, const char *n) { WITH_CTX(c); return CALL(cuModuleGetFunction, f, m, n); }
CUresult mc_cuFuncSetAttribute(CUcontext c, CUfunction f, int a, int v) { WITH_CTX(c); return CALL(cuFuncSetAttribute, f, a, v); }
CUresult mc_cuFuncGetAttribute(CUcontext c, int *v, int a, CUfunction f) { WITH_CTX(c); return CALL(cuFuncGetAttribute, v, a, f); }

#define MC_MAX_KERNEL_ARGS 64
CUresult mc_cuLaunchKernel(CUcontext c, CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                           unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                           CUstream s, unsigned char *args, const unsigned int *offsets, int nargs) {
	void *params[MC_MAX_KERNEL_ARGS];
	int i;
	if (nargs < 0 || nargs > MC_MAX_KERNEL_ARGS) return 1; /* CUDA_ERROR_INVALID_VALUE */
	WITH_CTX(c);
	for (i = 0; i < nargs; i++) params[i] = args + offsets[i];
	return CALL(cuLaunchKernel, f, gx, gy, gz, bx, by, bz, shmem, s, nargs ? params : NULL, NULL);
}

#define MC_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION 6
CUresult mc_cuLaunchKernelPDL(CUcontext c, CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                              unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                              CUstream s, unsigned char *args, const unsigned int *offsets, int nargs) {
	void *params[MC_MAX_KERNEL_ARGS];
	mc_CUlaunchAttribute attr;
	mc_CUlaunchConfig cfg;
	int i;
	if (nargs < 0 || nargs > MC_MAX_KERNEL_ARGS) return 1; /* CUDA_ERROR_INVALID_VALUE */
	WITH_CTX(c);
	for (i = 0; i < nargs; i++) params[i] = args + offsets[i];
	memset(&attr, 0, sizeof attr);
	attr.id = MC_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
	attr.value.i = 1;
	memset(&cfg, 0, sizeof cfg);
	cfg.gridDimX = gx, cfg.gridDimY = gy, cfg.gridDimZ = gz;
	cfg.blockDimX = bx, cfg.blockDimY = by, cfg.blockDimZ = bz;
	cfg.sharedMemBytes = shmem;
	cfg.hStream = s;
	cfg.attrs = &attr;
	cfg.numAttrs = 1;
	return CALL(cuLaunchKernelEx, &cfg, f, nargs ? params : NULL, NULL);
}

CUresult mc_cuStreamBeginCapture(CUcontext c, CUstream s, int mode) { WITH_CTX(c); return CALL(cuStreamBeginCapture, s, mode); }
CUresult mc_cuStreamEndCapture(CUcontext c, CUstream s, CUgraph *g) {
	*g = NULL;
	WITH_CTX(c);
	return CALL(cuStreamEndCapture, s, g);
}
CUresult mc_cuStreamIsCapturing(CUcontext c, CUstream s, int *status) {
	*status = 0;
	WITH_CTX(c);
	return CALL(cuStreamIsCapturing, s, status);
}
CUresult mc_cuGraphInstantiate(CUcontext c, CUgraphExec *e, CUgraph g, unsigned long long fl) {
	*e = NULL;
	WITH_CTX(c);
	return CALL(cuGraphInstantiateWithFlags, e, g, fl);
}
CUresult mc_cuGraphUpload(CUcontext c, CUgraphExec e, CUstream s) { WITH_CTX(c); return CALL(cuGraphUpload, e, s); }
CUresult mc_cuGraphLaunch(CUcontext c, CUgraphExec e, CUstream s) { WITH_CTX(c); return CALL(cuGraphLaunch, e, s); }
CUresult mc_cuGraphExecUpdate(CUcontext c, CUgraphExec e, CUgraph g, int *reason) {
	mc_CUgraphExecUpdateResultInfo info;
	CUresult r;
	memset(&info, 0, sizeof(info));
	*reason = 0;
	WITH_CTX(c);
	r = CALL(cuGraphExecUpdate, e, g, &info);
	*reason = info.result;
	return r;
}
CUresult mc_cuGraphExecDestroy(CUcontext c, CUgraphExec e) { WITH_CTX(c); return CALL(cuGraphExecDestroy, e); }
CUresult mc_cuGraphDestroy(CUcontext c, CUgraph g) { WITH_CTX(c); return CALL(cuGraphDestroy, g); }
CUresult mc_cuGraphNodeCount(CUcontext c, CUgraph g, size_t *n) {
	*n = 0;
	WITH_CTX(c);
	return CALL(cuGraphGetNodes, g, NULL, n);
}
