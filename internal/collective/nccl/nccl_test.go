package nccl

import (
	"context"
	"errors"
	"math"
	"runtime"
	"testing"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/internal/collective"
	"github.com/mooncake-go/mooncake-go/internal/cuda"
)

func TestResultNames(t *testing.T) {
	e := &Error{Op: "ncclAllReduce", Result: InvalidUsage}
	if got, want := e.Error(), "nccl: ncclAllReduce: ncclInvalidUsage"; got != want {
		t.Fatalf("got %q, want %q", got, want)
	}
	if Result(42).Name() != "ncclResult(42)" {
		t.Fatal(Result(42).Name())
	}
	if check("x", Success) != nil {
		t.Fatal("success is an error")
	}
}

func TestLoad(t *testing.T) {
	name, err := Load()
	if err != nil {
		if !errors.Is(err, ErrNoLibrary) {
			t.Fatalf("load error %v does not wrap ErrNoLibrary", err)
		}
		t.Skipf("no NCCL here: %v", err)
	}
	v, err := Version()
	if err != nil || v <= 0 {
		t.Fatalf("ncclGetVersion: %d, %v", v, err)
	}
	t.Logf("loaded %s, version %d", name, v)
}

func f32bytes(v []float32) []byte { return unsafe.Slice((*byte)(unsafe.Pointer(&v[0])), 4*len(v)) }

// TestOneRankGPU checks a 1-rank communicator on GPU 0 (NCCL refuses two
// ranks on one device): an out-of-place all-reduce writes the values into
// a zeroed buffer, the in-place one keeps them, all-gather and broadcast
// copy, the barrier returns; then a misused call breaks the communicator.
func TestOneRankGPU(t *testing.T) {
	if _, err := Load(); err != nil {
		t.Skipf("no NCCL: %v", err)
	}
	if err := cuda.Init(); err != nil {
		t.Skipf("no CUDA: %v", err)
	}
	if n, err := cuda.DeviceCount(); err != nil || n == 0 {
		t.Skipf("no GPU (%d, %v)", n, err)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	dev, err := cuda.GetDevice(0)
	if err != nil {
		t.Fatal(err)
	}
	cc, err := dev.Retain()
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Release()
	if err := cc.SetCurrent(); err != nil {
		t.Fatal(err)
	}
	s, err := cc.NewStream(cuda.StreamNonBlocking)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Destroy()
	comms, err := NewComms([]int{0}, []*cuda.Stream{s})
	if err != nil {
		t.Fatal(err)
	}
	c := comms[0]
	defer c.Close()
	if c.Rank() != 0 || c.Size() != 1 {
		t.Fatalf("rank %d of %d", c.Rank(), c.Size())
	}
	const n = 1 << 16
	in := make([]float32, n)
	for i := range in {
		in[i] = float32(i)*0.25 - 1000
	}
	alloc := func() cuda.DevicePtr {
		p, err := cc.MemAlloc(4 * n)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cc.MemFree(p) })
		if err := cc.MemsetD8(p, 0, 4*n); err != nil {
			t.Fatal(err)
		}
		return p
	}
	send, recv := alloc(), alloc()
	if err := cc.MemcpyHtoD(send, f32bytes(in)); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	read := func(p cuda.DevicePtr) []float32 {
		t.Helper()
		if err := s.Synchronize(); err != nil {
			t.Fatal(err)
		}
		out := make([]float32, n)
		if err := cc.MemcpyDtoH(f32bytes(out), p); err != nil {
			t.Fatal(err)
		}
		return out
	}
	same := func(what string, got []float32) {
		t.Helper()
		for i := range in {
			if math.Float32bits(got[i]) != math.Float32bits(in[i]) {
				t.Fatalf("%s: element %d = %v, want %v", what, i, got[i], in[i])
			}
		}
	}
	if err := c.AllReduceTo(ctx, collective.Device(uintptr(send), n), collective.Device(uintptr(recv), n)); err != nil {
		t.Fatal(err)
	}
	same("out-of-place all-reduce", read(recv))
	if err := c.AllReduce(ctx, collective.Device(uintptr(send), n)); err != nil {
		t.Fatal(err)
	}
	same("in-place all-reduce", read(send))
	gathered := alloc()
	if err := c.AllGather(ctx, collective.Device(uintptr(send), n), collective.Device(uintptr(gathered), n)); err != nil {
		t.Fatal(err)
	}
	same("all-gather", read(gathered))
	if err := c.Broadcast(ctx, collective.Device(uintptr(send), n), 0); err != nil {
		t.Fatal(err)
	}
	same("broadcast", read(send))
	if err := c.Barrier(ctx); err != nil {
		t.Fatal(err)
	}
	if err := c.AllReduce(ctx, collective.Host(in)); !errors.Is(err, collective.ErrAborted) {
		t.Fatalf("a host buffer: %v, want the communicator aborted", err)
	}
	if err := c.Barrier(ctx); !errors.Is(err, collective.ErrAborted) {
		t.Fatalf("after an abort: %v", err)
	}
}
