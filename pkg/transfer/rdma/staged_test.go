package rdma_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs/fake"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

// GPU memory without a dma-buf (transfertest's fake devices: host memory
// behind an inaccessible address range, reached only through their copies)
// on either side and both: staged through host buffers.
func TestConformanceDevice(t *testing.T) {
	transfertest.RunDevice(t, onFabric(fake.NewFabric(), rdma.Config{}, "mlx5_0"), transfertest.FakeDevices)
}

// Two NICs, small slices and little staging (pieces of 4099 bytes, 16 of
// them per ring): pieces wait for staging, spans wrap.
func TestConformanceDeviceSmallStaging(t *testing.T) {
	transfertest.RunDevice(t, onFabric(fake.NewFabric(), rdma.Config{SliceSize: 4096 + 3, MaxWR: 4, CQDepth: 6, StagingSize: 64 << 10}, "mlx5_0", "mlx5_1"),
		transfertest.FakeDevices)
}

// dualMem is GPU memory with a dma-buf that is also a transfer.DeviceMemory
// (its copies go through the test's mapping), as a CUDA pool is: rdma
// registers its dma-buf, and stages it when a NIC refuses that.
type dualMem struct {
	*gpuMem
	copies atomic.Int64
}

type doneCopy struct{}

func (doneCopy) Wait(context.Context) error { return nil }

type hostStaging struct{ b []byte }

func (s *hostStaging) Bytes() []byte { return s.b }
func (s *hostStaging) Close() error  { return nil }

func (d *dualMem) span(addr uint64, n int) ([]byte, error) {
	if addr < d.base || addr+uint64(n) > d.base+d.size {
		return nil, fmt.Errorf("%w: [%#x, +%d) outside the memory", transfer.ErrDeviceCopy, addr, n)
	}
	return d.view[addr-d.base : addr-d.base+uint64(n)], nil
}

func (d *dualMem) CopyToHost(dst []byte, src uint64) (transfer.Completion, error) {
	b, err := d.span(src, len(dst))
	if err != nil {
		return nil, err
	}
	d.copies.Add(1)
	copy(dst, b)
	return doneCopy{}, nil
}

func (d *dualMem) CopyFromHost(dst uint64, src []byte) (transfer.Completion, error) {
	b, err := d.span(dst, len(src))
	if err != nil {
		return nil, err
	}
	d.copies.Add(1)
	copy(b, src)
	return doneCopy{}, nil
}

func (d *dualMem) AllocStaging(n int) (transfer.Staging, error) {
	return &hostStaging{b: make([]byte, n)}, nil
}

var _ interface {
	rdma.DMABufMemory
	transfer.DeviceMemory
} = (*dualMem)(nil)

const fallbackMsg = "rdma stages GPU memory through host buffers (no GPUDirect RDMA for it)"

