// Package collective is the communication a tensor-parallel model's ranks
// need: all-reduce (sum), all-gather, broadcast and barrier over float32
// buffers, behind one interface with two implementations: NewLocal, the
// ranks of one process on the CPU with a fixed reduction order, and
// collective/nccl, NCCL loaded at run time for GPUs.
package collective

import (
	"context"
	"errors"
	"fmt"
)

// Comm is one rank's end of a communicator of Size ranks. Every rank calls
// the same operations in the same order with buffers of the same length
// (from its own goroutine). An operation is done for the caller when it
// returns (CPU), or once the rank's stream reaches it (NCCL: it is
// enqueued there). After a failure the communicator is broken: every rank's
// operations fail, with an error wrapping ErrAborted.
type Comm interface {
	Rank() int
	Size() int
	// AllReduce replaces b on every rank with the sum over the ranks.
	AllReduce(ctx context.Context, b Buf) error
	// AllGather writes every rank's send into recv, rank r's at r*send.N;
	// recv holds Size*send.N values.
	AllGather(ctx context.Context, send, recv Buf) error
	// Broadcast copies root's b into every rank's b.
	Broadcast(ctx context.Context, b Buf, root int) error
	// Barrier returns once every rank has reached it.
	Barrier(ctx context.Context) error
	// Close releases the rank's end; a rank's operation waiting for the
	// others fails.
	Close() error
}

// Buf is N float32 values in the memory a communicator works on: Host
// for the CPU one, device memory of the rank's GPU (Dev) for NCCL.
type Buf struct {
	Host []float32
	Dev  uintptr
	N    int
}

// Host is a host buffer.
func Host(v []float32) Buf { return Buf{Host: v, N: len(v)} }

// Device is a buffer of n float32 values at device address p.
func Device(p uintptr, n int) Buf { return Buf{Dev: p, N: n} }

// ErrAborted is wrapped by the errors of a broken communicator.
var ErrAborted = errors.New("collective: communicator aborted")

// Error is a failed operation: the rank that failed it, the operation and
// the cause. The other ranks' operations fail with an Error naming the
// rank that broke the communicator.
type Error struct {
	Rank int    // the rank whose failure broke the communicator
	Op   string // "all_reduce", "all_gather", "broadcast", "barrier"
	Err  error
}

func (e *Error) Error() string {
	return fmt.Sprintf("collective: %s: tp rank %d: %v", e.Op, e.Rank, e.Err)
}

func (e *Error) Unwrap() error { return e.Err }
