package rdma_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs/fake"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

type side struct {
	n *transfertest.Node
	h *fake.Host
	m *transfer.HostMemory
}

const memSize = 8 << 20

// pair starts an initiator a and a target b on one fabric, each with the
// named NICs and memSize bytes of registered memory.
func pair(t testing.TB, cfg rdma.Config, timeout time.Duration, nics ...string) (a, b side) {
	t.Helper()
	fab := fake.NewFabric()
	mk := func() side {
		h := fab.NewHost(nics...)
		c := cfg
		c.Provider = h
		n := transfertest.NewNode(t, func() []transfer.Transport { return []transfer.Transport{rdma.New(c)} }, func(tc *transfer.Config) {
			if timeout > 0 {
				tc.Timeout = timeout
			}
		})
		return side{n: n, h: h, m: n.Alloc(t, memSize, transfer.AccessReadWrite)}
	}
	return mk(), mk()
}

// write moves count blocks of size bytes from a to b at random offsets
// and returns the error; on success it checks every byte of b.
func write(t *testing.T, a, b side, count, size int, seed uint64) error {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, seed+1))
	for i := range b.m.Bytes() {
		b.m.Bytes()[i] = transfertest.Poison
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	seg, err := a.n.E.OpenSegment(ctx, b.n.E.Name())
	if err != nil {
		t.Fatal(err)
	}
	return writeSeg(t, ctx, a, b, seg, count, size, rng)
}

func writeSeg(t *testing.T, ctx context.Context, a, b side, seg transfer.SegmentID, count, size int, rng *rand.Rand) error {
	t.Helper()
	src, dst := a.m.Bytes(), b.m.Bytes()
	for i := range src {
		src[i] = byte(rng.Uint32())
	}
	stride := memSize / count
	var reqs []transfer.Request
	for i := 0; i < count; i++ {
		off := i*stride + rng.IntN(stride-size+1)
		reqs = append(reqs, transfer.Request{Op: transfer.Write, Local: uintptr(unsafe.Pointer(&src[off])), Len: uint64(size), Segment: seg, Remote: b.m.Addr() + uint64(off)})
	}
	if err := a.n.E.Transfer(ctx, reqs); err != nil {
		return err
	}
	want := bytes.Repeat([]byte{transfertest.Poison}, len(dst))
	for _, r := range reqs {
		off := r.Remote - b.m.Addr()
		copy(want[off:off+r.Len], src[off:off+r.Len])
	}
	if !bytes.Equal(dst, want) {
		t.Fatal("destination differs after a transfer that succeeded")
	}
	return nil
}

// A QP that drops into ERR in the middle of a batch, with no other NIC:
// its tasks fail within the bound, naming the queue pair; the next batch
// gets new queue pairs and succeeds.
func TestQPErrorMidBatchOneNIC(t *testing.T) {
	a, b := pair(t, rdma.Config{SliceSize: 64 << 10}, 0, "mlx5_0")
	if err := write(t, a, b, 8, 4096, 1); err != nil {
		t.Fatal(err)
	}
	a.h.HCA("mlx5_0").ErrorAfter(10)
	start := time.Now()
	err := write(t, a, b, 64, 100<<10, 2)
	if !errors.Is(err, rdma.ErrPath) || !errors.Is(err, transfer.ErrPeerDead) || !strings.Contains(err.Error(), "mlx5_0") {
		t.Fatalf("batch with a QP error: %v; want ErrPath and ErrPeerDead naming mlx5_0", err)
	}
	if el := time.Since(start); el >= 3*time.Second || errors.Is(err, transfer.ErrTimeout) {
		t.Errorf("failed after %v (%v); a QP error must fail its tasks before the engine's bound of 3s", el, err)
	}
	if err := write(t, a, b, 64, 100<<10, 3); err != nil {
		t.Fatalf("batch after the QP error: %v", err)
	}
}