// A NIC that refuses ibv_reg_dmabuf_mr: the target's GPU regions fall back
// to staging (counted, logged once as a warning), while the initiator's
// dma-buf-capable memory takes the ibv_reg_dmabuf_mr path (no device copy
// at all on its side); random data between them, both ops, plain and page
// lists, into poisoned destinations.
func TestDMABufFallbackToStaging(t *testing.T) {
	fab := fake.NewFabric()
	type node struct {
		n    *transfertest.Node
		reg  *prometheus.Registry
		logs *observer.ObservedLogs
	}
	mk := func(refuse bool) node {
		h := fab.NewHost("mlx5_0", "mlx5_1")
		h.HCA("mlx5_1").RefuseDmabuf(refuse)
		reg := prometheus.NewRegistry()
		core, logs := observer.New(zap.DebugLevel)
		n := transfertest.NewNode(t, func() []transfer.Transport {
			return []transfer.Transport{rdma.New(rdma.Config{Provider: h, Registerer: reg, SliceSize: 64 << 10})}
		}, func(c *transfer.Config) { c.Logger = zap.New(core) })
		return node{n, reg, logs}
	}
	a, b := mk(false), mk(true)
	const size = 4 << 20
	ctx := context.Background()
	ag := &dualMem{gpuMem: newGPUMem(t, 0x10_0000_0000, size)}
	bgs := []*dualMem{{gpuMem: newGPUMem(t, 0x20_0000_0000, size)}, {gpuMem: newGPUMem(t, 0x28_0000_0000, size)}}
	for _, c := range []struct {
		e *transfer.Engine
		g *dualMem
	}{{a.n.E, ag}, {b.n.E, bgs[0]}, {b.n.E, bgs[1]}} {
		if err := c.e.RegisterMemory(ctx, uintptr(c.g.base), size, transfertest.DeviceLocation, transfer.AccessReadWrite, transfer.WithMemory(c.g)); err != nil {
			t.Fatalf("register GPU memory: %v", err)
		}
		defer c.e.UnregisterMemory(ctx, uintptr(c.g.base))
	}
	for _, c := range []struct {
		n      node
		name   string
		labels map[string]string
		want   float64
	}{
		{a, "mooncake_rdma_registered_regions", map[string]string{"kind": "dmabuf"}, 1},
		{a, "mooncake_rdma_staging_fallbacks_total", nil, 0},
		{b, "mooncake_rdma_registered_regions", map[string]string{"kind": "staged"}, 2},
		{b, "mooncake_rdma_registered_regions", map[string]string{"kind": "dmabuf"}, 0},
		{b, "mooncake_rdma_staging_fallbacks_total", map[string]string{"reason": "reg_dmabuf_mr"}, 2},
	} {
		if got := metric(t, c.n.reg, c.name, c.labels); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	fb := b.logs.FilterMessage(fallbackMsg)
	if fb.Len() != 2 || fb.FilterLevelExact(zap.WarnLevel).Len() != 1 {
		t.Fatalf("fallback logged %d times (%d warnings), want twice, one warning", fb.Len(), fb.FilterLevelExact(zap.WarnLevel).Len())
	}
	w := fb.FilterLevelExact(zap.WarnLevel).All()[0].ContextMap()
	if w["reason"] != "reg_dmabuf_mr" || !strings.Contains(fmt.Sprint(w["error"]), "mlx5_1: ibv_reg_dmabuf_mr") {
		t.Errorf("the warning names no NIC or reason: %v", w)
	}
	if a.logs.FilterMessage(fallbackMsg).Len() != 0 {
		t.Error("the initiator's dma-buf memory fell back")
	}

	seg, err := a.n.E.OpenSegment(ctx, b.n.E.Name())
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(40, 41))
	for _, op := range []transfer.Op{transfer.Write, transfer.Read} {
		for _, pages := range []bool{false, true} {
			bg := bgs[rng.IntN(2)]
			src, dst := ag.view, bg.view
			if op == transfer.Read {
				src, dst = bg.view, ag.view
			}
			fillAndPoison(rng, src, dst)
			want := bytes.Repeat([]byte{transfertest.Poison}, size)
			var reqs []transfer.Request
			const blocks = 24
			for k := 0; k < blocks; k++ {
				n := uint64(100 + rng.IntN(150<<10))
				if pages {
					n = 16 << 10
				}
				off := uint64(k)*(size/blocks) + uint64(rng.IntN(1000))
				reqs = append(reqs, transfer.Request{Op: op, Local: uintptr(ag.base + off), Len: n, Segment: seg, Remote: bg.base + off})
				copy(want[off:off+n], src[off:off+n])
			}
			if pages {
				reqs = transfertest.PageList(reqs)
			}
			tctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			err := a.n.E.Transfer(tctx, reqs)
			cancel()
			if err != nil {
				t.Fatalf("%v (pages %v): %v", op, pages, err)
			}
			if !bytes.Equal(dst, want) {
				t.Fatalf("%v (pages %v): destination differs", op, pages)
			}
		}
	}
	if n := ag.copies.Load(); n != 0 {
		t.Errorf("%d device copies of the dma-buf memory: it did not go through ibv_reg_dmabuf_mr", n)
	}
	if bgs[0].copies.Load()+bgs[1].copies.Load() == 0 {
		t.Error("no device copy of the staged memory")
	}
	if got := metric(t, a.reg, "mooncake_rdma_staged_bytes_total", map[string]string{"side": "remote"}); got == 0 {
		t.Error("no bytes counted through the target's staging")
	}
	if got := metric(t, a.reg, "mooncake_rdma_staged_bytes_total", map[string]string{"side": "local"}); got != 0 {
		t.Errorf("%v bytes counted through local staging, which the initiator does not use", got)
	}
}

var errInjected = errors.New("injected device fault")

