package cuda

import "fmt"

// Virtual memory management (VMM): physical allocations (MemCreate) mapped
// into reserved address ranges (MemAddressReserve + MemMap + MemSetAccess),
// shareable through POSIX file descriptors or fabric handles.

// AllocationGranularity is the size and alignment unit of MemCreate on d for
// the given handle types (minimum, or the recommended one).
func (d Device) AllocationGranularity(ht HandleType, recommended bool) (uint64, error) {
	if err := Init(); err != nil {
		return 0, err
	}
	g, res := cuMemGetAllocationGranularity(d, ht, recommended)
	return g, check("cuMemGetAllocationGranularity", res)
}

// MemCreate allocates n bytes (a multiple of the granularity) of physical
// memory on c's device, exportable as ht.
func (c *Context) MemCreate(n uint64, ht HandleType) (MemHandle, error) {
	h, res := cuMemCreate(c.h, n, c.dev, ht)
	return h, check("cuMemCreate", res)
}

// MemRelease releases a physical allocation (it lives on while mapped).
func MemRelease(h MemHandle) error { return check("cuMemRelease", cuMemRelease(h)) }

// MemAddressReserve reserves n bytes of virtual address space.
func (c *Context) MemAddressReserve(n, align uint64) (DevicePtr, error) {
	p, res := cuMemAddressReserve(c.h, n, align)
	return p, check("cuMemAddressReserve", res)
}

// MemAddressFree frees a reservation.
func MemAddressFree(p DevicePtr, n uint64) error {
	return check("cuMemAddressFree", cuMemAddressFree(p, n))
}

// MemMap maps n bytes of h, from offset off, at p.
func (c *Context) MemMap(p DevicePtr, n, off uint64, h MemHandle) error {
	return check("cuMemMap", cuMemMap(c.h, p, n, off, h))
}

// MemUnmap unmaps a range mapped with MemMap.
func MemUnmap(p DevicePtr, n uint64) error { return check("cuMemUnmap", cuMemUnmap(p, n)) }

// MemSetAccess grants read/write access to [p, p+n) to each device.
func (c *Context) MemSetAccess(p DevicePtr, n uint64, devices ...Device) error {
	return check("cuMemSetAccess", cuMemSetAccess(c.h, p, n, devices))
}

// MemExportFD exports h as a POSIX file descriptor owned by the caller.
func MemExportFD(h MemHandle) (int, error) {
	fd, res := cuMemExportFD(h)
	return fd, check("cuMemExportToShareableHandle", res)
}

// MemExportFabric exports h as a fabric handle.
func MemExportFabric(h MemHandle) (FabricHandle, error) {
	fh, res := cuMemExportFabric(h)
	return fh, check("cuMemExportToShareableHandle", res)
}

// MemImportFD imports a POSIX file descriptor exported by MemExportFD (in
// this or another process). The fd stays owned by the caller.
func (c *Context) MemImportFD(fd int) (MemHandle, error) {
	h, res := cuMemImportFD(c.h, fd)
	return h, check("cuMemImportFromShareableHandle", res)
}

// MemImportFabric imports a fabric handle.
func (c *Context) MemImportFabric(fh FabricHandle) (MemHandle, error) {
	h, res := cuMemImportFabric(c.h, fh)
	return h, check("cuMemImportFromShareableHandle", res)
}

// MemGetDmabufFD exports [p, p+n) of mapped memory as a dma-buf file
// descriptor owned by the caller (cuMemGetHandleForAddressRange); p and n
// must be multiples of the host page size.
func (c *Context) MemGetDmabufFD(p DevicePtr, n uint64) (int, error) {
	fd, res := cuMemGetDmabufFD(c.h, p, n)
	return fd, check("cuMemGetHandleForAddressRange", res)
}

// FabricProbe is the outcome of a trial FABRIC allocation.
type FabricProbe struct {
	AttributeSupported bool  // what CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED says
	Usable             bool  // cuMemCreate(FABRIC) and the export succeeded
	Err                error // why it is not usable
}

func (p FabricProbe) String() string {
	if p.Usable {
		return "fabric handles usable"
	}
	return fmt.Sprintf("fabric handles unusable (attribute says supported=%v): %v", p.AttributeSupported, p.Err)
}

// ProbeFabric tries a real FABRIC allocation of one granule on c's device
// and exports it: the attribute alone is not trusted (H200s here report it
// supported while cuMemCreate fails with CUDA_ERROR_NOT_PERMITTED).
func (c *Context) ProbeFabric() FabricProbe {
	var p FabricProbe
	if v, err := c.dev.Attribute(AttrHandleTypeFabric); err == nil {
		p.AttributeSupported = v != 0
	}
	g, err := c.dev.AllocationGranularity(HandleFabric, false)
	if err != nil {
		p.Err = err
		return p
	}
	h, err := c.MemCreate(g, HandleFabric)
	if err != nil {
		p.Err = err
		return p
	}
	defer MemRelease(h)
	if _, err := MemExportFabric(h); err != nil {
		p.Err = err
		return p
	}
	p.Usable = true
	return p
}
