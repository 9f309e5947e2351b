package cli

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs/fake"
)

func TestParseIBDevice(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "ib.json")
	if err := os.WriteFile(file, []byte(`{"0": "mlx5_0", "1": ["mlx5_1", "mlx5_2"]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		in     string
		all    []string
		perGPU map[int][]string
	}{
		{"", nil, nil},
		{"mlx5_0", []string{"mlx5_0"}, nil},
		{" mlx5_1, mlx5_0,mlx5_1 ", []string{"mlx5_0", "mlx5_1"}, nil},
		{`{"0": "mlx5_0,mlx5_1", "3": "mlx5_3"}`, []string{"mlx5_0", "mlx5_1", "mlx5_3"}, map[int][]string{0: {"mlx5_0", "mlx5_1"}, 3: {"mlx5_3"}}},
		{file, []string{"mlx5_0", "mlx5_1", "mlx5_2"}, map[int][]string{0: {"mlx5_0"}, 1: {"mlx5_1", "mlx5_2"}}},
	} {
		d, err := parseIBDevice(c.in, os.ReadFile)
		if err != nil || !reflect.DeepEqual(d.all, c.all) || !reflect.DeepEqual(d.perGPU, c.perGPU) {
			t.Errorf("%q: %+v %v; want %v %v", c.in, d, err, c.all, c.perGPU)
		}
	}
	for in, want := range map[string]string{
		`{"0": mlx5_0}`:             "bad JSON",
		`{"gpu0": "mlx5_0"}`:        `key "gpu0"`,
		`{"0": ""}`:                 "GPU 0 has no device",
		`{"0": 7}`:                  "GPU 0",
		dir + "/missing.json":       "missing.json",
		"mlx5_0,ml x5":              "not a device name",
		filepath.Join(dir, "ib.js"): "ib.js",
	} {
		if _, err := parseIBDevice(in, os.ReadFile); err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "--disaggregation-ib-device") {
			t.Errorf("%q: %v; want an error naming the flag and %q", in, err, want)
		}
	}
}

// The backend choice with RDMA devices present (a fake HCA) and absent.
func TestTransportsRDMA(t *testing.T) {
	host := fake.NewFabric().NewHost("mlx5_0", "mlx5_1")
	withFake := func() (verbs.Provider, error) { return host, nil }
	names := func(tf *transferFlags, lg *zap.Logger) ([]string, error) {
		ts, err := tf.transports("--disaggregation-transfer-backend", lg, nil)
		var out []string
		for _, x := range ts {
			out = append(out, x.Name())
		}
		return out, err
	}
	// auto: rdma after the same-machine transports, before tcp.
	got, err := names(&transferFlags{backend: "auto", verbs: withFake, sysfsRoot: t.TempDir()}, nil)
	if err != nil || len(got) < 3 || got[len(got)-2] != "rdma" || got[len(got)-1] != "tcp" || got[len(got)-3] != "shm" {
		t.Fatalf("auto with devices: %v %v", got, err)
	}
	// auto, a named device that is missing: one warning, no rdma.
	core, logs := observer.New(zap.WarnLevel)
	lg := zap.New(core)
	tf := &transferFlags{backend: "auto", ibDevice: "mlx5_0,mlx5_9", verbs: withFake}
	for i := 0; i < 2; i++ {
		got, err = names(tf, lg)
		if err != nil || got[len(got)-1] != "tcp" || strings.Contains(strings.Join(got, ","), "rdma") {
			t.Fatalf("auto with a missing device: %v %v", got, err)
		}
	}
	if w := logs.FilterMessageSnippet("--disaggregation-ib-device").All(); len(w) != 1 || !strings.Contains(w[0].ContextMap()["reason"].(string), "mlx5_9") {
		t.Fatalf("warnings %v; want one naming mlx5_9", logs.All())
	}
	// rdma: the same is an error naming the device; with the devices, rdma alone.
	if _, err := names(&transferFlags{backend: "rdma", ibDevice: "mlx5_9", verbs: withFake}, nil); err == nil ||
		!strings.Contains(err.Error(), "mlx5_9") || !strings.Contains(err.Error(), "--disaggregation-transfer-backend rdma") {
		t.Fatalf("rdma with a missing device: %v", err)
	}
	if got, err := names(&transferFlags{backend: "rdma", ibDevice: `{"0": "mlx5_1"}`, verbs: withFake}, nil); err != nil || !reflect.DeepEqual(got, []string{"rdma"}) {
		t.Fatalf("rdma with devices: %v %v", got, err)
	}
	// No device at all under auto: no rdma, no warning.
	empty := fake.NewFabric().NewHost()
	core, logs = observer.New(zap.WarnLevel)
	got, err = names(&transferFlags{backend: "auto", verbs: func() (verbs.Provider, error) { return empty, nil }}, zap.New(core))
	if err != nil || strings.Contains(strings.Join(got, ","), "rdma") || logs.Len() != 0 {
		t.Fatalf("auto without devices: %v %v %v", got, err, logs.All())
	}
	// A malformed value is an error under auto too.
	if _, err := names(&transferFlags{backend: "auto", ibDevice: `{"x": 1}`, verbs: withFake}, nil); err == nil {
		t.Fatal("auto took a malformed --disaggregation-ib-device")
	}
}

// serve --disaggregation-transfer-backend rdma on a machine without an RDMA
// device fails at start, naming what is missing.
func TestServeRDMAWithoutDevice(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "no RDMA device"},
		{[]string{"--disaggregation-ib-device", "mlx5_7"}, "mlx5_7"},
	} {
		args := append([]string{"serve", "--log-level", "error", "--disaggregation-transfer-backend", "rdma"}, c.args...)
		_, err := run(t, args...)
		if err == nil || !strings.Contains(err.Error(), "--disaggregation-transfer-backend rdma") || !strings.Contains(err.Error(), c.want) {
			t.Errorf("serve %v: %v; want an error naming %q", c.args, err, c.want)
		}
		if err != nil && strings.Contains(err.Error(), "this build has no RDMA") {
			t.Errorf("serve %v still says %q", c.args, err)
		}
	}
}
