package transfer

import (
	"fmt"
	"sort"
)

// regionTable is a sorted, non-overlapping set of regions with bounds checks.
type regionTable struct {
	regs []RegionInfo // sorted by Addr
}

func newRegionTable(regs []RegionInfo) (*regionTable, error) {
	t := &regionTable{regs: append([]RegionInfo(nil), regs...)}
	sort.Slice(t.regs, func(i, j int) bool { return t.regs[i].Addr < t.regs[j].Addr })
	for i, r := range t.regs {
		if r.Len == 0 {
			return nil, fmt.Errorf("empty region at %#x", r.Addr)
		}
		if r.Addr+r.Len < r.Addr {
			return nil, fmt.Errorf("region at %#x of %d bytes wraps around", r.Addr, r.Len)
		}
		if i > 0 && t.regs[i-1].End() > r.Addr {
			return nil, fmt.Errorf("regions at %#x and %#x overlap", t.regs[i-1].Addr, r.Addr)
		}
	}
	return t, nil
}

// find returns the region holding addr, or -1.
func (t *regionTable) find(addr uint64) int {
	i := sort.Search(len(t.regs), func(i int) bool { return t.regs[i].End() > addr })
	if i < len(t.regs) && t.regs[i].Addr <= addr {
		return i
	}
	return -1
}

// Check returns the region that holds all of [addr, addr+n) and grants need,
// or a *RangeError naming the range.
func (t *regionTable) Check(addr, n uint64, need Access) (*RegionInfo, error) {
	if n == 0 {
		return nil, &RangeError{Addr: addr, Len: n, Err: ErrOutOfBounds, Detail: "zero-length request"}
	}
	if addr+n < addr {
		return nil, &RangeError{Addr: addr, Len: n, Err: ErrOutOfBounds, Detail: "range wraps around"}
	}
	i := t.find(addr)
	if i < 0 {
		return nil, &RangeError{Addr: addr, Len: n, Err: ErrOutOfBounds, Detail: "start is not in any registered region"}
	}
	r := &t.regs[i]
	if addr+n > r.End() {
		return nil, &RangeError{Addr: addr, Len: n, Err: ErrOutOfBounds,
			Detail: fmt.Sprintf("crosses the end of region [%#x, %#x)", r.Addr, r.End())}
	}
	if r.Access&need != need {
		return nil, &RangeError{Addr: addr, Len: n, Err: ErrAccessDenied,
			Detail: fmt.Sprintf("region [%#x, %#x) grants %v, request needs %v", r.Addr, r.End(), r.Access, need)}
	}
	return r, nil
}
