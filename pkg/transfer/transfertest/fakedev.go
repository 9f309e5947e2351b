package transfertest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// FakeDevice is device memory for CPU tests: a transfer.DeviceMemory whose
// bytes live in a host buffer the transports cannot see. Its addresses are
// those of an inaccessible (PROT_NONE) reservation, so a transport that
// dereferences a device address instead of staging it crashes the test.
// Copies run on goroutines, optionally slowed (SetDelay) or failing
// (SetFail).
type FakeDevice struct {
	guard []byte // PROT_NONE: the "device addresses"
	data  []byte // the bytes
	delay atomic.Int64
	fail  atomic.Pointer[error]
	stop  chan struct{}
	once  sync.Once
	wg    sync.WaitGroup
	count atomic.Int64
	now   atomic.Int64 // copies running
	peak  atomic.Int64 // most copies running at once
}

var _ transfer.DeviceMemory = (*FakeDevice)(nil)

// NewFakeDevice reserves size bytes of fake device memory.
func NewFakeDevice(size int) (*FakeDevice, error) {
	g, err := unix.Mmap(-1, 0, size, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return nil, fmt.Errorf("transfertest: reserve %d bytes: %w", size, err)
	}
	// The bytes are mapped outside the Go heap, like registered memory: the
	// race detector cannot see the sockets that order their accesses.
	d, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		unix.Munmap(g)
		return nil, fmt.Errorf("transfertest: map %d bytes: %w", size, err)
	}
	return &FakeDevice{guard: g, data: d, stop: make(chan struct{})}, nil
}

func (f *FakeDevice) Base() uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(f.guard)))) }
func (f *FakeDevice) Size() uint64 { return uint64(len(f.data)) }

// Share fails: a fake device cannot be mapped by another process.
func (f *FakeDevice) Share() (transfer.SharedHandle, error) {
	return transfer.SharedHandle{FD: -1}, fmt.Errorf("%w: fake device", transfer.ErrNotShareable)
}

// SetDelay makes every later copy take at least d.
func (f *FakeDevice) SetDelay(d time.Duration) { f.delay.Store(int64(d)) }

// SetFail makes every later copy fail with err (nil: copies succeed again).
func (f *FakeDevice) SetFail(err error) {
	if err == nil {
		f.fail.Store(nil)
		return
	}
	f.fail.Store(&err)
}

// Copies is how many copies were enqueued.
func (f *FakeDevice) Copies() int64 { return f.count.Load() }

// PeakCopies is the most copies that ran at once since the last
// ResetPeak.
func (f *FakeDevice) PeakCopies() int64 { return f.peak.Load() }

// ResetPeak starts PeakCopies over.
func (f *FakeDevice) ResetPeak() { f.peak.Store(0) }

// Data is the device's bytes, for checks (no copy runs when it is read).
func (f *FakeDevice) Data() []byte { return f.data }

func (f *FakeDevice) span(what string, dev uint64, n int) ([]byte, error) {
	base := f.Base()
	if n <= 0 || dev < base || dev+uint64(n) > base+f.Size() {
		return nil, fmt.Errorf("%w: fake %s of %d bytes at %#x: outside [%#x, +%d)", transfer.ErrDeviceCopy, what, n, dev, base, f.Size())
	}
	o := dev - base
	return f.data[o : o+uint64(n)], nil
}

func (f *FakeDevice) CopyToHost(dst []byte, src uint64) (transfer.Completion, error) {
	d, err := f.span("copy to host", src, len(dst))
	if err != nil {
		return nil, err
	}
	return f.start("copy to host", src, func() { copy(dst, d) }), nil
}

func (f *FakeDevice) CopyFromHost(dst uint64, src []byte) (transfer.Completion, error) {
	d, err := f.span("copy from host", dst, len(src))
	if err != nil {
		return nil, err
	}
	return f.start("copy from host", dst, func() { copy(d, src) }), nil
}

type fakeCompletion struct {
	done chan struct{}
	err  error
}

func (c *fakeCompletion) Wait(ctx context.Context) error {
	select { // a copy that ended reports its result even to a done ctx
	case <-c.done:
		return c.err
	default:
	}
	select {
	case <-c.done:
		return c.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (f *FakeDevice) start(what string, addr uint64, copyFn func()) *fakeCompletion {
	f.count.Add(1)
	c := &fakeCompletion{done: make(chan struct{})}
	delay := time.Duration(f.delay.Load())
	var failErr error
	if p := f.fail.Load(); p != nil {
		failErr = *p
	}
	if n := f.now.Add(1); n > f.peak.Load() {
		f.peak.Store(n) // racy max: good enough for a gauge
	}
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		defer close(c.done)
		defer f.now.Add(-1)
		if delay > 0 {
			t := time.NewTimer(delay)
			select {
			case <-t.C:
			case <-f.stop:
				t.Stop()
				c.err = fmt.Errorf("%w: fake %s at %#x: device closed", transfer.ErrDeviceCopy, what, addr)
				return
			}
		}
		if failErr != nil {
			c.err = fmt.Errorf("%w: fake %s at %#x: %w", transfer.ErrDeviceCopy, what, addr, failErr)
			return
		}
		copyFn()
	}()
	return c
}

type hostStaging struct{ b []byte }

func (s *hostStaging) Bytes() []byte { return s.b }
func (s *hostStaging) Close() error  { s.b = nil; return nil }

// AllocStaging returns a plain host buffer.
func (f *FakeDevice) AllocStaging(n int) (transfer.Staging, error) {
	if n <= 0 {
		return nil, fmt.Errorf("transfertest: staging of %d bytes", n)
	}
	return &hostStaging{b: make([]byte, n)}, nil
}

// Close ends pending copies (failing the slowed ones) and releases the
// reservation.
func (f *FakeDevice) Close() error {
	var err error
	f.once.Do(func() {
		close(f.stop)
		f.wg.Wait()
		err = errors.Join(unix.Munmap(f.guard), unix.Munmap(f.data))
	})
	return err
}
