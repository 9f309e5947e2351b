package nvlink

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// TestGPUWriteLegacyIPC runs after the VMM, host and speed tests (file
// order), so a sticky CUDA error here cannot hide their results.
func TestGPUWriteLegacyIPC(t *testing.T) {
	r := getRig(t)
	for _, c := range []struct {
		page uint64
		n    int
	}{{4 << 10, 1}, {4 << 10, 16384}, {64 << 10, 1024}, {1 << 20, 64}} {
		t.Run(fmt.Sprintf("page=%dKiB/batch=%d", c.page>>10, c.n), func(t *testing.T) { r.writeCase(t, "ipc", c.page, c.n, false) })
	}
	t.Run("read", func(t *testing.T) { r.readCase(t, "ipc", 16<<10, 4096) })
}

// TestGPUPeerDeath runs last (file order): it kills the shared target and
// expects the next batch to fail with ErrPeerDead, and the imports dropped.
func TestGPUPeerDeath(t *testing.T) {
	r := getRig(t)
	tr := r.tg.region("pool")
	reqs := []transfer.Request{{Op: transfer.Write, Local: uintptr(r.local.Ptr()), Len: 4096, Segment: r.seg, Remote: tr.Addr}}
	must(t, r.e.Transfer(context.Background(), reqs))
	must(t, r.tg.cmd.Process.Kill())
	r.tg.cmd.Wait()
	p := r.nv.peerState(r.tg.ready.Segment)
	deadline := time.Now().Add(10 * time.Second)
	for p != nil && !p.link.Dead() && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	err := r.e.Transfer(context.Background(), reqs)
	if !errors.Is(err, transfer.ErrPeerDead) {
		t.Fatalf("after the target was killed: %v, want ErrPeerDead", err)
	}
	t.Logf("after kill: %v", err)
	if p != nil && p.mapCount() != 0 {
		t.Fatalf("%d imports left after the peer died", p.mapCount())
	}
}
