package transfer

import (
	"fmt"
	"strconv"
	"strings"
)

// MemoryKind is where a region's bytes live.
type MemoryKind string

const (
	CPU  MemoryKind = "cpu"
	CUDA MemoryKind = "cuda"
)

// Location is a memory kind and a device index: "cpu:0" is NUMA node 0,
// "cuda:1" is GPU 1.
type Location struct {
	Kind  MemoryKind
	Index int
}

func (l Location) String() string { return fmt.Sprintf("%s:%d", l.Kind, l.Index) }

// ParseLocation parses "cpu:N", "cuda:N", or "cpu" / "cuda" (index 0).
func ParseLocation(s string) (Location, error) {
	kind, idx, found := strings.Cut(s, ":")
	l := Location{Kind: MemoryKind(kind)}
	if l.Kind != CPU && l.Kind != CUDA {
		return Location{}, fmt.Errorf("transfer: location %q: kind must be cpu or cuda", s)
	}
	if found {
		n, err := strconv.Atoi(idx)
		if err != nil || n < 0 {
			return Location{}, fmt.Errorf("transfer: location %q: bad index", s)
		}
		l.Index = n
	}
	return l, nil
}

// MarshalText makes a Location a JSON string.
func (l Location) MarshalText() ([]byte, error) { return []byte(l.String()), nil }

// UnmarshalText parses a Location from a JSON string.
func (l *Location) UnmarshalText(b []byte) error {
	v, err := ParseLocation(string(b))
	if err != nil {
		return err
	}
	*l = v
	return nil
}

// Access is a set of rights a peer has on a region.
type Access uint8

const (
	AccessRead      Access = 1 << iota // peers may READ from the region
	AccessWrite                        // peers may WRITE into the region
	AccessReadWrite = AccessRead | AccessWrite
)

func (a Access) String() string {
	switch a {
	case AccessRead:
		return "read"
	case AccessWrite:
		return "write"
	case AccessReadWrite:
		return "read-write"
	}
	return "none"
}

// Op is a transfer direction, seen from the initiator.
type Op uint8

const (
	Read  Op = iota // copy from the remote region into local memory
	Write           // copy local memory into the remote region
)

func (o Op) String() string {
	if o == Read {
		return "read"
	}
	return "write"
}

// need is the access right a remote region must grant for o.
func (o Op) need() Access {
	if o == Read {
		return AccessRead
	}
	return AccessWrite
}
