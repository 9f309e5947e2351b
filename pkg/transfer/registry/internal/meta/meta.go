// Package meta holds what the registries share: Mooncake's key names and the
// rpc_meta value.
package meta

import (
	"encoding/json"
	"fmt"
	"net"
	"strconv"
	"strings"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

// Key prefixes, as in Mooncake's transfer engine metadata.
const (
	RAMPrefix     = "mooncake/ram/"
	RPCMetaPrefix = "mooncake/rpc_meta/"
)

// join puts the cluster prefix (if any) in front of key.
func join(prefix, key string) string {
	prefix = strings.TrimRight(prefix, "/")
	if prefix == "" {
		return key
	}
	return prefix + "/" + key
}

// RAMKey is where name's descriptor lives: [prefix/]mooncake/ram/<name>.
func RAMKey(prefix, name string) string { return join(prefix, RAMPrefix+name) }

// RPCMetaKey is where name's RPC endpoint lives:
// [prefix/]mooncake/rpc_meta/<name>.
func RPCMetaKey(prefix, name string) string { return join(prefix, RPCMetaPrefix+name) }

// RPCMeta is Mooncake's rpc_meta value.
type RPCMeta struct {
	IPOrHostName string `json:"ip_or_host_name"`
	RPCPort      int    `json:"rpc_port"`
}

// EncodeRPCMeta builds the rpc_meta value from a descriptor's Addr
// (host:port).
func EncodeRPCMeta(addr string) ([]byte, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("rpc_meta: address %q: %w", addr, err)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 0 || p > 65535 {
		return nil, fmt.Errorf("rpc_meta: address %q: bad port", addr)
	}
	return json.Marshal(RPCMeta{IPOrHostName: host, RPCPort: p})
}

// Encode checks d and returns its JSON, sealed with s (the zero secret
// keeps d's own seal, if any), and its rpc_meta value. A descriptor with an
// Addr that is not host:port gets no rpc_meta (nil).
func Encode(s auth.Secret, d *transfer.Descriptor) (desc, rpc []byte, err error) {
	if d == nil {
		return nil, nil, fmt.Errorf("registry: nil descriptor")
	}
	if d.Name == "" {
		return nil, nil, fmt.Errorf("registry: descriptor without a name")
	}
	if !s.IsZero() {
		c := *d // Seal reads the maps and slices, it does not change them
		if err := c.Seal(s); err != nil {
			return nil, nil, err
		}
		d = &c
	}
	desc, err = json.Marshal(d)
	if err != nil {
		return nil, nil, fmt.Errorf("registry: encode descriptor of %s: %w", d.Name, err)
	}
	if d.Addr != "" {
		rpc, err = EncodeRPCMeta(d.Addr)
		if err != nil {
			return nil, nil, fmt.Errorf("registry: descriptor of %s: %w", d.Name, err)
		}
	}
	return desc, rpc, nil
}

// Secret resolves a registry's secret the way transfer.Config does: the
// zero secret means the per-user one of this host unless insecure.
func Secret(s auth.Secret, insecure bool) (auth.Secret, error) {
	switch {
	case insecure && !s.IsZero():
		return auth.Secret{}, fmt.Errorf("registry: config: Insecure with a Secret")
	case insecure, !s.IsZero():
		return s, nil
	}
	u, err := auth.UserDefault()
	if err != nil {
		return auth.Secret{}, fmt.Errorf("registry: no cluster secret given and the per-user one is unavailable: %w", err)
	}
	return u, nil
}
