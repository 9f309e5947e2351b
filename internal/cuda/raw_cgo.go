//go:build cgo

package cuda

/*
#cgo CFLAGS: -I${SRCDIR}/../../csrc -O2
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "cuda_shim.h"
*/
import "C"

import (
	"fmt"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/internal/dl"
)

// The raw layer: one Go function per C wrapper, Go types in and out. The
// public API (untagged files) is written against it; raw_nocgo.go is its
// twin for CGO_ENABLED=0.

const cgoEnabled = true

func bindDriver(lib *dl.Handle) error {
	var missing [128]C.char
	if C.mc_cuda_bind(lib.Raw(), &missing[0], C.int(len(missing))) != 0 {
		return fmt.Errorf("%w (libcuda.so.1: missing symbol %s)", ErrNoDriver, C.GoString(&missing[0]))
	}
	return nil
}

func r(x C.CUresult) Result { return Result(x) }

func driverErrorName(res Result) string {
	if !driverBound() {
		return ""
	}
	p := C.mc_cuErrorName(C.CUresult(res))
	if p == nil {
		return ""
	}
	return C.GoString(p)
}

func driverErrorString(res Result) string {
	if !driverBound() {
		return ""
	}
	p := C.mc_cuErrorString(C.CUresult(res))
	if p == nil {
		return ""
	}
	return C.GoString(p)
}

func cuInit() Result { return r(C.mc_cuInit()) }
func cuDriverGetVersion() (int, Result) {
	var v C.int
	res := r(C.mc_cuDriverGetVersion(&v))
	return int(v), res
}
func cuDeviceGetCount() (int, Result) {
	var v C.int
	res := r(C.mc_cuDeviceGetCount(&v))
	return int(v), res
}
func cuDeviceGet(ordinal int) (int, Result) {
	var d C.CUdevice
	res := r(C.mc_cuDeviceGet(&d, C.int(ordinal)))
	return int(d), res
}
func cuDeviceGetName(d Device) (string, Result) {
	var buf [256]C.char
	res := r(C.mc_cuDeviceGetName(&buf[0], C.int(len(buf)), C.CUdevice(d)))
	return C.GoString(&buf[0]), res
}
func cuDeviceGetAttribute(a DeviceAttribute, d Device) (int, Result) {
	var v C.int
	res := r(C.mc_cuDeviceGetAttribute(&v, C.int(a), C.CUdevice(d)))
	return int(v), res
}
func cuDeviceTotalMem(d Device) (uint64, Result) {
	var v C.size_t
	res := r(C.mc_cuDeviceTotalMem(&v, C.CUdevice(d)))
	return uint64(v), res
}
func cuDeviceGetPCIBusId(d Device) (string, Result) {
	var buf [64]C.char
	res := r(C.mc_cuDeviceGetPCIBusId(&buf[0], C.int(len(buf)), C.CUdevice(d)))
	return C.GoString(&buf[0]), res
}
func cuDeviceCanAccessPeer(d, peer Device) (bool, Result) {
	var v C.int
	res := r(C.mc_cuDeviceCanAccessPeer(&v, C.CUdevice(d), C.CUdevice(peer)))
	return v != 0, res
}

func cuDevicePrimaryCtxRetain(d Device) (unsafe.Pointer, Result) {
	var c C.CUcontext
	res := r(C.mc_cuDevicePrimaryCtxRetain(&c, C.CUdevice(d)))
	return unsafe.Pointer(c), res
}
func cuDevicePrimaryCtxRelease(d Device) Result {
	return r(C.mc_cuDevicePrimaryCtxRelease(C.CUdevice(d)))
}
func cuCtxSetCurrent(c unsafe.Pointer) Result  { return r(C.mc_cuCtxSetCurrent(C.CUcontext(c))) }
func cuCtxSynchronize(c unsafe.Pointer) Result { return r(C.mc_cuCtxSynchronize(C.CUcontext(c))) }
func cuCtxEnablePeerAccess(c, peer unsafe.Pointer) Result {
	return r(C.mc_cuCtxEnablePeerAccess(C.CUcontext(c), C.CUcontext(peer)))
}
func cuMemGetInfo(c unsafe.Pointer) (free, total uint64, res Result) {
	var f, t C.size_t
	res = r(C.mc_cuMemGetInfo(C.CUcontext(c), &f, &t))
	return uint64(f), uint64(t), res
}

