// cuda_shim.h: the subset of the CUDA driver API that mooncake-go uses,
// declared here because no CUDA headers exist on the build machines, and a
// table of function pointers filled with dlsym from libcuda.so.1 at run time.
//
// Types and values follow the CUDA driver API (cuda.h, CUDA 12/13 ABI).
#ifndef MOONCAKE_CUDA_SHIM_H
#define MOONCAKE_CUDA_SHIM_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUgraphNode_st *CUgraphNode;

#define MC_CUDA_SUCCESS 0
#define MC_CUDA_ERROR_NOT_INITIALIZED 3
#define MC_CUDA_ERROR_SYMBOL_NOT_FOUND 302 /* CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND */
#define MC_CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED 704

/* CUmemLocation */
typedef struct {
	int type; /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
	int id;
} mc_CUmemLocation;

/* CUmemAllocationProp (32 bytes) */
typedef struct {
	int type;                 /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
	int requestedHandleTypes; /* POSIX_FD = 1, FABRIC = 8 */
	mc_CUmemLocation location;
	void *win32HandleMetaData;
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} mc_CUmemAllocationProp;

/* CUmemAccessDesc */
typedef struct {
	mc_CUmemLocation location;
	int flags; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} mc_CUmemAccessDesc;

/* CUDA_MEMCPY2D (the _v2 ABI) */
typedef struct {
	size_t srcXInBytes, srcY;
	int srcMemoryType; /* CU_MEMORYTYPE_DEVICE = 2 */
	const void *srcHost;
	CUdeviceptr srcDevice;
	void *srcArray;
	size_t srcPitch;
	size_t dstXInBytes, dstY;
	int dstMemoryType;
	void *dstHost;
	CUdeviceptr dstDevice;
	void *dstArray;
	size_t dstPitch;
	size_t WidthInBytes, Height;
} mc_CUDA_MEMCPY2D;

/* CUgraphExecUpdateResultInfo (CUDA 12+) */
typedef struct {
	int result; /* CUgraphExecUpdateResult */
	CUgraphNode errorNode;
	CUgraphNode errorFromNode;
} mc_CUgraphExecUpdateResultInfo;

/* CUmemFabricHandle and CUipcMemHandle: 64 opaque bytes each. */
/* CUlaunchAttribute and CUlaunchConfig (cuda.h, CUDA 12): the value is a
 * 64-byte union at offset 8. */
typedef struct {
	int id;
	char pad[4];
	union {
		char pad[64];
		long long align;
		int i;
	} value;
} mc_CUlaunchAttribute;
typedef struct {
	unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
	CUstream hStream;
	mc_CUlaunchAttribute *attrs;
	unsigned int numAttrs;
} mc_CUlaunchConfig;

typedef struct { unsigned char data[64]; } mc_CUmemFabricHandle;
typedef struct { char reserved[64]; } mc_CUipcMemHandle;

/* The table of driver entry points. NULL means the driver lacks the symbol;
 * the wrappers then return MC_CUDA_ERROR_SYMBOL_NOT_FOUND. */
