package nccl

import (
	"context"
	"fmt"
	"math"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/collective"
	"github.com/mooncake-go/mooncake-go/internal/cuda"
)

// ranks are n GPUs' ends of one communicator, each with its context and
// stream; do runs f on every rank at once, each on its own OS thread with
// its context current.
type ranks struct {
	ctxs    []*cuda.Context
	streams []*cuda.Stream
	comms   []*Comm
}

// twoGPUs makes the communicator of GPUs 0 and 1, or skips the test.
func twoGPUs(tb testing.TB) *ranks {
	tb.Helper()
	if _, err := Load(); err != nil {
		tb.Skipf("no NCCL: %v", err)
	}
	if err := cuda.Init(); err != nil {
		tb.Skipf("no CUDA: %v", err)
	}
	if n, err := cuda.DeviceCount(); err != nil || n < 2 {
		tb.Skipf("needs two GPUs (%d, %v)", n, err)
	}
	rs := &ranks{}
	for d := range 2 {
		dev, err := cuda.GetDevice(d)
		if err != nil {
			tb.Fatal(err)
		}
		cc, err := dev.Retain()
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(func() { cc.Release() })
		s, err := cc.NewStream(cuda.StreamNonBlocking)
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(func() { s.Destroy() })
		rs.ctxs, rs.streams = append(rs.ctxs, cc), append(rs.streams, s)
	}
	comms, err := NewComms([]int{0, 1}, rs.streams)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		for _, c := range comms {
			c.Close()
		}
	})
	rs.comms = comms
	return rs
}

func (rs *ranks) do(tb testing.TB, f func(r int) error) {
	tb.Helper()
	errs := make([]error, len(rs.comms))
	var wg sync.WaitGroup
	for r := range rs.comms {
		wg.Go(func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			if err := rs.ctxs[r].SetCurrent(); err != nil {
				errs[r] = err
				return
			}
			errs[r] = f(r)
		})
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			tb.Fatalf("rank %d: %v", r, err)
		}
	}
}

