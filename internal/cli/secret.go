package cli

import (
	"errors"
	"fmt"
	"net"
	"os"

	"github.com/spf13/pflag"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

// secretFlags choose the cluster secret every peer port (transfer engine,
// bootstrap server, registry) and the load balancer's vouchers use.
type secretFlags struct {
	token, tokenFile string
	insecure         bool
}

const secretFlagNames = "--cluster-token, --cluster-token-file or MOONCAKE_CLUSTER_TOKEN"

func (f *secretFlags) register(fl *pflag.FlagSet) {
	fl.StringVar(&f.token, "cluster-token", "", "cluster secret peers prove (at least 16 characters; default: the per-user secret of this host)")
	fl.StringVar(&f.tokenFile, "cluster-token-file", "", "file holding the cluster secret (mode 0600)")
	fl.BoolVar(&f.insecure, "insecure-no-cluster-token", false, "turn peer authentication off: anyone who reaches the peer ports can read and write the KV cache")
}

// resolve returns the secret for a process whose peer ports bind hosts.
// Order: --cluster-token, --cluster-token-file, MOONCAKE_CLUSTER_TOKEN;
// without any, the per-user secret of this host, which peers on other hosts
// cannot hold, so binding a non-loopback address then refuses to start.
// With --insecure-no-cluster-token the zero secret (no authentication) comes
// back, logged as a warning.
func (f *secretFlags) resolve(lg *zap.Logger, hosts ...string) (auth.Secret, error) {
	env := os.Getenv("MOONCAKE_CLUSTER_TOKEN")
	given := 0
	for _, g := range []bool{f.token != "", f.tokenFile != "", f.insecure} {
		if g {
			given++
		}
	}
	if given > 1 {
		return auth.Secret{}, errors.New("give at most one of --cluster-token, --cluster-token-file and --insecure-no-cluster-token")
	}
	switch {
	case f.insecure:
		lg.Warn("peer authentication is OFF (--insecure-no-cluster-token): anyone who can reach the transfer, bootstrap and registry ports can read and overwrite the KV cache")
		return auth.Secret{}, nil
	case f.token != "":
		return auth.New(f.token, "--cluster-token")
	case f.tokenFile != "":
		return auth.FromFile(f.tokenFile)
	case env != "":
		return auth.New(env, "MOONCAKE_CLUSTER_TOKEN")
	}
	for _, h := range hosts {
		if !isLoopback(h) {
			return auth.Secret{}, fmt.Errorf("--host %s is not a loopback address: peers on other hosts need a shared cluster secret; give %s (or --insecure-no-cluster-token to run without authentication)",
				h, secretFlagNames)
		}
	}
	s, err := auth.UserDefault()
	if err != nil {
		return auth.Secret{}, fmt.Errorf("%w; or give %s", err, secretFlagNames)
	}
	return s, nil
}

// isLoopback reports whether binding host reaches this machine only.
func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
