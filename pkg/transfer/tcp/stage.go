package tcp

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// Staging directions: each has its own slots, so the side of a lane that
// sends never waits for slots the side that receives holds (and so never
// for the peer).
const (
	toWire   = 0 // device -> staging -> socket
	fromWire = 1 // socket -> staging -> device
)

// stager is one lane's staging memory for device regions: 2*slots slots of
// chunk bytes in one allocation, made once at the first device request
// (from that region's transfer.DeviceMemory) and freed when the lane ends.
type stager struct {
	chunk, slots int

	once  sync.Once
	err   error
	mem   transfer.Staging
	pools [2]chan []byte

	busy   sync.WaitGroup // copies past their context, still holding a slot
	leaked atomic.Bool    // a copy never ended: the memory must not be freed
}

func newStager(chunk, slots int) *stager { return &stager{chunk: chunk, slots: slots} }

// init allocates the staging memory from dev the first time; later calls
// return the first call's error.
func (s *stager) init(dev transfer.DeviceMemory) error {
	s.once.Do(func() {
		m, err := dev.AllocStaging(2 * s.slots * s.chunk)
		if err != nil {
			s.err = fmt.Errorf("tcp: %d bytes of staging: %w", 2*s.slots*s.chunk, err)
			return
		}
		if b := m.Bytes(); len(b) < 2*s.slots*s.chunk {
			m.Close()
			s.err = fmt.Errorf("tcp: staging of %d bytes, asked for %d", len(b), 2*s.slots*s.chunk)
			return
		}
		s.mem = m
		b := m.Bytes()
		for d := range s.pools {
			s.pools[d] = make(chan []byte, s.slots)
			for i := 0; i < s.slots; i++ {
				k := (d*s.slots + i) * s.chunk
				s.pools[d] <- b[k : k+s.chunk : k+s.chunk]
			}
		}
	})
	return s.err
}

// tryGet returns a free slot of direction d, if one is.
func (s *stager) tryGet(d int) ([]byte, bool) {
	select {
	case b := <-s.pools[d]:
		return b, true
	default:
		return nil, false
	}
}

// get waits for a free slot of direction d, at most tmo or until stop.
func (s *stager) get(d int, stop <-chan struct{}, tmo time.Duration) ([]byte, error) {
	if b, ok := s.tryGet(d); ok {
		return b, nil
	}
	t := time.NewTimer(tmo)
	defer t.Stop()
	select {
	case b := <-s.pools[d]:
		return b, nil
	case <-stop:
		return nil, errStopped
	case <-t.C:
		return nil, fmt.Errorf("%w: tcp: no staging slot came free for %v (%d slots of %d bytes)", transfer.ErrDeviceCopy, tmo, s.slots, s.chunk)
	}
}

var errStopped = fmt.Errorf("tcp: lane ended")

func (s *stager) put(d int, b []byte) {
	if b != nil {
		s.pools[d] <- b[:cap(b)]
	}
}

// settle takes over a copy whose waiter's context ended: it waits for the
// copy at most bound more, then calls done(ended) and, if the copy ended,
// returns the slot. A copy that never ends keeps its slot, and the staging
// memory is then never freed. done gets the copy's result (a context error
// if it never ended).
func (s *stager) settle(d int, slot []byte, c transfer.Completion, bound time.Duration, done func(err error, ended bool)) {
	s.busy.Add(1)
	go func() {
		defer s.busy.Done()
		ctx, cancel := context.WithTimeout(context.Background(), bound)
		err := c.Wait(ctx)
		ended := err == nil || ctx.Err() == nil || errors.Is(err, transfer.ErrDeviceCopy)
		cancel()
		if ended {
			s.put(d, slot)
		} else {
			s.leaked.Store(true)
		}
		done(err, ended)
	}()
}

// close frees the staging memory once no copy holds a slot. Call it after
// the lane's goroutines ended.
func (s *stager) close() error {
	s.busy.Wait()
	if s.mem == nil || s.leaked.Load() {
		return nil
	}
	return s.mem.Close()
}

// deviceOf returns the region's device memory, if it must be staged. A GPU
// region without one cannot be reached by tcp at all.
func deviceOf(r *transfer.Region) (transfer.DeviceMemory, error) {
	if r == nil {
		return nil, nil
	}
	if dm, ok := r.Memory.(transfer.DeviceMemory); ok {
		return dm, nil
	}
	if r.Location.Kind != transfer.CPU {
		return nil, fmt.Errorf("%w: tcp: %v region [%#x, +%d) has no transfer.DeviceMemory to stage through (register it WithMemory)",
			transfer.ErrDeviceCopy, r.Location, r.Addr, r.Len)
	}
	return nil, nil
}
