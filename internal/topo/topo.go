// Package topo describes the node's NVIDIA GPUs through NVML (go-nvml):
// names, UUIDs, PCI addresses, memory, NUMA affinity, NVLink peers and
// fabric (MNNVL) state. Without NVML (or without cgo) Discover returns an
// *Error whose message begins with the reason, so a caller can print
// "no NVIDIA GPU: " + err.Error().
package topo

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// ErrNoGPU is wrapped by every Discover error that means "no usable GPU".
var ErrNoGPU = errors.New("topo: no NVIDIA GPU")

// Error says why no GPU topology is available. Reason comes first in the
// message ("NVML not found (libnvidia-ml.so.1: cannot open shared object
// file: No such file or directory)").
type Error struct {
	Reason string
	Err    error
}

func (e *Error) Error() string {
	if e.Err != nil {
		return e.Reason + ": " + e.Err.Error()
	}
	return e.Reason
}

// Unwrap returns ErrNoGPU and the cause.
func (e *Error) Unwrap() []error {
	if e.Err != nil {
		return []error{ErrNoGPU, e.Err}
	}
	return []error{ErrNoGPU}
}

// FabricState is the GPU's NVLink fabric (MNNVL) registration state.
type FabricState string

// Fabric states (NVML_GPU_FABRIC_STATE_*); anything but Completed with a
// successful status is "not ready".
const (
	FabricNotSupported FabricState = "not-supported"
	FabricNotStarted   FabricState = "not-started"
	FabricInProgress   FabricState = "in-progress"
	FabricCompleted    FabricState = "completed"
	FabricUnknown      FabricState = "unknown"
)

// Fabric is what NVML reports about the GPU's fabric membership.
type Fabric struct {
	State       FabricState `json:"state"`
	Status      string      `json:"status,omitempty"` // NVML status of the registration
	ClusterUUID string      `json:"cluster_uuid,omitempty"`
	CliqueID    uint32      `json:"clique_id,omitempty"`
	Ready       bool        `json:"ready"`
}

// GPU is one device as NVML sees it.
type GPU struct {
	Index       int    `json:"index"` // NVML index (matches CUDA ordinals when CUDA_VISIBLE_DEVICES is unset and order is PCI)
	Name        string `json:"name"`
	UUID        string `json:"uuid"`
	PCIBusID    string `json:"pci_bus_id"` // "0000:19:00.0"
	MemoryTotal uint64 `json:"memory_total"`
	NUMANode    int    `json:"numa_node"` // -1 when unknown
	NVLinks     int    `json:"nvlinks"`   // active NVLink links
	Fabric      Fabric `json:"fabric"`
}

// Link describes the path between two GPUs.
type Link struct {
	A         int    `json:"a"`
	B         int    `json:"b"`
	NVLinks   int    `json:"nvlinks"` // links from A whose far end is B
	P2PRead   bool   `json:"p2p_read"`
	P2PWrite  bool   `json:"p2p_write"`
	P2PNVLink bool   `json:"p2p_nvlink"` // NVML says the P2P path is NVLink
	Path      string `json:"path"`       // NVML topology level: "NV", "PIX", "PXB", "PHB", "NODE", "SYS"
}

// Topology is the node's GPU view.
type Topology struct {
	DriverVersion string `json:"driver_version"`
	CUDAVersion   int    `json:"cuda_version"` // 13000 for 13.0
	GPUs          []GPU  `json:"gpus"`
	Links         []Link `json:"links"`
}

// NormalizeBusID turns NVML's "00000000:19:00.0" into "0000:19:00.0"
// (lower case), the form CUDA and sysfs use.
func NormalizeBusID(s string) string {
	s = strings.ToLower(strings.TrimRight(s, "\x00 "))
	if i := strings.IndexByte(s, ':'); i > 4 {
		s = s[i-4:]
	}
	return s
}

// numaFromSysfs reads /sys/bus/pci/devices/<bus id>/numa_node; -1 if unknown.
func numaFromSysfs(busID string) int {
	b, err := os.ReadFile("/sys/bus/pci/devices/" + busID + "/numa_node")
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return -1
	}
	return n
}

func (g GPU) String() string {
	return fmt.Sprintf("GPU %d: %s (%s, %s, %.1f GiB, NUMA %d, %d NVLinks, fabric %s)",
		g.Index, g.Name, g.UUID, g.PCIBusID, float64(g.MemoryTotal)/(1<<30), g.NUMANode, g.NVLinks, g.Fabric.State)
}