// A device copy that fails fails only the tasks whose memory it is, on
// either side, within the bound; the batch's other tasks (staged or not)
// move every byte.
func TestStagedCopyFailureFailsOnlyItsTasks(t *testing.T) {
	nt := onFabric(fake.NewFabric(), rdma.Config{SliceSize: 64 << 10}, "mlx5_0")
	a, b := transfertest.NewNode(t, nt, nil), transfertest.NewNode(t, nt, nil)
	const size = 1 << 20
	rw := transfer.AccessReadWrite
	bad, good := a.AllocDevice(t, transfertest.FakeDevices, size, rw), a.AllocDevice(t, transfertest.FakeDevices, size, rw)
	ah := a.Alloc(t, size, rw)
	bh := b.Alloc(t, 8*size, rw)
	bd := b.AllocDevice(t, transfertest.FakeDevices, size, rw)
	fd := func(d *transfertest.DeviceBuffer) *transfertest.FakeDevice { return d.Mem.(*transfertest.FakeDevice) }
	ctx := context.Background()
	seg, err := a.E.OpenSegment(ctx, b.E.Name())
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(42, 43))
	for _, buf := range [][]byte{fd(good).Data(), ah.Bytes(), bh.Bytes()[5*size:]} {
		for i := range buf {
			buf[i] = byte(rng.Uint32())
		}
	}
	const n = 256 << 10
	reqs := []transfer.Request{
		{Op: transfer.Write, Local: uintptr(bad.Addr), Len: n, Segment: seg, Remote: bh.Addr()},                    // fails
		{Op: transfer.Write, Local: uintptr(good.Addr), Len: n, Segment: seg, Remote: bh.Addr() + size},            // staged here
		{Op: transfer.Write, Local: uintptr(ah.Addr()), Len: n, Segment: seg, Remote: bh.Addr() + 2*size},          // not staged
		{Op: transfer.Read, Local: uintptr(bad.Addr) + n, Len: n, Segment: seg, Remote: bh.Addr() + 5*size},        // fails
		{Op: transfer.Read, Local: uintptr(good.Addr) + 2*n, Len: n, Segment: seg, Remote: bh.Addr() + 5*size + n}, // staged here
		{Op: transfer.Write, Local: uintptr(good.Addr) + 3*n, Len: n, Segment: seg, Remote: bd.Addr},               // staged both sides
	}
	fd(bad).SetFail(errInjected)
	start := time.Now()
	bt, err := a.E.Submit(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	bt.Wait(ctx)
	el := time.Since(start)
	for i, st := range bt.Statuses() {
		failing := i == 0 || i == 3
		switch {
		case failing && (st.State != transfer.Failed || !errors.Is(st.Err, transfer.ErrDeviceCopy) || !strings.Contains(st.Err.Error(), errInjected.Error())):
			t.Errorf("task %d: %v %v, want failed with the injected device fault", i, st.State, st.Err)
		case failing && !strings.Contains(st.Err.Error(), fmt.Sprintf("%#x", reqs[i].Local)):
			t.Errorf("task %d: %v names no local address", i, st.Err)
		case !failing && st.State != transfer.Completed:
			t.Errorf("task %d: %v %v, want completed", i, st.State, st.Err)
		}
	}
	if el > 1500*time.Millisecond {
		t.Errorf("batch took %v, bound 3s", el)
	}
	check := func(what string, got, want []byte) {
		t.Helper()
		if !bytes.Equal(got, want) {
			t.Errorf("%s differs", what)
		}
	}
	hb := bh.Bytes()
	check("write from bad device memory (must not land)", hb[:n], bytes.Repeat([]byte{transfertest.Poison}, n))
	check("staged write", hb[size:size+n], fd(good).Data()[:n])
	check("host write", hb[2*size:2*size+n], ah.Bytes()[:n])
	check("staged read", fd(good).Data()[2*n:3*n], hb[5*size+n:5*size+2*n])
	check("write to staged target", fd(bd).Data()[:n], fd(good).Data()[3*n:4*n])

	// The target's device fails: only the task into it fails, naming the
	// target's reason.
	fd(bad).SetFail(nil)
	fd(bd).SetFail(errInjected)
	bt, err = a.E.Submit(ctx, []transfer.Request{
		{Op: transfer.Write, Local: uintptr(ah.Addr()), Len: n, Segment: seg, Remote: bd.Addr + n},
		{Op: transfer.Write, Local: uintptr(good.Addr), Len: n, Segment: seg, Remote: bh.Addr() + 3*size},
		{Op: transfer.Read, Local: uintptr(ah.Addr()) + n, Len: n, Segment: seg, Remote: bd.Addr},
	})
	if err != nil {
		t.Fatal(err)
	}
	bt.Wait(ctx)
	fd(bd).SetFail(nil)
	sts := bt.Statuses()
	for _, i := range []int{0, 2} {
		if sts[i].State != transfer.Failed || !errors.Is(sts[i].Err, transfer.ErrDeviceCopy) || !strings.Contains(sts[i].Err.Error(), errInjected.Error()) {
			t.Errorf("task %d into the failing target device: %v %v", i, sts[i].State, sts[i].Err)
		}
	}
	if sts[1].State != transfer.Completed {
		t.Errorf("task beside them: %v %v", sts[1].State, sts[1].Err)
	}
	check("write beside the failing target device", hb[3*size:3*size+n], fd(good).Data()[:n])
	// The connection survived the refusals: the next batch is served.
	if err := a.E.Transfer(ctx, []transfer.Request{{Op: transfer.Write, Local: uintptr(good.Addr), Len: n, Segment: seg, Remote: bd.Addr + 2*n}}); err != nil {
		t.Fatalf("after the device recovered: %v", err)
	}
	check("write after recovery", fd(bd).Data()[2*n:3*n], fd(good).Data()[:n])
}

