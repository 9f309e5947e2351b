package cli

import (
	"fmt"
	"math"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/lb"
)

func newLBCmd(g *globals) *cobra.Command {
	var cfg lb.Config
	var sf secretFlags
	var host string
	var port int
	cmd := &cobra.Command{
		Use:   "lb",
		Short: "Run the prefill/decode load balancer",
		Args:  cobra.NoArgs,
		RunE: g.withLogger(func(cmd *cobra.Command, lg *zap.Logger) error {
			// --host is client-facing: it needs no cluster token. The
			// secret signs the vouchers the servers check.
			secret, err := sf.resolve(lg)
			if err != nil {
				return err
			}
			explicit := sf.token != "" || sf.tokenFile != "" || sf.insecure || os.Getenv("MOONCAKE_CLUSTER_TOKEN") != ""
			if !explicit {
				for _, u := range append(append([]string{}, cfg.Prefill...), cfg.Decode...) {
					if pu, err := url.Parse(u); err == nil && !isLoopback(pu.Hostname()) {
						lg.Warn("a server is on another host, which cannot hold this host's per-user cluster secret: give the LB and the servers the same "+secretFlagNames,
							zap.String("url", u))
						break
					}
				}
			}
			lg.Info("cluster secret", zap.String("source", secret.Source()), zap.String("fingerprint", secret.Fingerprint()))
			// Zero means the default in lb.CacheAwareConfig: an explicit 0
			// becomes the value that decides the same.
			if cfg.CacheAware.CacheThreshold == 0 {
				cfg.CacheAware.CacheThreshold = math.SmallestNonzeroFloat64 // any match
			}
			if cfg.CacheAware.BalanceAbsThreshold == 0 {
				cfg.CacheAware.BalanceAbsThreshold = -1 // only the relative condition
			}
			reg := newRegistry()
			cfg.Secret, cfg.Logger, cfg.Registerer, cfg.Gatherer = secret, lg, reg, reg
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
			return serveHTTP(ctx, l.HTTPServer(), ln)
		}),
	}
	f := cmd.Flags()
	f.StringArrayVar(&cfg.Prefill, "prefill", nil, "prefill server URL (repeatable)")
	f.StringArrayVar(&cfg.Decode, "decode", nil, "decode server URL (repeatable)")
	f.StringVar(&host, "host", "127.0.0.1", "listen host")
	f.IntVar(&port, "port", 8000, "listen port")
	f.StringVar(&cfg.Policy, "policy", "random", "how each role's server is picked: "+strings.Join(lb.BuiltinPolicies().Names(), ", "))
	f.Float64Var(&cfg.CacheAware.CacheThreshold, "cache-threshold", lb.DefaultCacheThreshold,
		"cache_aware: send a request to the server that was sent the longest prefix of its prompt when that prefix is more than this share of it (0 to 1), else to the one with the smallest record of prompts sent")
	f.IntVar(&cfg.CacheAware.BalanceAbsThreshold, "balance-abs-threshold", lb.DefaultBalanceAbsThreshold,
		"cache_aware: the servers are imbalanced, and requests go to the least loaded, when the most loaded has more than this many requests in flight more than the least loaded ...")
	f.Float64Var(&cfg.CacheAware.BalanceRelThreshold, "balance-rel-threshold", lb.DefaultBalanceRelThreshold,
		"cache_aware: ... and more than this many times as many (at least 1)")
	f.Int64Var(&cfg.CacheAware.MaxTreeBytes, "max-tree-size", lb.DefaultMaxTreeBytes,
		"cache_aware: bytes of the record of prompts sent to each server (least recently used prefixes go first)")
	f.DurationVar(&cfg.HealthInterval, "health-check-interval", lb.DefaultHealthInterval, "health check period")
	f.DurationVar(&cfg.UpstreamIdleTimeout, "upstream-idle-timeout", lb.DefaultUpstreamIdleTimeout,
		"end an upstream answer with no sign of life for this long (a stream: no bytes; an answer sent whole: no passed health check)")
	f.DurationVar(&cfg.HTTPReadTimeout, "http-read-timeout", lb.DefaultHTTPReadTimeout, "bound on reading a client's request, body included")
	sf.register(f)
	return cmd
}

// newRegistry is a process's Prometheus registry with the Go and process
// collectors.
func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}
