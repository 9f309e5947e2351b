package shm

import (
	"context"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/tcp"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

// shmThenTCP is the usual same-machine setup: shm first, tcp as the
// fallback for memory shm cannot share.
func shmThenTCP() []transfer.Transport {
	return []transfer.Transport{New(Config{}), tcp.New(tcp.Config{})}
}

func TestConformance(t *testing.T) { transfertest.Run(t, shmThenTCP) }

func TestConformanceProcess(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	transfertest.RunProcess(t, shmThenTCP)
}

// TestFallbackToTCP: memfd-backed regions go through shm, plain Go memory
// (which shm refuses at registration) through tcp, in one batch.
func TestFallbackToTCP(t *testing.T) {
	mk := func() *transfer.Engine {
		e, err := transfer.New(context.Background(), transfer.Config{Transports: shmThenTCP()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.Close() })
		return e
	}
	target, init := mk(), mk()
	ctx := context.Background()
	shared, err := target.AllocHost(ctx, 1<<20, 0, transfer.AccessReadWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer shared.Close()
	// Anonymous memory: not memfd-backed (and, unlike the Go heap, outside
	// the race detector's view: the tcp server writes it on another
	// goroutine, ordered only through sockets).
	plain, err := unix.Mmap(-1, 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(plain)
	if err := target.RegisterMemory(ctx, uintptr(bytesAddr(plain)), uint64(len(plain)), transfer.Location{Kind: transfer.CPU}, transfer.AccessReadWrite); err != nil {
		t.Fatalf("plain memory with tcp installed: %v", err)
	}
	if h := target.Self().Regions; len(h) != 2 {
		t.Fatalf("%d regions published", len(h))
	}
	src, err := init.AllocHost(ctx, 2<<20, 0, transfer.AccessReadWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	random(t, src.Bytes())
	fill(shared.Bytes(), 0xAB)
	fill(plain, 0xAB)
	seg, err := init.OpenSegment(ctx, target.Name())
	if err != nil {
		t.Fatal(err)
	}
	reqs := []transfer.Request{
		{Op: transfer.Write, Local: uintptr(src.Addr()), Len: 1 << 20, Segment: seg, Remote: shared.Addr()},
		{Op: transfer.Write, Local: uintptr(src.Addr() + 1<<20), Len: 1 << 20, Segment: seg, Remote: bytesAddr(plain)},
	}
	b, err := init.Submit(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if got := b.Status(0).Transport; got != Name {
		t.Errorf("memfd region went through %s, want shm", got)
	}
	if got := b.Status(1).Transport; got != "tcp" {
		t.Errorf("plain region went through %s, want tcp", got)
	}
	checkEqual(t, "shm region", shared.Bytes(), src.Bytes()[:1<<20])
	checkEqual(t, "tcp region", plain, src.Bytes()[1<<20:])
	target.UnregisterMemory(ctx, uintptr(bytesAddr(plain)))
}