// The staging requests on the control connection: the area exists only
// for a staged GPU region, once per connection; each copy must lie in the
// area and in a staged region granting its direction, else it is refused
// by itself, naming why.
func TestStagingRequests(t *testing.T) {
	fab := fake.NewFabric()
	nt := func() []transfer.Transport {
		return []transfer.Transport{rdma.New(rdma.Config{Provider: fab.NewHost("mlx5_0"), StagingSize: 1 << 20})}
	}
	a, b := transfertest.NewNode(t, nt, nil), transfertest.NewNode(t, nt, nil)
	bh := b.Alloc(t, 1<<20, transfer.AccessReadWrite)
	bd := b.AllocDevice(t, transfertest.FakeDevices, 1<<20, transfer.AccessReadWrite)
	ro := b.AllocDevice(t, transfertest.FakeDevices, 1<<20, transfer.AccessRead)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := a.E.Dial(ctx, b.E.Self(), rdma.Name)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	cp := func(in bool, dev, off, n uint64) map[string]any {
		return map[string]any{"in": in, "dev": dev, "off": off, "n": n}
	}
	if m := send(t, c, map[string]any{"op": "copy", "copies": []any{cp(false, bd.Addr, 0, 100)}}); !strings.Contains(fmt.Sprint(m["err"]), "no staging set up") {
		t.Fatalf("copy before stage: %v", m)
	}
	for _, addr := range []uint64{bh.Addr(), bd.Addr + 4096} {
		if m := send(t, c, map[string]any{"op": "stage", "addr": addr}); !strings.Contains(fmt.Sprint(m["err"]), "no staged GPU region") {
			t.Fatalf("stage for %#x: %v", addr, m)
		}
	}
	m := send(t, c, map[string]any{"op": "stage", "addr": bd.Addr})
	if m["err"] != nil || uint64(m["len"].(float64)) != 1<<20 || len(m["rkeys"].([]any)) != 1 {
		t.Fatalf("stage: %v", m)
	}
	if m2 := send(t, c, map[string]any{"op": "stage", "addr": ro.Addr}); m2["addr"] != m["addr"] {
		t.Fatalf("a second stage on one connection made another area: %v, then %v", m, m2)
	}
	for _, bad := range []map[string]any{{"op": "copy"}, {"op": "copy", "copies": make([]any, 257)}} {
		if m := send(t, c, bad); m["err"] == nil {
			t.Fatalf("%d copies: %v", len(bad), m)
		}
	}
	for _, c2 := range []struct {
		c    map[string]any
		want string
	}{
		{cp(false, bd.Addr, 1<<20-50, 100), "outside the 1048576 bytes of staging"},
		{cp(false, bd.Addr, 0, 0), "outside"},
		{cp(false, bh.Addr(), 0, 100), "not staged GPU memory"},
		{cp(false, 0x1000, 0, 100), "not in any local registered region"},
		{cp(true, ro.Addr, 0, 100), "grants"},
		{cp(false, bd.Addr+1<<20-10, 0, 100), "crosses the end"},
		{cp(false, bd.Addr, 0, 100), ""},
		{cp(true, bd.Addr+100, 0, 100), ""},
	} {
		m := send(t, c, map[string]any{"op": "copy", "copies": []any{c2.c}})
		errs, _ := m["errs"].([]any)
		if m["err"] != nil || len(errs) != 1 || (c2.want == "") != (errs[0] == "") || !strings.Contains(fmt.Sprint(errs[0]), c2.want) {
			t.Errorf("copy %v: %v, want %q", c2.c, m, c2.want)
		}
	}
}

