// Package registrytest is the conformance suite every transfer.Registry
// passes.
package registrytest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// Run runs the suite. open returns a registry for one subtest, over a store
// no other subtest sees (a fresh server, or a fresh cluster prefix); it
// registers its own cleanup with t.Cleanup.
func Run(t *testing.T, open func(t *testing.T) transfer.Registry) {
	t.Run("RoundTrip", func(t *testing.T) { testRoundTrip(t, open(t)) })
	t.Run("Overwrite", func(t *testing.T) { testOverwrite(t, open(t)) })
	t.Run("Delete", func(t *testing.T) { testDelete(t, open(t)) })
	t.Run("NotFound", func(t *testing.T) { testNotFound(t, open(t)) })
	t.Run("BadPut", func(t *testing.T) { testBadPut(t, open(t)) })
	t.Run("ConcurrentPuts", func(t *testing.T) { testConcurrentPuts(t, open(t)) })
	t.Run("Canceled", func(t *testing.T) { testCanceled(t, open(t)) })
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	t.Cleanup(cancel)
	return c
}

// Descriptor returns a valid descriptor with regions, handles and
// transports; incarnation distinguishes versions.
func Descriptor(name, incarnation string) *transfer.Descriptor {
	return &transfer.Descriptor{
		Name:        name,
		Incarnation: incarnation,
		Host:        transfer.HostID{BootID: "b-1", MachineID: "m-1", NetNS: "net:[4026531840]"},
		Addr:        "127.0.0.1:17777",
		PID:         4242,
		Transports: map[string]json.RawMessage{
			"tcp": json.RawMessage(`{"lanes":4}`),
			"shm": json.RawMessage(`{"socket":"@mooncake-4242"}`),
		},
		Regions: []transfer.RegionInfo{
			{
				Addr: 0x7f0000000000, Len: 1 << 30,
				Location: transfer.Location{Kind: transfer.CPU, Index: 0},
				Access:   transfer.AccessReadWrite,
				Handles:  map[string]json.RawMessage{"shm": json.RawMessage(`{"memfd":"m-7","offset":4096}`)},
			},
			{
				Addr: 0x7f1000000000, Len: 4096,
				Location: transfer.Location{Kind: transfer.CUDA, Index: 1},
				Access:   transfer.AccessRead,
			},
		},
		TokenRequired: true,
	}
}

func same(t *testing.T, got, want *transfer.Descriptor) {
	t.Helper()
	g, _ := json.Marshal(got)
	w, _ := json.Marshal(want)
	if string(g) != string(w) {
		t.Fatalf("descriptor differs\n got %s\nwant %s", g, w)
	}
}

func testRoundTrip(t *testing.T, r transfer.Registry) {
	// Names as the engine makes them (host:port) and ones a store must
	// escape (query characters, slashes, spaces).
	for _, name := range []string{"127.0.0.1:17777", "[::1]:9000", "a b&key=c?d/e#f%20"} {
		d := Descriptor(name, "inc-1")
		if err := r.Put(ctx(t), d); err != nil {
			t.Fatalf("put %q: %v", name, err)
		}
		got, err := r.Get(ctx(t), name)
		if err != nil {
			t.Fatalf("get %q: %v", name, err)
		}
		same(t, got, d)
	}
}

func testOverwrite(t *testing.T, r transfer.Registry) {
	d := Descriptor("seg:1", "inc-1")
	if err := r.Put(ctx(t), d); err != nil {
		t.Fatal(err)
	}
	d2 := Descriptor("seg:1", "inc-2")
	d2.Regions = append(d2.Regions, transfer.RegionInfo{
		Addr: 0x7f2000000000, Len: 8192,
		Location: transfer.Location{Kind: transfer.CPU, Index: 1}, Access: transfer.AccessWrite,
	})
	if err := r.Put(ctx(t), d2); err != nil {
		t.Fatal(err)
	}
	got, err := r.Get(ctx(t), "seg:1")
	if err != nil {
		t.Fatal(err)
	}
	same(t, got, d2)
}

func testDelete(t *testing.T, r transfer.Registry) {
	if err := r.Put(ctx(t), Descriptor("seg:1", "inc-1")); err != nil {
		t.Fatal(err)
	}
	if err := r.Put(ctx(t), Descriptor("seg:2", "inc-1")); err != nil {
		t.Fatal(err)
	}
	if err := r.Delete(ctx(t), "seg:1"); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Get(ctx(t), "seg:1"); !errors.Is(err, transfer.ErrSegmentNotFound) {
		t.Fatalf("get after delete: %v, want ErrSegmentNotFound", err)
	}
	if _, err := r.Get(ctx(t), "seg:2"); err != nil {
		t.Fatalf("the other segment went too: %v", err)
	}
	// Deleting what is not there is not an error (Engine.Close may run
	// after the entry expired).
	if err := r.Delete(ctx(t), "seg:1"); err != nil {
		t.Fatalf("second delete: %v", err)
	}
	if err := r.Delete(ctx(t), "never-was:1"); err != nil {
		t.Fatalf("delete of a missing name: %v", err)
	}
}

func testNotFound(t *testing.T, r transfer.Registry) {
	_, err := r.Get(ctx(t), "missing-host:1234")
	if !errors.Is(err, transfer.ErrSegmentNotFound) {
		t.Fatalf("get missing: %v, want ErrSegmentNotFound", err)
	}
	if errors.Is(err, transfer.ErrRegistry) {
		t.Fatalf("get missing: %v also wraps ErrRegistry", err)
	}
	if !strings.Contains(err.Error(), "missing-host:1234") {
		t.Fatalf("error %q does not name the segment", err)
	}
}

func testBadPut(t *testing.T, r transfer.Registry) {
	if err := r.Put(ctx(t), nil); err == nil {
		t.Fatal("put nil: no error")
	}
	if err := r.Put(ctx(t), &transfer.Descriptor{Incarnation: "x"}); err == nil {
		t.Fatal("put without a name: no error")
	}
}

func testConcurrentPuts(t *testing.T, r transfer.Registry) {
	const n = 16
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			name := fmt.Sprintf("10.0.0.%d:7000", i)
			if err := r.Put(ctx(t), Descriptor(name, fmt.Sprintf("inc-%d", i))); err != nil {
				errs[i] = err
				return
			}
			d, err := r.Get(ctx(t), name)
			if err == nil && d.Incarnation != fmt.Sprintf("inc-%d", i) {
				err = fmt.Errorf("got incarnation %s", d.Incarnation)
			}
			errs[i] = err
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		name := fmt.Sprintf("10.0.0.%d:7000", i)
		d, err := r.Get(ctx(t), name)
		if err != nil {
			t.Fatalf("get %s: %v", name, err)
		}
		if want := fmt.Sprintf("inc-%d", i); d.Incarnation != want {
			t.Fatalf("%s: incarnation %s, want %s", name, d.Incarnation, want)
		}
	}
}

func testCanceled(t *testing.T, r transfer.Registry) {
	c, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := r.Get(c, "seg:1"); !errors.Is(err, context.Canceled) {
		t.Fatalf("get with a canceled context: %v, want context.Canceled", err)
	}
	if err := r.Put(c, Descriptor("seg:1", "inc-1")); !errors.Is(err, context.Canceled) {
		t.Fatalf("put with a canceled context: %v, want context.Canceled", err)
	}
}