// TestTwoRanksGPU: on GPUs 0 and 1, all-reduce sums (exact: two addends),
// all-gather lays the ranks out in order, broadcast copies the root's,
// barrier returns; then a rank left waiting for the other is released by
// Abort within a bound.
func TestTwoRanksGPU(t *testing.T) {
	rs := twoGPUs(t)
	const n = 1 << 18
	vals := func(r int) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = float32(i%1000)*0.125 - 40 + float32(r)*1000
		}
		return v
	}
	bufs := make([][3]cuda.DevicePtr, 2) // a, gathered, b
	rs.do(t, func(r int) error {
		cc := rs.ctxs[r]
		for i, sz := range []uint64{4 * n, 8 * n, 4 * n} {
			p, err := cc.MemAlloc(sz)
			if err != nil {
				return err
			}
			bufs[r][i] = p
		}
		return cc.MemcpyHtoD(bufs[r][0], f32bytes(vals(r)))
	})
	t.Cleanup(func() {
		for r := range bufs {
			for _, p := range bufs[r] {
				rs.ctxs[r].MemFree(p)
			}
		}
	})
	read := func(r int, p cuda.DevicePtr, m int) []float32 {
		if err := rs.streams[r].Synchronize(); err != nil {
			t.Fatal(err)
		}
		out := make([]float32, m)
		if err := rs.ctxs[r].MemcpyDtoH(f32bytes(out), p); err != nil {
			t.Fatal(err)
		}
		return out
	}
	ctx := context.Background()
	got := make([][]float32, 2)
	rs.do(t, func(r int) error {
		if err := rs.comms[r].AllGather(ctx, collective.Device(uintptr(bufs[r][0]), n), collective.Device(uintptr(bufs[r][1]), 2*n)); err != nil {
			return err
		}
		if err := rs.comms[r].AllReduce(ctx, collective.Device(uintptr(bufs[r][0]), n)); err != nil {
			return err
		}
		got[r] = append(read(r, bufs[r][0], n), read(r, bufs[r][1], 2*n)...)
		return nil
	})
	v0, v1 := vals(0), vals(1)
	for r := range 2 {
		for i := range n {
			if want := v0[i] + v1[i]; math.Float32bits(got[r][i]) != math.Float32bits(want) {
				t.Fatalf("rank %d all-reduce element %d = %v, want %v", r, i, got[r][i], want)
			}
			if got[r][n+i] != v0[i] || got[r][2*n+i] != v1[i] {
				t.Fatalf("rank %d all-gather element %d = %v, %v; want %v, %v", r, i, got[r][n+i], got[r][2*n+i], v0[i], v1[i])
			}
		}
	}
	rs.do(t, func(r int) error {
		if err := rs.ctxs[r].MemcpyHtoD(bufs[r][2], f32bytes(vals(r))); err != nil {
			return err
		}
		if err := rs.comms[r].Broadcast(ctx, collective.Device(uintptr(bufs[r][2]), n), 1); err != nil {
			return err
		}
		got[r] = read(r, bufs[r][2], n)
		return rs.comms[r].Barrier(ctx)
	})
	for r := range 2 {
		for i := range n {
			if got[r][i] != v1[i] {
				t.Fatalf("rank %d broadcast element %d = %v, want %v", r, i, got[r][i], v1[i])
			}
		}
	}
	// Rank 0 all-reduces alone: its stream waits for rank 1 until Abort.
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := rs.ctxs[0].SetCurrent(); err != nil {
			done <- err
			return
		}
		if err := rs.comms[0].AllReduce(ctx, collective.Device(uintptr(bufs[0][0]), n)); err != nil {
			done <- err
			return
		}
		rs.streams[0].Synchronize() // its result does not matter: it must return
		done <- nil
	}()
	select {
	case err := <-done:
		t.Fatalf("a lone all-reduce ended before the abort: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	start := time.Now()
	for _, c := range rs.comms {
		c.Abort()
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("released %v after the abort", time.Since(start))
	case <-time.After(20 * time.Second):
		t.Fatal("the waiting rank was not released within 20 s of the abort")
	}
	if err := rs.comms[1].AllReduce(ctx, collective.Device(uintptr(bufs[1][0]), n)); err == nil {
		t.Error("an aborted communicator took an all-reduce")
	}
}

// BenchmarkAllReduce2GPU times in-place all-reduces of 1-64 MiB on GPUs 0
// and 1 (each iteration: both ranks enqueue, then wait), reporting the bus
// bandwidth (for two ranks: bytes / time), the figure nccl-tests and
// torch.distributed comparisons use.
func BenchmarkAllReduce2GPU(b *testing.B) {
	rs := twoGPUs(b)
	for _, mib := range []int{1, 4, 16, 64} {
		n := mib << 20 / 4
		b.Run(fmt.Sprintf("%dMiB", mib), func(b *testing.B) {
			ps := make([]cuda.DevicePtr, 2)
			rs.do(b, func(r int) error {
				p, err := rs.ctxs[r].MemAlloc(uint64(4 * n))
				ps[r] = p
				return err
			})
			defer func() {
				for r, p := range ps {
					rs.ctxs[r].MemFree(p)
				}
			}()
			ctx := context.Background()
			round := func(iters int) {
				rs.do(b, func(r int) error {
					for range iters {
						if err := rs.comms[r].AllReduce(ctx, collective.Device(uintptr(ps[r]), n)); err != nil {
							return err
						}
					}
					return rs.streams[r].Synchronize()
				})
			}
			round(3) // warm up
			b.ResetTimer()
			start := time.Now()
			round(b.N)
			el := time.Since(start)
			b.SetBytes(int64(4 * n))
			b.ReportMetric(float64(4*n)*float64(b.N)/el.Seconds()/1e9, "busGB/s")
		})
	}
}
