package nvlink

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

// rig is the initiator process of the GPU tests: an engine with nvlink and
// mnnvl on GPU gpu (1 when there are two GPUs), and a target process on
// GPU 0.
type rig struct {
	tg     *target
	e      *transfer.Engine
	nv, mn *Transport
	logs   *observer.ObservedLogs
	seg    transfer.SegmentID
	gpu    int
	ctx    *cuda.Context
	cp     *cuda.Copier
	stream *cuda.Stream
	local  *cuda.Pool // 1 GiB, registered cuda:gpu
	lhost  *transfer.HostMemory
	nextID int
	lists  bool // send the cases' pages as one page-list request
}

// submitReqs is reqs as the rig sends them: as they are, or as a page list.
func (r *rig) submitReqs(reqs []transfer.Request) []transfer.Request {
	if r.lists {
		return transfertest.PageList(reqs)
	}
	return reqs
}

func needGPU(t testing.TB) int {
	t.Helper()
	if err := Available(); err != nil {
		t.Skipf("no GPU: %v", err)
	}
	n, _ := cuda.DeviceCount()
	return n
}

var (
	rigOnce sync.Once
	theRig  *rig
	rigErr  error
)

// getRig starts the target process and the initiator engine once for all
// GPU tests of this binary (they run in order, sharing it).
func getRig(t *testing.T) *rig {
	t.Helper()
	n := needGPU(t)
	rigOnce.Do(func() { theRig, rigErr = newRig(t, n) })
	if rigErr != nil {
		t.Fatal(rigErr)
	}
	return theRig
}

func newRig(t *testing.T, ngpu int) (*rig, error) {
	if os.Getenv(envKernels) == "" {
		dir, err := os.MkdirTemp("", "mc-nvlink-kernels-")
		if err != nil {
			return nil, err
		}
		os.Setenv(envKernels, dir)
	}
	r := &rig{gpu: min(1, ngpu-1)}
	// The target outlives this test: it is stopped when the binary exits
	// (its stdin closes).
	r.tg = startTargetNoCleanup(0)
	if r.tg == nil {
		return nil, errors.New("target did not start")
	}
	k, err := testKernels()
	if err != nil {
		return nil, err
	}
	core, logs := observer.New(zap.InfoLevel)
	r.logs = logs
	if r.nv, err = New(Config{Kernels: k}); err != nil {
		return nil, err
	}
	if r.mn, err = NewMNNVL(Config{Kernels: k}); err != nil {
		return nil, err
	}
	r.e, err = transfer.New(context.Background(), transfer.Config{Listen: "127.0.0.1:0",
		Transports: []transfer.Transport{r.nv, r.mn}, Logger: zap.New(core), Timeout: 30 * time.Second})
	if err != nil {
		return nil, err
	}
	dev, err := cuda.GetDevice(r.gpu)
	if err != nil {
		return nil, err
	}
	if r.ctx, err = dev.Retain(); err != nil {
		return nil, err
	}
	if r.cp, err = cuda.NewCopier(r.ctx, k, cuda.CopierConfig{}); err != nil {
		return nil, err
	}
	if r.stream, err = r.ctx.NewStream(cuda.StreamNonBlocking); err != nil {
		return nil, err
	}
	if r.local, err = r.ctx.NewPool(cuda.PoolConfig{Size: 1024 * mib}); err != nil {
		return nil, err
	}
	ctx := context.Background()
	if err := r.e.RegisterMemory(ctx, uintptr(r.local.Ptr()), r.local.Size(), transfer.Location{Kind: transfer.CUDA, Index: r.gpu},
		transfer.AccessReadWrite, transfer.WithMemory(r.local), transfer.WithScope(transfer.ScopeSameMachine)); err != nil {
		return nil, err
	}
	if r.lhost, err = r.e.AllocHost(ctx, 64*mib, 0, transfer.AccessReadWrite, transfer.WithScope(transfer.ScopeSameMachine)); err != nil {
		return nil, err
	}
	if r.seg, err = r.e.OpenSegment(ctx, r.tg.ready.Segment); err != nil {
		return nil, err
	}
	return r, nil
}

// startTargetNoCleanup starts the target without tying it to one test.
func startTargetNoCleanup(gpu int) *target {
	var tb fakeTB
	defer func() { recover() }()
	return startTarget(&tb, gpu)
}

// fakeTB lets startTarget run outside a test's lifetime: Cleanup is never
// called (the target ends when this process exits and its stdin closes),
// Fatal panics (recovered above).
type fakeTB struct{ testing.TB }

func (*fakeTB) Helper()                   {}
func (*fakeTB) Cleanup(func())            {}
func (*fakeTB) Fatal(a ...any)            { fmt.Println(a...); panic("fatal") }
func (*fakeTB) Fatalf(f string, a ...any) { fmt.Printf(f+"\n", a...); panic("fatal") }

func gcd(a, b uint64) uint64 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

