package cli

import (
	"fmt"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/lb"
)

func init() { commands = append(commands, newLBCmd) }

func newLBCmd(g *globals) *cobra.Command {
	var cfg lb.Config
	var host string
	var port int
	cmd := &cobra.Command{
		Use:   "lb",
		Short: "Run the prefill/decode load balancer",
		Args:  cobra.NoArgs,
		RunE: g.withLogger(func(cmd *cobra.Command, lg *zap.Logger) error {
			reg := newRegistry()
			cfg.Logger, cfg.Registerer, cfg.Gatherer = lg, reg, reg
			l, err := lb.New(cfg)
			if err != nil {
				return err
			}
			ln, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
			if err != nil {
				return fmt.Errorf("--port %d: %w", port, err)
			}
			ctx := cmd.Context()
			go l.Run(ctx)
			lg.Info("load balancer listening", zap.String("addr", ln.Addr().String()),
				zap.Strings("prefill", cfg.Prefill), zap.Strings("decode", cfg.Decode), zap.String("policy", cfg.Policy))
			srv := &http.Server{Handler: l.Handler(), ReadHeaderTimeout: 10 * time.Second}
			return serveHTTP(ctx, srv, ln)
		}),
	}
	f := cmd.Flags()
	f.StringArrayVar(&cfg.Prefill, "prefill", nil, "prefill server URL (repeatable)")
	f.StringArrayVar(&cfg.Decode, "decode", nil, "decode server URL (repeatable)")
	f.StringVar(&host, "host", "127.0.0.1", "listen host")
	f.IntVar(&port, "port", 8000, "listen port")
	f.StringVar(&cfg.Policy, "policy", "random", "random, round_robin or least_load")
	f.DurationVar(&cfg.HealthInterval, "health-check-interval", time.Second, "health check period")
	return cmd
}

// newRegistry is a process's Prometheus registry with the Go and process
// collectors.
func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}
