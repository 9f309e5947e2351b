package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/nvlink"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/shm"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/tcp"
)

// transferFlags are the flags shared by every command that runs a
// transfer engine.
type transferFlags struct {
	backend  string // auto, tcp, shm, nvlink, rdma
	ibDevice string
	metadata string
	timeout  time.Duration
	prefix   string
	secretFlags
	// secret is what resolve gave (set by the command before
	// newTransferEngine); zero with --insecure-no-cluster-token.
	secret auth.Secret
	// mc is Mooncake's environment (readMC), set by the command.
	mc mcEnv
	// verbs opens the verbs library (nil: libibverbs); sysfsRoot is where
	// sysfs lives ("": /). Tests set both.
	verbs     func() (verbs.Provider, error)
	sysfsRoot string
	warned    map[string]bool
}

// transports builds the transports for a backend name, in preference
// order. flag names the flag for errors; lg gets the warnings (nil: none),
// reg the rdma transport's metrics (nil: none).
func (f *transferFlags) transports(flag string, lg *zap.Logger, reg prometheus.Registerer) ([]transfer.Transport, error) {
	b := f.backend
	switch {
	case f.mc.forceTCP:
		b = "tcp"
	case f.mc.forceHCA:
		r, err := f.rdmaTransport(reg)
		if err != nil {
			return nil, fmt.Errorf("MC_FORCE_HCA: %w", err)
		}
		return []transfer.Transport{r}, nil
	case f.mc.forceMNNVL:
		mn, err := nvlink.NewMNNVL(nvlink.Config{})
		if err != nil {
			return nil, fmt.Errorf("MC_FORCE_MNNVL: the multi-node NVLink transport is unavailable: %w", err)
		}
		return []transfer.Transport{mn, shm.New(shm.Config{}), tcp.New(tcp.Config{})}, nil
	case f.mc.intraNVLink:
		g := gpuTransports()
		if len(g) == 0 {
			return nil, fmt.Errorf("%s: the intra-node NVLink transport is unavailable: %s", f.mc.intraName, gpuUnavailable())
		}
		return []transfer.Transport{g[0], shm.New(shm.Config{}), tcp.New(tcp.Config{})}, nil
	}
	switch b {
	case "", "auto", "mooncake": // mooncake: SGLang's name for its Mooncake backend, which this is
		ts := append(gpuTransports(), shm.New(shm.Config{}))
		switch r, err := f.rdmaTransport(reg); {
		case err == nil:
			ts = append(ts, r) // across hosts rdma comes before tcp
		case !errors.Is(err, errNoRDMA):
			return nil, err
		case f.ibDevice != "":
			f.warnOnce(lg, "--disaggregation-ib-device names a device that is not usable: the rdma transport is not installed (KV moves over nvlink, shm or tcp)",
				zap.String("device", f.ibDevice), zap.String("reason", err.Error()))
		}
		return append(ts, tcp.New(tcp.Config{})), nil
	case "nixl", "ascend", "fake":
		return nil, fmt.Errorf("%s %s: SGLang's %s backend is not this one; use auto (mooncake), tcp, shm or nvlink", flag, b, b)
	case "tcp":
		return []transfer.Transport{tcp.New(tcp.Config{})}, nil
	case "shm":
		return []transfer.Transport{shm.New(shm.Config{})}, nil
	case "nvlink":
		g := gpuTransports()
		if len(g) == 0 {
			return nil, fmt.Errorf("%s nvlink: %s", flag, gpuUnavailable())
		}
		// GPU memory over NVLink; host memory (the first token's aux slot)
		// has no NVLink path: shm carries it, on the same machine too.
		return append(g, shm.New(shm.Config{})), nil
	case "rdma":
		r, err := f.rdmaTransport(reg)
		if err != nil {
			return nil, fmt.Errorf("%s rdma: %w", flag, err)
		}
		return []transfer.Transport{r}, nil
	}
	return nil, fmt.Errorf("%s %q: want auto, tcp, shm, nvlink or rdma", flag, b)
}

// newTransferEngine opens the registry and starts an engine listening on
// listen. The returned closer closes the engine, then the registry.
func (f *transferFlags) newTransferEngine(ctx context.Context, listen, name string, lg *zap.Logger, reg prometheus.Registerer,
	onNotify func(transfer.Notification), flag string) (*transfer.Engine, io.Closer, error) {
	ts, err := f.transports(flag, lg, reg)
	if err != nil {
		return nil, nil, err
	}
	r, rc, err := registry.Open(ctx, metadataSpec(f.metadata), registry.Options{Prefix: f.prefix, Logger: lg, Secret: f.secret, Insecure: f.insecure})
	if err != nil {
		return nil, nil, fmt.Errorf("--metadata-server %s: %w", f.metadata, err)
	}
	e, err := transfer.New(ctx, transfer.Config{
		Listen: listen, Name: name, Registry: r, Transports: ts, Secret: f.secret, Insecure: f.insecure,
		Timeout: f.timeout, Logger: lg, Registerer: reg, OnNotify: onNotify,
	})
	if err != nil {
		rc.Close()
		return nil, nil, err
	}
	return e, closers{e, rc}, nil
}

