package registry

import (
	"net/http/httptest"
	"os"
	"strings"
	"testing"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/httpmeta"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/shm"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/tcp"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

// processTransports is the target's transport set: MOONCAKE_TEST_TRANSPORT
// picks tcp or shm (the initiator uses the same one).
func processTransports() []transfer.Transport {
	if os.Getenv("MOONCAKE_TEST_TRANSPORT") == "shm" {
		return []transfer.Transport{shm.New(shm.Config{})}
	}
	return []transfer.Transport{tcp.New(tcp.Config{})}
}

// TestTwoProcesses moves random data between two OS processes through each
// transport, with the target's descriptor found through each registry:
// P2P, etcd (an embedded server started here) and the HTTP metadata server.
func TestTwoProcesses(t *testing.T) {
	_, etcd, err := Open(t.Context(), "embedded", Options{DataDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer etcd.Close()
	etcdSpec := "etcd://" + strings.TrimPrefix(etcd.(Endpointer).Endpoints()[0], "http://")
	ms, err := httpmeta.NewServer(httpmeta.ServerConfig{Secret: transfertest.Secret(transfertest.ProcessToken)})
	if err != nil {
		t.Fatal(err)
	}
	meta := httptest.NewServer(ms)
	defer meta.Close()
	for _, tr := range []string{"tcp", "shm"} {
		for _, spec := range []string{"p2p", etcdSpec, meta.URL + "/metadata"} {
			name := tr + "/" + strings.SplitN(spec, ":", 2)[0]
			t.Run(name, func(t *testing.T) {
				t.Setenv("MOONCAKE_TEST_TRANSPORT", tr)
				transfertest.RunProcessRegistry(t, processTransports, spec)
			})
		}
	}
}
