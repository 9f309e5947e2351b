package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/ibv"
	"github.com/mooncake-go/mooncake-go/internal/topo"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma"
)

// ibDevices is --disaggregation-ib-device in SGLang's forms: a list
// ("mlx5_0,mlx5_1"), or a JSON object from GPU id to devices (a string
// "mlx5_0,mlx5_1" or a list), given inline or as the path of a file
// holding it.
type ibDevices struct {
	all    []string         // every device named, sorted, no repeats
	perGPU map[int][]string // the JSON form
}

func splitDevices(s string) []string {
	var out []string
	for _, d := range strings.Split(s, ",") {
		if d = strings.TrimSpace(d); d != "" {
			out = append(out, d)
		}
	}
	return out
}

// parseIBDevice reads the flag's value; readFile reads a path form.
func parseIBDevice(s string, readFile func(string) ([]byte, error)) (ibDevices, error) {
	var d ibDevices
	s = strings.TrimSpace(s)
	if s == "" {
		return d, nil
	}
	src := s
	if !strings.HasPrefix(s, "{") && (strings.ContainsAny(s, "/\\") || strings.HasSuffix(s, ".json")) {
		b, err := readFile(s)
		if err != nil {
			return d, fmt.Errorf("--disaggregation-ib-device %s: %w", s, err)
		}
		src = strings.TrimSpace(string(b))
		if !strings.HasPrefix(src, "{") {
			return d, fmt.Errorf("--disaggregation-ib-device %s: the file holds no JSON object from GPU id to devices", s)
		}
	}
	if !strings.HasPrefix(src, "{") {
		d.all = splitDevices(src)
		for _, n := range d.all {
			if strings.ContainsAny(n, " \t\"'{}[]:") {
				return ibDevices{}, fmt.Errorf("--disaggregation-ib-device %q: %q is not a device name", s, n)
			}
		}
		slices.Sort(d.all)
		d.all = slices.Compact(d.all)
		return d, nil
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal([]byte(src), &raw); err != nil {
		return d, fmt.Errorf("--disaggregation-ib-device: bad JSON (want {\"0\": \"mlx5_0\", \"1\": \"mlx5_1,mlx5_2\"}): %w", err)
	}
	d.perGPU = map[int][]string{}
	for k, v := range raw {
		gpu, err := strconv.Atoi(k)
		if err != nil || gpu < 0 {
			return ibDevices{}, fmt.Errorf("--disaggregation-ib-device: key %q is not a GPU id", k)
		}
		var one string
		var list []string
		switch {
		case json.Unmarshal(v, &one) == nil:
			list = splitDevices(one)
		case json.Unmarshal(v, &list) == nil:
		default:
			return ibDevices{}, fmt.Errorf("--disaggregation-ib-device: GPU %d: want a device name, a comma list or a list of names, got %s", gpu, v)
		}
		if len(list) == 0 {
			return ibDevices{}, fmt.Errorf("--disaggregation-ib-device: GPU %d has no device", gpu)
		}
		d.perGPU[gpu] = list
		d.all = append(d.all, list...)
	}
	slices.Sort(d.all)
	d.all = slices.Compact(d.all)
	return d, nil
}

// errNoRDMA marks why the rdma transport cannot be installed.
var errNoRDMA = errors.New("no RDMA device")

// rdmaTransport builds the rdma transport from the flags, or says why it
// cannot be: the verbs library is missing, it lists no device, or a named
// device is not among those it lists (errors wrapping errNoRDMA, naming
// the device); a malformed --disaggregation-ib-device is an error of its
// own.
func (f *transferFlags) rdmaTransport(reg prometheus.Registerer) (transfer.Transport, error) {
	dev, err := parseIBDevice(f.ibDevice, os.ReadFile)
	if err != nil {
		return nil, err
	}
	newProvider := f.verbs
	if newProvider == nil {
		newProvider = ibv.Provider
	}
	p, err := newProvider()
	if err != nil {
		return nil, fmt.Errorf("%w%s: %w", errNoRDMA, named(dev.all), err)
	}
	have, err := p.Devices()
	if err != nil {
		return nil, fmt.Errorf("%w%s: listing devices: %w", errNoRDMA, named(dev.all), err)
	}
	for _, n := range dev.all {
		if !slices.Contains(have, n) {
			return nil, fmt.Errorf("%w %s (--disaggregation-ib-device): the devices here are [%s]", errNoRDMA, n, strings.Join(have, ", "))
		}
	}
	if len(have) == 0 {
		return nil, fmt.Errorf("%w: libibverbs lists none (no HCA, no soft-RoCE)", errNoRDMA)
	}
	nics, err := rdma.Discover(f.sysfsRoot)
	if err != nil {
		return nil, err
	}
	perGPU := dev.perGPU
	if perGPU == nil && len(nics) > 0 {
		perGPU = nearestPerGPU(f.sysfsRoot, nics, dev.all)
	}
	cfg := rdma.Config{Provider: p, Devices: dev.all, GPUDevices: perGPU, NUMADevices: rdma.NUMANICs(nics), Port: f.mc.ibPort, GIDIndex: f.mc.gidIndex,
		Registerer: reg}
	if !f.mc.gidSet {
		port := int(f.mc.ibPort)
		if port == 0 {
			port = 1
		}
		cfg.GIDIndexes = rdma.RoCEv2Indexes(nics, port) // RoCE ports: their RoCE v2 GID
	}
	return rdma.New(cfg), nil
}

// nearestPerGPU maps each GPU NVML finds to its nearest NICs (among only,
// when devices were named); nil without GPUs.
func nearestPerGPU(root string, nics []rdma.NIC, only []string) map[int][]string {
	t, err := topo.Discover()
	if err != nil || len(t.GPUs) == 0 {
		return nil
	}
	if len(only) > 0 {
		nics = slices.DeleteFunc(slices.Clone(nics), func(n rdma.NIC) bool { return !slices.Contains(only, n.Name) })
	}
	var gpus []rdma.GPUPlace
	for _, g := range t.GPUs {
		gpus = append(gpus, rdma.GPUPlace{Index: g.Index, PCI: topo.NormalizeBusID(g.PCIBusID), NUMA: g.NUMANode})
	}
	return rdma.NearestNICs(root, nics, gpus)
}

func named(devs []string) string {
	if len(devs) == 0 {
		return ""
	}
	return " " + strings.Join(devs, ", ")
}

// warnOnce logs msg once per transferFlags (transports is built twice by
// serve: once to check the flags, once for the engine).
func (f *transferFlags) warnOnce(lg *zap.Logger, msg string, fields ...zap.Field) {
	if f.warned == nil {
		f.warned = map[string]bool{}
	}
	if lg == nil || f.warned[msg] {
		return
	}
	f.warned[msg] = true
	lg.Warn(msg, fields...)
}
