package cuda

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
)

// TestNoDriver runs where libcuda.so.1 is absent (CI): every entry point
// must fail with an error wrapping ErrNoDriver that names the library.
func TestNoDriver(t *testing.T) {
	if err := Init(); err == nil {
		t.Skip("a CUDA driver is present; the no-driver path cannot be tested here")
	} else if errors.Is(err, ErrNoDevice) {
		t.Skipf("driver present but no device: %v", err)
	}
	err := Init()
	if !errors.Is(err, ErrNoDriver) {
		t.Fatalf("Init error %v does not wrap ErrNoDriver", err)
	}
	if !strings.Contains(err.Error(), "CUDA driver not found (libcuda.so.1: ") {
		t.Fatalf("Init error %q lacks 'CUDA driver not found (libcuda.so.1: <reason>)'", err)
	}
	t.Logf("no-driver error: %v", err)
	checks := map[string]error{}
	_, checks["DeviceCount"] = DeviceCount()
	_, checks["GetDevice"] = GetDevice(0)
	_, checks["DriverVersion"] = DriverVersion()
	_, checks["Device.Name"] = Device(0).Name()
	_, checks["Device.TotalMem"] = Device(0).TotalMem()
	_, checks["Device.PCIBusID"] = Device(0).PCIBusID()
	_, checks["Device.Retain"] = Device(0).Retain()
	_, checks["Device.CanAccessPeer"] = Device(0).CanAccessPeer(1)
	_, checks["Device.AllocationGranularity"] = Device(0).AllocationGranularity(HandlePosixFD, false)
	var st Stream
	checks["Stream.BeginCapture"] = st.BeginCapture(CaptureThreadLocal)
	_, checks["Stream.EndCapture"] = st.EndCapture()
	_, checks["Stream.CaptureStatus"] = st.CaptureStatus()
	_, checks["Graph.Instantiate"] = (&Graph{}).Instantiate()
	_, checks["Graph.NodeCount"] = (&Graph{}).NodeCount()
	checks["GraphExec.Launch"] = (&GraphExec{}).Launch(&st)
	checks["GraphExec.Upload"] = (&GraphExec{}).Upload(&st)
	checks["GraphExec.Update"] = (&GraphExec{}).Update(&Graph{})
	for name, err := range checks {
		if !errors.Is(err, ErrNoDriver) {
			t.Errorf("%s: error %v does not wrap ErrNoDriver", name, err)
		}
	}
}

// TestGraphNoHandle: the graph entry points refuse nil, zero and destroyed
// handles with an error (ErrNoDriver without a driver, else ErrNoHandle),
// never a crash; Destroy of nothing is a no-op.
func TestGraphNoHandle(t *testing.T) {
	want := ErrNoHandle
	if err := Init(); err != nil {
		want = ErrNoDriver
	}
	var nilStream *Stream
	var nilExec *GraphExec
	var nilGraph *Graph
	legacy := &Stream{ctx: &Context{}}
	for name, err := range map[string]error{
		"nil stream BeginCapture":    nilStream.BeginCapture(CaptureGlobal),
		"legacy stream BeginCapture": legacy.BeginCapture(CaptureThreadLocal),
		"nil exec Launch":            nilExec.Launch(legacy),
		"zero exec Update":           (&GraphExec{}).Update(nilGraph),
	} {
		if !errors.Is(err, want) {
			t.Errorf("%s: %v, want %v", name, err, want)
		}
	}
	if _, err := nilGraph.Instantiate(); !errors.Is(err, want) {
		t.Errorf("nil graph Instantiate: %v, want %v", err, want)
	}
	if err := errors.Join(nilGraph.Destroy(), nilExec.Destroy(), (&Graph{}).Destroy(), (&GraphExec{}).Destroy()); err != nil {
		t.Errorf("Destroy of nothing: %v", err)
	}
}

func TestGraphUpdateError(t *testing.T) {
	err := error(&GraphUpdateError{Reason: GraphUpdateTopologyChanged, Err: &Error{Op: "cuGraphExecUpdate", Code: ErrorGraphExecUpdateFailure}})
	for _, want := range []string{"topology changed", "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE", "910"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q lacks %q", err, want)
		}
	}
	if Code(err) != ErrorGraphExecUpdateFailure {
		t.Errorf("Code %v", Code(err))
	}
	var ue *GraphUpdateError
	if !errors.As(fmt.Errorf("wrapped: %w", err), &ue) || ue.Reason != GraphUpdateTopologyChanged {
		t.Error("errors.As did not find the update error")
	}
	if GraphUpdateResult(42).String() != "graph-update-result(42)" || CaptureInvalidated.String() != "invalidated" {
		t.Error("names of unknown values")
	}
}

