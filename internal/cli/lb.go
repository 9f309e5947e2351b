package cli

import (
	"fmt"
	"math"
	"net"
	"net/url"
	"os"
	"slices"
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
	var prefill, decode, bootstrapPorts []string
	var pd, mini bool
	cmd := &cobra.Command{
		Use:   "lb",
		Short: "Run the prefill/decode load balancer",
		Long: `Run the prefill/decode load balancer.

The servers are given as SGLang's mini_lb and sgl-router take them: --prefill URL
[BOOTSTRAP_PORT] and --decode URL, each repeatable, with several URLs after one flag
(--prefill A B), in comma lists (--prefill A,B or --prefill URL,PORT), or with
--prefill-bootstrap-ports (one port for all prefills, or one each). A bootstrap port
given here is used instead of the one the prefill reports ("none": the prefill's).`,
		Args: cobra.NoArgs,
		RunE: g.withLogger(func(cmd *cobra.Command, lg *zap.Logger) error {
			var err error
			cfg.Prefill, cfg.PrefillBootstrapPorts, cfg.Decode, err = lbServers(prefill, decode, bootstrapPorts, cmd.Flags().Changed("prefill-bootstrap-ports"))
			if err != nil {
				return err
			}
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
	f.StringArrayVar(&prefill, "prefill", nil, "prefill server URL, optionally followed by its bootstrap port or none (repeatable; several URLs after one flag, or comma lists)")
	f.StringArrayVar(&decode, "decode", nil, "decode server URL (repeatable; several URLs after one flag, or comma lists)")
	f.StringArrayVar(&bootstrapPorts, "prefill-bootstrap-ports", nil, "the prefills' bootstrap ports: one for all, or one per --prefill in order (none: the port the server reports)")
	f.BoolVar(&pd, "pd-disaggregation", false, "accepted for sgl-router's command line: this load balancer always pairs a prefill with a decode")
	f.BoolVar(&mini, "mini-lb", false, "accepted for sgl-router's command line (no effect)")
	_ = f.MarkHidden("mini-lb")
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
	f.IntVar(&cfg.MaxBatch, "max-batch", lb.DefaultMaxBatch,
		"most generations one request may ask for (prompts times n): each is sent to a pair as a request of its own")
	f.IntVar(&cfg.BatchConcurrency, "batch-concurrency", lb.DefaultBatchConcurrency, "most generations of one request in flight at once")
	sf.register(f)
	return cmd
}

// lbListFlags are the lb flags that take several words, in SGLang's forms.
var lbListFlags = map[string]bool{"--prefill": true, "--decode": true, "--prefill-bootstrap-ports": true}

// joinLBArgs rewrites the words after each of lbListFlags (mini_lb's
// "--prefill A B", sgl-router's "--prefill URL 8998") into one comma list
// ("--prefill=A,B"), which cobra takes as one value and lbServers reads.
func joinLBArgs(args []string) []string {
	out := make([]string, 0, len(args))
	for i := 0; i < len(args); i++ {
		name, val, hasVal := strings.Cut(args[i], "=")
		if !lbListFlags[name] {
			out = append(out, args[i])
			continue
		}
		var vals []string
		if hasVal {
			vals = append(vals, val)
		}
		for i+1 < len(args) && !strings.HasPrefix(args[i+1], "-") {
			i++
			vals = append(vals, args[i])
		}
		out = append(out, name+"="+strings.Join(vals, ","))
	}
	return out
}

// words splits a flag's value into its comma-separated words.
func words(v string) []string {
	var out []string
	for _, w := range strings.Split(v, ",") {
		if w = strings.TrimSpace(w); w != "" {
			out = append(out, w)
		}
	}
	return out
}

// portWord reads a bootstrap port: a number, or none (0, as SGLang's Rust
// LB takes it, too): the port the server reports. isPort is false for
// any other word (a URL).
func portWord(w string) (port int, isPort bool, err error) {
	if strings.EqualFold(w, "none") {
		return 0, true, nil
	}
	if strings.IndexFunc(w, func(r rune) bool { return r < '0' || r > '9' }) >= 0 {
		return 0, false, nil
	}
	p, err := strconv.Atoi(w)
	if err != nil || p > 65535 {
		return 0, true, fmt.Errorf("bootstrap port %s: want 1 to 65535, or none", w)
	}
	return p, true, nil
}

// lbServers reads --prefill, --decode and --prefill-bootstrap-ports as
// joinLBArgs leaves them. A --prefill word is a URL or, right after one,
// its bootstrap port; portsGiven: --prefill-bootstrap-ports was given (one
// port for every prefill, or one each). ports is nil when none was given.
func lbServers(prefillVals, decodeVals, portVals []string, portsGiven bool) (prefill []string, ports []int, decode []string, err error) {
	inline := false
	for _, v := range prefillVals {
		last, hasPort := -1, false // this flag's last URL, and whether its port came
		for _, w := range words(v) {
			p, isPort, perr := portWord(w)
			switch {
			case !isPort:
				prefill, ports = append(prefill, w), append(ports, 0)
				last, hasPort = len(prefill)-1, false
				continue
			case perr != nil:
				return nil, nil, nil, fmt.Errorf("--prefill %s: %w", v, perr)
			case last < 0:
				return nil, nil, nil, fmt.Errorf("--prefill %s: a bootstrap port comes after its prefill's URL (--prefill URL PORT)", v)
			case hasPort:
				return nil, nil, nil, fmt.Errorf("--prefill %s: two bootstrap ports for %s", v, prefill[last])
			}
			ports[last], hasPort = p, true
			inline = inline || p > 0
		}
	}
	for _, v := range decodeVals {
		for _, w := range words(v) {
			if _, isPort, _ := portWord(w); isPort {
				return nil, nil, nil, fmt.Errorf("--decode %s: %q is not a URL (a decode server has no bootstrap port)", v, w)
			}
			decode = append(decode, w)
		}
	}
	if portsGiven {
		var list []int
		for _, v := range portVals {
			for _, w := range words(v) {
				p, isPort, perr := portWord(w)
				if !isPort || perr != nil {
					return nil, nil, nil, fmt.Errorf("--prefill-bootstrap-ports %s: want ports (1 to 65535) or none", v)
				}
				list = append(list, p)
			}
		}
		switch {
		case len(list) == 0:
			return nil, nil, nil, fmt.Errorf("--prefill-bootstrap-ports: no port given")
		case inline:
			return nil, nil, nil, fmt.Errorf("--prefill-bootstrap-ports: the --prefill URLs have bootstrap ports after them already: give the ports one way")
		case len(list) == 1:
			for i := range ports {
				ports[i] = list[0]
			}
		case len(list) == len(prefill):
			copy(ports, list)
		default:
			return nil, nil, nil, fmt.Errorf("--prefill-bootstrap-ports: %d ports for %d --prefill servers (give one for all, or one each)", len(list), len(prefill))
		}
	}
	if !slices.ContainsFunc(ports, func(p int) bool { return p != 0 }) {
		ports = nil
	}
	return prefill, ports, decode, nil
}

// newRegistry is a process's Prometheus registry with the Go and process
// collectors.
func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}