typedef struct {
	CUresult (*cuInit)(unsigned int);
	CUresult (*cuDriverGetVersion)(int *);
	CUresult (*cuGetErrorName)(CUresult, const char **);
	CUresult (*cuGetErrorString)(CUresult, const char **);

	CUresult (*cuDeviceGetCount)(int *);
	CUresult (*cuDeviceGet)(CUdevice *, int);
	CUresult (*cuDeviceGetName)(char *, int, CUdevice);
	CUresult (*cuDeviceGetAttribute)(int *, int, CUdevice);
	CUresult (*cuDeviceTotalMem)(size_t *, CUdevice);
	CUresult (*cuDeviceGetPCIBusId)(char *, int, CUdevice);
	CUresult (*cuDeviceCanAccessPeer)(int *, CUdevice, CUdevice);

	CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
	CUresult (*cuCtxSetCurrent)(CUcontext);
	CUresult (*cuCtxGetCurrent)(CUcontext *);
	CUresult (*cuCtxSynchronize)(void);
	CUresult (*cuCtxEnablePeerAccess)(CUcontext, unsigned int);
	CUresult (*cuMemGetInfo)(size_t *, size_t *);

	CUresult (*cuStreamCreate)(CUstream *, unsigned int);
	CUresult (*cuStreamDestroy)(CUstream);
	CUresult (*cuStreamSynchronize)(CUstream);
	CUresult (*cuStreamQuery)(CUstream);
	CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned int);

	CUresult (*cuEventCreate)(CUevent *, unsigned int);
	CUresult (*cuEventDestroy)(CUevent);
	CUresult (*cuEventRecord)(CUevent, CUstream);
	CUresult (*cuEventSynchronize)(CUevent);
	CUresult (*cuEventQuery)(CUevent);
	CUresult (*cuEventElapsedTime)(float *, CUevent, CUevent);

	CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
	CUresult (*cuMemFree)(CUdeviceptr);
	CUresult (*cuMemcpy)(CUdeviceptr, CUdeviceptr, size_t);
	CUresult (*cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
	CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
	CUresult (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
	CUresult (*cuMemcpyDtoD)(CUdeviceptr, CUdeviceptr, size_t);
	CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
	CUresult (*cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
	CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
	CUresult (*cuMemcpy2DAsync)(const mc_CUDA_MEMCPY2D *, CUstream);
	CUresult (*cuMemcpyPeer)(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t);
	CUresult (*cuMemcpyPeerAsync)(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t, CUstream);
	CUresult (*cuMemsetD8)(CUdeviceptr, unsigned char, size_t);
	CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);

	CUresult (*cuMemHostAlloc)(void **, size_t, unsigned int);
	CUresult (*cuMemFreeHost)(void *);
	CUresult (*cuMemHostRegister)(void *, size_t, unsigned int);
	CUresult (*cuMemHostUnregister)(void *);
	CUresult (*cuMemHostGetDevicePointer)(CUdeviceptr *, void *, unsigned int);

	CUresult (*cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const mc_CUmemAllocationProp *, unsigned long long);
	CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
	CUresult (*cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
	CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
	CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
	CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
	CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const mc_CUmemAccessDesc *, size_t);
	CUresult (*cuMemGetAllocationGranularity)(size_t *, const mc_CUmemAllocationProp *, int);
	CUresult (*cuMemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, int, unsigned long long);
	CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, int);
	/* Optional (CUDA 11.7+): a dma-buf fd for a mapped range. */
	CUresult (*cuMemGetHandleForAddressRange)(void *, CUdeviceptr, size_t, int /* CUmemRangeHandleType */, unsigned long long);

	CUresult (*cuIpcGetMemHandle)(mc_CUipcMemHandle *, CUdeviceptr);
	CUresult (*cuIpcOpenMemHandle)(CUdeviceptr *, mc_CUipcMemHandle, unsigned int);
	CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);

	CUresult (*cuPointerGetAttribute)(void *, int, CUdeviceptr);

	CUresult (*cuModuleLoadData)(CUmodule *, const void *);
	CUresult (*cuModuleUnload)(CUmodule);
	CUresult (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
	CUresult (*cuFuncSetAttribute)(CUfunction, int, int);
	CUresult (*cuFuncGetAttribute)(int *, int, CUfunction);
	CUresult (*cuLaunchKernel)(CUfunction, unsigned int, unsigned int, unsigned int,
	                           unsigned int, unsigned int, unsigned int, unsigned int,
	                           CUstream, void **, void **);
	/* Optional (CUDA 12+): launches with attributes. */
	CUresult (*cuLaunchKernelEx)(const mc_CUlaunchConfig *, CUfunction, void **, void **);

	/* CUDA graphs (optional: a driver without them still binds). */
	CUresult (*cuStreamBeginCapture)(CUstream, int /* CUstreamCaptureMode */); /* cuStreamBeginCapture_v2 */
	CUresult (*cuStreamEndCapture)(CUstream, CUgraph *);
	CUresult (*cuStreamIsCapturing)(CUstream, int * /* CUstreamCaptureStatus */);
	CUresult (*cuGraphInstantiateWithFlags)(CUgraphExec *, CUgraph, unsigned long long);
	CUresult (*cuGraphUpload)(CUgraphExec, CUstream);
	CUresult (*cuGraphLaunch)(CUgraphExec, CUstream);
	CUresult (*cuGraphExecUpdate)(CUgraphExec, CUgraph, mc_CUgraphExecUpdateResultInfo *); /* cuGraphExecUpdate_v2 */
	CUresult (*cuGraphExecDestroy)(CUgraphExec);
	CUresult (*cuGraphDestroy)(CUgraph);
	CUresult (*cuGraphGetNodes)(CUgraph, CUgraphNode *, size_t *);
} mc_cuda_table;

/* Fills the table from a dlopen handle of libcuda. Returns 0, or -1 with the
 * name of the first missing required symbol copied into missing. */