// With two NICs the slices of the failed QP are posted again on the other
// one: the batch succeeds, every byte in place.
func TestQPErrorMidBatchRetriedOnOtherNIC(t *testing.T) {
	reg := prometheus.NewRegistry()
	a, b := pair(t, rdma.Config{SliceSize: 16 << 10, Registerer: reg}, 0, "mlx5_0", "mlx5_1")
	if err := write(t, a, b, 4, 4096, 4); err != nil {
		t.Fatal(err)
	}
	before := a.h.HCA("mlx5_1").Posted()
	a.h.HCA("mlx5_0").ErrorAfter(7)
	if err := write(t, a, b, 64, 100<<10, 5); err != nil {
		t.Fatalf("batch with a QP error on one of two NICs: %v", err)
	}
	if a.h.HCA("mlx5_1").Posted()-before < 64*7/2 {
		t.Errorf("mlx5_1 carried only %d requests", a.h.HCA("mlx5_1").Posted()-before)
	}
	if got := metric(t, reg, "mooncake_rdma_bytes_total", nil); got != 4*4096+64*100<<10 {
		t.Errorf("mooncake_rdma_bytes_total %v, want every byte once: %v", got, 4*4096+64*100<<10)
	}
	if metric(t, reg, "mooncake_rdma_completion_errors_total", map[string]string{"nic": "mlx5_0", "status": "work request flushed"}) < 1 ||
		metric(t, reg, "mooncake_rdma_retries_total", map[string]string{"nic": "mlx5_0"}) < 1 ||
		metric(t, reg, "mooncake_rdma_retries_total", map[string]string{"nic": "mlx5_1"}) != 0 {
		t.Error("the flushed requests and their retries are not counted on mlx5_0")
	}
	if got := metric(t, reg, "mooncake_rdma_queue_pairs", nil); got < 1 || got > 4 {
		t.Errorf("mooncake_rdma_queue_pairs %v", got)
	}
	// The next batch gets new queue pairs: mlx5_0 carries work again.
	before0 := a.h.HCA("mlx5_0").Posted()
	if err := write(t, a, b, 64, 100<<10, 15); err != nil {
		t.Fatal(err)
	}
	if a.h.HCA("mlx5_0").Posted()-before0 < 64*7/2 {
		t.Errorf("after its QP failed, mlx5_0 carried only %d requests of the next batch", a.h.HCA("mlx5_0").Posted()-before0)
	}
}

// metric sums the series of name whose labels include want.
func metric(t *testing.T, g prometheus.Gatherer, name string, want map[string]string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for k, v := range want {
				found := false
				for _, lp := range m.GetLabel() {
					found = found || lp.GetName() == k && lp.GetValue() == v
				}
				if !found {
					continue next
				}
			}
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum
}

// Failures of one work request (retry exceeded) and a NIC whose link goes
// down: the work moves to the other NIC.
func TestFailedNICWorkRetried(t *testing.T) {
	for _, c := range []struct {
		name  string
		fault func(*fake.HCA)
	}{
		{"retry exceeded", func(d *fake.HCA) { d.FailNth(3, verbs.StatusRetryExc) }},
		{"link down", func(d *fake.HCA) { d.SetDown(true) }},
		{"CQ overrun", func(d *fake.HCA) { d.OverrunCQs() }},
	} {
		t.Run(c.name, func(t *testing.T) {
			a, b := pair(t, rdma.Config{SliceSize: 32 << 10}, 0, "mlx5_0", "mlx5_1")
			if err := write(t, a, b, 4, 1000, 6); err != nil {
				t.Fatal(err)
			}
			c.fault(a.h.HCA("mlx5_0"))
			if err := write(t, a, b, 32, 200<<10, 7); err != nil {
				t.Fatalf("after %s on mlx5_0: %v", c.name, err)
			}
			if err := write(t, a, b, 32, 200<<10, 8); err != nil {
				t.Fatalf("second batch after %s on mlx5_0: %v", c.name, err)
			}
		})
	}
}

// A stale remote key (the target unregistered the region after the
// initiator learned its key): the target's HCA refuses, the task fails
// with ErrOutOfBounds naming the range, and no byte lands.
func TestStaleKeyRefusedByHCA(t *testing.T) {
	a, b := pair(t, rdma.Config{}, 0, "mlx5_0")
	ctx := context.Background()
	seg, err := a.n.E.OpenSegment(ctx, b.n.E.Name())
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(9, 10))
	if err := writeSeg(t, ctx, a, b, seg, 4, 4096, rng); err != nil {
		t.Fatal(err)
	}
	if err := b.n.E.UnregisterMemory(ctx, uintptr(b.m.Addr())); err != nil {
		t.Fatal(err)
	}
	for i := range b.m.Bytes() {
		b.m.Bytes()[i] = transfertest.Poison
	}
	err = writeSeg(t, ctx, a, b, seg, 4, 4096, rng)
	if !errors.Is(err, transfer.ErrOutOfBounds) || !strings.Contains(err.Error(), "0x") {
		t.Fatalf("write with a revoked key: %v; want ErrOutOfBounds naming the range", err)
	}
	if !strings.Contains(err.Error(), "HCA refused") {
		t.Errorf("error %q does not say the target's HCA refused", err)
	}
	for i, c := range b.m.Bytes() {
		if c != transfertest.Poison {
			t.Fatalf("a refused write changed byte %d of the target's memory", i)
		}
	}
}

