package cli

import (
	"context"
	"fmt"
	"net"
	"os"
	"runtime/pprof"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/bench"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// Mooncake's transfer_engine_bench spells its flags with underscores
// (--metadata_server): they are the same flags here, by pflag's normalization.
func underscoresAsDashes(_ *pflag.FlagSet, name string) pflag.NormalizedName {
	return pflag.NormalizedName(strings.ReplaceAll(name, "_", "-"))
}

// secondsValue is a duration flag that also takes whole seconds ("10"), as
// transfer_engine_bench's --duration does.
type secondsValue struct{ d *time.Duration }

func (s secondsValue) String() string {
	if s.d == nil {
		return ""
	}
	return s.d.String()
}

func (s secondsValue) Set(v string) error {
	d, err := secondsOrDuration(v)
	if err != nil {
		return fmt.Errorf("want seconds (10) or a duration (10s, 1m30s): %w", err)
	}
	*s.d = d
	return nil
}

func (secondsValue) Type() string { return "duration" }

func newBenchTransferCmd(g *globals) *cobra.Command {
	cfg := bench.DefaultTransferConfig()
	var tf transferFlags
	var deviceName, nicMatrix, backend, cpuProfile string
	var autoDiscovery, initMem bool
	cmd := &cobra.Command{
		Use:   "transfer",
		Short: "Measure the transfer engine between a target and an initiator process (like Mooncake's transfer_engine_bench)",
		Long: "Measure the transfer engine between a target and an initiator process, as Mooncake's transfer_engine_bench does.\n" +
			"Its flags are taken in its spellings too (--metadata_server, --local_server_name, --segment_id, --block_size,\n" +
			"--batch_size, --buffer_size, --duration 10, --report_unit, --device_name), a bare host:port metadata server is\n" +
			"etcd's, and --format mooncake prints its result line.",
		Example: "  mooncake-go bench transfer --mode target --local-server-name 127.0.0.1:0\n" +
			"  mooncake-go bench transfer --mode initiator --segment-id 127.0.0.1:PORT --protocol tcp --baseline\n" +
			"  mooncake-go bench transfer --mode=initiator --metadata_server=127.0.0.1:2379 --segment_id=HOST:PORT --duration=10 --format=mooncake",
		Args: cobra.NoArgs,
		RunE: g.withLogger(func(cmd *cobra.Command, lg *zap.Logger) error {
			mc, err := readMC(g.environ(), lg)
			if err != nil {
				return err
			}
			tf.mc = mc
			fl := cmd.Flags()
			if fl.Changed("nic-priority-matrix") {
				lg.Warn("--nic_priority_matrix has no effect here: the rdma transport picks NICs by NUMA node and PCI distance (--device_name names them)")
			}
			tf.ibDevice = deviceName
			if fl.Changed("auto-discovery") && autoDiscovery {
				lg.Warn("--auto_discovery has no effect here: the transports are chosen per request from what each side can reach (--protocol auto)")
			}
			if backend != "classic" {
				lg.Warn("--backend has no effect here: there is one transfer engine", zap.String("backend", backend))
			}
			if fl.Changed("init-mem") && !initMem {
				lg.Warn("--init_mem=false has no effect here: buffers are always filled with a pattern (never measured on zeros)")
			}
			if _, _, err := net.SplitHostPort(cfg.LocalServerName); err != nil {
				cfg.LocalServerName = net.JoinHostPort(cfg.LocalServerName, "0") // Mooncake's bare host: any port
			}
			tf.backend, tf.metadata = cfg.Protocol, cfg.MetadataServer
			host, _, _ := net.SplitHostPort(cfg.LocalServerName)
			secret, err := tf.resolve(lg, host)
			if err != nil {
				return err
			}
			tf.secret = secret
			if cpuProfile != "" {
				stop, err := startCPUProfile(cpuProfile)
				if err != nil {
					return err
				}
				defer stop()
			}
			var closers closers
			defer func() { closers.Close() }()
			deps := bench.Deps{
				NewEngine: func(ctx context.Context, listen, name string) (*transfer.Engine, error) {
					e, c, err := tf.newTransferEngine(ctx, listen, name, lg, nil, nil, "--protocol")
					if err != nil {
						return nil, err
					}
					closers = append(closers, c)
					return e, nil
				},
				AllocDevice: allocDevice,
			}
			return bench.RunTransfer(cmd.Context(), cfg, deps, cmd.OutOrStdout())
		}),
	}
	f := cmd.Flags()
	f.SetNormalizeFunc(underscoresAsDashes)
	f.StringVar(&cfg.Mode, "mode", cfg.Mode, "target or initiator")
	f.StringVar(&cfg.LocalServerName, "local-server-name", cfg.LocalServerName, "host:port to listen on; the segment name (port 0 or no port picks a free port)")
	f.StringVar(&cfg.SegmentID, "segment-id", "", "the target's segment name (initiator)")
	f.StringVar(&cfg.MetadataServer, "metadata-server", cfg.MetadataServer, "p2p (P2PHANDSHAKE), embedded, etcd://host:port (or host:port), or http://host:port/metadata")
	f.StringVar(&cfg.Protocol, "protocol", cfg.Protocol, "auto, tcp, shm, nvlink or rdma")
	f.StringVar(&cfg.Operation, "operation", cfg.Operation, "read or write")
	f.Int64Var(&cfg.BlockSize, "block-size", cfg.BlockSize, "bytes per request")
	f.IntVar(&cfg.BatchSize, "batch-size", cfg.BatchSize, "requests per batch")
	f.BoolVar(&cfg.PageList, "page-list", false, "send each batch as one page-list request of --batch-size pages")
	f.BoolVar(&cfg.Scatter, "scatter", false, "place the blocks at permuted slots of both buffers, not consecutive ones")
	f.IntVar(&cfg.Threads, "threads", cfg.Threads, "concurrent submitters")
	f.Var(secondsValue{&cfg.Duration}, "duration", "measurement time: seconds (10) or a duration (10s)")
	f.Int64Var(&cfg.BufferSize, "buffer-size", cfg.BufferSize, "registered buffer size on each side")
	f.BoolVar(&cfg.UseVRAM, "use-vram", false, "use GPU memory (--gpu-id)")
	f.IntVar(&cfg.GPUID, "gpu-id", 0, "GPU for --use-vram")
	f.BoolVar(&cfg.Baseline, "baseline", false, "also measure a plain baseline of the same bytes and print the ratio")
	f.BoolVar(&cfg.JSON, "json", false, "print one JSON object (--format json)")
	f.StringVar(&cfg.Format, "format", cfg.Format, "text, json, or mooncake: transfer_engine_bench's result line")
	f.StringVar(&cfg.ReportUnit, "report-unit", cfg.ReportUnit, "the rate's unit: GB, GiB, Gb, MB, MiB, Mb, KB, KiB or Kb (per second)")
	f.IntVar(&cfg.ReportPrecision, "report-precision", cfg.ReportPrecision, "decimals of the rate (--format mooncake)")
	f.StringVar(&deviceName, "device-name", "", "RDMA devices, as serve's --disaggregation-ib-device (default: every device found)")
	f.StringVar(&nicMatrix, "nic-priority-matrix", "", "Mooncake's RDMA NIC priorities: no effect (NICs are picked by topology)")
	f.BoolVar(&autoDiscovery, "auto-discovery", false, "Mooncake's topology discovery: no effect (transports are chosen per request)")
	f.StringVar(&backend, "backend", "classic", "Mooncake's engine backend: classic (there is one)")
	f.BoolVar(&initMem, "init-mem", true, "Mooncake's buffer initialization: buffers are always filled")
	f.StringVar(&cpuProfile, "cpu-profile", "", "write a Go CPU profile of the run to this file (go tool pprof)")
	for _, n := range []string{"device-name", "nic-priority-matrix", "auto-discovery", "backend", "init-mem"} {
		_ = f.MarkHidden(n)
	}
	tf.secretFlags.register(f)
	return cmd
}

// startCPUProfile starts a Go CPU profile into path; stop ends it and
// closes the file.
func startCPUProfile(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("--cpu-profile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("--cpu-profile: %w", err)
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}
