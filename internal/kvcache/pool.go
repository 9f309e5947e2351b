package kvcache

import "fmt"

// Pool is a KV pool in host memory: the layout, the memory and its allocator.
// A GPU pool has the same layout with device memory instead of Mem. The
// ranks of a tensor-parallel model have a pool each and share one
// allocator: a page index names the same positions in every rank's pool.
type Pool struct {
	Layout
	Mem   []byte // len == TotalBytes
	Alloc *Allocator
}

// NewPool wraps mem (which must hold exactly l.TotalBytes bytes) as a pool
// with an allocator of its own.
func NewPool(l Layout, mem []byte) (*Pool, error) {
	return NewPoolShared(l, mem, nil)
}

// NewPoolShared is NewPool with the allocator a (nil: a new one), which
// must have l.Pages pages: another rank's pool's.
func NewPoolShared(l Layout, mem []byte, a *Allocator) (*Pool, error) {
	if err := l.Validate(); err != nil {
		return nil, err
	}
	if int64(len(mem)) != l.TotalBytes() {
		return nil, fmt.Errorf("kvcache: pool memory is %d bytes, layout needs %d", len(mem), l.TotalBytes())
	}
	if a == nil {
		a = NewAllocator(l.Pages)
	} else if a.Total() != l.Pages {
		return nil, fmt.Errorf("kvcache: shared allocator has %d pages, the pool %d", a.Total(), l.Pages)
	}
	return &Pool{Layout: l, Mem: mem, Alloc: a}, nil
}

// LayerPage returns the memory of one page of one layer (LayerPage's
// spans).
func (p *Pool) LayerPage(layer, page int) [][]byte {
	var out [][]byte
	for _, s := range p.Layout.LayerPage(layer, page) {
		out = append(out, p.Mem[s.Off:s.Off+s.Len])
	}
	return out
}
