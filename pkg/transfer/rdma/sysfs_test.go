package rdma_test

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma"
)

// fakeSysfs builds a sysfs tree under a temp dir: two root complexes
// (NUMA 0 and 1), GPUs and NICs behind PCIe switches.
func fakeSysfs(t *testing.T) string {
	root := t.TempDir()
	mk := func(path, content string) {
		p := filepath.Join(root, path)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	link := func(from, to string) {
		p := filepath.Join(root, from)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		rel, err := filepath.Rel(filepath.Dir(p), filepath.Join(root, to))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(rel, p); err != nil {
			t.Fatal(err)
		}
	}
	dev := func(path string, numa int) string {
		d := "sys/devices/" + path
		mk(d+"/numa_node", string(rune('0'+numa)))
		bdf := filepath.Base(path)
		link("sys/bus/pci/devices/"+bdf, d)
		return d
	}
	nic := func(name, path string, numa int, state string) {
		d := dev(path, numa)
		link("sys/class/infiniband/"+name+"/device", d)
		mk("sys/class/infiniband/"+name+"/ports/1/state", state)
		mk("sys/class/infiniband/"+name+"/ports/1/link_layer", "InfiniBand")
		mk("sys/class/infiniband/"+name+"/ports/1/gids/0", "fe80:0000:0000:0000:0000:0000:0000:0001")
	}
	// NUMA 0: switch A holds GPU 0 and mlx5_0; switch B holds GPU 1 and mlx5_1.
	dev("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0", 0) // GPU 0
	nic("mlx5_0", "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0", 0, "4: ACTIVE")
	dev("pci0000:00/0000:00:02.0/0000:05:00.0/0000:06:00.0/0000:07:00.0", 0) // GPU 1
	nic("mlx5_1", "pci0000:00/0000:00:02.0/0000:05:00.0/0000:06:01.0/0000:08:00.0", 0, "4: ACTIVE")
	// NUMA 1: GPU 2 with two NICs behind its switch (and a third that is
	// down); GPU 3 behind a switch of its own.
	dev("pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:00.0/0000:83:00.0", 1) // GPU 2
	nic("mlx5_2", "pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:01.0/0000:84:00.0", 1, "4: ACTIVE")
	nic("mlx5_3", "pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:02.0/0000:85:00.0", 1, "4: ACTIVE")
	nic("mlx5_4", "pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:03.0/0000:86:00.0", 1, "1: DOWN")
	dev("pci0000:80/0000:80:02.0/0000:87:00.0/0000:88:00.0/0000:89:00.0", 1) // GPU 3
	// A software device (rxe) lives outside the PCI tree.
	mk("sys/devices/virtual/infiniband/rxe0/x", "")
	link("sys/class/infiniband/rxe0/device", "sys/devices/virtual/infiniband/rxe0")
	mk("sys/class/infiniband/rxe0/ports/1/state", "4: ACTIVE")
	mk("sys/class/infiniband/rxe0/ports/1/link_layer", "Ethernet")
	return root
}

func TestDiscoverAndNearest(t *testing.T) {
	root := fakeSysfs(t)
	nics, err := rdma.Discover(root)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, n := range nics {
		names = append(names, n.Name)
	}
	if want := []string{"mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "rxe0"}; !reflect.DeepEqual(names, want) {
		t.Fatalf("devices %v, want %v", names, want)
	}
	m0 := nics[0]
	if m0.PCI != "0000:04:00.0" || m0.NUMA != 0 || len(m0.Ports) != 1 || m0.Ports[0].State != "ACTIVE" || m0.Ports[0].LinkLayer != "InfiniBand" ||
		!strings.HasPrefix(m0.Ports[0].GID0, "fe80") || m0.Path[0] != "pci0000:00" {
		t.Fatalf("mlx5_0 read as %+v", m0)
	}
	if nics[4].Active() {
		t.Error("mlx5_4 (port DOWN) reads as active")
	}
	if rxe := nics[5]; rxe.PCI != "" || rxe.NUMA != -1 || !rxe.Active() {
		t.Errorf("rxe0 read as %+v", rxe)
	}
	gpus := []rdma.GPUPlace{
		{Index: 0, PCI: "0000:03:00.0", NUMA: 0},
		{Index: 1, PCI: "0000:07:00.0", NUMA: 0},
		{Index: 2, PCI: "0000:83:00.0", NUMA: 1},
		{Index: 3, PCI: "0000:89:00.0", NUMA: 1},
	}
	got := rdma.NearestNICs(root, nics[:5], gpus)
	want := map[int][]string{0: {"mlx5_0"}, 1: {"mlx5_1"}, 2: {"mlx5_2", "mlx5_3"}, 3: {"mlx5_2", "mlx5_3"}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("nearest NICs %v, want %v", got, want)
	}
	// NUMA first: a GPU of NUMA 1 whose place is unknown gets NUMA 1's NICs.
	if got := rdma.NearestNICs(root, nics[:5], []rdma.GPUPlace{{Index: 7, PCI: "0000:ff:00.0", NUMA: 1}}); !reflect.DeepEqual(got[7], []string{"mlx5_2", "mlx5_3"}) {
		t.Fatalf("GPU of unknown place on NUMA 1: %v", got)
	}
	if got := rdma.NUMANICs(nics); !reflect.DeepEqual(got, map[int][]string{0: {"mlx5_0", "mlx5_1"}, 1: {"mlx5_2", "mlx5_3"}}) {
		t.Fatalf("NICs by NUMA node: %v", got)
	}
	// A machine without RDMA: no devices, no error.
	if nics, err := rdma.Discover(t.TempDir()); err != nil || len(nics) != 0 {
		t.Fatalf("empty sysfs: %v, %v", nics, err)
	}
}

// This machine, through rdmamap: whatever it finds, every listed device
// has a name and no error comes back.
func TestDiscoverHere(t *testing.T) {
	nics, err := rdma.Discover("")
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range nics {
		if n.Name == "" {
			t.Fatalf("unnamed device in %+v", nics)
		}
	}
	t.Logf("%d RDMA devices here", len(nics))
}

// A RoCE port: the first "RoCE v2" GID that is set is the one to use.
func TestRoCEv2Index(t *testing.T) {
	root := t.TempDir()
	port := filepath.Join(root, "sys/class/infiniband/mlx5_bond_0/ports/1")
	for i, c := range []struct{ typ, gid string }{
		{"IB/RoCE v1", "fe80:0000:0000:0000:0a00:27ff:fe00:0001"},
		{"RoCE v2", "0000:0000:0000:0000:0000:0000:0000:0000"},
		{"IB/RoCE v1", "0000:0000:0000:ffff:0a00:0001:0000:0000"},
		{"RoCE v2", "0000:0000:0000:0000:0000:ffff:0a00:0001"},
	} {
		for _, f := range []struct{ path, v string }{
			{"gid_attrs/types/" + string(rune('0'+i)), c.typ}, {"gids/" + string(rune('0'+i)), c.gid},
		} {
			p := filepath.Join(port, f.path)
			os.MkdirAll(filepath.Dir(p), 0o755)
			if err := os.WriteFile(p, []byte(f.v+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	os.WriteFile(filepath.Join(port, "state"), []byte("4: ACTIVE\n"), 0o644)
	os.WriteFile(filepath.Join(port, "link_layer"), []byte("Ethernet\n"), 0o644)
	nics, err := rdma.Discover(root)
	if err != nil || len(nics) != 1 {
		t.Fatalf("%v %v", nics, err)
	}
	if got := rdma.RoCEv2Indexes(nics, 1); !reflect.DeepEqual(got, map[string]int{"mlx5_bond_0": 3}) {
		t.Fatalf("RoCE v2 indexes %v, want mlx5_bond_0: 3", got)
	}
	if got := rdma.RoCEv2Indexes(nics, 2); len(got) != 0 {
		t.Fatalf("port 2: %v", got)
	}
}
