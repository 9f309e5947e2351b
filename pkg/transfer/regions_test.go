package transfer

import (
	"errors"
	"testing"
)

func TestRegionCheck(t *testing.T) {
	tab, err := newRegionTable([]RegionInfo{
		{Addr: 0x2000, Len: 0x1000, Access: AccessReadWrite},
		{Addr: 0x1000, Len: 0x1000, Access: AccessRead},
		{Addr: 0x8000, Len: 0x10, Access: AccessWrite},
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		addr uint64
		n    uint64
		need Access
		want error
	}{
		{"inside", 0x2000, 0x1000, AccessWrite, nil},
		{"adjacent regions are not one", 0x1800, 0x1000, AccessRead, ErrOutOfBounds},
		{"crosses end", 0x2fff, 2, AccessRead, ErrOutOfBounds},
		{"below all", 0x10, 1, AccessRead, ErrOutOfBounds},
		{"gap", 0x4000, 1, AccessRead, ErrOutOfBounds},
		{"after all", 0x8010, 1, AccessWrite, ErrOutOfBounds},
		{"wraps", 0x8000, ^uint64(0), AccessWrite, ErrOutOfBounds},
		{"zero length", 0x8000, 0, AccessWrite, ErrOutOfBounds},
		{"read-only", 0x1000, 8, AccessWrite, ErrAccessDenied},
		{"write-only", 0x8000, 8, AccessRead, ErrAccessDenied},
		{"last byte", 0x800f, 1, AccessWrite, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := tab.Check(c.addr, c.n, c.need)
			if c.want == nil && err != nil || c.want != nil && !errors.Is(err, c.want) {
				t.Fatalf("Check(%#x, %d) = %v, want %v", c.addr, c.n, err, c.want)
			}
		})
	}
	if _, err := newRegionTable([]RegionInfo{{Addr: 0, Len: 10}, {Addr: 5, Len: 10}}); err == nil {
		t.Fatal("overlapping regions accepted")
	}
}

// FuzzRegionCheck checks that an accepted range always lies inside one
// region granting the right, and a refused one never does.
func FuzzRegionCheck(f *testing.F) {
	f.Add(uint64(0x1000), uint64(0x100), uint64(0x1000), uint64(16), uint8(1))
	f.Add(uint64(0xffffffffffffff00), uint64(0x100), uint64(0xfffffffffffffff0), uint64(0x20), uint8(2))
	f.Fuzz(func(t *testing.T, raddr, rlen, addr, n uint64, need uint8) {
		tab, err := newRegionTable([]RegionInfo{{Addr: raddr, Len: rlen, Access: AccessRead}})
		if err != nil {
			return
		}
		acc := Access(need%2 + 1)
		r, err := tab.Check(addr, n, acc)
		inside := n > 0 && addr >= raddr && addr+n >= addr && addr+n <= raddr+rlen && acc == AccessRead
		if (err == nil) != inside {
			t.Fatalf("region [%#x,+%d) check [%#x,+%d) %v: err=%v, inside=%v", raddr, rlen, addr, n, acc, err, inside)
		}
		if err == nil && r.Addr != raddr {
			t.Fatal("wrong region")
		}
	})
}
