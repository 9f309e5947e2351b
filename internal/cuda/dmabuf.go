package cuda

import (
	"errors"
	"fmt"
	"os"
)

// ErrNoDMABuf is wrapped when a pool cannot export a dma-buf: the device
// does not report CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (an older driver or
// kernel, or a GPU without it).
var ErrNoDMABuf = errors.New("cuda: dma-buf export not supported")

// DMABuf exports the pages holding [addr, addr+n) of the pool as a dma-buf
// file descriptor, which NICs register with ibv_reg_dmabuf_mr (GPUDirect
// RDMA). The exported range is [addr, addr+n) widened to host pages; off is
// addr's offset in it. The caller closes fd. A Pool thereby satisfies
// rdma.DMABufMemory (by its method set: this package does not import rdma).
func (p *Pool) DMABuf(addr, n uint64) (fd int, off uint64, err error) {
	if p.ptr == 0 {
		return -1, 0, fmt.Errorf("cuda: dma-buf: GPU %d pool is closed", p.ctx.dev)
	}
	base := uint64(p.ptr)
	if n == 0 || addr < base || addr+n > base+p.size || addr+n < addr {
		return -1, 0, fmt.Errorf("cuda: dma-buf of %d bytes at %#x: outside the GPU %d pool [%#x, +%d)", n, addr, p.ctx.dev, base, p.size)
	}
	if v, err := p.ctx.dev.Attribute(AttrDMABufSupported); err != nil {
		return -1, 0, fmt.Errorf("cuda: dma-buf on GPU %d: %w", p.ctx.dev, err)
	} else if v == 0 {
		return -1, 0, fmt.Errorf("%w: GPU %d does not report CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED", ErrNoDMABuf, p.ctx.dev)
	}
	pg := uint64(os.Getpagesize())
	start := addr &^ (pg - 1)
	end := (addr + n + pg - 1) &^ (pg - 1) // within the pool: it is granularity-aligned
	fd, err = p.ctx.MemGetDmabufFD(DevicePtr(start), end-start)
	if err != nil {
		return -1, 0, fmt.Errorf("cuda: dma-buf of [%#x, +%d) on GPU %d: %w", start, end-start, p.ctx.dev, err)
	}
	return fd, addr - start, nil
}
