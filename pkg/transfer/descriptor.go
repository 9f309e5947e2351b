package transfer

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"strings"
)

// Descriptor is what a segment publishes: enough for a peer to decide which
// transport can reach which region, and how. It is stored as JSON in the
// registry (key mooncake/ram/<name>) and exchanged in the P2P handshake.
type Descriptor struct {
	Name string `json:"name"`
	// Incarnation changes every time a process starts: a peer that restarts
	// under the same name is a new peer.
	Incarnation string `json:"incarnation"`
	Host        HostID `json:"host"`
	// Addr is the engine's listen address (host:port) for connections of
	// every kind: control, tcp data lanes.
	Addr string `json:"addr"`
	// PID is the process id, for same-machine transports' diagnostics.
	PID int `json:"pid"`
	// Transports lists what the segment serves, with each one's
	// segment-level information (for example shm's unix socket name).
	Transports map[string]json.RawMessage `json:"transports"`
	Regions    []RegionInfo               `json:"regions"`
	// TokenRequired says peers must prove they know the cluster token.
	TokenRequired bool `json:"token_required,omitempty"`
}

// RegionInfo is one registered region as its peers see it.
type RegionInfo struct {
	Addr     uint64   `json:"addr"`
	Len      uint64   `json:"len"`
	Location Location `json:"location"`
	Access   Access   `json:"access"`
	// Handles holds per-transport data that lets a peer reach the region
	// (shm: memfd id and offset; nvlink: an exported handle).
	Handles map[string]json.RawMessage `json:"handles,omitempty"`
}

// End is one past the region's last byte.
func (r RegionInfo) End() uint64 { return r.Addr + r.Len }

// Clone returns a deep copy.
func (d *Descriptor) Clone() *Descriptor {
	b, _ := json.Marshal(d)
	var c Descriptor
	_ = json.Unmarshal(b, &c)
	return &c
}

// DecodeDescriptor parses and validates a descriptor.
func DecodeDescriptor(b []byte) (*Descriptor, error) {
	var d Descriptor
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&d); err != nil {
		return nil, fmt.Errorf("transfer: bad descriptor: %w", err)
	}
	if d.Name == "" || d.Incarnation == "" {
		return nil, fmt.Errorf("transfer: bad descriptor: name and incarnation are required")
	}
	if _, err := newRegionTable(d.Regions); err != nil {
		return nil, fmt.Errorf("transfer: bad descriptor of %s: %w", d.Name, err)
	}
	return &d, nil
}

// HostID identifies a machine and network namespace. Two processes with equal
// HostIDs are on the same machine: same boot, same machine-id, same network
// namespace (two namespaces stand for two hosts).
type HostID struct {
	BootID    string `json:"boot_id"`
	MachineID string `json:"machine_id"`
	NetNS     string `json:"netns"`
}

// SameMachine reports whether h and o are the same machine and namespace.
// Unknown (empty) identities are never the same.
func (h HostID) SameMachine(o HostID) bool {
	return h.BootID != "" && h.MachineID != "" && h.NetNS != "" && h == o
}

// LocalHostID reads this process's identity from /proc and /etc.
func LocalHostID() HostID {
	read := func(p string) string {
		b, err := os.ReadFile(p)
		if err != nil {
			return ""
		}
		return strings.TrimSpace(string(b))
	}
	id := HostID{
		BootID:    read("/proc/sys/kernel/random/boot_id"),
		MachineID: read("/etc/machine-id"),
	}
	if id.MachineID == "" {
		id.MachineID = read("/var/lib/dbus/machine-id")
	}
	if id.MachineID == "" && id.BootID != "" {
		// Containers often ship an empty machine-id; the boot id (random
		// per kernel boot) still tells machines apart.
		id.MachineID = "boot:" + id.BootID
	}
	if ns, err := os.Readlink("/proc/self/ns/net"); err == nil {
		id.NetNS = ns
	}
	return id
}
