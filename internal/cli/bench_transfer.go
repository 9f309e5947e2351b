package cli

import (
	"context"
	"net"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/bench"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

func newBenchTransferCmd(g *globals) *cobra.Command {
	cfg := bench.DefaultTransferConfig()
	var tf transferFlags
	cmd := &cobra.Command{
		Use:   "transfer",
		Short: "Measure the transfer engine between a target and an initiator process (like Mooncake's transfer_engine_bench)",
		Example: "  mooncake-go bench transfer --mode target --local-server-name 127.0.0.1:0\n" +
			"  mooncake-go bench transfer --mode initiator --segment-id 127.0.0.1:PORT --protocol tcp --baseline",
		Args: cobra.NoArgs,
		RunE: g.withLogger(func(cmd *cobra.Command, lg *zap.Logger) error {
			tf.backend, tf.metadata = cfg.Protocol, cfg.MetadataServer
			host, _, _ := net.SplitHostPort(cfg.LocalServerName)
			secret, err := tf.resolve(lg, host)
			if err != nil {
				return err
			}
			tf.secret = secret
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
	f.StringVar(&cfg.Mode, "mode", cfg.Mode, "target or initiator")
	f.StringVar(&cfg.LocalServerName, "local-server-name", cfg.LocalServerName, "host:port to listen on; the segment name (port 0 picks a free port)")
	f.StringVar(&cfg.SegmentID, "segment-id", "", "the target's segment name (initiator)")
	f.StringVar(&cfg.MetadataServer, "metadata-server", cfg.MetadataServer, "p2p, embedded, etcd://host:port or http://host:port/metadata")
	f.StringVar(&cfg.Protocol, "protocol", cfg.Protocol, "auto, tcp, shm or nvlink")
	f.StringVar(&cfg.Operation, "operation", cfg.Operation, "read or write")
	f.Int64Var(&cfg.BlockSize, "block-size", cfg.BlockSize, "bytes per request")
	f.IntVar(&cfg.BatchSize, "batch-size", cfg.BatchSize, "requests per batch")
	f.BoolVar(&cfg.PageList, "page-list", false, "send each batch as one page-list request of --batch-size pages")
	f.BoolVar(&cfg.Scatter, "scatter", false, "place the blocks at permuted slots of both buffers, not consecutive ones")
	f.IntVar(&cfg.Threads, "threads", cfg.Threads, "concurrent submitters")
	f.DurationVar(&cfg.Duration, "duration", cfg.Duration, "measurement time")
	f.Int64Var(&cfg.BufferSize, "buffer-size", cfg.BufferSize, "registered buffer size on each side")
	f.BoolVar(&cfg.UseVRAM, "use-vram", false, "use GPU memory (--gpu-id)")
	f.IntVar(&cfg.GPUID, "gpu-id", 0, "GPU for --use-vram")
	f.BoolVar(&cfg.Baseline, "baseline", false, "also measure a plain baseline of the same bytes and print the ratio")
	f.BoolVar(&cfg.JSON, "json", false, "print one JSON object")
	tf.secretFlags.register(f)
	return cmd
}
