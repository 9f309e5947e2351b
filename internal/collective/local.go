package collective

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

// NewLocal makes a communicator of n ranks of one process, on host
// buffers. Its all-reduce sums in rank order (((b0 + b1) + b2) + ...),
// element by element, each rank summing a slice of the elements for all:
// every rank gets the same bits, whatever the buffer's length or the
// timing. A rank whose context ends while it waits breaks the
// communicator.
func NewLocal(n int) []Comm {
	g := &local{n: n, gen: make(chan struct{}), broken: make(chan struct{}), bufs: make([][]float32, n)}
	out := make([]Comm, n)
	for r := range out {
		out[r] = &localComm{g: g, rank: r}
	}
	return out
}

type local struct {
	n      int
	bufs   [][]float32 // what each rank published for the current operation
	mu     sync.Mutex
	come   int           // ranks at the current barrier
	gen    chan struct{} // closed when the current barrier is complete
	broken chan struct{} // closed by abort
	err    *Error
}

type localComm struct {
	g    *local
	rank int
}

var _ Comm = (*localComm)(nil)

func (c *localComm) Rank() int { return c.rank }
func (c *localComm) Size() int { return c.g.n }

// abort breaks the communicator for every rank (the first cause wins).
func (g *local) abort(rank int, op string, cause error) *Error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.err == nil {
		g.err = &Error{Rank: rank, Op: op, Err: fmt.Errorf("%w: %w", ErrAborted, cause)}
		close(g.broken)
	}
	return g.err
}

func (g *local) failed() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.err != nil {
		return g.err
	}
	return nil
}

// wait is a barrier of all ranks.
func (g *local) wait(ctx context.Context, rank int, op string) error {
	g.mu.Lock()
	if g.err != nil {
		g.mu.Unlock()
		return g.err
	}
	ch := g.gen
	if g.come++; g.come == g.n {
		g.come = 0
		g.gen = make(chan struct{})
		close(ch)
		g.mu.Unlock()
		return nil
	}
	g.mu.Unlock()
	select {
	case <-ch:
		return nil
	case <-g.broken:
		return g.failed()
	case <-ctx.Done():
		select {
		case <-ch: // complete after all
			return nil
		default:
		}
		return g.abort(rank, op, ctx.Err())
	}
}

// publish checks b, makes it rank's buffer of this operation and waits for
// the others'.
func (c *localComm) publish(ctx context.Context, op string, b Buf) error {
	if b.Dev != 0 || len(b.Host) != b.N {
		return c.g.abort(c.rank, op, fmt.Errorf("not a host buffer (%d host values, N %d)", len(b.Host), b.N))
	}
	c.g.bufs[c.rank] = b.Host
	return c.g.wait(ctx, c.rank, op)
}

// sameLen reports a length mismatch (every rank sees the same).
func (c *localComm) sameLen(op string) error {
	n := len(c.g.bufs[0])
	for k, b := range c.g.bufs {
		if len(b) != n {
			return c.g.abort(c.rank, op, fmt.Errorf("rank %d has %d values, rank 0 %d", k, len(b), n))
		}
	}
	return nil
}

func (c *localComm) AllReduce(ctx context.Context, b Buf) error {
	const op = "all_reduce"
	g := c.g
	if g.n == 1 {
		return g.failed()
	}
	if err := c.publish(ctx, op, b); err != nil {
		return err
	}
	if err := c.sameLen(op); err != nil {
		return err
	}
	n := len(b.Host)
	bufs := g.bufs
	for i := n * c.rank / g.n; i < n*(c.rank+1)/g.n; i++ {
		s := bufs[0][i]
		for _, o := range bufs[1:] {
			s += o[i]
		}
		for _, o := range bufs {
			o[i] = s
		}
	}
	return g.wait(ctx, c.rank, op)
}

func (c *localComm) AllGather(ctx context.Context, send, recv Buf) error {
	const op = "all_gather"
	g := c.g
	if recv.Dev != 0 || len(recv.Host) != recv.N || recv.N != g.n*send.N {
		return g.abort(c.rank, op, fmt.Errorf("receive buffer of %d values for %d ranks of %d", len(recv.Host), g.n, send.N))
	}
	if g.n == 1 {
		if err := g.failed(); err != nil {
			return err
		}
		copy(recv.Host, send.Host)
		return nil
	}
	if err := c.publish(ctx, op, send); err != nil {
		return err
	}
	if err := c.sameLen(op); err != nil {
		return err
	}
	for k, s := range g.bufs {
		copy(recv.Host[k*len(s):], s)
	}
	return g.wait(ctx, c.rank, op)
}

func (c *localComm) Broadcast(ctx context.Context, b Buf, root int) error {
	const op = "broadcast"
	g := c.g
	if root < 0 || root >= g.n {
		return g.abort(c.rank, op, fmt.Errorf("root %d of %d ranks", root, g.n))
	}
	if g.n == 1 {
		return g.failed()
	}
	if err := c.publish(ctx, op, b); err != nil {
		return err
	}
	if err := c.sameLen(op); err != nil {
		return err
	}
	if c.rank != root {
		copy(b.Host, g.bufs[root])
	}
	return g.wait(ctx, c.rank, op)
}

func (c *localComm) Barrier(ctx context.Context) error {
	if c.g.n == 1 {
		return c.g.failed()
	}
	return c.g.wait(ctx, c.rank, "barrier")
}

// errClosed is the cause of a communicator closed by one of its ranks.
var errClosed = errors.New("a rank closed the communicator")

// Close breaks the communicator: a rank still waiting for this one fails.
func (c *localComm) Close() error {
	c.g.abort(c.rank, "close", errClosed)
	return nil
}