// scatter returns a multiplier coprime to slots and an offset: page i goes
// to slot (i*mul+add) % slots, every page to its own slot.
func scatter(slots uint64) (mul, add uint64) {
	mul = rand.Uint64N(slots) | 1
	for gcd(mul, slots) != 1 {
		mul = (mul + 2) % slots
		if mul == 0 {
			mul = 1
		}
	}
	return mul, rand.Uint64N(slots)
}

// writeCase writes n pages of random data from local GPU (or host) memory
// into scattered slots of a target region and has the target check every
// byte of the region.
func (r *rig) writeCase(t *testing.T, region string, page uint64, n int, fromHost bool) {
	t.Helper()
	tr := r.tg.region(region)
	slots := tr.Len / page
	seed := rand.Uint64()
	var src uint64
	if fromHost {
		cuda.PatternFill(r.lhost.Bytes()[:uint64(n)*page], 0, seed)
		src = r.lhost.Addr()
	} else {
		if err := r.cp.Fill(r.stream, r.local.Ptr(), uint64(n)*page, seed); err != nil {
			t.Fatal(err)
		}
		if err := r.stream.Synchronize(); err != nil {
			t.Fatal(err)
		}
		src = uint64(r.local.Ptr())
	}
	mul, add := scatter(slots)
	reqs := make([]transfer.Request, n)
	for i := range reqs {
		reqs[i] = transfer.Request{Op: transfer.Write, Local: uintptr(src + uint64(i)*page), Len: page, Segment: r.seg,
			Remote: tr.Addr + slotOf(i, mul, add, slots)*page}
	}
	b, err := r.e.Submit(context.Background(), r.submitReqs(reqs))
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	if tp := b.Status(0).Transport; tp != Name {
		t.Fatalf("transport %s chosen, want nvlink", tp)
	}
	r.nextID++
	q := checkReq{ID: r.nextID, Region: region, Seed: seed, Page: page, N: n, Mul: mul, Add: add}
	data, _ := json.Marshal(q)
	if err := r.e.Notify(context.Background(), r.tg.ready.Segment, "check", data); err != nil {
		t.Fatal(err)
	}
	r.tg.wait(t, q.ID)
}

// readCase reads n scattered pages of a target region into poisoned local
// GPU memory and checks every byte read (and that nothing else changed).
func (r *rig) readCase(t *testing.T, region string, page uint64, n int) {
	t.Helper()
	tr := r.tg.region(region)
	slots := tr.Len / page
	poison := rand.Uint64()
	total := uint64(n) * page
	guard := uint64(64 << 10)
	if err := r.cp.Fill(r.stream, r.local.Ptr(), total+guard, poison); err != nil {
		t.Fatal(err)
	}
	if err := r.stream.Synchronize(); err != nil {
		t.Fatal(err)
	}
	mul, add := scatter(slots)
	reqs := make([]transfer.Request, n)
	for i := range reqs {
		reqs[i] = transfer.Request{Op: transfer.Read, Local: uintptr(uint64(r.local.Ptr()) + uint64(i)*page), Len: page, Segment: r.seg,
			Remote: tr.Addr + slotOf(i, mul, add, slots)*page}
	}
	if err := r.e.Transfer(context.Background(), r.submitReqs(reqs)); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, total+guard)
	if err := r.ctx.MemcpyDtoH(got, r.local.Ptr()); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, page)
	for i := 0; i < n; i++ {
		cuda.PatternFill(want, slotOf(i, mul, add, slots)*page, tr.Poison)
		if g := got[uint64(i)*page : uint64(i+1)*page]; string(g) != string(want) {
			t.Fatalf("page %d read from slot %d differs", i, slotOf(i, mul, add, slots))
		}
	}
	w := make([]byte, guard)
	cuda.PatternFill(w, total, poison)
	if string(got[total:]) != string(w) {
		t.Fatal("bytes after the last page were written")
	}
}

func sizes() []uint64 { return []uint64{4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20} }

