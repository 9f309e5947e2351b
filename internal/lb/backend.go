// Package lb is the prefill/decode load balancer: it picks a (prefill,
// decode) pair per request, injects the bootstrap fields, sends the request
// to both at once and streams the decode side's answer back.
package lb

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"sync/atomic"
	"time"
)

// backend is one prefill or decode server.
type backend struct {
	role     string // "prefill" or "decode"
	url      *url.URL
	healthy  atomic.Bool
	inflight atomic.Int64
	// bootstrapPort is learned from the prefill's /get_server_info (0 until known).
	bootstrapPort atomic.Int64
	fails         int // consecutive failed checks (health loop only)
}

func newBackend(role, raw string) (*backend, error) {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("--%s %q: want http://host:port", role, raw)
	}
	u.Path = ""
	return &backend{role: role, url: u}, nil
}

func (b *backend) String() string { return b.url.String() }

func (b *backend) endpoint(path string) string { return b.url.String() + path }

// check probes /health and, for a prefill server, learns its bootstrap port.
func (b *backend) check(ctx context.Context, c *http.Client, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, b.endpoint("/health"), nil)
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("/health answered %d", resp.StatusCode)
	}
	if b.role != "prefill" {
		return nil
	}
	req, _ = http.NewRequestWithContext(ctx, http.MethodGet, b.endpoint("/get_server_info"), nil)
	resp, err = c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var info struct {
		Mode          string `json:"disaggregation_mode"`
		BootstrapPort int    `json:"bootstrap_port"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&info); err != nil {
		return fmt.Errorf("/get_server_info: %w", err)
	}
	if info.Mode != "prefill" {
		return fmt.Errorf("is not a prefill server (disaggregation_mode %q)", info.Mode)
	}
	if info.BootstrapPort <= 0 {
		return fmt.Errorf("/get_server_info has no bootstrap_port")
	}
	b.bootstrapPort.Store(int64(info.BootstrapPort))
	return nil
}