func cuStreamCreate(c unsafe.Pointer, flags uint) (unsafe.Pointer, Result) {
	var s C.CUstream
	res := r(C.mc_cuStreamCreate(C.CUcontext(c), &s, C.uint(flags)))
	return unsafe.Pointer(s), res
}
func cuStreamDestroy(c, s unsafe.Pointer) Result {
	return r(C.mc_cuStreamDestroy(C.CUcontext(c), C.CUstream(s)))
}
func cuStreamSynchronize(c, s unsafe.Pointer) Result {
	return r(C.mc_cuStreamSynchronize(C.CUcontext(c), C.CUstream(s)))
}
func cuStreamQuery(c, s unsafe.Pointer) Result {
	return r(C.mc_cuStreamQuery(C.CUcontext(c), C.CUstream(s)))
}
func cuStreamWaitEvent(c, s, e unsafe.Pointer) Result {
	return r(C.mc_cuStreamWaitEvent(C.CUcontext(c), C.CUstream(s), C.CUevent(e)))
}

func cuEventCreate(c unsafe.Pointer, flags uint) (unsafe.Pointer, Result) {
	var e C.CUevent
	res := r(C.mc_cuEventCreate(C.CUcontext(c), &e, C.uint(flags)))
	return unsafe.Pointer(e), res
}
func cuEventDestroy(c, e unsafe.Pointer) Result {
	return r(C.mc_cuEventDestroy(C.CUcontext(c), C.CUevent(e)))
}
func cuEventRecord(c, e, s unsafe.Pointer) Result {
	return r(C.mc_cuEventRecord(C.CUcontext(c), C.CUevent(e), C.CUstream(s)))
}
func cuEventSynchronize(c, e unsafe.Pointer) Result {
	return r(C.mc_cuEventSynchronize(C.CUcontext(c), C.CUevent(e)))
}
func cuEventQuery(c, e unsafe.Pointer) Result {
	return r(C.mc_cuEventQuery(C.CUcontext(c), C.CUevent(e)))
}
func cuEventElapsedTime(c, start, end unsafe.Pointer) (float32, Result) {
	var ms C.float
	res := r(C.mc_cuEventElapsedTime(C.CUcontext(c), &ms, C.CUevent(start), C.CUevent(end)))
	return float32(ms), res
}

