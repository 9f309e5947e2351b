// Package nccl is the collective.Comm of GPUs: NCCL (libnccl.so.2) loaded
// with dlopen at run time, its few types and entry points declared here,
// so a binary built without NCCL's headers builds and runs anywhere; every
// call then fails with an error wrapping ErrNoLibrary. One process drives
// N GPUs: NewComms makes their communicators together (ncclCommInitAll),
// and each rank's goroutine enqueues its operations on its own stream.
package nccl

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/mooncake-go/mooncake-go/internal/collective"
	"github.com/mooncake-go/mooncake-go/internal/cuda"
)

// ErrNoLibrary is wrapped when libnccl cannot be loaded or lacks a symbol.
var ErrNoLibrary = errors.New("nccl: libnccl not found")

// ErrUnavailable is wrapped (with ErrNoLibrary) when built without cgo.
var ErrUnavailable = errors.New("nccl: unavailable (built without cgo)")

// Libraries are the sonames Load tries, in order.
var Libraries = []string{"libnccl.so.2", "libnccl.so"}

// Result is an ncclResult_t.
type Result int

// Results.
const (
	Success            Result = 0
	UnhandledCudaError Result = 1
	SystemError        Result = 2
	InternalError      Result = 3
	InvalidArgument    Result = 4
	InvalidUsage       Result = 5
	RemoteError        Result = 6
	InProgress         Result = 7
)

