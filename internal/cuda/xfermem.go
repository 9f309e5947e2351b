package cuda

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// A Pool is transfer.DeviceMemory: the transfer engine's transports share
// it (nvlink: its POSIX-FD or FABRIC handle) or stage it through pinned
// host memory (tcp), without importing this package.
var _ transfer.DeviceMemory = (*Pool)(nil)

// copySpin is how long a Wait polls without sleeping.
const copySpin = 200 * time.Microsecond

// copyStreams is how many streams a pool copies on per direction: copies
// are spread over them in turn, so one caller's long run of copies does
// not queue every other caller's behind it.
const copyStreams = 4

// poolCopies are a pool's copy streams (per direction, so copies to the
// host overlap copies from it) and their reusable events.
type poolCopies struct {
	once     sync.Once
	err      error
	toHost   [copyStreams]*Stream
	fromHost [copyStreams]*Stream
	next     atomic.Uint32
	mu       sync.Mutex // guards free
	free     []*Event
}

// Base is the pool's base address.
func (p *Pool) Base() uint64 { return uint64(p.ptr) }

// Share exports the pool's handle (a new fd for POSIX-FD pools, which the
// caller closes).
func (p *Pool) Share() (transfer.SharedHandle, error) {
	e, err := p.Export()
	if err != nil {
		return transfer.SharedHandle{FD: -1}, err
	}
	h := transfer.SharedHandle{FD: e.FD, Size: e.Size, Granularity: e.Granularity, Device: e.Device}
	switch e.HandleType {
	case HandlePosixFD:
		h.Kind = transfer.HandlePosixFD
	case HandleFabric:
		h.Kind, h.Fabric = transfer.HandleFabric, append([]byte(nil), e.Fabric[:]...)
	default:
		return transfer.SharedHandle{FD: -1}, fmt.Errorf("%w: GPU %d pool has %v handles", transfer.ErrNotShareable, p.ctx.dev, e.HandleType)
	}
	return h, nil
}

func (p *Pool) copies() (*poolCopies, error) {
	c := &p.xfer
	c.once.Do(func() {
		for i := 0; i < copyStreams && c.err == nil; i++ {
			if c.toHost[i], c.err = p.ctx.NewStream(StreamNonBlocking); c.err == nil {
				c.fromHost[i], c.err = p.ctx.NewStream(StreamNonBlocking)
			}
		}
		if c.err != nil {
			c.destroyStreams()
		}
	})
	if c.err != nil {
		return nil, fmt.Errorf("%w: GPU %d: copy streams: %v", transfer.ErrDeviceCopy, p.ctx.dev, c.err)
	}
	return c, nil
}

func (p *Pool) checkRange(what string, dev uint64, n int) error {
	if p.ptr == 0 {
		return fmt.Errorf("%w: %s: GPU %d pool is closed", transfer.ErrDeviceCopy, what, p.ctx.dev)
	}
	base := uint64(p.ptr)
	if n <= 0 || dev < base || dev+uint64(n) > base+p.size || dev+uint64(n) < dev {
		return fmt.Errorf("%w: %s of %d bytes at %#x: outside the GPU %d pool [%#x, +%d)", transfer.ErrDeviceCopy,
			what, n, dev, p.ctx.dev, base, p.size)
	}
	return nil
}

func (c *poolCopies) destroyStreams() {
	for i := range c.toHost {
		c.toHost[i].Destroy()
		c.fromHost[i].Destroy()
	}
}

// CopyToHost enqueues a copy of len(dst) bytes at src into dst (pinned
// staging from AllocStaging).
func (p *Pool) CopyToHost(dst []byte, src uint64) (transfer.Completion, error) {
	return p.enqueue("copy to host", src, len(dst), func(s *Stream) error {
		return s.MemcpyDtoH(unsafe.Pointer(unsafe.SliceData(dst)), DevicePtr(src), uint64(len(dst)))
	}, false)
}

// CopyFromHost enqueues a copy of src (pinned staging) to dst.
func (p *Pool) CopyFromHost(dst uint64, src []byte) (transfer.Completion, error) {
	return p.enqueue("copy from host", dst, len(src), func(s *Stream) error {
		return s.MemcpyHtoD(DevicePtr(dst), unsafe.Pointer(unsafe.SliceData(src)), uint64(len(src)))
	}, true)
}

