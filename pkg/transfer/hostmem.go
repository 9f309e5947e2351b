package transfer

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// HostMemory is shareable host memory: a memfd mapped MAP_SHARED, so a
// process on the same machine that receives the fd can map the same pages.
// Nothing is touched at allocation, so large pools are cheap to create.
type HostMemory struct {
	fd   int
	mem  []byte
	name string
}

// AllocHost creates size bytes of memfd-backed shared memory.
func AllocHost(size int64, name string) (*HostMemory, error) {
	if size <= 0 {
		return nil, fmt.Errorf("transfer: host allocation of %d bytes", size)
	}
	fd, err := unix.MemfdCreate("mooncake:"+name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("transfer: memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("transfer: ftruncate memfd to %d bytes: %w", size, err)
	}
	mem, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("transfer: mmap %d bytes: %w", size, err)
	}
	return &HostMemory{fd: fd, mem: mem, name: name}, nil
}

// MapHost maps a memfd received from another process. The fd is owned by
// the returned HostMemory.
func MapHost(fd int, size int64, writable bool) (*HostMemory, error) {
	prot := unix.PROT_READ
	if writable {
		prot |= unix.PROT_WRITE
	}
	mem, err := unix.Mmap(fd, 0, int(size), prot, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("transfer: mmap peer memfd (%d bytes): %w", size, err)
	}
	return &HostMemory{fd: fd, mem: mem}, nil
}

// Bytes is the mapped memory.
func (m *HostMemory) Bytes() []byte { return m.mem }

// Addr is the address of the first byte.
func (m *HostMemory) Addr() uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(m.mem)))) }

// Size is the mapping's length.
func (m *HostMemory) Size() int64 { return int64(len(m.mem)) }

// File returns the memfd (owned by m; do not close it).
func (m *HostMemory) FD() int { return m.fd }

func closeFD(fd int) error { return unix.Close(fd) }

// Close unmaps the memory and closes the fd.
func (m *HostMemory) Close() error {
	var err error
	if m.mem != nil {
		err = unix.Munmap(m.mem)
		m.mem = nil
	}
	if m.fd >= 0 {
		if e := unix.Close(m.fd); err == nil {
			err = e
		}
		m.fd = -1
	}
	if err != nil {
		return fmt.Errorf("transfer: release host memory: %w", err)
	}
	return nil
}