int mc_cuda_bind(void *lib, char *missing, int missing_len);

/* Wrappers. Those taking a CUcontext make it current on the calling thread
 * first (Go moves goroutines between threads). */
CUresult mc_cuInit(void);
CUresult mc_cuDriverGetVersion(int *v);
const char *mc_cuErrorName(CUresult r);
const char *mc_cuErrorString(CUresult r);

CUresult mc_cuDeviceGetCount(int *n);
CUresult mc_cuDeviceGet(CUdevice *d, int ordinal);
CUresult mc_cuDeviceGetName(char *buf, int len, CUdevice d);
CUresult mc_cuDeviceGetAttribute(int *v, int attr, CUdevice d);
CUresult mc_cuDeviceTotalMem(size_t *v, CUdevice d);
CUresult mc_cuDeviceGetPCIBusId(char *buf, int len, CUdevice d);
CUresult mc_cuDeviceCanAccessPeer(int *v, CUdevice d, CUdevice peer);

CUresult mc_cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d);
CUresult mc_cuDevicePrimaryCtxRelease(CUdevice d);
CUresult mc_cuCtxSetCurrent(CUcontext c);
CUresult mc_cuCtxSynchronize(CUcontext c);
CUresult mc_cuCtxEnablePeerAccess(CUcontext c, CUcontext peer);
CUresult mc_cuMemGetInfo(CUcontext c, size_t *free_b, size_t *total_b);

CUresult mc_cuStreamCreate(CUcontext c, CUstream *s, unsigned int flags);
CUresult mc_cuStreamDestroy(CUcontext c, CUstream s);
CUresult mc_cuStreamSynchronize(CUcontext c, CUstream s);
CUresult mc_cuStreamQuery(CUcontext c, CUstream s);
CUresult mc_cuStreamWaitEvent(CUcontext c, CUstream s, CUevent e);

CUresult mc_cuEventCreate(CUcontext c, CUevent *e, unsigned int flags);
CUresult mc_cuEventDestroy(CUcontext c, CUevent e);
CUresult mc_cuEventRecord(CUcontext c, CUevent e, CUstream s);
CUresult mc_cuEventSynchronize(CUcontext c, CUevent e);
CUresult mc_cuEventQuery(CUcontext c, CUevent e);
CUresult mc_cuEventElapsedTime(CUcontext c, float *ms, CUevent start, CUevent end);

CUresult mc_cuMemAlloc(CUcontext c, CUdeviceptr *p, size_t n);
CUresult mc_cuMemFree(CUcontext c, CUdeviceptr p);
CUresult mc_cuMemcpy(CUcontext c, CUdeviceptr dst, CUdeviceptr src, size_t n);
CUresult mc_cuMemcpyAsync(CUcontext c, CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s);
CUresult mc_cuMemcpyHtoD(CUcontext c, CUdeviceptr dst, uintptr_t src, size_t n);
CUresult mc_cuMemcpyDtoH(CUcontext c, uintptr_t dst, CUdeviceptr src, size_t n);
CUresult mc_cuMemcpyDtoD(CUcontext c, CUdeviceptr dst, CUdeviceptr src, size_t n);
CUresult mc_cuMemcpyHtoDAsync(CUcontext c, CUdeviceptr dst, uintptr_t src, size_t n, CUstream s);
CUresult mc_cuMemcpyDtoHAsync(CUcontext c, uintptr_t dst, CUdeviceptr src, size_t n, CUstream s);
CUresult mc_cuMemcpyDtoDAsync(CUcontext c, CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s);
CUresult mc_cuMemcpy2DDtoDAsync(CUcontext c, CUdeviceptr dst, size_t dpitch, CUdeviceptr src, size_t spitch, size_t width, size_t height, CUstream s);
CUresult mc_cuMemcpyPeer(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx, size_t n);
CUresult mc_cuMemcpyPeerAsync(CUcontext c, CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx, size_t n, CUstream s);
CUresult mc_cuMemsetD8(CUcontext c, CUdeviceptr dst, unsigned char v, size_t n);
CUresult mc_cuMemsetD8Async(CUcontext c, CUdeviceptr dst, unsigned char v, size_t n, CUstream s);

CUresult mc_cuMemHostAlloc(CUcontext c, void **p, size_t n, unsigned int flags);
CUresult mc_cuMemFreeHost(CUcontext c, void *p);
CUresult mc_cuMemHostRegister(CUcontext c, uintptr_t p, size_t n, unsigned int flags);
CUresult mc_cuMemHostUnregister(CUcontext c, uintptr_t p);
CUresult mc_cuMemHostGetDevicePointer(CUcontext c, CUdeviceptr *d, uintptr_t p);