// counts are the batch sizes tried for a page size: 1..65536, at most
// 256 MiB per case and at most the region's slots.
func counts(page, regionLen uint64, all []int) []int {
	var out []int
	for _, n := range all {
		n = int(min(uint64(n), 256*mib/page, regionLen/page))
		if !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	return out
}

func TestGPUWriteGPUToGPU(t *testing.T) {
	r := getRig(t)
	for _, page := range sizes() {
		for _, n := range counts(page, r.tg.region("pool").Len, []int{1, 3, 100, 4096, 65536}) {
			t.Run(fmt.Sprintf("page=%dKiB/batch=%d", page>>10, n), func(t *testing.T) { r.writeCase(t, "pool", page, n, false) })
		}
	}
}

func TestGPUReadGPUFromGPU(t *testing.T) {
	r := getRig(t)
	for _, page := range []uint64{4 << 10, 64 << 10, 1 << 20} {
		for _, n := range counts(page, r.tg.region("pool").Len, []int{1, 4096, 65536}) {
			t.Run(fmt.Sprintf("page=%dKiB/batch=%d", page>>10, n), func(t *testing.T) { r.readCase(t, "pool", page, n) })
		}
	}
}

// TestGPUPageList: the same cases as one page-list request each.
func TestGPUPageList(t *testing.T) {
	r := getRig(t)
	r.lists = true
	defer func() { r.lists = false }()
	for _, page := range []uint64{4 << 10, 64 << 10} {
		for _, n := range counts(page, r.tg.region("pool").Len, []int{1, 100, 65536}) {
			t.Run(fmt.Sprintf("write/page=%dKiB/batch=%d", page>>10, n), func(t *testing.T) { r.writeCase(t, "pool", page, n, false) })
			t.Run(fmt.Sprintf("read/page=%dKiB/batch=%d", page>>10, n), func(t *testing.T) { r.readCase(t, "pool", page, n) })
		}
	}
	t.Run("write/host/page=4KiB/batch=4096", func(t *testing.T) { r.writeCase(t, "host", 4<<10, 4096, false) })
}

func TestGPUWriteGPUToHost(t *testing.T) {
	r := getRig(t)
	for _, page := range []uint64{4 << 10, 64 << 10, 1 << 20} {
		for _, n := range counts(page, r.tg.region("host").Len, []int{1, 4096, 65536}) {
			t.Run(fmt.Sprintf("page=%dKiB/batch=%d", page>>10, n), func(t *testing.T) { r.writeCase(t, "host", page, n, false) })
		}
	}
	t.Run("read", func(t *testing.T) { r.readCase(t, "host", 64<<10, 2048) })
}

func TestGPUWriteHostToGPU(t *testing.T) {
	r := getRig(t)
	for _, c := range []struct {
		page uint64
		n    int
	}{{4 << 10, 1}, {4 << 10, 16384}, {1 << 20, 64}} {
		t.Run(fmt.Sprintf("page=%dKiB/batch=%d", c.page>>10, c.n), func(t *testing.T) { r.writeCase(t, "pool", c.page, c.n, true) })
	}
}

func TestGPUOutOfBounds(t *testing.T) {
	r := getRig(t)
	tr := r.tg.region("pool")
	ctx := context.Background()
	for name, q := range map[string]transfer.Request{
		"remote end":    {Op: transfer.Write, Local: uintptr(r.local.Ptr()), Len: 8192, Segment: r.seg, Remote: tr.Addr + tr.Len - 4096},
		"remote before": {Op: transfer.Write, Local: uintptr(r.local.Ptr()), Len: 4096, Segment: r.seg, Remote: tr.Addr - 4096},
		"local end":     {Op: transfer.Read, Local: uintptr(r.local.Ptr()) + uintptr(r.local.Size()) - 4096, Len: 8192, Segment: r.seg, Remote: tr.Addr},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := r.e.Submit(ctx, []transfer.Request{q})
			if !errors.Is(err, transfer.ErrOutOfBounds) {
				t.Fatalf("got %v, want ErrOutOfBounds", err)
			}
			t.Logf("refused: %v", err)
		})
	}
	// Nothing moved: the region still holds only its poison.
	r.nextID++
	q := checkReq{ID: r.nextID, Region: "pool", Page: 4096, N: 0, Mul: 1}
	data, _ := json.Marshal(q)
	if err := r.e.Notify(ctx, r.tg.ready.Segment, "check", data); err != nil {
		t.Fatal(err)
	}
	r.tg.wait(t, q.ID)
}

func TestGPUFabricFallback(t *testing.T) {
	r := getRig(t)
	fc := CheckFabric()
	t.Logf("fabric check: usable=%v reason=%q", fc.Usable, fc.Reason)
	lines := r.logs.FilterMessageSnippet("mnnvl not installed").All()
	if fc.Usable {
		if r.mn.Active() != true {
			t.Fatal("fabric usable but mnnvl inactive")
		}
		t.Skip("the fabric is usable here: no fallback to test")
	}
	if len(lines) != 1 {
		t.Fatalf("want one 'mnnvl not installed' log line, got %d", len(lines))
	}
	t.Logf("log line: %s %v", lines[0].Message, lines[0].ContextMap())
	if !strings.Contains(r.mn.Reason(), "FABRIC probe") && !strings.Contains(r.mn.Reason(), "NVML") {
		t.Fatalf("reason %q names neither NVML nor the probe", r.mn.Reason())
	}
	d, err := r.e.SegmentDescriptor(r.seg)
	if err != nil {
		t.Fatal(err)
	}
	for _, reg := range d.Regions {
		for _, loc := range []transfer.Location{{Kind: transfer.CUDA, Index: r.gpu}, {Kind: transfer.CPU}} {
			got := r.e.Select(loc, d, &reg)
			want := Name
			if loc.Kind == transfer.CPU && reg.Location.Kind == transfer.CPU {
				want = "" // host <-> host is shm's, not installed here
			}
			if got != want {
				t.Errorf("%v -> %v: selector picked %q, want %q", loc, reg.Location, got, want)
			}
		}
		if _, ok := reg.Handles[NameMNNVL]; ok {
			t.Errorf("inactive mnnvl published a handle for %v", reg.Location)
		}
	}
}