func (p *Pool) enqueue(what string, dev uint64, n int, copyFn func(*Stream) error, fromHost bool) (transfer.Completion, error) {
	if err := p.checkRange(what, dev, n); err != nil {
		return nil, err
	}
	c, err := p.copies()
	if err != nil {
		return nil, err
	}
	k := c.next.Add(1) % copyStreams
	s := c.toHost[k]
	if fromHost {
		s = c.fromHost[k]
	}
	c.mu.Lock()
	var ev *Event
	if k := len(c.free); k > 0 {
		ev, c.free = c.free[k-1], c.free[:k-1]
	}
	c.mu.Unlock()
	if ev == nil {
		if ev, err = p.ctx.NewEvent(EventDisableTiming); err != nil {
			return nil, fmt.Errorf("%w: %s: %v", transfer.ErrDeviceCopy, what, err)
		}
	}
	if err = copyFn(s); err == nil {
		err = ev.Record(s)
	}
	if err != nil {
		ev.Destroy()
		return nil, fmt.Errorf("%w: %s of %d bytes at %#x on GPU %d: %v", transfer.ErrDeviceCopy, what, n, dev, p.ctx.dev, err)
	}
	return &poolCompletion{c: c, ev: ev, what: what, n: n, dev: dev, gpu: int(p.ctx.dev)}, nil
}

// poolCompletion polls its event: first back to back for up to copySpin
// (a copy of a staging chunk ends within tens of microseconds, and a Go
// timer of a few microseconds sleeps about a millisecond: a staged 64 KiB
// stream waited on that, its staging full), then with a backoff (at most
// 50 µs between polls) that needs no goroutine.
type poolCompletion struct {
	c    *poolCopies
	ev   *Event // nil once the copy ended
	res  error  // the copy's result, once it ended
	what string
	n    int
	dev  uint64
	gpu  int
}

func (pc *poolCompletion) Wait(ctx context.Context) error {
	if pc.ev == nil {
		return pc.res
	}
	sleep := time.Duration(0)
	spinEnd := time.Now().Add(copySpin)
	var t *time.Timer
	defer func() {
		if t != nil {
			t.Stop()
		}
	}()
	for {
		done, err := pc.ev.Query()
		if err != nil {
			pc.ev.Destroy() // the context is broken: do not reuse it
			pc.ev = nil
			pc.res = fmt.Errorf("%w: %s of %d bytes at %#x on GPU %d: %v", transfer.ErrDeviceCopy, pc.what, pc.n, pc.dev, pc.gpu, err)
			return pc.res
		}
		if done {
			pc.c.mu.Lock()
			pc.c.free = append(pc.c.free, pc.ev)
			pc.c.mu.Unlock()
			pc.ev = nil
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if time.Now().Before(spinEnd) {
			runtime.Gosched()
			continue
		}
		switch {
		case sleep == 0:
			sleep = 2 * time.Microsecond
			runtime.Gosched()
			continue
		case sleep < 50*time.Microsecond:
			sleep *= 2
		}
		if t == nil {
			t = time.NewTimer(sleep)
		} else {
			t.Reset(sleep)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// closeCopies destroys the copy streams and events (the pool is closing:
// no copy may be pending).
func (p *Pool) closeCopies() {
	c := &p.xfer
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, ev := range c.free {
		ev.Destroy()
	}
	c.free = nil
	c.destroyStreams()
}

// pinnedStaging is page-locked host memory holding its own reference to
// the primary context, so it outlives the pool that made it.
type pinnedStaging struct {
	ctx *Context
	mem *HostMem
}

// AllocStaging allocates n bytes of portable pinned host memory.
func (p *Pool) AllocStaging(n int) (transfer.Staging, error) {
	if n <= 0 {
		return nil, fmt.Errorf("cuda: staging of %d bytes", n)
	}
	c, err := p.ctx.dev.Retain()
	if err != nil {
		return nil, err
	}
	m, err := c.MemHostAlloc(uint64(n), HostAllocPortable)
	if err != nil {
		c.Release()
		return nil, fmt.Errorf("cuda: %d bytes of pinned staging for GPU %d: %w", n, p.ctx.dev, err)
	}
	return &pinnedStaging{ctx: c, mem: m}, nil
}

func (s *pinnedStaging) Bytes() []byte { return s.mem.Bytes() }

func (s *pinnedStaging) Close() error {
	if s.mem == nil {
		return nil
	}
	err := s.mem.Free()
	s.mem = nil
	if rerr := s.ctx.Release(); err == nil {
		err = rerr
	}
	return err
}