// A target device copy that outlives the bound: the batch times out, the
// target ends that control connection (the span's state is unknown), and
// the next batch gets a new one once the device is fast again.
func TestStagedTargetCopyPastBound(t *testing.T) {
	nt := onFabric(fake.NewFabric(), rdma.Config{}, "mlx5_0")
	a, b := transfertest.NewNode(t, nt, nil), transfertest.NewNode(t, nt, nil)
	ah := a.Alloc(t, 1<<20, transfer.AccessReadWrite)
	bd := b.AllocDevice(t, transfertest.FakeDevices, 1<<20, transfer.AccessReadWrite)
	dev := bd.Mem.(*transfertest.FakeDevice)
	ctx := context.Background()
	seg, err := a.E.OpenSegment(ctx, b.E.Name())
	if err != nil {
		t.Fatal(err)
	}
	const bound = 3 * time.Second // NewNode's Timeout
	dev.SetDelay(bound + time.Second)
	start := time.Now()
	err = a.E.Transfer(ctx, []transfer.Request{{Op: transfer.Write, Local: uintptr(ah.Addr()), Len: 64 << 10, Segment: seg, Remote: bd.Addr}})
	dev.SetDelay(0)
	if !errors.Is(err, transfer.ErrTimeout) && !errors.Is(err, transfer.ErrDeviceCopy) {
		t.Fatalf("got %v, want a timeout", err)
	}
	if el := time.Since(start); el > bound+time.Second {
		t.Errorf("failed after %v, bound %v", el, bound)
	}
	rng := rand.New(rand.NewPCG(44, 45))
	for i := range ah.Bytes() {
		ah.Bytes()[i] = byte(rng.Uint32())
	}
	if err := a.E.Transfer(ctx, []transfer.Request{{Op: transfer.Write, Local: uintptr(ah.Addr()), Len: 1 << 20, Segment: seg, Remote: bd.Addr}}); err != nil {
		t.Fatalf("the next batch: %v", err)
	}
	if !bytes.Equal(dev.Data(), ah.Bytes()) {
		t.Fatal("the next batch's bytes differ")
	}
}

// Staging is registered once per peer (initiator) and per connection
// (target), not per batch, and released: the target's when the
// initiator's engine closes, everything when the target's does.
func TestStagingRegisteredOnce(t *testing.T) {
	fab := fake.NewFabric()
	ha, hb := fab.NewHost("mlx5_0", "mlx5_1"), fab.NewHost("mlx5_0")
	mk := func(h *fake.Host) *transfertest.Node {
		return transfertest.NewNode(t, func() []transfer.Transport {
			return []transfer.Transport{rdma.New(rdma.Config{Provider: h, StagingSize: 1 << 20})}
		}, nil)
	}
	a, b := mk(ha), mk(hb)
	ad := a.AllocDevice(t, transfertest.FakeDevices, 1<<20, transfer.AccessReadWrite)
	bd := b.AllocDevice(t, transfertest.FakeDevices, 1<<20, transfer.AccessReadWrite)
	bh := b.Alloc(t, 1<<20, transfer.AccessReadWrite)
	mrs := func(h *fake.Host, nic string) int { _, m, _ := h.HCA(nic).Live(); return m }
	// Device regions have no MR; the host region one per NIC.
	if got := [3]int{mrs(ha, "mlx5_0"), mrs(ha, "mlx5_1"), mrs(hb, "mlx5_0")}; got != [3]int{0, 0, 1} {
		t.Fatalf("MRs before any transfer: %v, want [0 0 1]", got)
	}
	ctx := context.Background()
	seg, err := a.E.OpenSegment(ctx, b.E.Name())
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 5; i++ {
		for _, op := range []transfer.Op{transfer.Write, transfer.Read} {
			if err := a.E.Transfer(ctx, []transfer.Request{
				{Op: op, Local: uintptr(ad.Addr), Len: 300 << 10, Segment: seg, Remote: bd.Addr},
				{Op: op, Local: uintptr(ad.Addr) + 512<<10, Len: 300 << 10, Segment: seg, Remote: bh.Addr()},
			}); err != nil {
				t.Fatal(err)
			}
		}
	}
	// One local staging on each of a's NICs; one served area on b's.
	if got := [3]int{mrs(ha, "mlx5_0"), mrs(ha, "mlx5_1"), mrs(hb, "mlx5_0")}; got != [3]int{1, 1, 2} {
		t.Fatalf("MRs after 10 staged batches: %v, want [1 1 2]", got)
	}
	a.Close()
	deadline := time.Now().Add(5 * time.Second)
	for mrs(hb, "mlx5_0") != 1 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := [3]int{mrs(ha, "mlx5_0"), mrs(ha, "mlx5_1"), mrs(hb, "mlx5_0")}; got != [3]int{0, 0, 1} {
		t.Fatalf("MRs after the initiator closed: %v, want [0 0 1]", got)
	}
}
