package transfer

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
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
	// MAC seals the descriptor with the cluster secret (see Seal); empty
	// when the publisher runs without authentication.
	MAC string `json:"mac,omitempty"`
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

// descriptorDomain is the MAC domain of descriptor seals.
const descriptorDomain = "mooncake descriptor v1"

// canonical is the byte string a seal covers: d's JSON with MAC empty.
// encoding/json writes struct fields in declaration order, map keys sorted
// and raw messages compacted, so a reader that decodes a descriptor and
// encodes it again gets the bytes the publisher sealed.
func (d *Descriptor) canonical() ([]byte, error) {
	c := *d
	c.MAC = ""
	return json.Marshal(&c)
}

// Seal sets d.MAC to the HMAC under s of d's canonical encoding; the zero
// secret (no authentication) clears it.
func (d *Descriptor) Seal(s auth.Secret) error {
	d.MAC = ""
	if s.IsZero() {
		return nil
	}
	b, err := d.canonical()
	if err == nil {
		// Seal what a reader will see: the encoding of the decoded
		// encoding (they differ only where JSON cannot carry a value as
		// it is, as invalid UTF-8 in a string).
		var r Descriptor
		if err = json.Unmarshal(b, &r); err == nil {
			b, err = r.canonical()
		}
	}
	if err != nil {
		return fmt.Errorf("transfer: seal descriptor of %s: %w", d.Name, err)
	}
	d.MAC = s.MACHex(descriptorDomain, b)
	return nil
}

// CheckSeal reports whether d is sealed under s; with the zero secret every
// descriptor passes. The error says why in words an operator can act on.
func (d *Descriptor) CheckSeal(s auth.Secret) error {
	if s.IsZero() {
		return nil
	}
	if d.MAC == "" {
		return fmt.Errorf("segment %q carries no seal: its publisher runs without a cluster secret (--insecure-no-cluster-token), or it was written by something other than mooncake-go; this side holds %s (fingerprint %s)",
			d.Name, s.Source(), s.Fingerprint())
	}
	b, err := d.canonical()
	if err != nil {
		return err
	}
	if !s.VerifyHex(d.MAC, descriptorDomain, b) {
		return fmt.Errorf("the seal of segment %q does not match this side's cluster secret (%s, fingerprint %s): it was forged, altered, or written by a process with another secret; give both the same --cluster-token",
			d.Name, s.Source(), s.Fingerprint())
	}
	return nil
}

// ReadDescriptor decodes b, what key (a registry key, or "handshake with
// host:port") holds, validates it and checks its seal under s; name, when
// not empty, is the segment the descriptor must be of (a descriptor copied
// under another name is refused). Every failure is a *DescriptorError.
func ReadDescriptor(s auth.Secret, key, name string, b []byte) (*Descriptor, error) {
	d, err := decodeDescriptor(b)
	if err == nil && name != "" && d.Name != name {
		err = fmt.Errorf("it describes segment %q, not %q", d.Name, name)
	}
	if err == nil {
		err = d.CheckSeal(s)
	}
	if err != nil {
		return nil, &DescriptorError{Key: key, Err: err}
	}
	return d, nil
}

// decodeDescriptor parses and validates a descriptor.
func decodeDescriptor(b []byte) (*Descriptor, error) {
	var d Descriptor
	if err := json.Unmarshal(b, &d); err != nil {
		return nil, fmt.Errorf("not a descriptor: %w", err)
	}
	if d.Name == "" || d.Incarnation == "" {
		return nil, fmt.Errorf("name and incarnation are required")
	}
	if _, err := newRegionTable(d.Regions); err != nil {
		return nil, fmt.Errorf("segment %q: %w", d.Name, err)
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
