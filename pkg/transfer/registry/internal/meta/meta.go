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

// Encode checks d and returns its JSON and rpc_meta values. A descriptor
// with an Addr that is not host:port gets no rpc_meta (nil).
func Encode(d *transfer.Descriptor) (desc, rpc []byte, err error) {
	if d == nil {
		return nil, nil, fmt.Errorf("registry: nil descriptor")
	}
	if d.Name == "" {
		return nil, nil, fmt.Errorf("registry: descriptor without a name")
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
