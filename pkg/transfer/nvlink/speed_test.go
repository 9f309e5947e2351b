package nvlink

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

// The speed tests print GB/s (1e9 bytes per second; bytes moved once,
// not read+write) and log a summary table.

const speedBytes = 256 * mib

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// gpuTime times fn (enqueued on s) with events: median ms of reps.
func gpuTime(t *testing.T, c *cuda.Context, s *cuda.Stream, reps int, fn func() error) float64 {
	t.Helper()
	a, err := c.NewEvent(cuda.EventDefault)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Destroy()
	b, err := c.NewEvent(cuda.EventDefault)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Destroy()
	var ms []float64
	for i := 0; i < reps+2; i++ {
		must(t, a.Record(s))
		must(t, fn())
		must(t, b.Record(s))
		must(t, b.Synchronize())
		v, err := cuda.ElapsedMs(a, b)
		must(t, err)
		if i >= 2 {
			ms = append(ms, float64(v))
		}
	}
	return median(ms)
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func gbps(bytes uint64, ms float64) float64 { return float64(bytes) / ms / 1e6 }

// mapped returns the local address of the target region (imported by an
// earlier transfer).
func (r *rig) mapped(t *testing.T, tr tregion) cuda.DevicePtr {
	t.Helper()
	p := r.nv.peerState(r.tg.ready.Segment)
	if p == nil {
		t.Fatal("no nvlink peer state")
	}
	p.mu.RLock()
	defer p.mu.RUnlock()
	m := p.byAddr[tr.Addr]
	if m == nil {
		t.Fatalf("region %s not imported", tr.Name)
	}
	return m.ptr(tr.Addr)
}

// scatterReqs: n pages of page bytes, local slots and remote slots both
// permuted over their buffers.
func (r *rig) scatterReqs(op transfer.Op, tr tregion, page uint64, n int) []transfer.Request {
	lslots := r.local.Size() / page
	rslots := tr.Len / page
	lm, la := scatter(lslots)
	rm, ra := scatter(rslots)
	reqs := make([]transfer.Request, n)
	for i := range reqs {
		reqs[i] = transfer.Request{Op: op, Local: uintptr(uint64(r.local.Ptr()) + slotOf(i, lm, la, lslots)*page), Len: page,
			Segment: r.seg, Remote: tr.Addr + slotOf(i, rm, ra, rslots)*page}
	}
	return reqs
}

func (r *rig) descsFor(t *testing.T, reqs []transfer.Request, tr tregion) []cuda.CopyDesc {
	base := r.mapped(t, tr)
	d := make([]cuda.CopyDesc, len(reqs))
	for i, q := range reqs {
		remote := base + cuda.DevicePtr(q.Remote-tr.Addr)
		if q.Op == transfer.Write {
			d[i] = cuda.CopyDesc{Src: cuda.DevicePtr(q.Local), Dst: remote, Len: q.Len}
		} else {
			d[i] = cuda.CopyDesc{Src: remote, Dst: cuda.DevicePtr(q.Local), Len: q.Len}
		}
	}
	return d
}

// engineGBps is end to end through Engine.Transfer: median of reps batches
// (wall clock, one submitter), and the rate of 4 concurrent submitters.
func (r *rig) engineGBps(t *testing.T, reqs []transfer.Request, reps int) (one, four float64) {
	ctx := context.Background()
	var bytes uint64
	for _, q := range reqs {
		bytes += q.Len * uint64(max(len(q.Pages), 1))
	}
	var ms []float64
	for i := 0; i < reps+2; i++ {
		t0 := time.Now()
		must(t, r.e.Transfer(ctx, reqs))
		if i >= 2 {
			ms = append(ms, float64(time.Since(t0).Nanoseconds())/1e6)
		}
	}
	one = gbps(bytes, median(ms))
	var wg sync.WaitGroup
	t0 := time.Now()
	var mu sync.Mutex
	var ferr error
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < reps; i++ {
				if err := r.e.Transfer(ctx, reqs); err != nil {
					mu.Lock()
					ferr = err
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	must(t, ferr)
	four = float64(bytes) * float64(4*reps) / time.Since(t0).Seconds() / 1e9
	return one, four
}

type variant struct {
	name string
	cfg  cuda.CopierConfig
}

var variants = []variant{
	{"pages/u4", cuda.CopierConfig{Kernel: cuda.KernelPages, Unroll: 4}},
	{"pages/u8", cuda.CopierConfig{Kernel: cuda.KernelPages, Unroll: 8}},
	{"pages/u2", cuda.CopierConfig{Kernel: cuda.KernelPages, Unroll: 2}},
	{"pages/u4/cta4", cuda.CopierConfig{Kernel: cuda.KernelPages, Unroll: 4, CTAsPerSM: 4}},
	{"chunks", cuda.CopierConfig{Kernel: cuda.KernelChunks}},
	{"chunks/hostdesc", cuda.CopierConfig{Kernel: cuda.KernelChunks, HostDescriptors: true}},
}

func TestGPUSpeed(t *testing.T) {
	r := getRig(t)
	big := r.tg.region("big")
	host := r.tg.region("host")
	ctx := context.Background()
	// Import both regions.
	must(t, r.e.Transfer(ctx, r.scatterReqs(transfer.Write, big, 1<<20, 4)))
	must(t, r.e.Transfer(ctx, r.scatterReqs(transfer.Write, host, 1<<20, 4)))
	must(t, r.cp.Fill(r.stream, r.local.Ptr(), r.local.Size(), rand.Uint64()))
	must(t, r.stream.Synchronize())
	k, err := testKernels()
	must(t, err)

	// Ceilings: copy engine, 1 GiB, cross-process over the imported
	// mapping, and in-process cuMemcpyPeer between the two GPUs.
	remote := r.mapped(t, big)
	ceilW := gbps(1<<30, gpuTime(t, r.ctx, r.stream, 5, func() error { return r.stream.Memcpy(remote, r.local.Ptr(), 1<<30) }))
	ceilR := gbps(1<<30, gpuTime(t, r.ctx, r.stream, 5, func() error { return r.stream.Memcpy(r.local.Ptr(), remote, 1<<30) }))
	var peer float64
	if r.gpu != 0 {
		d0, err := cuda.GetDevice(0)
		must(t, err)
		c0, err := d0.Retain()
		must(t, err)
		defer c0.Release()
		buf0, err := c0.MemAlloc(1 << 30)
		must(t, err)
		defer c0.MemFree(buf0)
		peer = gbps(1<<30, gpuTime(t, r.ctx, r.stream, 5, func() error {
			return r.stream.MemcpyPeer(buf0, c0, r.local.Ptr(), r.ctx, 1<<30)
		}))
	}
	hostPtr := r.mapped(t, host)
	ceilH := gbps(256*mib, gpuTime(t, r.ctx, r.stream, 5, func() error { return r.stream.Memcpy(hostPtr, r.local.Ptr(), 256*mib) }))
	t.Logf("CEILING copy engine 1 GiB GPU%d->GPU0 cross-process %.1f GB/s; GPU0->GPU%d %.1f GB/s; cuMemcpyPeer in-process GPU%d->GPU0 %.1f GB/s; GPU%d->peer host 256 MiB %.1f GB/s",
		r.gpu, ceilW, r.gpu, ceilR, r.gpu, peer, r.gpu, ceilH)
	ceil := max(peer, ceilW)

	// Kernel variants: the exact descriptors of the engine's batches,
	// timed with events (upload + kernel).
	cps := map[string]*cuda.Copier{}
	for _, v := range variants {
		cp, err := cuda.NewCopier(r.ctx, k, v.cfg)
		must(t, err)
		defer cp.Close()
		cps[v.name] = cp
	}
	var summary []string
	for _, op := range []transfer.Op{transfer.Write, transfer.Read} {
		for _, page := range sizes() {
			n := int(speedBytes / page)
			reqs := r.scatterReqs(op, big, page, n)
			descs := r.descsFor(t, reqs, big)
			line := fmt.Sprintf("%-5s page=%4dKiB n=%6d:", op, page>>10, n)
			for _, v := range variants {
				cp := cps[v.name]
				ms := gpuTime(t, r.ctx, r.stream, 10, func() error { return cp.Copy(r.stream, descs) })
				g := gbps(speedBytes, ms)
				line += fmt.Sprintf(" %s %.1f (%.3f)", v.name, g, g/ceil)
			}
			// Eight batches back to back: the host's staging of one batch
			// overlaps the kernel of the one before, as with several
			// submitters; this is the kernel's own rate.
			cp := cps["pages/u4"]
			ms := gpuTime(t, r.ctx, r.stream, 5, func() error {
				for range 8 {
					if err := cp.Copy(r.stream, descs); err != nil {
						return err
					}
				}
				return nil
			})
			g := gbps(8*speedBytes, ms)
			line += fmt.Sprintf(" | pages/u4 x8 back to back %.1f (%.3f)", g, g/ceil)
			one, four := r.engineGBps(t, reqs, 8)
			line += fmt.Sprintf(" | engine 1 submitter %.1f GB/s (%.3f), 4 submitters %.1f GB/s (%.3f)", one, one/ceil, four, four/ceil)
			one, four = r.engineGBps(t, transfertest.PageList(reqs), 8)
			line += fmt.Sprintf(" | page list: 1 submitter %.1f GB/s (%.3f), 4 submitters %.1f GB/s (%.3f)", one, one/ceil, four, four/ceil)
			t.Log(line)
			summary = append(summary, line)
		}
	}
	// GPU -> peer host.
	for _, page := range []uint64{64 << 10, 1 << 20} {
		n := int(speedBytes / page)
		reqs := r.scatterReqs(transfer.Write, host, page, n)
		descs := r.descsFor(t, reqs, host)
		cp := cps["pages/u4"]
		g := gbps(speedBytes, gpuTime(t, r.ctx, r.stream, 10, func() error { return cp.Copy(r.stream, descs) }))
		one, four := r.engineGBps(t, reqs, 8)
		line := fmt.Sprintf("host  page=%4dKiB n=%6d: kernel %.1f GB/s (%.3f of copy engine) | engine 1 submitter %.1f, 4 submitters %.1f GB/s",
			page>>10, n, g, g/ceilH, one, four)
		t.Log(line)
		summary = append(summary, line)
	}
	fmt.Println("=== nvlink speed summary (GB/s; ratio to max(cuMemcpyPeer, cross-process copy engine) =", fmt.Sprintf("%.1f", ceil), ")")
	for _, l := range summary {
		fmt.Println(l)
	}
}

// TestGPUPoolRegister100GiB times creating a 100 GiB pool and registering
// it with an engine running nvlink.
func TestGPUPoolRegister100GiB(t *testing.T) {
	n := needGPU(t)
	gpu := n - 1
	d, err := cuda.GetDevice(gpu)
	must(t, err)
	c, err := d.Retain()
	must(t, err)
	defer c.Release()
	free, _, err := c.MemGetInfo()
	must(t, err)
	const size = 100 << 30
	if free < size+(2<<30) {
		t.Skipf("GPU %d has %d bytes free, need 102 GiB", gpu, free)
	}
	nv, err := New(Config{})
	must(t, err)
	e, err := transfer.New(context.Background(), transfer.Config{Listen: "127.0.0.1:0", Transports: []transfer.Transport{nv}})
	must(t, err)
	defer e.Close()
	t0 := time.Now()
	pool, err := c.NewPool(cuda.PoolConfig{Size: size})
	must(t, err)
	defer pool.Close()
	t1 := time.Now()
	must(t, e.RegisterMemory(context.Background(), uintptr(pool.Ptr()), size, transfer.Location{Kind: transfer.CUDA, Index: gpu},
		transfer.AccessReadWrite, transfer.WithMemory(pool), transfer.WithScope(transfer.ScopeSameMachine)))
	t2 := time.Now()
	total := t2.Sub(t0)
	t.Logf("100 GiB pool on GPU %d: create %v, register (export + publish) %v, total %v", gpu, t1.Sub(t0), t2.Sub(t1), total)
	fmt.Printf("=== 100 GiB pool: create %v + register %v = %v\n", t1.Sub(t0), t2.Sub(t1), total)
	if total > time.Second {
		t.Errorf("creating and registering a 100 GiB pool took %v, want < 1 s", total)
	}
	must(t, e.UnregisterMemory(context.Background(), uintptr(pool.Ptr())))
}
