package cuda

import (
	"fmt"
	"runtime"
	"unsafe"
)

// MemAlloc allocates n bytes of device memory (cuMemAlloc).
func (c *Context) MemAlloc(n uint64) (DevicePtr, error) {
	p, res := cuMemAlloc(c.h, n)
	if res == ErrorOutOfMemory {
		free, total, _ := cuMemGetInfo(c.h)
		return 0, fmt.Errorf("cuda: GPU %d: cannot allocate %d bytes, %d of %d free: %w",
			c.dev, n, free, total, &Error{Op: "cuMemAlloc", Code: res})
	}
	return p, check("cuMemAlloc", res)
}

// MemFree frees memory from MemAlloc.
func (c *Context) MemFree(p DevicePtr) error { return check("cuMemFree", cuMemFree(c.h, p)) }

// Memcpy copies n bytes between any two unified addresses (device, peer,
// mapped host), synchronously.
func (c *Context) Memcpy(dst, src DevicePtr, n uint64) error {
	return check("cuMemcpy", cuMemcpy(c.h, dst, src, n))
}

// MemcpyHtoD copies host bytes to the device, synchronously.
func (c *Context) MemcpyHtoD(dst DevicePtr, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	res := cuMemcpyHtoD(c.h, dst, uintptr(unsafe.Pointer(&src[0])), uint64(len(src)))
	runtime.KeepAlive(src)
	return check("cuMemcpyHtoD", res)
}

// MemcpyDtoH copies device bytes into dst, synchronously.
func (c *Context) MemcpyDtoH(dst []byte, src DevicePtr) error {
	if len(dst) == 0 {
		return nil
	}
	res := cuMemcpyDtoH(c.h, uintptr(unsafe.Pointer(&dst[0])), src, uint64(len(dst)))
	runtime.KeepAlive(dst)
	return check("cuMemcpyDtoH", res)
}

// MemcpyDtoD copies within device memory, synchronously.
func (c *Context) MemcpyDtoD(dst, src DevicePtr, n uint64) error {
	return check("cuMemcpyDtoD", cuMemcpyDtoD(c.h, dst, src, n))
}

// MemsetD8 sets n bytes to v, synchronously.
func (c *Context) MemsetD8(dst DevicePtr, v byte, n uint64) error {
	return check("cuMemsetD8", cuMemsetD8(c.h, dst, v, n))
}

// Async copies. Host pointers must be page-locked (HostMem, registered
// memory) and stay valid until the stream reaches the copy.

// Memcpy enqueues a copy between unified addresses.
func (s *Stream) Memcpy(dst, src DevicePtr, n uint64) error {
	return check("cuMemcpyAsync", cuMemcpyAsync(s.ctx.h, dst, src, n, s.h))
}

// MemcpyHtoD enqueues a host-to-device copy from pinned memory.
func (s *Stream) MemcpyHtoD(dst DevicePtr, src unsafe.Pointer, n uint64) error {
	return check("cuMemcpyHtoDAsync", cuMemcpyHtoDAsync(s.ctx.h, dst, uintptr(src), n, s.h))
}

// MemcpyDtoH enqueues a device-to-host copy into pinned memory.
func (s *Stream) MemcpyDtoH(dst unsafe.Pointer, src DevicePtr, n uint64) error {
	return check("cuMemcpyDtoHAsync", cuMemcpyDtoHAsync(s.ctx.h, uintptr(dst), src, n, s.h))
}

// MemcpyDtoD enqueues a device-to-device copy.
func (s *Stream) MemcpyDtoD(dst, src DevicePtr, n uint64) error {
	return check("cuMemcpyDtoDAsync", cuMemcpyDtoDAsync(s.ctx.h, dst, src, n, s.h))
}

// Memcpy2D enqueues a device-to-device copy of height rows of width bytes,
// row i from src+i*spitch to dst+i*dpitch.
func (s *Stream) Memcpy2D(dst DevicePtr, dpitch uint64, src DevicePtr, spitch, width, height uint64) error {
	return check("cuMemcpy2DAsync", cuMemcpy2DDtoDAsync(s.ctx.h, dst, dpitch, src, spitch, width, height, s.h))
}

// MemcpyPeer enqueues a copy between contexts.
func (s *Stream) MemcpyPeer(dst DevicePtr, dstCtx *Context, src DevicePtr, srcCtx *Context, n uint64) error {
	return check("cuMemcpyPeerAsync", cuMemcpyPeerAsync(s.ctx.h, dst, dstCtx.h, src, srcCtx.h, n, s.h))
}