func cuMemAlloc(c unsafe.Pointer, n uint64) (DevicePtr, Result) {
	var p C.CUdeviceptr
	res := r(C.mc_cuMemAlloc(C.CUcontext(c), &p, C.size_t(n)))
	return DevicePtr(p), res
}
func cuMemFree(c unsafe.Pointer, p DevicePtr) Result {
	return r(C.mc_cuMemFree(C.CUcontext(c), C.CUdeviceptr(p)))
}
func cuMemcpy(c unsafe.Pointer, dst, src DevicePtr, n uint64) Result {
	return r(C.mc_cuMemcpy(C.CUcontext(c), C.CUdeviceptr(dst), C.CUdeviceptr(src), C.size_t(n)))
}
func cuMemcpyAsync(c unsafe.Pointer, dst, src DevicePtr, n uint64, s unsafe.Pointer) Result {
	return r(C.mc_cuMemcpyAsync(C.CUcontext(c), C.CUdeviceptr(dst), C.CUdeviceptr(src), C.size_t(n), C.CUstream(s)))
}
func cuMemcpyHtoD(c unsafe.Pointer, dst DevicePtr, src uintptr, n uint64) Result {
	return r(C.mc_cuMemcpyHtoD(C.CUcontext(c), C.CUdeviceptr(dst), C.uintptr_t(src), C.size_t(n)))
}
func cuMemcpyDtoH(c unsafe.Pointer, dst uintptr, src DevicePtr, n uint64) Result {
	return r(C.mc_cuMemcpyDtoH(C.CUcontext(c), C.uintptr_t(dst), C.CUdeviceptr(src), C.size_t(n)))
}
func cuMemcpyDtoD(c unsafe.Pointer, dst, src DevicePtr, n uint64) Result {
	return r(C.mc_cuMemcpyDtoD(C.CUcontext(c), C.CUdeviceptr(dst), C.CUdeviceptr(src), C.size_t(n)))
}
func cuMemcpyHtoDAsync(c unsafe.Pointer, dst DevicePtr, src uintptr, n uint64, s unsafe.Pointer) Result {
	return r(C.mc_cuMemcpyHtoDAsync(C.CUcontext(c), C.CUdeviceptr(dst), C.uintptr_t(src), C.size_t(n), C.CUstream(s)))
}
func cuMemcpyDtoHAsync(c unsafe.Pointer, dst uintptr, src DevicePtr, n uint64, s unsafe.Pointer) Result {
	return r(C.mc_cuMemcpyDtoHAsync(C.CUcontext(c), C.uintptr_t(dst), C.CUdeviceptr(src), C.size_t(n), C.CUstream(s)))
}
func cuMemcpyDtoDAsync(c unsafe.Pointer, dst, src DevicePtr, n uint64, s unsafe.Pointer) Result {
	return r(C.mc_cuMemcpyDtoDAsync(C.CUcontext(c), C.CUdeviceptr(dst), C.CUdeviceptr(src), C.size_t(n), C.CUstream(s)))
}
func cuMemcpy2DDtoDAsync(c unsafe.Pointer, dst DevicePtr, dpitch uint64, src DevicePtr, spitch, width, height uint64, s unsafe.Pointer) Result {
	return r(C.mc_cuMemcpy2DDtoDAsync(C.CUcontext(c), C.CUdeviceptr(dst), C.size_t(dpitch), C.CUdeviceptr(src), C.size_t(spitch),
		C.size_t(width), C.size_t(height), C.CUstream(s)))
}
func cuMemcpyPeer(dst DevicePtr, dctx unsafe.Pointer, src DevicePtr, sctx unsafe.Pointer, n uint64) Result {
	return r(C.mc_cuMemcpyPeer(C.CUdeviceptr(dst), C.CUcontext(dctx), C.CUdeviceptr(src), C.CUcontext(sctx), C.size_t(n)))
}
func cuMemcpyPeerAsync(c unsafe.Pointer, dst DevicePtr, dctx unsafe.Pointer, src DevicePtr, sctx unsafe.Pointer, n uint64, s unsafe.Pointer) Result {
	return r(C.mc_cuMemcpyPeerAsync(C.CUcontext(c), C.CUdeviceptr(dst), C.CUcontext(dctx), C.CUdeviceptr(src), C.CUcontext(sctx), C.size_t(n), C.CUstream(s)))
}
func cuMemsetD8(c unsafe.Pointer, dst DevicePtr, v byte, n uint64) Result {
	return r(C.mc_cuMemsetD8(C.CUcontext(c), C.CUdeviceptr(dst), C.uchar(v), C.size_t(n)))
}
func cuMemsetD8Async(c unsafe.Pointer, dst DevicePtr, v byte, n uint64, s unsafe.Pointer) Result {
	return r(C.mc_cuMemsetD8Async(C.CUcontext(c), C.CUdeviceptr(dst), C.uchar(v), C.size_t(n), C.CUstream(s)))
}