func TestNoNVRTC(t *testing.T) {
	_, err := LoadNVRTC()
	if err == nil {
		t.Skip("NVRTC present")
	}
	if !errors.Is(err, ErrNoNVRTC) || !strings.Contains(err.Error(), "libnvrtc") {
		t.Fatalf("LoadNVRTC error %v: want ErrNoNVRTC naming libnvrtc", err)
	}
	if _, err := NewKernels(KernelsConfig{}); !errors.Is(err, ErrNoNVRTC) {
		t.Fatalf("NewKernels error %v does not wrap ErrNoNVRTC", err)
	}
}

func TestErrorFormat(t *testing.T) {
	err := error(&Error{Op: "cuMemMap", Code: ErrorNotPermitted})
	msg := err.Error()
	for _, want := range []string{"cuMemMap", "CUDA_ERROR_NOT_PERMITTED", "800"} {
		if !strings.Contains(msg, want) {
			t.Errorf("%q lacks %q", msg, want)
		}
	}
	wrapped := errors.Join(errors.New("pool"), err)
	if !errors.Is(wrapped, &Error{Code: ErrorNotPermitted}) {
		t.Error("errors.Is by code failed")
	}
	if errors.Is(wrapped, &Error{Code: ErrorOutOfMemory}) {
		t.Error("errors.Is matched the wrong code")
	}
	if Code(wrapped) != ErrorNotPermitted || Code(errors.New("x")) != Success {
		t.Error("Code() wrong")
	}
	if Result(12345).Name() != "CUDA_ERROR_12345" {
		t.Errorf("unknown code name %q", Result(12345).Name())
	}
}

func TestArgsPacking(t *testing.T) {
	var a Args
	a.U32(7).Ptr(0x1122334455667788).F32(1.5).I32(-1).U64(9)
	if a.Len() != 5 {
		t.Fatalf("Len %d", a.Len())
	}
	want := []uint32{0, 8, 16, 20, 24}
	for i, o := range a.off {
		if o != want[i] {
			t.Fatalf("offsets %v, want %v", a.off, want)
		}
	}
	if len(a.buf) != 32 {
		t.Fatalf("buffer %d bytes, want 32", len(a.buf))
	}
	if err := a.Add(3); err == nil {
		t.Fatal("plain int accepted")
	}
	a.Reset()
	if a.Len() != 0 || len(a.buf) != 0 {
		t.Fatal("Reset did not empty")
	}
}

func TestPatternFill(t *testing.T) {
	whole := make([]byte, 4096)
	PatternFill(whole, 0, 42)
	for _, off := range []uint64{0, 1, 3, 8, 13, 100} {
		part := make([]byte, 1000)
		PatternFill(part, off, 42)
		if !bytes.Equal(part, whole[off:off+1000]) {
			t.Fatalf("pattern at offset %d differs", off)
		}
	}
	other := make([]byte, 4096)
	PatternFill(other, 0, 43)
	if bytes.Equal(whole, other) {
		t.Fatal("seeds give the same pattern")
	}
}

func TestPoolConfigValidate(t *testing.T) {
	if (PoolConfig{}).Validate() == nil {
		t.Error("zero size accepted")
	}
	if (PoolConfig{Size: 1, HandleType: 2}).Validate() == nil {
		t.Error("win32 handle accepted")
	}
	if err := (PoolConfig{Size: 1}).Validate(); err != nil {
		t.Error(err)
	}
}

func TestCopierPlan(t *testing.T) {
	cp := &Copier{cfg: CopierConfig{BlockThreads: 256, CTAsPerSM: 8}, sms: 132}
	descs := make([]CopyDesc, 65536)
	for i := range descs {
		descs[i].Len = 4096
	}
	p := cp.Plan(descs)
	if p.ChunkBytes < 2048 || p.ChunkBytes%16 != 0 || p.Grid != 132*8 || p.Block != 256 {
		t.Fatalf("plan %+v", p)
	}
	if p.ChunksPerDesc != (4096+p.ChunkBytes-1)/p.ChunkBytes {
		t.Fatalf("uniform pages not detected: %+v", p)
	}
	descs[7].Len = 100000
	if cp.Plan(descs).ChunksPerDesc != 0 {
		t.Fatal("varied pages planned as uniform")
	}
	descs[7].Len = 4096
	if p.TotalChunks != uint64(65536*((4096+p.ChunkBytes-1)/p.ChunkBytes)) {
		t.Fatalf("chunks %d", p.TotalChunks)
	}
	one := cp.Plan([]CopyDesc{{Len: 0}})
	if one.TotalChunks != 1 || one.Grid != 1 {
		t.Fatalf("empty-desc plan %+v", one)
	}
}

