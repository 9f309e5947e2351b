// Package lb is the prefill/decode load balancer: it picks a (prefill,
// decode) pair per request, preferring servers with room, sets the
// bootstrap fields and vouches for them, sends the request to both at once
// and streams the decode side's answer back; a pair that fails before the
// answer started is replaced once.
package lb

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"sync/atomic"
	"time"
)

// backend is one prefill or decode server.
type backend struct {
	role     string // "prefill" or "decode"
	id       int    // place in its role's list
	url      *url.URL
	healthy  atomic.Bool
	inflight atomic.Int64
	// bootstrapPort is the prefill's bootstrap port: flagPort when given,
	// else learned from its /get_server_info (0 until known).
	bootstrapPort atomic.Int64
	flagPort      int                  // given on the command line (0: the server's)
	load          atomic.Pointer[load] // from the last passed check; nil until one passed
	lastOK        atomic.Int64         // unix nanoseconds of the last passed check
	// why is the reason of the last failed check (nil after a passed
	// one); of Kind role, the server is refused.
	why atomic.Pointer[checkError]

	// The health checks' own state (one check of a server runs at a time).
	checked      bool  // a check ran
	slow         int   // checks in a row that timed out while healthy
	reportedPort int64 // the bootstrap port the server last reported
	warnedPort   int64 // the last reported port logged as a mismatch
}

// checkError is why a server failed a health check.
type checkError struct {
	Kind string // unreachable, health, info, role, bootstrap
	Msg  string
	Err  error // the cause, if any
}

func (e *checkError) Error() string { return e.Msg }
func (e *checkError) Unwrap() error { return e.Err }

// load is what a server's /get_server_info says about its room.
type load struct {
	Queued     int64 `json:"queued"`
	Running    int64 `json:"running"`
	PagesFree  int64 `json:"kv_pages_free"`
	PagesTotal int64 `json:"kv_pages_total"`
	// PagesCached are pages only the server's prefix cache holds: it
	// gives them up for new requests.
	PagesCached int64 `json:"kv_pages_cached"`
	inflight    int64 // the LB's requests on the server when it answered
}

// full reports whether the server has no room for another request now:
// requests wait in its queue, or its KV pool has no page free or only
// cached.
func (l *load) full() bool {
	return l != nil && (l.Queued > 0 || (l.PagesTotal > 0 && l.PagesFree+l.PagesCached <= 0))
}

// full reports whether b had no room at its last check and none of the
// LB's requests on it ended since: a check is a snapshot up to an interval
// old, and a request that ends gives its room back.
func (b *backend) full() bool {
	l := b.load.Load()
	return l.full() && b.inflight.Load() >= l.inflight
}

func newBackend(role string, id int, raw string, flagPort int) (*backend, error) {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("--%s %q: want http://host:port", role, raw)
	}
	for _, c := range u.Hostname() { // it goes into JSON bodies quoted by strconv
		if c < 0x21 || c > 0x7e || c == '"' || c == '\\' {
			return nil, fmt.Errorf("--%s %q: the host has a character that is not printable ASCII", role, raw)
		}
	}
	u.Path = ""
	b := &backend{role: role, id: id, url: u, flagPort: flagPort}
	b.bootstrapPort.Store(int64(flagPort))
	return b, nil
}

func (b *backend) String() string { return b.url.String() }

func (b *backend) endpoint(path string) string { return b.url.String() + path }

// usable reports whether requests may go to b.
func (b *backend) usable() bool {
	return b.healthy.Load() && (b.role != "prefill" || b.bootstrapPort.Load() > 0)
}

// modeName says what a disaggregation_mode is.
func modeName(mode string) string {
	switch mode {
	case "prefill", "decode":
		return "a " + mode + " server"
	case "null", "":
		return "a colocated server"
	}
	return "an unknown mode"
}

// check probes /health and /get_server_info: the server's role, its load
// and, for a prefill server, its bootstrap port.
func (b *backend) check(ctx context.Context, c *http.Client, timeout time.Duration) *checkError {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, b.endpoint("/health"), nil)
	resp, err := c.Do(req)
	if err != nil {
		return &checkError{Kind: "unreachable", Msg: "GET /health: " + err.Error(), Err: err}
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return &checkError{Kind: "health", Msg: fmt.Sprintf("/health answered %d", resp.StatusCode)}
	}
	req, _ = http.NewRequestWithContext(ctx, http.MethodGet, b.endpoint("/get_server_info"), nil)
	resp, err = c.Do(req)
	if err != nil {
		return &checkError{Kind: "unreachable", Msg: "GET /get_server_info: " + err.Error(), Err: err}
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return &checkError{Kind: "info", Msg: fmt.Sprintf("/get_server_info answered %d", resp.StatusCode)}
	}
	var info struct {
		Mode          string `json:"disaggregation_mode"`
		BootstrapPort int64  `json:"bootstrap_port"`
		// SGLang's servers report the flag.
		FlagBootstrapPort int64 `json:"disaggregation_bootstrap_port"`
		load
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&info); err != nil {
		return &checkError{Kind: "info", Msg: "/get_server_info: " + err.Error(), Err: err}
	}
	if info.Mode != b.role {
		return &checkError{Kind: "role", Msg: fmt.Sprintf("its /get_server_info says disaggregation_mode %q (%s), but it was given as --%s",
			info.Mode, modeName(info.Mode), b.role)}
	}
	if b.role == "prefill" {
		port := info.BootstrapPort
		if port == 0 {
			port = info.FlagBootstrapPort
		}
		if port < 0 || port > 65535 {
			port = 0
		}
		b.reportedPort = port
		switch {
		case b.flagPort > 0: // the command line's wins
		case port == 0:
			return &checkError{Kind: "bootstrap", Msg: "its /get_server_info has no bootstrap_port (give it after the URL: --prefill URL PORT)"}
		default:
			b.bootstrapPort.Store(port)
		}
	}
	info.load.inflight = b.inflight.Load()
	b.load.Store(&info.load)
	b.lastOK.Store(time.Now().UnixNano())
	return nil
}
