package collective

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// ranks runs f on every rank of comms at once and returns their errors.
func ranks(comms []Comm, f func(c Comm) error) []error {
	errs := make([]error, len(comms))
	var wg sync.WaitGroup
	for i, c := range comms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = f(c)
		}()
	}
	wg.Wait()
	return errs
}

func noErrors(t *testing.T, errs []error) {
	t.Helper()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
}

// TestLocalAllReduce: every rank gets the rank-ordered float32 sum, bit for
// bit the same, for lengths below, at and above the rank count, many times
// in a row.
func TestLocalAllReduce(t *testing.T) {
	for _, n := range []int{1, 2, 3, 4, 8} {
		comms := NewLocal(n)
		r := rand.New(rand.NewPCG(uint64(n), 1))
		for round, length := range []int{1, 2, 3, 7, 64, 1000, 4097} {
			in := make([][]float32, n)
			bufs := make([][]float32, n)
			for k := range in {
				in[k] = make([]float32, length)
				for i := range in[k] {
					in[k][i] = float32(r.NormFloat64()) * float32(math.Pow(10, float64(r.IntN(6)-3)))
				}
				bufs[k] = append([]float32(nil), in[k]...)
			}
			noErrors(t, ranks(comms, func(c Comm) error { return c.AllReduce(context.Background(), Host(bufs[c.Rank()])) }))
			for i := 0; i < length; i++ {
				want := in[0][i]
				for k := 1; k < n; k++ {
					want += in[k][i]
				}
				for k := range bufs {
					if math.Float32bits(bufs[k][i]) != math.Float32bits(want) {
						t.Fatalf("n %d round %d: rank %d element %d = %v, want the rank-ordered sum %v", n, round, k, i, bufs[k][i], want)
					}
				}
			}
		}
		noErrors(t, ranks(comms, func(c Comm) error { return c.Close() }))
	}
}

func TestLocalGatherBroadcastBarrier(t *testing.T) {
	const n = 4
	comms := NewLocal(n)
	send := make([][]float32, n)
	recv := make([][]float32, n)
	for k := range send {
		send[k] = []float32{float32(k), float32(10 * k), float32(100 * k)}
		recv[k] = make([]float32, 3*n)
	}
	noErrors(t, ranks(comms, func(c Comm) error {
		return c.AllGather(context.Background(), Host(send[c.Rank()]), Host(recv[c.Rank()]))
	}))
	for k := range recv {
		for j := range n {
			for i := range 3 {
				if recv[k][j*3+i] != send[j][i] {
					t.Fatalf("rank %d got %v", k, recv[k])
				}
			}
		}
	}
	bc := make([][]float32, n)
	for k := range bc {
		bc[k] = []float32{float32(k), float32(k)}
	}
	noErrors(t, ranks(comms, func(c Comm) error { return c.Broadcast(context.Background(), Host(bc[c.Rank()]), 2) }))
	for k := range bc {
		if bc[k][0] != 2 || bc[k][1] != 2 {
			t.Fatalf("rank %d after broadcast from 2: %v", k, bc[k])
		}
	}
	// Nobody leaves a barrier before the last rank arrives.
	var mu sync.Mutex
	arrived := 0
	noErrors(t, ranks(comms, func(c Comm) error {
		time.Sleep(time.Duration(c.Rank()) * 5 * time.Millisecond)
		mu.Lock()
		arrived++
		mu.Unlock()
		if err := c.Barrier(context.Background()); err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		if arrived != n {
			return errors.New("left the barrier early")
		}
		return nil
	}))
}

// TestLocalAbort: a rank whose context ends breaks the communicator: the
// others' waits end with an error naming it, wrapping ErrAborted and the
// cause, and every later call fails.
func TestLocalAbort(t *testing.T) {
	const n = 3
	comms := NewLocal(n)
	ctx, cancel := context.WithCancel(context.Background())
	errs := ranks(comms, func(c Comm) error {
		if c.Rank() == 1 {
			time.Sleep(10 * time.Millisecond)
			cancel()
			return c.AllReduce(ctx, Host(make([]float32, 4)))
		}
		// Ranks 0 and 2 wait for rank 1's second reduce, which never comes.
		if err := c.AllReduce(context.Background(), Host(make([]float32, 4))); err != nil {
			return err
		}
		return c.AllReduce(context.Background(), Host(make([]float32, 4)))
	})
	for r, err := range errs {
		var ce *Error
		if !errors.As(err, &ce) || ce.Rank != 1 || !errors.Is(err, ErrAborted) || !errors.Is(err, context.Canceled) {
			t.Fatalf("rank %d: %v, want rank 1's abort", r, err)
		}
	}
	if err := comms[0].Barrier(context.Background()); !errors.Is(err, ErrAborted) {
		t.Fatalf("barrier on a broken communicator: %v", err)
	}
}

func TestLocalMisuse(t *testing.T) {
	comms := NewLocal(2)
	errs := ranks(comms, func(c Comm) error {
		return c.AllReduce(context.Background(), Host(make([]float32, 3+c.Rank())))
	})
	for r, err := range errs {
		if !errors.Is(err, ErrAborted) {
			t.Fatalf("rank %d: lengths 3 and 4 gave %v", r, err)
		}
	}
	one := NewLocal(1)[0]
	if err := one.AllGather(context.Background(), Host([]float32{1}), Host(make([]float32, 2))); err == nil {
		t.Fatal("receive buffer of the wrong size accepted")
	}
	if err := NewLocal(1)[0].AllReduce(context.Background(), Device(0x1000, 4)); err != nil {
		t.Fatalf("a 1-rank all-reduce has nothing to do: %v", err)
	}
}
