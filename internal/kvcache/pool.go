package kvcache

import (
	"fmt"
)

// Pool is a KV pool in host memory: the layout, the memory and its allocator.
// A GPU pool has the same layout with device memory instead of Mem.
type Pool struct {
	Layout
	Mem   []byte // len == TotalBytes
	Alloc *Allocator
}

// NewPool wraps mem (which must hold exactly l.TotalBytes bytes) as a pool.
func NewPool(l Layout, mem []byte) (*Pool, error) {
	if err := l.Validate(); err != nil {
		return nil, err
	}
	if int64(len(mem)) != l.TotalBytes() {
		return nil, fmt.Errorf("kvcache: pool memory is %d bytes, layout needs %d", len(mem), l.TotalBytes())
	}
	return &Pool{Layout: l, Mem: mem, Alloc: NewAllocator(l.Pages)}, nil
}

// Page returns one page of one layer's K or V buffer as bytes.
func (p *Pool) Page(layer int, kind Kind, page int) []byte {
	off := p.Offset(layer, kind, page)
	return p.Mem[off : off+int64(p.PageBytes())]
}
