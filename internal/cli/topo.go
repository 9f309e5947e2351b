package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"

	"github.com/spf13/cobra"

	"github.com/mooncake-go/mooncake-go/internal/topo"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma"
)

func newTopoCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "topo",
		Short: "Print the GPUs, their links, and the transport the engine picks between memory locations",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			out := cmd.OutOrStdout()
			t, err := topo.Discover()
			if err != nil {
				fmt.Fprintf(out, "no NVIDIA GPU: %v\n", err)
			} else {
				printGPUs(out, t)
			}
			printRDMA(out, t)
			return printSelection(cmd, out, t)
		},
	}
}

// printRDMA lists the RDMA devices sysfs shows and, with GPUs, the NICs
// the rdma transport prefers for each.
func printRDMA(out io.Writer, t *topo.Topology) {
	nics, err := rdma.Discover("")
	if err != nil || len(nics) == 0 {
		fmt.Fprintf(out, "no RDMA device (/sys/class/infiniband lists none%s)\n", map[bool]string{true: ": " + fmt.Sprint(err), false: ""}[err != nil])
		return
	}
	fmt.Fprintf(out, "%d RDMA device(s)\n", len(nics))
	for _, n := range nics {
		fmt.Fprintf(out, "  %s: PCI %s, NUMA %d", n.Name, n.PCI, n.NUMA)
		for _, p := range n.Ports {
			fmt.Fprintf(out, ", port %d %s %s", p.Num, p.State, p.LinkLayer)
		}
		fmt.Fprintln(out)
	}
	if t == nil {
		return
	}
	var gpus []rdma.GPUPlace
	for _, g := range t.GPUs {
		gpus = append(gpus, rdma.GPUPlace{Index: g.Index, PCI: topo.NormalizeBusID(g.PCIBusID), NUMA: g.NUMANode})
	}
	per := rdma.NearestNICs("", nics, gpus)
	for _, g := range gpus {
		fmt.Fprintf(out, "  GPU%d -> %v\n", g.Index, per[g.Index])
	}
}

func printGPUs(out io.Writer, t *topo.Topology) {
	fmt.Fprintf(out, "driver %s, CUDA %d.%d, %d GPU(s)\n", t.DriverVersion, t.CUDAVersion/1000, t.CUDAVersion%1000/10, len(t.GPUs))
	for _, g := range t.GPUs {
		fmt.Fprintf(out, "  %s\n", g)
	}
	for _, l := range t.Links {
		fmt.Fprintf(out, "  GPU%d <-> GPU%d: %s, %d NVLinks, p2p read=%v write=%v\n", l.A, l.B, l.Path, l.NVLinks, l.P2PRead, l.P2PWrite)
	}
}

// printSelection asks the engine's own selector which transport it would
// use between each pair of memory locations, for a peer on this machine
// and a peer on another machine.
func printSelection(cmd *cobra.Command, out io.Writer, t *topo.Topology) error {
	tf := transferFlags{backend: "auto", metadata: "p2p"}
	e, closer, err := tf.newTransferEngine(cmd.Context(), "127.0.0.1:0", "", nil, nil, nil, "--disaggregation-transfer-backend")
	if err != nil {
		return err
	}
	defer closer.Close()
	locs := []transfer.Location{{Kind: transfer.CPU}}
	if t != nil {
		for _, g := range t.GPUs {
			locs = append(locs, transfer.Location{Kind: transfer.CUDA, Index: g.Index})
		}
	}
	self := e.Self()
	remote := self.Clone()
	remote.Host = transfer.HostID{BootID: "other", MachineID: "other", NetNS: "other"}
	fmt.Fprintf(out, "transports installed: %v\n", keys(self.Transports))
	fmt.Fprintln(out, "selection (local -> remote memory):")
	for _, peer := range []struct {
		name string
		d    *transfer.Descriptor
	}{{"same machine", self}, {"other machine", remote}} {
		for _, a := range locs {
			for _, b := range locs {
				sel := e.Select(a, peer.d, &transfer.RegionInfo{Location: b, Handles: published(self)})
				if sel == "" {
					sel = "none"
				}
				fmt.Fprintf(out, "  %-13s %-7v -> %-7v %s\n", peer.name, a, b, sel)
			}
		}
	}
	return nil
}

// published gives a probe region a handle of every installed transport, as
// a region registered from shareable memory (a KV pool) has.
func published(d *transfer.Descriptor) map[string]json.RawMessage {
	h := map[string]json.RawMessage{}
	for name := range d.Transports {
		h[name] = json.RawMessage("{}")
	}
	return h
}

func keys[V any](m map[string]V) []string {
	var s []string
	for k := range m {
		s = append(s, k)
	}
	slices.Sort(s)
	return s
}