// BenchmarkCopierPlan is the host's planning cost per descriptor of a
// 65536-page batch (the part of Copy before the staging writes).
func BenchmarkCopierPlan(b *testing.B) {
	cp := &Copier{cfg: CopierConfig{BlockThreads: 256, CTAsPerSM: 8}, sms: 132}
	descs := make([]CopyDesc, 65536)
	for i := range descs {
		descs[i] = CopyDesc{Src: DevicePtr(i * 4096), Dst: DevicePtr((65536 - i) * 4096), Len: 4096}
	}
	for b.Loop() {
		cp.Plan(descs)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(descs)), "ns/desc")
}

// planRef is Plan as first written (a pass per question): the reference
// for TestCopierPlanSame.
func planRef(cp *Copier, descs []CopyDesc) Plan {
	var total uint64
	for _, d := range descs {
		total += d.Len
	}
	block := cp.cfg.BlockThreads
	maxGrid := cp.sms * cp.cfg.CTAsPerSM
	chunk := cp.cfg.ChunkBytes
	if chunk == 0 {
		warps := uint64(maxGrid) * uint64(block/32)
		chunk = total / (warps * 4) &^ 15
		chunk = min(max(chunk, 2048), 64<<10)
	}
	var chunks, per uint64
	for i, d := range descs {
		k := max((d.Len+chunk-1)/chunk, 1)
		if i == 0 {
			per = k
		} else if k != per {
			per = 0
		}
		chunks += k
	}
	wpb := uint64(block / 32)
	grid := uint32(min((chunks+wpb-1)/wpb, uint64(maxGrid)))
	p := Plan{Kernel: KernelChunks, ChunkBytes: chunk, TotalChunks: chunks, ChunksPerDesc: per, Grid: max(grid, 1), Block: block}
	fit := len(descs) > 0 && descs[0].Len != 0 && descs[0].Len%16 == 0
	for _, d := range descs {
		fit = fit && d.Len == descs[0].Len && (uint64(d.Src)|uint64(d.Dst))&15 == 0
	}
	if cp.cfg.Kernel != KernelChunks && fit {
		vecs := total / 16
		u := uint64(max(cp.cfg.Unroll, 1))
		pg := cp.pagesGrid
		if pg == 0 {
			pg = maxGrid
		}
		threads := (vecs + u - 1) / u
		g := uint32(min((threads+uint64(block)-1)/uint64(block), uint64(pg)))
		p.Kernel, p.PageBytes, p.Grid = KernelPages, descs[0].Len, max(g, 1)
	}
	return p
}

// TestCopierPlanSame: Plan gives the reference's plan on many batches.
func TestCopierPlanSame(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	kinds := map[CopyKernel]int{}
	for trial := 0; trial < 2000; trial++ {
		cp := &Copier{cfg: CopierConfig{BlockThreads: 32 * uint32(1+rng.IntN(8)), CTAsPerSM: uint32(1 + rng.IntN(8)),
			Unroll: rng.IntN(5)}, sms: uint32(1 + rng.IntN(132)), pagesGrid: uint32(rng.IntN(300))}
		if rng.IntN(3) == 0 {
			cp.cfg.ChunkBytes = 16 * uint64(1+rng.IntN(512))
		}
		if rng.IntN(4) == 0 {
			cp.cfg.Kernel = KernelChunks
		}
		n := rng.IntN(300)
		descs := make([]CopyDesc, n)
		size := uint64(16 * (1 + rng.IntN(1024)))
		mess := rng.IntN(2) == 0 // else every block is an aligned page
		for i := range descs {
			descs[i] = CopyDesc{Src: DevicePtr(rng.Uint64() &^ 15), Dst: DevicePtr(rng.Uint64() &^ 15), Len: size}
			switch rng.IntN(20) * map[bool]int{true: 1, false: 0}[mess] {
			case 1:
				descs[i].Len = uint64(rng.IntN(1 << 20)) // another size, maybe 0 or odd
			case 2:
				descs[i].Src |= 1 // misaligned
			}
		}
		got, want := cp.Plan(descs), planRef(cp, descs)
		if got != want {
			t.Fatalf("trial %d (%d descs): Plan %+v, reference %+v", trial, n, got, want)
		}
		kinds[got.Kernel]++
	}
	if kinds[KernelPages] < 100 || kinds[KernelChunks] < 100 {
		t.Fatalf("trials by kernel %v: both kinds should be common", kinds)
	}
}