func cuMemHostAlloc(c unsafe.Pointer, n uint64, flags uint) (unsafe.Pointer, Result) {
	var p unsafe.Pointer
	res := r(C.mc_cuMemHostAlloc(C.CUcontext(c), &p, C.size_t(n), C.uint(flags)))
	return p, res
}
func cuMemFreeHost(c, p unsafe.Pointer) Result { return r(C.mc_cuMemFreeHost(C.CUcontext(c), p)) }
func cuMemHostRegister(c unsafe.Pointer, p uintptr, n uint64, flags uint) Result {
	return r(C.mc_cuMemHostRegister(C.CUcontext(c), C.uintptr_t(p), C.size_t(n), C.uint(flags)))
}
func cuMemHostUnregister(c unsafe.Pointer, p uintptr) Result {
	return r(C.mc_cuMemHostUnregister(C.CUcontext(c), C.uintptr_t(p)))
}
func cuMemHostGetDevicePointer(c unsafe.Pointer, p uintptr) (DevicePtr, Result) {
	var d C.CUdeviceptr
	res := r(C.mc_cuMemHostGetDevicePointer(C.CUcontext(c), &d, C.uintptr_t(p)))
	return DevicePtr(d), res
}

func cuMemGetAllocationGranularity(d Device, ht HandleType, recommended bool) (uint64, Result) {
	var g C.size_t
	opt := C.int(0)
	if recommended {
		opt = 1
	}
	res := r(C.mc_cuMemGetAllocationGranularity(&g, C.CUdevice(d), C.int(ht), opt))
	return uint64(g), res
}
func cuMemCreate(c unsafe.Pointer, n uint64, d Device, ht HandleType) (MemHandle, Result) {
	var h C.CUmemGenericAllocationHandle
	res := r(C.mc_cuMemCreate(C.CUcontext(c), &h, C.size_t(n), C.CUdevice(d), C.int(ht)))
	return MemHandle(h), res
}
func cuMemRelease(h MemHandle) Result { return r(C.mc_cuMemRelease(C.CUmemGenericAllocationHandle(h))) }
func cuMemAddressReserve(c unsafe.Pointer, n, align uint64) (DevicePtr, Result) {
	var p C.CUdeviceptr
	res := r(C.mc_cuMemAddressReserve(C.CUcontext(c), &p, C.size_t(n), C.size_t(align)))
	return DevicePtr(p), res
}
func cuMemAddressFree(p DevicePtr, n uint64) Result {
	return r(C.mc_cuMemAddressFree(C.CUdeviceptr(p), C.size_t(n)))
}
func cuMemMap(c unsafe.Pointer, p DevicePtr, n, off uint64, h MemHandle) Result {
	return r(C.mc_cuMemMap(C.CUcontext(c), C.CUdeviceptr(p), C.size_t(n), C.size_t(off), C.CUmemGenericAllocationHandle(h)))
}
func cuMemUnmap(p DevicePtr, n uint64) Result {
	return r(C.mc_cuMemUnmap(C.CUdeviceptr(p), C.size_t(n)))
}
func cuMemSetAccess(c unsafe.Pointer, p DevicePtr, n uint64, devs []Device) Result {
	if len(devs) == 0 || len(devs) > 64 {
		return ErrorInvalidValue
	}
	ids := make([]C.int, len(devs))
	for i, d := range devs {
		ids[i] = C.int(d)
	}
	return r(C.mc_cuMemSetAccess(C.CUcontext(c), C.CUdeviceptr(p), C.size_t(n), &ids[0], C.int(len(ids))))
}
func cuMemExportFD(h MemHandle) (int, Result) {
	var fd C.int
	res := r(C.mc_cuMemExportFD(&fd, C.CUmemGenericAllocationHandle(h)))
	return int(fd), res
}
func cuMemExportFabric(h MemHandle) (FabricHandle, Result) {
	var out C.mc_CUmemFabricHandle
	res := r(C.mc_cuMemExportFabric(&out, C.CUmemGenericAllocationHandle(h)))
	var fh FabricHandle
	copy(fh[:], C.GoBytes(unsafe.Pointer(&out.data[0]), 64))
	return fh, res
}
func cuMemGetDmabufFD(c unsafe.Pointer, p DevicePtr, n uint64) (int, Result) {
	var fd C.int
	res := r(C.mc_cuMemGetDmabufFD(C.CUcontext(c), &fd, C.CUdeviceptr(p), C.size_t(n)))
	return int(fd), res
}
func cuMemImportFD(c unsafe.Pointer, fd int) (MemHandle, Result) {
	var h C.CUmemGenericAllocationHandle
	res := r(C.mc_cuMemImportFD(C.CUcontext(c), &h, C.int(fd)))
	return MemHandle(h), res
}
func cuMemImportFabric(c unsafe.Pointer, fh FabricHandle) (MemHandle, Result) {
	var in C.mc_CUmemFabricHandle
	for i := range fh {
		in.data[i] = C.uchar(fh[i])
	}
	var h C.CUmemGenericAllocationHandle
	res := r(C.mc_cuMemImportFabric(C.CUcontext(c), &h, &in))
	return MemHandle(h), res
}

