package disagg

import (
	"context"
	"fmt"
	"sync"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// auxSlots is a registered host buffer cut into AuxSize slots.
type auxSlots struct {
	mem  *transfer.HostMemory
	mu   sync.Mutex
	free []int
}

func newAuxSlots(ctx context.Context, e Transfer, n int) (*auxSlots, error) {
	mem, err := e.AllocHost(ctx, int64(n*AuxSize), 0, transfer.AccessReadWrite)
	if err != nil {
		return nil, fmt.Errorf("disagg: aux buffer: %w", err)
	}
	a := &auxSlots{mem: mem}
	for i := n - 1; i >= 0; i-- {
		a.free = append(a.free, i)
	}
	return a, nil
}

func (a *auxSlots) get() (int, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.free) == 0 {
		return 0, fmt.Errorf("disagg: all %d aux slots in use", len(a.mem.Bytes())/AuxSize)
	}
	s := a.free[len(a.free)-1]
	a.free = a.free[:len(a.free)-1]
	clear(a.slot(s))
	return s, nil
}

func (a *auxSlots) put(s int) {
	a.mu.Lock()
	a.free = append(a.free, s)
	a.mu.Unlock()
}

func (a *auxSlots) slot(s int) []byte { return a.mem.Bytes()[s*AuxSize : (s+1)*AuxSize] }

func (a *auxSlots) addr(s int) uint64 { return a.mem.Addr() + uint64(s*AuxSize) }

func (a *auxSlots) inUse() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.mem.Bytes())/AuxSize - len(a.free)
}