// An HCA that never completes: the batch ends at the engine's bound with
// a timeout; the transport then flushes the queue pairs and reports every
// task (no goroutine left: TestMain checks), and the next batch, on new
// queue pairs, succeeds.
func TestStalledHCABounded(t *testing.T) {
	const bound = 400 * time.Millisecond
	a, b := pair(t, rdma.Config{}, bound, "mlx5_0")
	if err := write(t, a, b, 4, 4096, 11); err != nil {
		t.Fatal(err)
	}
	seg, err := a.n.E.OpenSegment(context.Background(), b.n.E.Name())
	if err != nil {
		t.Fatal(err)
	}
	var reqs []transfer.Request
	for i := 0; i < 16; i++ {
		reqs = append(reqs, transfer.Request{Op: transfer.Write, Local: uintptr(a.m.Addr()) + uintptr(i*8192), Len: 4096, Segment: seg, Remote: b.m.Addr() + uint64(i*8192)})
	}
	a.h.HCA("mlx5_0").Stall(true)
	start := time.Now()
	err = a.n.E.Transfer(context.Background(), reqs)
	if !errors.Is(err, transfer.ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("stalled batch: %v; want a timeout", err)
	}
	if el := time.Since(start); el > bound+time.Second {
		t.Fatalf("stalled batch failed after %v (bound %v)", el, bound)
	}
	a.h.HCA("mlx5_0").Stall(false)
	deadline := time.Now().Add(3 * bound)
	for {
		err = write(t, a, b, 16, 4096, 13)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("batches after a stall still fail: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Start fails naming a device that does not exist or whose port is down.
func TestStartNamesTheDevice(t *testing.T) {
	fab := fake.NewFabric()
	h := fab.NewHost("mlx5_0")
	_, err := transfer.New(context.Background(), transfer.Config{Transports: []transfer.Transport{rdma.New(rdma.Config{Provider: h, Devices: []string{"mlx5_9"}})}})
	if !errors.Is(err, rdma.ErrNoDevice) || !strings.Contains(err.Error(), "mlx5_9") {
		t.Fatalf("missing device: %v", err)
	}
	h.HCA("mlx5_0").SetDown(true)
	_, err = transfer.New(context.Background(), transfer.Config{Transports: []transfer.Transport{rdma.New(rdma.Config{Provider: h})}})
	if !errors.Is(err, rdma.ErrNoDevice) || !strings.Contains(err.Error(), "mlx5_0") || !strings.Contains(err.Error(), "not active") {
		t.Fatalf("port down: %v", err)
	}
	if o, m, q := h.HCA("mlx5_0").Live(); o+m+q != 0 {
		t.Errorf("failed start left %d contexts, %d MRs, %d QPs open", o, m, q)
	}
	if err := (&rdma.Config{}).Validate(); err == nil {
		t.Error("a config with no provider validated")
	}
	for _, c := range []rdma.Config{{Provider: h, SliceSize: -1}, {Provider: h, MaxWR: 1 << 20}, {Provider: h, GIDIndex: 300}, {Provider: h, CQDepth: -1},
		{Provider: h, StagingSize: -1}, {Provider: h, StagingSize: 2 << 30}, {Provider: h, MaxServedStaging: -1}} {
		if err := c.Validate(); err == nil {
			t.Errorf("%+v validated", c)
		}
	}
	if got := rdma.New(rdma.Config{Provider: h, MaxWR: 8192}).Config(); got.Port != 1 || got.SliceSize == 0 || got.CQDepth < got.MaxWR ||
		got.StagingSize != 16<<20 || got.MaxServedStaging != 64*16<<20 {
		t.Errorf("defaults not filled: %+v", got)
	}
}

// Keys are not published: the descriptor (which a registry may show to
// anyone) carries NIC addresses and a region marker, never a key; and every
// context, MR and QP is released when the engines close.
func TestNoKeysInDescriptorAndNoLeaks(t *testing.T) {
	fab := fake.NewFabric()
	ha, hb := fab.NewHost("mlx5_0"), fab.NewHost("mlx5_0")
	mk := func(h *fake.Host) *transfertest.Node {
		return transfertest.NewNode(t, func() []transfer.Transport { return []transfer.Transport{rdma.New(rdma.Config{Provider: h})} }, nil)
	}
	a, b := mk(ha), mk(hb)
	am, bm := a.Alloc(t, memSize, transfer.AccessReadWrite), b.Alloc(t, memSize, transfer.AccessReadWrite)
	if err := write(t, side{n: a, h: ha, m: am}, side{n: b, h: hb, m: bm}, 4, 1000, 14); err != nil {
		t.Fatal(err)
	}
	d := b.E.Self()
	raw, _ := json.Marshal(d)
	if strings.Contains(strings.ToLower(string(raw)), "key") {
		t.Fatalf("descriptor mentions keys: %s", raw)
	}
	var h struct {
		NICs int    `json:"nics"`
		Gen  uint64 `json:"gen"`
	}
	raw = d.Regions[0].Handles[rdma.Name]
	if err := json.Unmarshal(raw, &h); err != nil || h.NICs != 1 || h.Gen == 0 || strings.Count(string(raw), ",") != 1 {
		t.Fatalf("region handle %s", raw)
	}
	a.Close()
	b.Close()
	for _, h := range []*fake.Host{ha, hb} {
		if o, m, q := h.HCA("mlx5_0").Live(); o+m+q != 0 {
			t.Errorf("after close: %d contexts, %d MRs, %d QPs open", o, m, q)
		}
	}
}

// Closing the engine while a batch waits on a stalled HCA: the batch ends,
// Close returns within its bounds, nothing is left running.
func TestCloseWithStalledBatch(t *testing.T) {
	const bound = 300 * time.Millisecond
	a, b := pair(t, rdma.Config{}, bound, "mlx5_0")
	if err := write(t, a, b, 4, 4096, 16); err != nil {
		t.Fatal(err)
	}
	seg, err := a.n.E.OpenSegment(context.Background(), b.n.E.Name())
	if err != nil {
		t.Fatal(err)
	}
	a.h.HCA("mlx5_0").Stall(true)
	done := make(chan error, 1)
	go func() {
		done <- a.n.E.Transfer(context.Background(), []transfer.Request{{Op: transfer.Write, Local: uintptr(a.m.Addr()), Len: 4096, Segment: seg, Remote: b.m.Addr()}})
	}()
	for a.h.HCA("mlx5_0").Posted() < 5 { // the 4 writes above, then this one
		time.Sleep(5 * time.Millisecond)
	}
	start := time.Now()
	a.n.Close()
	if el := time.Since(start); el > 2*bound+2*time.Second {
		t.Fatalf("Close took %v with a stalled batch", el)
	}
	if err := <-done; err == nil {
		t.Fatal("a stalled batch succeeded")
	}
	if o, m, q := a.h.HCA("mlx5_0").Live(); o+m+q != 0 {
		t.Errorf("after Close: %d contexts, %d MRs, %d QPs open", o, m, q)
	}
}

// The target unregisters a region and registers it again at the same
// address: once the initiator has the new descriptor, the old keys are not
// used (the handle's generation changed) and the first batch succeeds.
func TestReRegisteredRegion(t *testing.T) {
	a, b := pair(t, rdma.Config{}, 0, "mlx5_0")
	if err := write(t, a, b, 4, 4096, 18); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := b.n.E.UnregisterMemory(ctx, uintptr(b.m.Addr())); err != nil {
		t.Fatal(err)
	}
	if err := b.n.E.RegisterMemory(ctx, uintptr(b.m.Addr()), uint64(b.m.Size()), transfer.Location{Kind: transfer.CPU}, transfer.AccessReadWrite,
		transfer.WithHostMemory(b.m, 0)); err != nil {
		t.Fatal(err)
	}
	if err := write(t, a, b, 4, 4096, 19); err != nil {
		t.Fatalf("first batch after the target registered the region again: %v", err)
	}
}