func cuIpcGetMemHandle(c unsafe.Pointer, p DevicePtr) (IpcMemHandle, Result) {
	var h C.mc_CUipcMemHandle
	res := r(C.mc_cuIpcGetMemHandle(C.CUcontext(c), &h, C.CUdeviceptr(p)))
	var out IpcMemHandle
	copy(out[:], C.GoBytes(unsafe.Pointer(&h.reserved[0]), 64))
	return out, res
}
func cuIpcOpenMemHandle(c unsafe.Pointer, h IpcMemHandle, flags uint) (DevicePtr, Result) {
	var in C.mc_CUipcMemHandle
	for i := range h {
		in.reserved[i] = C.char(h[i])
	}
	var p C.CUdeviceptr
	res := r(C.mc_cuIpcOpenMemHandle(C.CUcontext(c), &p, &in, C.uint(flags)))
	return DevicePtr(p), res
}
func cuIpcCloseMemHandle(c unsafe.Pointer, p DevicePtr) Result {
	return r(C.mc_cuIpcCloseMemHandle(C.CUcontext(c), C.CUdeviceptr(p)))
}

func cuPointerGetAttribute(c unsafe.Pointer, a PointerAttribute, p DevicePtr) (uint64, Result) {
	var v C.ulonglong
	res := r(C.mc_cuPointerGetAttributeU64(C.CUcontext(c), &v, C.int(a), C.CUdeviceptr(p)))
	return uint64(v), res
}

func cuModuleLoadData(c unsafe.Pointer, image []byte) (unsafe.Pointer, Result) {
	// The image must be NUL-terminated for PTX; copy into C memory with a 0.
	buf := C.malloc(C.size_t(len(image) + 1))
	defer C.free(buf)
	b := unsafe.Slice((*byte)(buf), len(image)+1)
	copy(b, image)
	b[len(image)] = 0
	var m C.CUmodule
	res := r(C.mc_cuModuleLoadData(C.CUcontext(c), &m, buf))
	return unsafe.Pointer(m), res
}
func cuModuleUnload(c, m unsafe.Pointer) Result {
	return r(C.mc_cuModuleUnload(C.CUcontext(c), C.CUmodule(m)))
}
func cuModuleGetFunction(c, m unsafe.Pointer, name string) (unsafe.Pointer, Result) {
	cn := C.CString(name)
	defer C.free(unsafe.Pointer(cn))
	var f C.CUfunction
	res := r(C.mc_cuModuleGetFunction(C.CUcontext(c), &f, C.CUmodule(m), cn))
	return unsafe.Pointer(f), res
}
func cuFuncSetAttribute(c, f unsafe.Pointer, attr, v int) Result {
	return r(C.mc_cuFuncSetAttribute(C.CUcontext(c), C.CUfunction(f), C.int(attr), C.int(v)))
}
func cuFuncGetAttribute(c, f unsafe.Pointer, attr int) (int, Result) {
	var v C.int
	res := r(C.mc_cuFuncGetAttribute(C.CUcontext(c), &v, C.int(attr), C.CUfunction(f)))
	return int(v), res
}
func cuLaunchKernel(c, f unsafe.Pointer, grid, block Dim3, shmem uint32, s unsafe.Pointer, args []byte, offsets []uint32) Result {
	var ap *C.uchar
	var op *C.uint
	if len(args) > 0 {
		ap = (*C.uchar)(unsafe.Pointer(&args[0]))
	}
	if len(offsets) > 0 {
		op = (*C.uint)(unsafe.Pointer(&offsets[0]))
	}
	return r(C.mc_cuLaunchKernel(C.CUcontext(c), C.CUfunction(f),
		C.uint(grid.X), C.uint(grid.Y), C.uint(grid.Z), C.uint(block.X), C.uint(block.Y), C.uint(block.Z),
		C.uint(shmem), C.CUstream(s), ap, op, C.int(len(offsets))))
}