var resultNames = map[Result]string{0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError",
	3: "ncclInternalError", 4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress"}

// Name is the result's C name.
func (r Result) Name() string {
	if n, ok := resultNames[r]; ok {
		return n
	}
	return fmt.Sprintf("ncclResult(%d)", int(r))
}

// The ncclDataType_t and ncclRedOp_t values used.
const (
	typeFloat32 = 7
	opSum       = 0
)

// Error is a failed NCCL call, with ncclGetErrorString's text.
type Error struct {
	Op     string
	Result Result
	Msg    string
}

func (e *Error) Error() string {
	if e.Msg == "" {
		return fmt.Sprintf("nccl: %s: %s", e.Op, e.Result.Name())
	}
	return fmt.Sprintf("nccl: %s: %s (%s)", e.Op, e.Result.Name(), e.Msg)
}

func check(op string, r Result) error {
	if r == Success {
		return nil
	}
	return &Error{Op: op, Result: r, Msg: errorString(r)}
}

// Comm is one rank's NCCL communicator, enqueuing on its stream.
type Comm struct {
	h       uintptr // ncclComm_t
	rank    int
	size    int
	stream  *cuda.Stream
	scratch cuda.DevicePtr // one float for Barrier
	mu      sync.Mutex
	broken  error
}

var _ collective.Comm = (*Comm)(nil)

// NewComms makes the communicators of GPUs devs, rank i on devs[i]
// enqueuing on streams[i] (a stream of that device's primary context), all
// at once (ncclCommInitAll).
func NewComms(devs []int, streams []*cuda.Stream) ([]*Comm, error) {
	if len(devs) == 0 || len(devs) != len(streams) {
		return nil, fmt.Errorf("nccl: %d devices, %d streams", len(devs), len(streams))
	}
	if _, err := Load(); err != nil {
		return nil, err
	}
	hs, err := initAll(devs)
	if err != nil {
		return nil, err
	}
	out := make([]*Comm, len(devs))
	for i, h := range hs {
		c := &Comm{h: h, rank: i, size: len(devs), stream: streams[i]}
		if c.scratch, err = streams[i].Context().MemAlloc(4); err != nil {
			for _, o := range out[:i] {
				o.Close()
			}
			for _, h := range hs[i:] {
				destroy(h)
			}
			return nil, fmt.Errorf("nccl: rank %d barrier buffer: %w", i, err)
		}
		out[i] = c
	}
	return out, nil
}

// Version is NCCL's version code (major*10000 + minor*100 + patch since 2.9).
func Version() (int, error) {
	if _, err := Load(); err != nil {
		return 0, err
	}
	return version()
}

func (c *Comm) Rank() int { return c.rank }
func (c *Comm) Size() int { return c.size }

// Stream is the stream the rank's operations are enqueued on.
func (c *Comm) Stream() *cuda.Stream { return c.stream }

// do runs one enqueue; a failure aborts the communicator.
func (c *Comm) do(ctx context.Context, op string, f func() error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.broken != nil {
		return c.broken
	}
	err := ctx.Err()
	if err == nil {
		err = f()
	}
	if err != nil {
		if c.h != 0 {
			abort(c.h) // the communicator is unusable after a failed call
			c.h = 0
		}
		c.broken = &collective.Error{Rank: c.rank, Op: op, Err: fmt.Errorf("%w: %w", collective.ErrAborted, err)}
		return c.broken
	}
	return nil
}

func device(op string, bs ...collective.Buf) error {
	for _, b := range bs {
		if b.Dev == 0 || b.Host != nil {
			return fmt.Errorf("nccl: %s: not a device buffer", op)
		}
	}
	return nil
}

// AllReduce sums b over the ranks, in place (ncclAllReduce, float32).
func (c *Comm) AllReduce(ctx context.Context, b collective.Buf) error {
	return c.AllReduceTo(ctx, b, b)
}

// AllReduceTo writes the sum of send over the ranks into recv.
func (c *Comm) AllReduceTo(ctx context.Context, send, recv collective.Buf) error {
	return c.do(ctx, "all_reduce", func() error {
		if err := device("all_reduce", send, recv); err != nil {
			return err
		}
		if send.N != recv.N {
			return fmt.Errorf("nccl: all_reduce of %d values into %d", send.N, recv.N)
		}
		return check("ncclAllReduce", allReduce(send.Dev, recv.Dev, send.N, c.h, c.stream.Handle()))
	})
}

// AllGather gathers every rank's send into recv in rank order.
func (c *Comm) AllGather(ctx context.Context, send, recv collective.Buf) error {
	return c.do(ctx, "all_gather", func() error {
		if err := device("all_gather", send, recv); err != nil {
			return err
		}
		if recv.N != c.size*send.N {
			return fmt.Errorf("nccl: all_gather of %d values from %d ranks into %d", send.N, c.size, recv.N)
		}
		return check("ncclAllGather", allGather(send.Dev, recv.Dev, send.N, c.h, c.stream.Handle()))
	})
}

// Broadcast copies root's b into every rank's b.
func (c *Comm) Broadcast(ctx context.Context, b collective.Buf, root int) error {
	return c.do(ctx, "broadcast", func() error {
		if err := device("broadcast", b); err != nil {
			return err
		}
		if root < 0 || root >= c.size {
			return fmt.Errorf("nccl: broadcast from root %d of %d ranks", root, c.size)
		}
		return check("ncclBroadcast", broadcast(b.Dev, b.N, root, c.h, c.stream.Handle()))
	})
}

// Barrier all-reduces one value and waits for the stream: it returns once
// every rank's stream has reached it.
func (c *Comm) Barrier(ctx context.Context) error {
	return c.do(ctx, "barrier", func() error {
		if err := check("ncclAllReduce", allReduce(uintptr(c.scratch), uintptr(c.scratch), 1, c.h, c.stream.Handle())); err != nil {
			return err
		}
		return c.stream.Synchronize()
	})
}

// Capturable says that the rank's operations can be captured in a CUDA
// graph of its stream (NCCL's are).
func (c *Comm) Capturable() bool { return true }

// Abort ends the communicator at once (ncclCommAbort): operations of any
// rank still waiting on the device end, so a pass whose rank failed does
// not hang the others. The communicator is broken after it.
func (c *Comm) Abort() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.h != 0 {
		abort(c.h)
		c.h = 0
	}
	if c.broken == nil {
		c.broken = &collective.Error{Rank: c.rank, Op: "abort", Err: fmt.Errorf("%w: aborted", collective.ErrAborted)}
	}
}

// Close destroys the communicator (ncclCommDestroy) and its barrier buffer.
func (c *Comm) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	var errs []error
	if c.h != 0 {
		errs = append(errs, check("ncclCommDestroy", destroy(c.h)))
		c.h = 0
	}
	if c.scratch != 0 {
		errs = append(errs, c.stream.Context().MemFree(c.scratch))
		c.scratch = 0
	}
	if c.broken == nil {
		c.broken = &collective.Error{Rank: c.rank, Op: "close", Err: fmt.Errorf("%w: closed", collective.ErrAborted)}
	}
	return errors.Join(errs...)
}
