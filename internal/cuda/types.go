// Package cuda binds the CUDA driver API (libcuda.so.1) and NVRTC through
// cgo, loading both with dlopen at run time: a binary built here runs where
// there is no GPU, and every entry point then returns an error wrapping
// ErrNoDriver.
//
// Contexts are the device's primary context. Every call that needs a context
// makes it current on the calling OS thread first, so goroutines need not be
// locked to threads.
package cuda

import (
	"fmt"
	"sync"
	"unsafe"
)

// DevicePtr is a device (or unified) virtual address.
type DevicePtr uint64

// Add returns p+off.
func (p DevicePtr) Add(off uint64) DevicePtr { return p + DevicePtr(off) }

// Device is a CUDA device ordinal.
type Device int

// DeviceAttribute is a CUdevice_attribute value.
type DeviceAttribute int

// Device attributes used by mooncake-go (values of cuda.h).
const (
	AttrMaxThreadsPerBlock           DeviceAttribute = 1
	AttrMaxSharedMemoryPerBlock      DeviceAttribute = 8
	AttrWarpSize                     DeviceAttribute = 10
	AttrClockRate                    DeviceAttribute = 13
	AttrMultiprocessorCount          DeviceAttribute = 16
	AttrPCIBusID                     DeviceAttribute = 33
	AttrPCIDeviceID                  DeviceAttribute = 34
	AttrL2CacheSize                  DeviceAttribute = 38
	AttrMaxThreadsPerMultiprocessor  DeviceAttribute = 39
	AttrAsyncEngineCount             DeviceAttribute = 40
	AttrUnifiedAddressing            DeviceAttribute = 41
	AttrPCIDomainID                  DeviceAttribute = 50
	AttrComputeCapabilityMajor       DeviceAttribute = 75
	AttrComputeCapabilityMinor       DeviceAttribute = 76
	AttrMaxSharedMemoryPerSM         DeviceAttribute = 81
	AttrCanUseHostPointerForRegMem   DeviceAttribute = 91
	AttrMaxSharedMemoryPerBlockOptin DeviceAttribute = 97
	AttrHostRegisterSupported        DeviceAttribute = 99
	AttrVirtualMemoryManagement      DeviceAttribute = 102
	AttrHandleTypePosixFD            DeviceAttribute = 103
	AttrMaxBlocksPerMultiprocessor   DeviceAttribute = 106
	AttrGPUDirectRDMAWithVMM         DeviceAttribute = 110
	AttrGPUDirectRDMA                DeviceAttribute = 116
	AttrDMABufSupported              DeviceAttribute = 124
	AttrHandleTypeFabric             DeviceAttribute = 128
	AttrNUMAID                       DeviceAttribute = 131
)

// HandleType is a CUmemAllocationHandleType (a bit set).
type HandleType int

// Shareable handle types.
const (
	HandleNone    HandleType = 0
	HandlePosixFD HandleType = 1
	HandleFabric  HandleType = 8
)

func (h HandleType) String() string {
	switch h {
	case HandleNone:
		return "none"
	case HandlePosixFD:
		return "posix-fd"
	case HandleFabric:
		return "fabric"
	case HandlePosixFD | HandleFabric:
		return "posix-fd+fabric"
	}
	return fmt.Sprintf("handle-type(%d)", int(h))
}

// FabricHandle is a CUmemFabricHandle: 64 opaque bytes valid across the
// NVLink fabric (MNNVL) when the driver permits.
type FabricHandle [64]byte

// IpcMemHandle is a legacy CUipcMemHandle for cuMemAlloc memory.
type IpcMemHandle [64]byte

// MemHandle is a CUmemGenericAllocationHandle (physical memory of VMM).
type MemHandle uint64

// Dim3 is a grid or block shape.
type Dim3 struct{ X, Y, Z uint32 }

// D1 is a one-dimensional shape.
func D1(x uint32) Dim3 { return Dim3{x, 1, 1} }

// MemoryType is what cuPointerGetAttribute(MEMORY_TYPE) reports.
type MemoryType int

// Memory types.
const (
	MemoryHost    MemoryType = 1
	MemoryDevice  MemoryType = 2
	MemoryArray   MemoryType = 3
	MemoryUnified MemoryType = 4
)

// PointerAttribute is a CUpointer_attribute with an integer value.
type PointerAttribute int

// Pointer attributes.
const (
	PointerAttrContext       PointerAttribute = 1
	PointerAttrMemoryType    PointerAttribute = 2
	PointerAttrDevicePointer PointerAttribute = 3
	PointerAttrHostPointer   PointerAttribute = 4
	PointerAttrBufferID      PointerAttribute = 7
	PointerAttrIsManaged     PointerAttribute = 8
	PointerAttrDeviceOrdinal PointerAttribute = 9
	PointerAttrIsLegacyIPC   PointerAttribute = 10
	PointerAttrRangeStart    PointerAttribute = 11
	PointerAttrRangeSize     PointerAttribute = 12
	PointerAttrMapped        PointerAttribute = 13
	PointerAttrHandleTypes   PointerAttribute = 14
)

// Host allocation / registration flags.
const (
	HostAllocPortable      = 0x1
	HostAllocDeviceMap     = 0x2
	HostAllocWriteCombined = 0x4

	HostRegisterPortable  = 0x1
	HostRegisterDeviceMap = 0x2
	HostRegisterIOMemory  = 0x4
	HostRegisterReadOnly  = 0x8
)

// Stream and event creation flags.
const (
	StreamDefault     = 0x0
	StreamNonBlocking = 0x1

	EventDefault       = 0x0
	EventBlockingSync  = 0x1
	EventDisableTiming = 0x2
	EventInterprocess  = 0x4
)

// Function attributes (CUfunction_attribute).
const (
	FuncAttrMaxThreadsPerBlock        = 0
	FuncAttrSharedSizeBytes           = 1
	FuncAttrLocalSizeBytes            = 3
	FuncAttrNumRegs                   = 4
	FuncAttrMaxDynamicSharedSizeBytes = 8
	FuncAttrPreferredSharedCarveout   = 9
)

// HostMem is page-locked host memory from cuMemHostAlloc.
type HostMem struct {
	ctx  *Context
	ptr  unsafe.Pointer
	size uint64
}

// Ptr is the host address.
func (h *HostMem) Ptr() unsafe.Pointer { return h.ptr }

// Size in bytes.
func (h *HostMem) Size() uint64 { return h.size }

// Bytes views the memory as a byte slice (valid until Free).
func (h *HostMem) Bytes() []byte {
	if h == nil || h.ptr == nil {
		return nil
	}
	return unsafe.Slice((*byte)(h.ptr), h.size)
}

// Context is a retained primary context of one device.
type Context struct {
	h   unsafe.Pointer // CUcontext
	dev Device

	fabricOnce sync.Once
	fabric     FabricProbe
}

// Device returns the context's device.
func (c *Context) Device() Device { return c.dev }

// Stream is a CUDA stream of one context. The zero handle is the legacy
// default stream (see Context.DefaultStream).
type Stream struct {
	ctx *Context
	h   unsafe.Pointer
}

// Context returns the stream's context.
func (s *Stream) Context() *Context { return s.ctx }

// Event is a CUDA event.
type Event struct {
	ctx *Context
	h   unsafe.Pointer
}

// Module is a loaded CUBIN or PTX image.
type Module struct {
	ctx *Context
	h   unsafe.Pointer
}

// Function is a kernel of a Module.
type Function struct {
	mod  *Module
	h    unsafe.Pointer
	Name string
}
