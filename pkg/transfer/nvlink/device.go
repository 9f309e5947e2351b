package nvlink

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// device is the per-GPU state of the initiator: the primary context, one
// stream the batches of this GPU run on, the copier and spare events.
type device struct {
	idx    int
	ctx    *cuda.Context
	once   sync.Once
	err    error
	stream *cuda.Stream
	cp     *cuda.Copier
	evMu   sync.Mutex
	events []*cuda.Event
}

// device returns GPU i's context (retained on first use).
func (t *Transport) device(i int) (*device, error) {
	if i < 0 || i >= t.ndev {
		return nil, fmt.Errorf("%s: no GPU %d (this process sees %d)", t.name, i, t.ndev)
	}
	t.devMu.Lock()
	d := t.devs[i]
	if d == nil {
		d = &device{idx: i}
		t.devs[i] = d
	}
	t.devMu.Unlock()
	d.once.Do(func() {
		dv, err := cuda.GetDevice(i)
		if err == nil {
			d.ctx, err = dv.Retain()
		}
		d.err = err
	})
	if d.err != nil {
		return nil, fmt.Errorf("%s: GPU %d: %w", t.name, i, d.err)
	}
	return d, nil
}

// copier returns GPU i's stream and copier, created on first use (the
// kernels compile, or load from the on-disk cache, then).
func (t *Transport) copier(i int) (*device, error) {
	d, err := t.device(i)
	if err != nil {
		return nil, err
	}
	t.devMu.Lock()
	defer t.devMu.Unlock()
	if d.cp != nil {
		return d, nil
	}
	k := t.cfg.Kernels
	if k == nil {
		if k, err = cuda.NewKernels(cuda.KernelsConfig{Logger: t.lg}); err != nil {
			return nil, fmt.Errorf("%s: %w", t.name, err)
		}
		t.cfg.Kernels = k
	}
	s, err := d.ctx.NewStream(cuda.StreamNonBlocking)
	if err != nil {
		return nil, err
	}
	cp, err := cuda.NewCopier(d.ctx, k, t.cfg.Copier)
	if err != nil {
		s.Destroy()
		return nil, fmt.Errorf("%s: GPU %d: copy kernels: %w", t.name, i, err)
	}
	d.stream, d.cp = s, cp
	return d, nil
}

func (d *device) event() (*cuda.Event, error) {
	d.evMu.Lock()
	if n := len(d.events); n > 0 {
		e := d.events[n-1]
		d.events = d.events[:n-1]
		d.evMu.Unlock()
		return e, nil
	}
	d.evMu.Unlock()
	return d.ctx.NewEvent(cuda.EventDisableTiming)
}

func (d *device) putEvent(e *cuda.Event) {
	d.evMu.Lock()
	d.events = append(d.events, e)
	d.evMu.Unlock()
}

func (d *device) close() error {
	if d.ctx == nil {
		return nil
	}
	var errs []error
	if d.stream != nil {
		errs = append(errs, d.stream.Synchronize())
	}
	if d.cp != nil {
		errs = append(errs, d.cp.Close())
	}
	errs = append(errs, d.stream.Destroy())
	for _, e := range d.events {
		errs = append(errs, e.Destroy())
	}
	errs = append(errs, d.ctx.Release())
	d.ctx = nil
	return errors.Join(errs...)
}

// pin is a local host region page-locked for the GPU (so kernels read or
// write it over PCIe): host -> peer GPU transfers.
type pin struct {
	ctx  *cuda.Context
	ptr  unsafe.Pointer
	dev  cuda.DevicePtr
	mine bool // registered by us (else it already was)
}

func (p *pin) release() {
	if p.mine {
		p.ctx.MemHostUnregister(p.ptr)
	}
}

// pinLocal page-locks a local host region once (portable: every GPU of the
// process reaches it) and returns its device address.
func (t *Transport) pinLocal(r *transfer.Region, d *device) (*pin, error) {
	t.mu.Lock()
	pn := t.pinned[r]
	t.mu.Unlock()
	if pn != nil {
		return pn, nil
	}
	ptr := hostPtr(r.Addr)
	pn = &pin{ctx: d.ctx, ptr: ptr, mine: true}
	err := d.ctx.MemHostRegister(ptr, r.Len, cuda.HostRegisterPortable|cuda.HostRegisterDeviceMap)
	if cuda.Code(err) == cuda.ErrorHostMemoryRegistered {
		pn.mine, err = false, nil
	}
	if err != nil {
		return nil, fmt.Errorf("%s: page-lock local host region [%#x, +%d) for GPU %d: %w", t.name, r.Addr, r.Len, d.idx, err)
	}
	if pn.dev, err = d.ctx.MemHostGetDevicePointer(ptr); err != nil {
		pn.release()
		return nil, err
	}
	t.mu.Lock()
	if old := t.pinned[r]; old != nil || t.closed {
		t.mu.Unlock()
		pn.release()
		if old == nil {
			return nil, transfer.ErrClosed
		}
		return old, nil
	}
	t.pinned[r] = pn
	t.mu.Unlock()
	return pn, nil
}

// cudaDevice0 retains GPU 0's primary context for the fabric probe (the
// context is cached by the driver; the probe's outcome by cuda.Context).
func cudaDevice0() (*cuda.Context, error) {
	d, err := cuda.GetDevice(0)
	if err != nil {
		return nil, err
	}
	return d.Retain()
}

// hostPtr turns the address of host memory outside the Go heap (an mmap'ed
// region) into a pointer for the driver.
func hostPtr(a uint64) unsafe.Pointer {
	p := uintptr(a)
	return *(*unsafe.Pointer)(unsafe.Pointer(&p))
}

// Available reports why no GPU transport can work in this process (nil
// when a CUDA driver and at least one GPU are present).
func Available() error {
	n, err := cuda.DeviceCount()
	if err != nil {
		return err
	}
	if n == 0 {
		return cuda.ErrNoDevice
	}
	return nil
}