// MemsetD8 enqueues a byte fill.
func (s *Stream) MemsetD8(dst DevicePtr, v byte, n uint64) error {
	return check("cuMemsetD8Async", cuMemsetD8Async(s.ctx.h, dst, v, n, s.h))
}

// MemHostAlloc allocates page-locked host memory (flags: HostAlloc*).
func (c *Context) MemHostAlloc(n uint64, flags uint) (*HostMem, error) {
	p, res := cuMemHostAlloc(c.h, n, flags)
	if err := check("cuMemHostAlloc", res); err != nil {
		return nil, err
	}
	return &HostMem{ctx: c, ptr: p, size: n}, nil
}

// Free releases the host memory.
func (h *HostMem) Free() error {
	if h == nil || h.ptr == nil {
		return nil
	}
	p := h.ptr
	h.ptr = nil
	return check("cuMemFreeHost", cuMemFreeHost(h.ctx.h, p))
}

// DevicePtr is the address kernels use for mapped (HostAllocDeviceMap)
// memory; with unified addressing it equals the host address.
func (h *HostMem) DevicePtr() (DevicePtr, error) {
	return h.ctx.MemHostGetDevicePointer(h.ptr)
}

// MemHostRegister page-locks existing host memory (e.g. an mmap'ed memfd)
// so copies and kernels reach it at PCIe speed (flags: HostRegister*).
// The memory must not be Go-heap memory.
func (c *Context) MemHostRegister(p unsafe.Pointer, n uint64, flags uint) error {
	return check("cuMemHostRegister", cuMemHostRegister(c.h, uintptr(p), n, flags))
}

// MemHostUnregister undoes MemHostRegister.
func (c *Context) MemHostUnregister(p unsafe.Pointer) error {
	return check("cuMemHostUnregister", cuMemHostUnregister(c.h, uintptr(p)))
}

// MemHostGetDevicePointer returns the device address of registered or
// mapped host memory.
func (c *Context) MemHostGetDevicePointer(p unsafe.Pointer) (DevicePtr, error) {
	d, res := cuMemHostGetDevicePointer(c.h, uintptr(p))
	return d, check("cuMemHostGetDevicePointer", res)
}

// IpcGetMemHandle exports cuMemAlloc memory to other processes (legacy IPC).
func (c *Context) IpcGetMemHandle(p DevicePtr) (IpcMemHandle, error) {
	h, res := cuIpcGetMemHandle(c.h, p)
	return h, check("cuIpcGetMemHandle", res)
}

// IpcOpenMemHandle maps another process's legacy IPC memory into c (with
// lazy peer access enabled); close it with IpcCloseMemHandle.
func (c *Context) IpcOpenMemHandle(h IpcMemHandle) (DevicePtr, error) {
	p, res := cuIpcOpenMemHandle(c.h, h, 1 /* CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS */)
	return p, check("cuIpcOpenMemHandle", res)
}

// IpcCloseMemHandle unmaps memory from IpcOpenMemHandle.
func (c *Context) IpcCloseMemHandle(p DevicePtr) error {
	return check("cuIpcCloseMemHandle", cuIpcCloseMemHandle(c.h, p))
}

// PointerAttribute reads an integer pointer attribute (cuPointerGetAttribute).
func (c *Context) PointerAttribute(a PointerAttribute, p DevicePtr) (uint64, error) {
	v, res := cuPointerGetAttribute(c.h, a, p)
	return v, check("cuPointerGetAttribute", res)
}

// PointerInfo describes an address as the driver sees it.
type PointerInfo struct {
	MemoryType    MemoryType
	DeviceOrdinal int
	RangeStart    DevicePtr
	RangeSize     uint64
}

// PointerInfo reads memory type, device and allocation range of p.
func (c *Context) PointerInfo(p DevicePtr) (PointerInfo, error) {
	var pi PointerInfo
	v, err := c.PointerAttribute(PointerAttrMemoryType, p)
	if err != nil {
		return pi, err
	}
	pi.MemoryType = MemoryType(uint32(v))
	if v, err = c.PointerAttribute(PointerAttrDeviceOrdinal, p); err != nil {
		return pi, err
	}
	pi.DeviceOrdinal = int(int32(uint32(v)))
	if v, err = c.PointerAttribute(PointerAttrRangeStart, p); err != nil {
		return pi, err
	}
	pi.RangeStart = DevicePtr(v)
	if v, err = c.PointerAttribute(PointerAttrRangeSize, p); err != nil {
		return pi, err
	}
	pi.RangeSize = v
	return pi, nil
}
