package httpmeta

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/internal/meta"
)

// DefaultTimeout bounds every request of a Client.
const DefaultTimeout = 3 * time.Second

// ClientConfig configures a Client. Zero values mean the defaults noted.
type ClientConfig struct {
	// URL is the server's metadata URL ("http://host:port/metadata").
	URL string
	// HTTPClient: nil means a private client.
	HTTPClient *http.Client
	// Secret signs every request and seals every descriptor Put writes;
	// Get refuses a descriptor whose seal does not check out under it. The
	// zero value means the per-user secret of this host (auth.UserDefault).
	Secret auth.Secret
	// Insecure sends unsigned requests and checks no seal (Secret must be
	// zero): for a server run insecure.
	Insecure bool
	// Timeout bounds every request on top of the caller's context
	// (default DefaultTimeout).
	Timeout time.Duration
}

// Client is a transfer.Registry on a metadata server. It is safe for
// concurrent use.
type Client struct {
	url     string
	hc      *http.Client
	ownHC   bool
	secret  auth.Secret
	timeout time.Duration
}

var _ transfer.Registry = (*Client)(nil)

// NewClient returns a client of the server at cfg.URL (no I/O).
func NewClient(cfg ClientConfig) (*Client, error) {
	s, err := meta.Secret(cfg.Secret, cfg.Insecure)
	if err != nil {
		return nil, fmt.Errorf("http registry: %w", err)
	}
	c := &Client{url: cfg.URL, hc: cfg.HTTPClient, secret: s, timeout: cfg.Timeout}
	if c.timeout <= 0 {
		c.timeout = DefaultTimeout
	}
	if c.hc == nil {
		c.hc = &http.Client{Timeout: c.timeout}
		c.ownHC = true
	}
	return c, nil
}

// do sends one request for key and returns the response body of a 2xx.
// A 404 gives errNotFound; anything else that fails wraps ErrRegistry.
func (c *Client) do(ctx context.Context, method, key string, body []byte) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	u, err := url.Parse(c.url)
	if err != nil {
		return nil, fmt.Errorf("%w: metadata server URL %q: %w", transfer.ErrRegistry, c.url, err)
	}
	q := u.Query()
	q.Set("key", key)
	u.RawQuery = q.Encode()
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, u.String(), rd)
	if err != nil {
		return nil, fmt.Errorf("%w: %s %s: %w", transfer.ErrRegistry, method, key, err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if !c.secret.IsZero() {
		sign(c.secret, req, key, body, time.Now())
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%w: metadata server %s: %s %s: %w", transfer.ErrRegistry, c.url, method, key, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, MaxValueBytes+1))
	if err != nil {
		return nil, fmt.Errorf("%w: metadata server %s: %s %s: read response: %w", transfer.ErrRegistry, c.url, method, key, err)
	}
	switch {
	case resp.StatusCode == http.StatusNotFound:
		return nil, errNotFound
	case resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden:
		side := "this side sends unsigned requests (--insecure-no-cluster-token)"
		if !c.secret.IsZero() {
			side = fmt.Sprintf("this side: %s, fingerprint %s", c.secret.Source(), c.secret.Fingerprint())
		}
		return nil, fmt.Errorf("%w: metadata server %s refused %s %s: %s: %s (%s); give the registry and every process the same --cluster-token",
			transfer.ErrAuth, c.url, method, key, resp.Status, errorMessage(b), side)
	case resp.StatusCode/100 != 2:
		return nil, fmt.Errorf("%w: metadata server %s: %s %s: %s: %s", transfer.ErrRegistry, c.url, method, key, resp.Status, errorMessage(b))
	case len(b) > MaxValueBytes:
		return nil, fmt.Errorf("%w: metadata server %s: %s %s: response larger than %d bytes", transfer.ErrRegistry, c.url, method, key, MaxValueBytes)
	}
	return b, nil
}

var errNotFound = errors.New("not found")

// errorMessage is the message of a JSON error body, or the body itself,
// shortened.
func errorMessage(b []byte) string {
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	msg := strings.TrimSpace(string(b))
	if json.Unmarshal(b, &e) == nil && e.Error.Message != "" {
		msg = e.Error.Message
	}
	if len(msg) > 300 {
		msg = msg[:300] + "..."
	}
	return msg
}

// ctxErr prefers the caller's cancellation over a transport error, so
// errors.Is(err, context.Canceled) holds when the caller gave up.
func ctxErr(ctx context.Context, op, key string, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("http registry: %s %s: %w", op, key, cerr)
	}
	return err
}

// Put stores d's descriptor, then its rpc_meta.
func (c *Client) Put(ctx context.Context, d *transfer.Descriptor) error {
	desc, rpc, err := meta.Encode(c.secret, d)
	if err != nil {
		return err
	}
	ram := meta.RAMKey("", d.Name)
	if _, err := c.do(ctx, http.MethodPut, ram, desc); err != nil {
		return ctxErr(ctx, "put", ram, notFoundIsRegistry(c, http.MethodPut, ram, err))
	}
	rpcKey := meta.RPCMetaKey("", d.Name)
	if rpc == nil {
		_, err = c.do(ctx, http.MethodDelete, rpcKey, nil)
		if errors.Is(err, errNotFound) {
			err = nil
		}
	} else {
		_, err = c.do(ctx, http.MethodPut, rpcKey, rpc)
	}
	if err != nil {
		return ctxErr(ctx, "put", rpcKey, notFoundIsRegistry(c, http.MethodPut, rpcKey, err))
	}
	return nil
}

// notFoundIsRegistry turns a 404 on a PUT (a URL that is not a metadata
// server) into a registry error.
func notFoundIsRegistry(c *Client, method, key string, err error) error {
	if errors.Is(err, errNotFound) {
		return fmt.Errorf("%w: metadata server %s: %s %s: 404 (is this a metadata server URL?)", transfer.ErrRegistry, c.url, method, key)
	}
	return err
}

// Get returns name's descriptor, or an error wrapping
// transfer.ErrSegmentNotFound naming the key.
func (c *Client) Get(ctx context.Context, name string) (*transfer.Descriptor, error) {
	key := meta.RAMKey("", name)
	b, err := c.do(ctx, http.MethodGet, key, nil)
	if errors.Is(err, errNotFound) {
		return nil, fmt.Errorf("%w: %s (no key %s on metadata server %s)", transfer.ErrSegmentNotFound, name, key, c.url)
	}
	if err != nil {
		return nil, ctxErr(ctx, "get", key, err)
	}
	return transfer.ReadDescriptor(c.secret, key, name, b)
}

// Delete removes name's descriptor and rpc_meta. Deleting a name that is not
// there is not an error.
func (c *Client) Delete(ctx context.Context, name string) error {
	for _, key := range []string{meta.RAMKey("", name), meta.RPCMetaKey("", name)} {
		if _, err := c.do(ctx, http.MethodDelete, key, nil); err != nil && !errors.Is(err, errNotFound) {
			return ctxErr(ctx, "delete", key, err)
		}
	}
	return nil
}

// Close releases idle connections of a private HTTP client. It does not
// delete anything: the engine deletes its entry itself.
func (c *Client) Close() error {
	if c.ownHC {
		c.hc.CloseIdleConnections()
	}
	return nil
}
