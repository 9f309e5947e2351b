package ibv_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/ibv"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs"
)

// Where libibverbs is absent (CPU machines) Load fails naming the library;
// where it loads (GPU machines: the library but no HCA), opening a device
// that does not exist fails naming it.
func TestLoad(t *testing.T) {
	name, err := ibv.Load()
	if err != nil {
		if !errors.Is(err, verbs.ErrUnavailable) || !strings.Contains(err.Error(), "libibverbs") {
			t.Fatalf("Load: %v; want ErrUnavailable naming libibverbs", err)
		}
		if _, perr := ibv.Provider(); !errors.Is(perr, verbs.ErrUnavailable) {
			t.Fatalf("Provider after a failed Load: %v", perr)
		}
		t.Logf("no library here: %v", err)
		return
	}
	p, err := ibv.Provider()
	if err != nil {
		t.Fatal(err)
	}
	devs, err := p.Devices()
	t.Logf("%s: devices %v (%v)", name, devs, err)
	_, err = p.Open("mc_no_such_device0")
	if err == nil || !strings.Contains(err.Error(), "mc_no_such_device0") {
		t.Fatalf("Open of a missing device: %v; want an error naming it", err)
	}
	if len(devs) == 0 && !errors.Is(err, verbs.ErrNoDevice) {
		t.Fatalf("Open with no devices: %v; want ErrNoDevice", err)
	}
}
