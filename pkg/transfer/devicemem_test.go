package transfer

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
)

type spanMemory struct{ base, size uint64 }

func (m spanMemory) Base() uint64                 { return m.base }
func (m spanMemory) Size() uint64                 { return m.size }
func (m spanMemory) Share() (SharedHandle, error) { return SharedHandle{FD: -1}, ErrNotShareable }

// memTransport records the Memory its regions were registered with.
type memTransport struct {
	nopTransport
	got chan Memory
}

func (m memTransport) RegisterRegion(r *Region) (json.RawMessage, error) {
	m.got <- r.Memory
	return nil, nil
}

// TestRegisterWithMemory: the memory given reaches the transports, and a
// range outside it is refused before any transport sees it.
func TestRegisterWithMemory(t *testing.T) {
	tr := memTransport{got: make(chan Memory, 4)}
	e, err := New(context.Background(), Config{Transports: []Transport{tr}})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	m := spanMemory{base: 0x7f0000000000, size: 1 << 20}
	loc := Location{Kind: CUDA}
	ctx := context.Background()
	for _, c := range []struct{ addr, n uint64 }{{m.base - 1, 16}, {m.base + m.size - 8, 16}} {
		err := e.RegisterMemory(ctx, uintptr(c.addr), c.n, loc, AccessReadWrite, WithMemory(m))
		if err == nil || !strings.Contains(err.Error(), "not inside the memory given") {
			t.Errorf("[%#x, +%d): %v, want a refusal naming the memory", c.addr, c.n, err)
		}
	}
	if len(tr.got) != 0 {
		t.Fatal("a transport saw a refused region")
	}
	if err := e.RegisterMemory(ctx, uintptr(m.base+4096), 4096, loc, AccessReadWrite, WithMemory(m)); err != nil {
		t.Fatal(err)
	}
	if got := <-tr.got; got != Memory(m) {
		t.Fatalf("transport got memory %v, want %v", got, m)
	}
}
