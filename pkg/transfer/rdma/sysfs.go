package rdma

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/Mellanox/rdmamap"
)

// NIC is an RDMA device as sysfs shows it.
type NIC struct {
	Name string
	// PCI is the device's PCI address ("0000:17:00.0"; empty for a
	// software device such as rxe).
	PCI string
	// Path is the device's place in the PCI tree, from its root complex
	// ("pci0000:00", "0000:00:01.0", ..., PCI).
	Path  []string
	NUMA  int // -1 when unknown
	Ports []Port
}

// Port is one port of a NIC.
type Port struct {
	Num       int
	State     string // "ACTIVE", "DOWN", ...
	LinkLayer string // "InfiniBand" or "Ethernet"
	GID0      string // GID table entry 0
	// RoCEv2 is the first GID index of type "RoCE v2" with a GID set
	// (Ethernet ports; -1 if none): what RoCE v2 traffic uses.
	RoCEv2 int
}

// Active reports whether some port is ACTIVE.
func (n NIC) Active() bool {
	for _, p := range n.Ports {
		if p.State == "ACTIVE" {
			return true
		}
	}
	return false
}

// Discover lists the RDMA devices under root ("" or "/" is this machine:
// the list comes from github.com/Mellanox/rdmamap; another root is a copy of
// a sysfs tree, for tests). No device is an empty list, not an error.
func Discover(root string) ([]NIC, error) {
	var names []string
	if root == "" || root == "/" {
		root = "/"
		names = rdmamap.GetRdmaDeviceList()
	} else {
		ents, err := os.ReadDir(filepath.Join(root, "sys/class/infiniband"))
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("rdma: listing devices: %w", err)
		}
		for _, e := range ents {
			names = append(names, e.Name())
		}
	}
	sort.Strings(names)
	var out []NIC
	for _, name := range names {
		out = append(out, readNIC(root, name))
	}
	return out, nil
}

func readNIC(root, name string) NIC {
	base := filepath.Join(root, "sys/class/infiniband", name)
	n := NIC{Name: name, NUMA: -1}
	if p, ok := pciPath(root, filepath.Join(base, "device")); ok {
		n.Path = p
		n.PCI = p[len(p)-1]
		n.NUMA = readInt(filepath.Join(base, "device/numa_node"), -1)
	}
	ports, _ := os.ReadDir(filepath.Join(base, "ports"))
	for _, e := range ports {
		num, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		pd := filepath.Join(base, "ports", e.Name())
		st := readString(filepath.Join(pd, "state")) // "4: ACTIVE"
		if _, s, ok := strings.Cut(st, ": "); ok {
			st = s
		}
		n.Ports = append(n.Ports, Port{Num: num, State: st, LinkLayer: readString(filepath.Join(pd, "link_layer")),
			GID0: readString(filepath.Join(pd, "gids/0")), RoCEv2: roceV2Index(pd)})
	}
	return n
}

// roceV2Index finds the first "RoCE v2" GID with a non-zero value.
func roceV2Index(port string) int {
	ents, _ := os.ReadDir(filepath.Join(port, "gid_attrs/types"))
	var idx []int
	for _, e := range ents {
		if i, err := strconv.Atoi(e.Name()); err == nil {
			idx = append(idx, i)
		}
	}
	sort.Ints(idx)
	for _, i := range idx {
		if !strings.EqualFold(readString(filepath.Join(port, "gid_attrs/types", strconv.Itoa(i))), "RoCE v2") {
			continue
		}
		g := readString(filepath.Join(port, "gids", strconv.Itoa(i)))
		if g != "" && strings.Trim(g, "0:") != "" {
			return i
		}
	}
	return -1
}

// RoCEv2Indexes maps each NIC with a RoCE v2 GID on port to its index.
func RoCEv2Indexes(nics []NIC, port int) map[string]int {
	out := map[string]int{}
	for _, n := range nics {
		for _, p := range n.Ports {
			if p.Num == port && p.RoCEv2 >= 0 {
				out[n.Name] = p.RoCEv2
			}
		}
	}
	return out
}

// pciPath resolves a sysfs device link to its components below
// sys/devices ("pci0000:00", ..., the device's address).
func pciPath(root, link string) ([]string, bool) {
	real, err := filepath.EvalSymlinks(link)
	if err != nil {
		return nil, false
	}
	devs, err := filepath.EvalSymlinks(filepath.Join(root, "sys/devices"))
	if err != nil {
		return nil, false
	}
	rel, err := filepath.Rel(devs, real)
	if err != nil || strings.HasPrefix(rel, "..") || !strings.HasPrefix(rel, "pci") {
		return nil, false // virtual (rxe, siw) or outside the PCI tree
	}
	return strings.Split(rel, string(filepath.Separator)), true
}

func readString(p string) string {
	b, err := os.ReadFile(p)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

func readInt(p string, def int) int {
	v, err := strconv.Atoi(readString(p))
	if err != nil {
		return def
	}
	return v
}

// GPUPlace is where a GPU sits: its PCI address and NUMA node (from NVML,
// see internal/topo).
type GPUPlace struct {
	Index int
	PCI   string // "0000:19:00.0"
	NUMA  int
}

// distance counts the PCI links between two places in the tree (through
// their deepest common bridge); places under different root complexes are
// farther apart than any two under one.
func distance(a, b []string) int {
	c := 0
	for c < len(a) && c < len(b) && a[c] == b[c] {
		c++
	}
	d := len(a) - c + len(b) - c
	if c == 0 {
		d += 1000
	}
	return d
}

// NearestNICs picks for each GPU the active NICs nearest it: first those on
// its NUMA node, then by PCI distance; every NIC at the least distance is
// kept (two NICs behind the GPU's switch are both used). root is as for
// Discover. A GPU whose place is unknown gets every active NIC on its NUMA
// node, else every active NIC.
func NearestNICs(root string, nics []NIC, gpus []GPUPlace) map[int][]string {
	if root == "" {
		root = "/"
	}
	out := map[int][]string{}
	for _, g := range gpus {
		gp, ok := pciPath(root, filepath.Join(root, "sys/bus/pci/devices", g.PCI))
		type cand struct {
			name      string
			numa, hop int
		}
		var cs []cand
		for _, n := range nics {
			if !n.Active() {
				continue
			}
			c := cand{name: n.Name}
			if g.NUMA >= 0 && n.NUMA >= 0 && g.NUMA != n.NUMA {
				c.numa = 1
			}
			if ok && n.Path != nil {
				c.hop = distance(gp, n.Path)
			}
			cs = append(cs, c)
		}
		if len(cs) == 0 {
			continue
		}
		sort.SliceStable(cs, func(i, j int) bool {
			if cs[i].numa != cs[j].numa {
				return cs[i].numa < cs[j].numa
			}
			return cs[i].hop < cs[j].hop
		})
		for _, c := range cs {
			if c.numa == cs[0].numa && c.hop == cs[0].hop {
				out[g.Index] = append(out[g.Index], c.name)
			}
		}
		slices.Sort(out[g.Index])
	}
	return out
}

// NUMANICs groups the active NICs by NUMA node (for host memory).
func NUMANICs(nics []NIC) map[int][]string {
	out := map[int][]string{}
	for _, n := range nics {
		if n.Active() && n.NUMA >= 0 {
			out[n.NUMA] = append(out[n.NUMA], n.Name)
		}
	}
	return out
}