CUresult mc_cuMemGetAllocationGranularity(size_t *g, CUdevice d, int handle_types, int option);
CUresult mc_cuMemCreate(CUcontext c, CUmemGenericAllocationHandle *h, size_t n, CUdevice d, int handle_types);
CUresult mc_cuMemRelease(CUmemGenericAllocationHandle h);
CUresult mc_cuMemAddressReserve(CUcontext c, CUdeviceptr *p, size_t n, size_t align);
CUresult mc_cuMemAddressFree(CUdeviceptr p, size_t n);
CUresult mc_cuMemMap(CUcontext c, CUdeviceptr p, size_t n, size_t offset, CUmemGenericAllocationHandle h);
CUresult mc_cuMemUnmap(CUdeviceptr p, size_t n);
CUresult mc_cuMemSetAccess(CUcontext c, CUdeviceptr p, size_t n, const int *devices, int ndevices);
CUresult mc_cuMemExportFD(int *fd, CUmemGenericAllocationHandle h);
CUresult mc_cuMemExportFabric(mc_CUmemFabricHandle *out, CUmemGenericAllocationHandle h);
CUresult mc_cuMemImportFD(CUcontext c, CUmemGenericAllocationHandle *h, int fd);
CUresult mc_cuMemImportFabric(CUcontext c, CUmemGenericAllocationHandle *h, const mc_CUmemFabricHandle *in);
CUresult mc_cuMemGetDmabufFD(CUcontext c, int *fd, CUdeviceptr p, size_t n);

CUresult mc_cuIpcGetMemHandle(CUcontext c, mc_CUipcMemHandle *h, CUdeviceptr p);
CUresult mc_cuIpcOpenMemHandle(CUcontext c, CUdeviceptr *p, const mc_CUipcMemHandle *h, unsigned int flags);
CUresult mc_cuIpcCloseMemHandle(CUcontext c, CUdeviceptr p);

CUresult mc_cuPointerGetAttributeU64(CUcontext c, unsigned long long *v, int attr, CUdeviceptr p);

CUresult mc_cuModuleLoadData(CUcontext c, CUmodule *m, const void *image);
CUresult mc_cuModuleUnload(CUcontext c, CUmodule m);
CUresult mc_cuModuleGetFunction(CUcontext c, CUfunction *f, CUmodule m, const char *name);
CUresult mc_cuFuncSetAttribute(CUcontext c, CUfunction f, int attr, int v);
CUresult mc_cuFuncGetAttribute(CUcontext c, int *v, int attr, CUfunction f);
/* args: packed parameter bytes; offsets[i] is where parameter i starts. */
CUresult mc_cuLaunchKernel(CUcontext c, CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                           unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                           CUstream s, unsigned char *args, const unsigned int *offsets, int nargs);
/* mc_cuLaunchKernelPDL: mc_cuLaunchKernel with programmatic stream
 * serialization allowed (cuLaunchKernelEx; MC_CUDA_ERROR_SYMBOL_NOT_FOUND when
 * the driver lacks it). */
CUresult mc_cuLaunchKernelPDL(CUcontext c, CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                              unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                              CUstream s, unsigned char *args, const unsigned int *offsets, int nargs);

CUresult mc_cuStreamBeginCapture(CUcontext c, CUstream s, int mode);
/* On failure *g may still be set (an invalidated capture's graph): destroy it. */
CUresult mc_cuStreamEndCapture(CUcontext c, CUstream s, CUgraph *g);
CUresult mc_cuStreamIsCapturing(CUcontext c, CUstream s, int *status);
CUresult mc_cuGraphInstantiate(CUcontext c, CUgraphExec *e, CUgraph g, unsigned long long flags);
CUresult mc_cuGraphUpload(CUcontext c, CUgraphExec e, CUstream s);
CUresult mc_cuGraphLaunch(CUcontext c, CUgraphExec e, CUstream s);
/* *reason: the CUgraphExecUpdateResult (0 on success). */
CUresult mc_cuGraphExecUpdate(CUcontext c, CUgraphExec e, CUgraph g, int *reason);
CUresult mc_cuGraphExecDestroy(CUcontext c, CUgraphExec e);
CUresult mc_cuGraphDestroy(CUcontext c, CUgraph g);
CUresult mc_cuGraphNodeCount(CUcontext c, CUgraph g, size_t *n);

#endif
