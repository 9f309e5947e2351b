// Package embedded runs a single-member etcd server inside the process, for
// `--metadata-server embedded` and for tests. It listens on 127.0.0.1 only.
package embedded

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"sync"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// DefaultStartTimeout bounds the wait for the server to be ready.
const DefaultStartTimeout = 15 * time.Second

// Config configures Start. Zero values mean the defaults noted.
type Config struct {
	// Dir is the data directory. Empty: a new temporary directory, removed
	// by Close (and written without fsync: its data does not outlive the
	// server anyway).
	Dir string
	// ClientURL is where clients connect, "http://127.0.0.1:port". Empty:
	// a free port on 127.0.0.1.
	ClientURL string
	// PeerURL is the raft peer URL. Empty: a free port on 127.0.0.1.
	PeerURL string
	// StartTimeout bounds the wait for readiness (default 15 s).
	StartTimeout time.Duration
	// Logger receives the server's warnings and errors; nil: no logs.
	Logger *zap.Logger
}

// Server is a running embedded etcd.
type Server struct {
	etcd      *embed.Etcd
	endpoints []string
	tempDir   string // removed by Close; empty when the caller gave Dir

	closeOnce sync.Once
	closeErr  error
}

// Start starts the server and waits until it serves clients, at most
// cfg.StartTimeout or until ctx ends.
func Start(ctx context.Context, cfg Config) (*Server, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("embedded etcd: start: %w", err)
	}
	if cfg.StartTimeout <= 0 {
		cfg.StartTimeout = DefaultStartTimeout
	}
	lg := cfg.Logger
	if lg == nil {
		lg = zap.NewNop()
	}
	lg = lg.Named("registry.embedded").WithOptions(zap.IncreaseLevel(zap.WarnLevel))

	// Free ports are found by listening and closing; another process may
	// take one in between, so a failed start with picked ports is retried.
	pick := cfg.ClientURL == "" || cfg.PeerURL == ""
	attempts := 1
	if pick {
		attempts = 3
	}
	var err error
	for range attempts {
		var s *Server
		s, err = start(ctx, cfg, lg)
		if err == nil {
			return s, nil
		}
		if ctx.Err() != nil || !errors.Is(err, errBind) {
			break
		}
	}
	return nil, err
}

var errBind = errors.New("bind")

func start(ctx context.Context, cfg Config, lg *zap.Logger) (*Server, error) {
	curl, err := urlOrFree(cfg.ClientURL)
	if err != nil {
		return nil, fmt.Errorf("embedded etcd: client URL: %w", err)
	}
	purl, err := urlOrFree(cfg.PeerURL)
	if err != nil {
		return nil, fmt.Errorf("embedded etcd: peer URL: %w", err)
	}
	s := &Server{}
	ecfg := embed.NewConfig()
	ecfg.Name = "mooncake"
	if cfg.Dir == "" {
		dir, err := os.MkdirTemp("", "mooncake-etcd-*")
		if err != nil {
			return nil, fmt.Errorf("embedded etcd: data dir: %w", err)
		}
		s.tempDir = dir
		ecfg.Dir = dir
		ecfg.UnsafeNoFsync = true
	} else {
		if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
			return nil, fmt.Errorf("embedded etcd: data dir: %w", err)
		}
		ecfg.Dir = cfg.Dir
	}
	ecfg.ListenClientUrls = []url.URL{*curl}
	ecfg.AdvertiseClientUrls = []url.URL{*curl}
	ecfg.ListenPeerUrls = []url.URL{*purl}
	ecfg.AdvertisePeerUrls = []url.URL{*purl}
	ecfg.InitialCluster = ecfg.InitialClusterFromName(ecfg.Name)
	ecfg.ListenMetricsUrls = nil
	ecfg.EnableGRPCGateway = false
	ecfg.LogLevel = "warn"
	ecfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(lg)

	e, err := embed.StartEtcd(ecfg)
	if err != nil {
		s.removeTemp()
		var opErr *net.OpError
		if errors.As(err, &opErr) && opErr.Op == "listen" {
			return nil, fmt.Errorf("embedded etcd: %w: %w", errBind, err)
		}
		return nil, fmt.Errorf("embedded etcd: start (data dir %s): %w", ecfg.Dir, err)
	}
	s.etcd = e
	timer := time.NewTimer(cfg.StartTimeout)
	defer timer.Stop()
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		s.Close()
		return nil, fmt.Errorf("embedded etcd: start: %w", err)
	case <-e.Server.StopNotify():
		s.Close()
		return nil, errors.New("embedded etcd: server stopped while starting")
	case <-timer.C:
		s.Close()
		return nil, fmt.Errorf("embedded etcd: not ready after %v (data dir %s)", cfg.StartTimeout, ecfg.Dir)
	case <-ctx.Done():
		s.Close()
		return nil, fmt.Errorf("embedded etcd: start: %w", ctx.Err())
	}
	s.endpoints = []string{curl.String()}
	return s, nil
}

// urlOrFree parses u, or picks a free port on 127.0.0.1 when u is empty.
func urlOrFree(u string) (*url.URL, error) {
	if u != "" {
		p, err := url.Parse(u)
		if err != nil {
			return nil, err
		}
		if p.Scheme != "http" || p.Host == "" {
			return nil, fmt.Errorf("%q: want http://host:port", u)
		}
		return p, nil
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	addr := ln.Addr().String()
	ln.Close()
	return &url.URL{Scheme: "http", Host: addr}, nil
}

// Endpoints returns the client URLs ("http://127.0.0.1:port").
func (s *Server) Endpoints() []string { return append([]string(nil), s.endpoints...) }

// Close stops the server (closing client connections, then peers, then the
// store) and removes a temporary data directory. Calling it again returns
// the first result.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		if s.etcd != nil {
			s.etcd.Close()
		}
		s.closeErr = s.removeTemp()
	})
	return s.closeErr
}

func (s *Server) removeTemp() error {
	if s.tempDir == "" {
		return nil
	}
	dir := s.tempDir
	s.tempDir = ""
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("embedded etcd: remove data dir: %w", err)
	}
	return nil
}