type closers []io.Closer

func (c closers) Close() error {
	var first error
	for _, x := range c {
		if err := x.Close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// metadataSpec is a --metadata-server value with Mooncake's forms: a bare
// host:port (transfer_engine_bench's etcd default) is etcd://host:port.
func metadataSpec(s string) string {
	if strings.Contains(s, "://") {
		return s
	}
	if h, p, err := net.SplitHostPort(strings.SplitN(s, ",", 2)[0]); err == nil && h != "" && p != "" {
		return "etcd://" + s
	}
	return s
}

// mcEnv is Mooncake's environment as mooncake-go honours it.
type mcEnv struct {
	forceTCP, forceHCA, forceMNNVL, intraNVLink bool
	intraName                                   string // MC_INTRANODE_NVLINK or MC_INTRA_NVLINK
	ibPort                                      uint8  // MC_IB_PORT (0: the transport's default, 1)
	gidIndex                                    int    // MC_GID_INDEX
	gidSet                                      bool   // MC_GID_INDEX given (else RoCE v2 entries from sysfs)
	teMetric                                    bool
	teMetricEvery                               time.Duration
}

// mcNoOps are Mooncake's MC_* variables that change nothing here, and why.
var mcNoOps = map[string]string{
	"MC_SLICE_SIZE":                 "the transports split transfers themselves (tcp lanes, one scatter kernel per batch)",
	"MC_RETRY_CNT":                  "a failed batch goes back to its caller, which fails the room with its reason",
	"MC_LOG_DIR":                    "logs go to stderr (--log-format json for collectors)",
	"MC_DISABLE_METACACHE":          "descriptors are read again when a peer's incarnation changes",
	"MC_HANDSHAKE_LISTEN_BACKLOG":   "the handshake has its own bounds",
	"MC_HANDSHAKE_MAX_LENGTH":       "the handshake has its own bounds",
	"MC_REDIS_PASSWORD":             "there is no Redis metadata backend (p2p, etcd or http)",
	"MC_REDIS_DB_INDEX":             "there is no Redis metadata backend (p2p, etcd or http)",
	"MC_MIN_PRC_PORT":               "the transfer engine listens on --transfer-port (0 picks a free port)",
	"MC_MAX_PRC_PORT":               "the transfer engine listens on --transfer-port (0 picks a free port)",
	"MC_TCP_ENABLE_CONNECTION_POOL": "tcp keeps a fixed set of lanes per peer",
	"MC_TRANSFER_TIMEOUT":           "the bound on one batch is --transfer-timeout",
	"MC_USE_IPV6":                   "addresses are used as given (IPv6 works in brackets)",
}

// mcRDMA are Mooncake's RDMA tuning variables the rdma transport does not
// read (it sizes its queues itself; docs/RDMA.md).
var mcRDMA = []string{"MC_NUM_CQ_PER_CTX", "MC_NUM_COMP_CHANNELS_PER_CTX", "MC_IB_TC", "MC_IB_PCI_RELAXED_ORDERING",
	"MC_MAX_CQE_PER_CTX", "MC_MAX_EP_PER_CTX", "MC_NUM_QP_PER_EP", "MC_MAX_SGE", "MC_MAX_WR", "MC_MAX_INLINE", "MC_MTU",
	"MC_WORKERS_PER_CTX", "MC_FRAGMENT_RATIO", "MC_ENABLE_DEST_DEVICE_AFFINITY", "MC_ENABLE_PARALLEL_REG_MR", "MC_PATH_ROUNDROBIN",
	"MC_ENDPOINT_STORE_TYPE"}

// mcHonoured are the MC_* variables read with their Mooncake meaning (MC_LOG_LEVEL
// by the logger).
var mcHonoured = []string{"MC_FORCE_TCP", "MC_FORCE_HCA", "MC_IB_PORT", "MC_GID_INDEX", "MC_FORCE_MNNVL", "MC_INTRANODE_NVLINK", "MC_INTRA_NVLINK",
	"MC_TE_METRIC", "MC_TE_METRIC_INTERVAL_SECONDS", "MC_LOG_LEVEL"}

// envFlag reads a Mooncake switch: 1/true/yes/on set it, 0/false/no/off/"" not;
// anything else sets it (Mooncake reads the variable's presence) with a warning.
func envFlag(lg *zap.Logger, name, v string) bool {
	switch strings.ToLower(strings.TrimSpace(v)) {
	case "", "0", "false", "no", "off":
		return false
	case "1", "true", "yes", "on":
		return true
	}
	lg.Warn(name+" has an unclear value: taken as set, as Mooncake takes any value", zap.String("value", v))
	return true
}

// readMC reads Mooncake's MC_* variables from environ (os.Environ's form): the
// honoured ones set mcEnv; every other one set gets a warning that names it and
// says why it has no effect here.
func readMC(environ []string, lg *zap.Logger) (mcEnv, error) {
	vars := map[string]string{}
	for _, kv := range environ {
		if k, v, ok := strings.Cut(kv, "="); ok && strings.HasPrefix(k, "MC_") {
			vars[k] = v
		}
	}
	var m mcEnv
	m.forceTCP = envFlag(lg, "MC_FORCE_TCP", vars["MC_FORCE_TCP"])
	m.forceHCA = envFlag(lg, "MC_FORCE_HCA", vars["MC_FORCE_HCA"])
	m.forceMNNVL = envFlag(lg, "MC_FORCE_MNNVL", vars["MC_FORCE_MNNVL"])
	for _, n := range []string{"MC_INTRANODE_NVLINK", "MC_INTRA_NVLINK"} {
		if envFlag(lg, n, vars[n]) {
			m.intraNVLink, m.intraName = true, n
		}
	}
	if m.forceMNNVL && m.intraNVLink {
		return m, fmt.Errorf("MC_FORCE_MNNVL and %s exclude each other (as in Mooncake)", m.intraName)
	}
	if v := vars["MC_IB_PORT"]; v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 255 {
			return m, fmt.Errorf("MC_IB_PORT %q: want a port number in [1, 255]", v)
		}
		m.ibPort = uint8(n)
	}
	if v := vars["MC_GID_INDEX"]; v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 || n > 255 {
			return m, fmt.Errorf("MC_GID_INDEX %q: want a GID index in [0, 255]", v)
		}
		m.gidIndex, m.gidSet = n, true
	}
	m.teMetric = envFlag(lg, "MC_TE_METRIC", vars["MC_TE_METRIC"])
	m.teMetricEvery = 5 * time.Second
	if v := vars["MC_TE_METRIC_INTERVAL_SECONDS"]; v != "" {
		d, err := secondsOrDuration(v)
		if err != nil || d <= 0 {
			return m, fmt.Errorf("MC_TE_METRIC_INTERVAL_SECONDS %q: want a positive number of seconds", v)
		}
		m.teMetricEvery = d
	}
	if m.forceTCP && (m.forceMNNVL || m.intraNVLink) {
		lg.Warn("MC_FORCE_TCP wins over MC_FORCE_MNNVL and MC_INTRANODE_NVLINK: KV moves over tcp")
	}
	names := make([]string, 0, len(vars))
	for k := range vars {
		names = append(names, k)
	}
	slices.Sort(names)
	for _, k := range names {
		switch {
		case slices.Contains(mcHonoured, k):
		case slices.Contains(mcRDMA, k):
			lg.Warn(k+" has no effect here: the rdma transport sizes its queues and slices itself (docs/RDMA.md)", zap.String("var", k))
		case mcNoOps[k] != "":
			lg.Warn(k+" has no effect here: "+mcNoOps[k], zap.String("var", k))
		default:
			lg.Warn(k+" is not a Mooncake variable mooncake-go knows: ignored", zap.String("var", k))
		}
	}
	return m, nil
}

