package transfer

import (
	"context"
	"errors"
)

// Memory is backend-owned memory given to RegisterMemory (WithMemory): a
// CUDA pool, for instance. Transports reach such memory through this
// interface, never through a backend's own types, so this package and the
// transports that only move host memory import no CUDA package.
type Memory interface {
	// Base is the address of the first byte (a device address for GPU
	// memory); registered ranges lie inside [Base, Base+Size).
	Base() uint64
	// Size is the memory's length in bytes.
	Size() uint64
	// Share returns a handle another process (or a device) can map the
	// memory with. Memory that cannot be shared returns an error wrapping
	// ErrNotShareable.
	Share() (SharedHandle, error)
}

// DeviceMemory is Memory the CPU cannot address (GPU memory). Transports
// that move bytes through host memory (tcp; rdma without GPUDirect) stage
// it: they copy between it and host staging buffers from AllocStaging.
// Copies run on the implementation's own stream(s) and may end in any
// order: each has its own Completion. All methods are safe for concurrent
// use.
type DeviceMemory interface {
	Memory
	// CopyToHost enqueues a copy of len(dst) bytes from device address src
	// (inside the memory) into dst, which must be staging memory from
	// AllocStaging. It fails at once (wrapping ErrDeviceCopy) on a range
	// outside the memory.
	CopyToHost(dst []byte, src uint64) (Completion, error)
	// CopyFromHost enqueues a copy of src (staging memory) to device
	// address dst (inside the memory).
	CopyFromHost(dst uint64, src []byte) (Completion, error)
	// AllocStaging allocates n bytes of host memory fit for these copies
	// (page-locked for a GPU). Close releases it; it stays valid after the
	// memory itself is closed.
	AllocStaging(n int) (Staging, error)
}

// Completion is one enqueued device copy.
type Completion interface {
	// Wait returns once the copy ended: nil, or an error wrapping
	// ErrDeviceCopy. If ctx ends first it returns ctx's error and the copy
	// may still be using its host buffer: the caller must not reuse the
	// buffer until a later Wait returns something other than a context
	// error. Wait may be called again; once the copy ended it returns the
	// same result. A copy that ended reports its result even to a ctx
	// that is already done, so such a ctx polls. Calls must not overlap.
	Wait(ctx context.Context) error
}

// Staging is host memory a DeviceMemory copies to and from.
type Staging interface {
	Bytes() []byte
	Close() error
}

// HandleKind names how a SharedHandle is mapped.
type HandleKind string

const (
	// HandlePosixFD: VMM memory exported as a file descriptor, passed to a
	// process of the same machine over a unix socket.
	HandlePosixFD HandleKind = "posix-fd"
	// HandleFabric: VMM memory with a fabric handle, mappable across the
	// NVLink fabric of a multi-node NVLink domain.
	HandleFabric HandleKind = "fabric"
)

// SharedHandle is what another process needs to map a Memory.
type SharedHandle struct {
	Kind HandleKind
	// FD is the exported file descriptor (HandlePosixFD; -1 otherwise),
	// owned by the caller of Share, who must close it.
	FD int
	// Fabric is the fabric handle's bytes (HandleFabric).
	Fabric []byte
	// Size is the mapped length from Base (a multiple of Granularity).
	Size uint64
	// Granularity is the mapping granularity.
	Granularity uint64
	// Device is the owner's device ordinal (in the owner's process).
	Device int
}

// Close closes the handle's file descriptor, if any.
func (h *SharedHandle) Close() error {
	if h.FD < 0 {
		return nil
	}
	fd := h.FD
	h.FD = -1
	return closeFD(fd)
}

var (
	// ErrNotShareable: the memory has no handle another process can map.
	ErrNotShareable = errors.New("transfer: memory is not shareable")
	// ErrDeviceCopy: a copy between device memory and host staging failed.
	ErrDeviceCopy = errors.New("transfer: device copy failed")
)

// WithMemory says the region lies in m (backend memory such as a CUDA
// pool), for transports that share it (nvlink, rdma) or stage it (tcp).
func WithMemory(m Memory) RegisterOption { return func(o *regOpts) { o.mem = m } }
