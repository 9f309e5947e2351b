package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
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
}

// forceTCP is MC_FORCE_TCP=1 (read only here, in the CLI).
func forceTCP() bool { return os.Getenv("MC_FORCE_TCP") == "1" }

// transports builds the transports for a backend name, in preference
// order. flag names the flag for errors.
func (f *transferFlags) transports(flag string) ([]transfer.Transport, error) {
	b := f.backend
	if forceTCP() {
		b = "tcp"
	}
	switch b {
	case "", "auto":
		return append(gpuTransports(), shm.New(shm.Config{}), tcp.New(tcp.Config{})), nil
	case "tcp":
		return []transfer.Transport{tcp.New(tcp.Config{})}, nil
	case "shm":
		return []transfer.Transport{shm.New(shm.Config{})}, nil
	case "nvlink":
		g := gpuTransports()
		if len(g) == 0 {
			return nil, fmt.Errorf("%s nvlink: %s", flag, gpuUnavailable())
		}
		return g, nil
	case "rdma":
		return nil, fmt.Errorf("%s rdma: this build has no RDMA transport (no ibverbs devices here%s); use auto or tcp",
			flag, map[bool]string{true: ", --disaggregation-ib-device " + f.ibDevice, false: ""}[f.ibDevice != ""])
	}
	return nil, fmt.Errorf("%s %q: want auto, tcp, shm, nvlink or rdma", flag, b)
}

// newTransferEngine opens the registry and starts an engine listening on
// listen. The returned closer closes the engine, then the registry.
func (f *transferFlags) newTransferEngine(ctx context.Context, listen, name string, lg *zap.Logger, reg prometheus.Registerer,
	onNotify func(transfer.Notification), flag string) (*transfer.Engine, io.Closer, error) {
	ts, err := f.transports(flag)
	if err != nil {
		return nil, nil, err
	}
	r, rc, err := registry.Open(ctx, f.metadata, registry.Options{Prefix: f.prefix, Logger: lg, Secret: f.secret, Insecure: f.insecure})
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
