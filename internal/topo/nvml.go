//go:build cgo

package topo

import (
	"errors"
	"fmt"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/mooncake-go/mooncake-go/internal/dl"
)

// NVMLLibrary is the soname loaded.
const NVMLLibrary = "libnvidia-ml.so.1"

// Discover reads the topology through NVML. It returns an *Error (wrapping
// ErrNoGPU) when NVML is missing, fails to initialise, or sees no GPU.
func Discover() (*Topology, error) {
	// Open it ourselves first: go-nvml drops dlerror's text.
	h, err := dl.Open(NVMLLibrary, dl.RTLD_LAZY)
	if err != nil {
		msg := err.Error()
		var de *dl.Error
		if errors.As(err, &de) {
			msg = de.Msg
		}
		if !strings.HasPrefix(msg, NVMLLibrary) { // dlerror usually names the file itself
			msg = NVMLLibrary + ": " + msg
		}
		return nil, &Error{Reason: fmt.Sprintf("NVML not found (%s)", msg)}
	}
	defer h.Close()

	lib := nvml.New()
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return nil, &Error{Reason: "NVML init failed", Err: fmt.Errorf("nvmlInit: %s", lib.ErrorString(ret))}
	}
	defer lib.Shutdown()

	t := &Topology{}
	if v, ret := lib.SystemGetDriverVersion(); ret == nvml.SUCCESS {
		t.DriverVersion = v
	}
	if v, ret := lib.SystemGetCudaDriverVersion(); ret == nvml.SUCCESS {
		t.CUDAVersion = v
	}
	n, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, &Error{Reason: "NVML cannot count GPUs", Err: fmt.Errorf("nvmlDeviceGetCount: %s", lib.ErrorString(ret))}
	}
	if n == 0 {
		return nil, &Error{Reason: "NVML reports 0 GPUs"}
	}
	hasFabric := lib.Extensions().LookupSymbol("nvmlDeviceGetGpuFabricInfo") == nil
	devs := make([]nvml.Device, n)
	remote := make([]map[string]int, n) // per GPU: remote bus id -> link count
	for i := 0; i < n; i++ {
		d, ret := lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nil, &Error{Reason: fmt.Sprintf("NVML cannot open GPU %d", i), Err: fmt.Errorf("%s", lib.ErrorString(ret))}
		}
		devs[i] = d
		g := GPU{Index: i, NUMANode: -1}
		g.Name, _ = d.GetName()
		g.UUID, _ = d.GetUUID()
		if pi, ret := d.GetPciInfo(); ret == nvml.SUCCESS {
			g.PCIBusID = NormalizeBusID(cstr(pi.BusId[:]))
		}
		if m, ret := d.GetMemoryInfo(); ret == nvml.SUCCESS {
			g.MemoryTotal = m.Total
		}
		if nn, ret := d.GetNumaNodeId(); ret == nvml.SUCCESS {
			g.NUMANode = nn
		} else if g.PCIBusID != "" {
			g.NUMANode = numaFromSysfs(g.PCIBusID)
		}
		g.Fabric = Fabric{State: FabricNotSupported}
		if hasFabric {
			g.Fabric = fabricInfo(lib, d)
		}
		remote[i] = map[string]int{}
		for l := 0; l < nvml.NVLINK_MAX_LINKS; l++ {
			st, ret := d.GetNvLinkState(l)
			if ret != nvml.SUCCESS {
				if ret == nvml.ERROR_INVALID_ARGUMENT || ret == nvml.ERROR_NOT_SUPPORTED {
					break
				}
				continue
			}
			if st != nvml.FEATURE_ENABLED {
				continue
			}
			g.NVLinks++
			if rp, ret := d.GetNvLinkRemotePciInfo(l); ret == nvml.SUCCESS {
				remote[i][NormalizeBusID(cstr(rp.BusId[:]))]++
			}
		}
		t.GPUs = append(t.GPUs, g)
	}
	for a := 0; a < n; a++ {
		for b := a + 1; b < n; b++ {
			l := Link{A: a, B: b}
			l.NVLinks = remote[a][t.GPUs[b].PCIBusID]
			l.P2PRead = p2pOK(devs[a], devs[b], nvml.P2P_CAPS_INDEX_READ)
			l.P2PWrite = p2pOK(devs[a], devs[b], nvml.P2P_CAPS_INDEX_WRITE)
			l.P2PNVLink = p2pOK(devs[a], devs[b], nvml.P2P_CAPS_INDEX_NVLINK)
			if lvl, ret := devs[a].GetTopologyCommonAncestor(devs[b]); ret == nvml.SUCCESS {
				l.Path = levelName(lvl)
			}
			if l.NVLinks > 0 || l.P2PNVLink {
				l.Path = "NV"
			}
			t.Links = append(t.Links, l)
		}
	}
	return t, nil
}

func p2pOK(a, b nvml.Device, idx nvml.GpuP2PCapsIndex) bool {
	st, ret := a.GetP2PStatus(b, idx)
	return ret == nvml.SUCCESS && st == nvml.P2P_STATUS_OK
}

func fabricInfo(lib nvml.Interface, d nvml.Device) Fabric {
	fi, ret := d.GetGpuFabricInfo()
	if ret == nvml.ERROR_NOT_SUPPORTED {
		return Fabric{State: FabricNotSupported}
	}
	if ret != nvml.SUCCESS {
		return Fabric{State: FabricUnknown, Status: lib.ErrorString(ret)}
	}
	f := Fabric{CliqueID: fi.CliqueId, Status: lib.ErrorString(nvml.Return(fi.Status))}
	switch fi.State {
	case nvml.GPU_FABRIC_STATE_NOT_SUPPORTED:
		f.State = FabricNotSupported
	case nvml.GPU_FABRIC_STATE_NOT_STARTED:
		f.State = FabricNotStarted
	case nvml.GPU_FABRIC_STATE_IN_PROGRESS:
		f.State = FabricInProgress
	case nvml.GPU_FABRIC_STATE_COMPLETED:
		f.State = FabricCompleted
	default:
		f.State = FabricUnknown
	}
	var zero [16]uint8
	if fi.ClusterUuid != zero {
		u := fi.ClusterUuid
		f.ClusterUUID = fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
	}
	f.Ready = f.State == FabricCompleted && nvml.Return(fi.Status) == nvml.SUCCESS
	return f
}

func levelName(l nvml.GpuTopologyLevel) string {
	switch l {
	case nvml.TOPOLOGY_INTERNAL:
		return "X"
	case nvml.TOPOLOGY_SINGLE:
		return "PIX"
	case nvml.TOPOLOGY_MULTIPLE:
		return "PXB"
	case nvml.TOPOLOGY_HOSTBRIDGE:
		return "PHB"
	case nvml.TOPOLOGY_NODE:
		return "NODE"
	case nvml.TOPOLOGY_SYSTEM:
		return "SYS"
	}
	return fmt.Sprintf("level-%d", int(l))
}

func cstr(b []int8) string {
	out := make([]byte, 0, len(b))
	for _, c := range b {
		if c == 0 {
			break
		}
		out = append(out, byte(c))
	}
	return string(out)
}