func cuLaunchKernelPDL(c, f unsafe.Pointer, grid, block Dim3, shmem uint32, s unsafe.Pointer, args []byte, offsets []uint32) Result {
	var ap *C.uchar
	var op *C.uint
	if len(args) > 0 {
		ap = (*C.uchar)(unsafe.Pointer(&args[0]))
	}
	if len(offsets) > 0 {
		op = (*C.uint)(unsafe.Pointer(&offsets[0]))
	}
	return r(C.mc_cuLaunchKernelPDL(C.CUcontext(c), C.CUfunction(f),
		C.uint(grid.X), C.uint(grid.Y), C.uint(grid.Z), C.uint(block.X), C.uint(block.Y), C.uint(block.Z),
		C.uint(shmem), C.CUstream(s), ap, op, C.int(len(offsets))))
}

func cuStreamBeginCapture(c, s unsafe.Pointer, mode int) Result {
	return r(C.mc_cuStreamBeginCapture(C.CUcontext(c), C.CUstream(s), C.int(mode)))
}
func cuStreamEndCapture(c, s unsafe.Pointer) (unsafe.Pointer, Result) {
	var g C.CUgraph
	res := r(C.mc_cuStreamEndCapture(C.CUcontext(c), C.CUstream(s), &g))
	return unsafe.Pointer(g), res
}
func cuStreamIsCapturing(c, s unsafe.Pointer) (int, Result) {
	var st C.int
	res := r(C.mc_cuStreamIsCapturing(C.CUcontext(c), C.CUstream(s), &st))
	return int(st), res
}
func cuGraphInstantiate(c, g unsafe.Pointer, flags uint64) (unsafe.Pointer, Result) {
	var e C.CUgraphExec
	res := r(C.mc_cuGraphInstantiate(C.CUcontext(c), &e, C.CUgraph(g), C.ulonglong(flags)))
	return unsafe.Pointer(e), res
}
func cuGraphUpload(c, e, s unsafe.Pointer) Result {
	return r(C.mc_cuGraphUpload(C.CUcontext(c), C.CUgraphExec(e), C.CUstream(s)))
}
func cuGraphLaunch(c, e, s unsafe.Pointer) Result {
	return r(C.mc_cuGraphLaunch(C.CUcontext(c), C.CUgraphExec(e), C.CUstream(s)))
}
func cuGraphExecUpdate(c, e, g unsafe.Pointer) (int, Result) {
	var reason C.int
	res := r(C.mc_cuGraphExecUpdate(C.CUcontext(c), C.CUgraphExec(e), C.CUgraph(g), &reason))
	return int(reason), res
}
func cuGraphExecDestroy(c, e unsafe.Pointer) Result {
	return r(C.mc_cuGraphExecDestroy(C.CUcontext(c), C.CUgraphExec(e)))
}
func cuGraphDestroy(c, g unsafe.Pointer) Result {
	return r(C.mc_cuGraphDestroy(C.CUcontext(c), C.CUgraph(g)))
}
func cuGraphNodeCount(c, g unsafe.Pointer) (int, Result) {
	var n C.size_t
	res := r(C.mc_cuGraphNodeCount(C.CUcontext(c), C.CUgraph(g), &n))
	return int(n), res
}
