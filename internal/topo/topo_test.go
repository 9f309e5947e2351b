package topo

import (
	"errors"
	"strings"
	"testing"
)

func TestDiscover(t *testing.T) {
	topo, err := Discover()
	if err != nil {
		var e *Error
		if !errors.As(err, &e) || !errors.Is(err, ErrNoGPU) {
			t.Fatalf("Discover error %T %v: want *topo.Error wrapping ErrNoGPU", err, err)
		}
		if !strings.HasPrefix(err.Error(), e.Reason) || e.Reason == "" {
			t.Fatalf("message %q does not begin with the reason", err)
		}
		t.Skipf("no NVIDIA GPU: %v", err)
	}
	t.Logf("driver %s, CUDA %d", topo.DriverVersion, topo.CUDAVersion)
	for _, g := range topo.GPUs {
		t.Log(g.String())
		if g.UUID == "" || g.PCIBusID == "" || g.MemoryTotal == 0 {
			t.Errorf("GPU %d incomplete: %+v", g.Index, g)
		}
		if g.Fabric.Ready && g.Fabric.State != FabricCompleted {
			t.Errorf("fabric ready in state %s", g.Fabric.State)
		}
	}
	for _, l := range topo.Links {
		t.Logf("GPU %d <-> GPU %d: path %s, %d NVLinks, P2P read=%v write=%v nvlink=%v", l.A, l.B, l.Path, l.NVLinks, l.P2PRead, l.P2PWrite, l.P2PNVLink)
	}
}

func TestNormalizeBusID(t *testing.T) {
	for in, want := range map[string]string{
		"00000000:19:00.0":         "0000:19:00.0",
		"0000:1A:00.0":             "0000:1a:00.0",
		"00000001:3b:00.0\x00\x00": "0001:3b:00.0",
	} {
		if got := NormalizeBusID(in); got != want {
			t.Errorf("NormalizeBusID(%q) = %q, want %q", in, got, want)
		}
	}
}
