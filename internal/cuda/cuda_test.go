package cuda

import (
	"bytes"
	"errors"
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
	for name, err := range checks {
		if !errors.Is(err, ErrNoDriver) {
			t.Errorf("%s: error %v does not wrap ErrNoDriver", name, err)
		}
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