// logTransferRate is MC_TE_METRIC: every m.teMetricEvery until ctx ends, one log
// line with the transfer engine's throughput since the last (from
// mooncake_transfer_bytes_total in g).
func logTransferRate(ctx context.Context, m mcEnv, g prometheus.Gatherer, lg *zap.Logger) {
	if !m.teMetric || g == nil {
		return
	}
	lg = lg.Named("transfer.metric")
	last, at := transferBytes(g), time.Now()
	t := time.NewTicker(m.teMetricEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			b := transferBytes(g)
			lg.Info("transfer engine throughput", zap.Float64("MB_per_s", (b-last)/now.Sub(at).Seconds()/1e6),
				zap.Float64("bytes", b-last), zap.Duration("over", now.Sub(at)))
			last, at = b, now
		}
	}
}

func transferBytes(g prometheus.Gatherer) float64 {
	mfs, err := g.Gather()
	if err != nil {
		return 0
	}
	total := 0.0
	for _, mf := range mfs {
		if mf.GetName() == "mooncake_transfer_bytes_total" {
			for _, m := range mf.GetMetric() {
				total += m.GetCounter().GetValue()
			}
		}
	}
	return total
}

// secondsOrDuration reads "10" (seconds, as Mooncake takes it) or a Go duration
// ("10s", "1m30s").
func secondsOrDuration(s string) (time.Duration, error) {
	if n, err := strconv.ParseFloat(s, 64); err == nil {
		return time.Duration(n * float64(time.Second)), nil
	}
	return time.ParseDuration(s)
}
