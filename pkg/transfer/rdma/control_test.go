package rdma_test

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs/fake"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

func send(t *testing.T, c net.Conn, v any) map[string]any {
	t.Helper()
	b, _ := json.Marshal(v)
	hdr := binary.BigEndian.AppendUint32(nil, uint32(len(b)))
	if _, err := c.Write(append(hdr, b...)); err != nil {
		t.Fatal(err)
	}
	var h [4]byte
	if _, err := io.ReadFull(c, h[:]); err != nil {
		t.Fatal(err)
	}
	body := make([]byte, binary.BigEndian.Uint32(h[:]))
	if _, err := io.ReadFull(c, body); err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(body, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

// The control connection speaks only after the handshake: a peer without
// the cluster secret never gets a key; an authenticated one gets keys of
// registered regions only, sets up queue pairs once per connection, and a
// frame over the limit closes the connection.
func TestControlConnection(t *testing.T) {
	fab := fake.NewFabric()
	nt := func() []transfer.Transport {
		return []transfer.Transport{rdma.New(rdma.Config{Provider: fab.NewHost("mlx5_0")})}
	}
	withTok := func(tok string) func(*transfer.Config) {
		return func(c *transfer.Config) { c.Secret = transfertest.Secret(tok) }
	}
	b := transfertest.NewNode(t, nt, withTok("secret-secret-secret"))
	bm := b.Alloc(t, 1<<20, transfer.AccessReadWrite)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	stranger := transfertest.NewNode(t, nt, withTok("another-token-entirely"))
	if _, err := stranger.E.Dial(ctx, b.E.Self(), rdma.Name); !errors.Is(err, transfer.ErrAuth) {
		t.Fatalf("a peer with another token dialed the rdma control connection: %v", err)
	}

	a := transfertest.NewNode(t, nt, withTok("secret-secret-secret"))
	c, err := a.E.Dial(ctx, b.E.Self(), rdma.Name)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if m := send(t, c, map[string]any{"op": "keys", "addr": bm.Addr()}); m["err"] != nil || len(m["rkeys"].([]any)) != 1 || uint64(m["len"].(float64)) != 1<<20 {
		t.Fatalf("keys of a registered region: %v", m)
	}
	for _, addr := range []uint64{bm.Addr() + 4096, 0x1000} {
		if m := send(t, c, map[string]any{"op": "keys", "addr": addr}); m["rkeys"] != nil || !strings.Contains(fmt.Sprint(m["err"]), "no region registered") {
			t.Fatalf("keys at %#x: %v", addr, m)
		}
	}
	for _, bad := range []map[string]any{
		{"op": "connect"},
		{"op": "connect", "lanes": []map[string]any{{"nic": 5, "qpn": 7, "gid": "fe80::1"}}},
		{"op": "connect", "lanes": []map[string]any{{"nic": 0, "qpn": 7, "gid": "not-a-gid"}}},
		{"op": "steal"},
	} {
		if m := send(t, c, bad); m["err"] == nil || m["resp"] != nil {
			t.Fatalf("%v: %v", bad, m)
		}
	}
	good := map[string]any{"op": "connect", "lanes": []map[string]any{{"nic": 0, "qpn": 7, "gid": "fe80::1", "mtu": 5}}}
	if m := send(t, c, good); m["err"] != nil || len(m["resp"].([]any)) != 1 {
		t.Fatalf("connect: %v", m)
	}
	if m := send(t, c, good); !strings.Contains(fmt.Sprint(m["err"]), "already set up") {
		t.Fatalf("a second connect on one connection: %v", m)
	}
	c.Write(binary.BigEndian.AppendUint32(nil, 64<<20))
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("connection not closed after an oversized frame: %v", err)
	}
}
