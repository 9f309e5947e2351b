package httpmeta

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/internal/meta"
)

// DefaultTimeout bounds every request of a Client.
const DefaultTimeout = 3 * time.Second

// Client is a transfer.Registry on a metadata server. It is safe for
// concurrent use.
type Client struct {
	url     string
	hc      *http.Client
	ownHC   bool
	timeout time.Duration
}

var _ transfer.Registry = (*Client)(nil)

// NewClient returns a client of the server at url
// ("http://host:port/metadata"). httpClient nil: a private client. Every
// request is bounded by DefaultTimeout on top of the caller's context.
func NewClient(url string, httpClient *http.Client) *Client {
	c := &Client{url: url, hc: httpClient, timeout: DefaultTimeout}
	if c.hc == nil {
		c.hc = &http.Client{Timeout: DefaultTimeout}
		c.ownHC = true
	}
	return c
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
	case resp.StatusCode/100 != 2:
		msg := strings.TrimSpace(string(b))
		if len(msg) > 200 {
			msg = msg[:200] + "..."
		}
		return nil, fmt.Errorf("%w: metadata server %s: %s %s: %s: %s", transfer.ErrRegistry, c.url, method, key, resp.Status, msg)
	case len(b) > MaxValueBytes:
		return nil, fmt.Errorf("%w: metadata server %s: %s %s: response larger than %d bytes", transfer.ErrRegistry, c.url, method, key, MaxValueBytes)
	}
	return b, nil
}

var errNotFound = errors.New("not found")

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
	desc, rpc, err := meta.Encode(d)
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
	d, err := transfer.DecodeDescriptor(b)
	if err != nil {
		return nil, fmt.Errorf("http registry: key %s holds a bad descriptor: %w", key, err)
	}
	return d, nil
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
