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
	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

// Store is one subtest's registry, and a way around it.
type Store struct {
	Registry transfer.Registry
	// Secret is the cluster secret Registry was opened with.
	Secret auth.Secret
	// Raw stores value under the key where name's descriptor lives, as
	// anyone who reaches the store without the secret could: no seal, no
	// checks.
	Raw func(ctx context.Context, name string, value []byte) error
}

// Secret is the cluster secret a suite's registries are opened with.
func Secret() auth.Secret {
	s, err := auth.New("registrytest-cluster-secret", "registrytest secret")
	if err != nil {
		panic(err)
	}
	return s
}

// Run runs the suite. open returns a registry for one subtest, over a store
// no other subtest sees (a fresh server, or a fresh cluster prefix); it
// registers its own cleanup with t.Cleanup.
func Run(t *testing.T, open func(t *testing.T) Store) {
	reg := func(t *testing.T) transfer.Registry { return open(t).Registry }
	t.Run("RoundTrip", func(t *testing.T) { testRoundTrip(t, reg(t)) })
	t.Run("Overwrite", func(t *testing.T) { testOverwrite(t, reg(t)) })
	t.Run("Delete", func(t *testing.T) { testDelete(t, reg(t)) })
	t.Run("NotFound", func(t *testing.T) { testNotFound(t, reg(t)) })
	t.Run("BadPut", func(t *testing.T) { testBadPut(t, reg(t)) })
	t.Run("ConcurrentPuts", func(t *testing.T) { testConcurrentPuts(t, reg(t)) })
	t.Run("Canceled", func(t *testing.T) { testCanceled(t, reg(t)) })
	t.Run("Forged", func(t *testing.T) { testForged(t, open(t)) })
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
	}
}

// same compares descriptors but for their seals; got must be sealed.
func same(t *testing.T, got, want *transfer.Descriptor) {
	t.Helper()
	if got.MAC == "" {
		t.Fatalf("descriptor of %s came back without a seal", got.Name)
	}
	g, w := *got, *want
	g.MAC, w.MAC = "", ""
	gb, _ := json.Marshal(&g)
	wb, _ := json.Marshal(&w)
	if string(gb) != string(wb) {
		t.Fatalf("descriptor differs\n got %s\nwant %s", gb, wb)
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

// testForged: values written around the registry (garbage, no seal, a seal
// of another secret, an altered descriptor, another segment's descriptor)
// are refused by Get with an error naming the key, wrapping
// ErrBadDescriptor and neither ErrSegmentNotFound nor ErrRegistry; a good
// Put then works at once (nothing bad was cached).
func testForged(t *testing.T, st Store) {
	r := st.Registry
	const name = "victim:7000"
	good := Descriptor(name, "inc-good")
	sealed := func(d *transfer.Descriptor, s auth.Secret) *transfer.Descriptor {
		if err := d.Seal(s); err != nil {
			t.Fatal(err)
		}
		return d
	}
	enc := func(d *transfer.Descriptor) []byte { b, _ := json.Marshal(d); return b }
	other, _ := auth.New("another-cluster-secret", "test")
	redirected := sealed(Descriptor(name, "inc-good"), st.Secret)
	redirected.Addr = "10.6.6.6:6666" // altered after sealing
	for _, tc := range []struct {
		what  string
		value []byte
		why   string
	}{
		{"garbage", []byte("not json at all"), "not a descriptor"},
		{"empty", []byte("{}"), "name and incarnation are required"},
		{"unsealed", enc(Descriptor(name, "inc-forged")), "no seal"},
		{"other secret", enc(sealed(Descriptor(name, "inc-forged"), other)), "does not match"},
		{"altered", enc(redirected), "does not match"},
		{"other segment", enc(sealed(Descriptor("other:1", "inc-other"), st.Secret)), `describes segment "other:1"`},
	} {
		t.Run(tc.what, func(t *testing.T) {
			if err := st.Raw(ctx(t), name, tc.value); err != nil {
				t.Fatalf("raw write: %v", err)
			}
			d, err := r.Get(ctx(t), name)
			var de *transfer.DescriptorError
			switch {
			case err == nil:
				t.Fatalf("forged value accepted: %+v", d)
			case !errors.Is(err, transfer.ErrBadDescriptor) || !errors.As(err, &de):
				t.Fatalf("get: %v, want a *DescriptorError wrapping ErrBadDescriptor", err)
			case errors.Is(err, transfer.ErrSegmentNotFound) || errors.Is(err, transfer.ErrRegistry):
				t.Fatalf("get: %v also wraps ErrSegmentNotFound or ErrRegistry", err)
			case !strings.Contains(err.Error(), "mooncake/ram/"+name) || !strings.Contains(de.Key, "mooncake/ram/"+name):
				t.Fatalf("get: %q (key %q) does not name the key mooncake/ram/%s", err, de.Key, name)
			case !strings.Contains(err.Error(), tc.why):
				t.Fatalf("get: %q does not say %q", err, tc.why)
			}
			if err := r.Put(ctx(t), good); err != nil {
				t.Fatal(err)
			}
			got, err := r.Get(ctx(t), name)
			if err != nil {
				t.Fatalf("get after a good put: %v", err)
			}
			same(t, got, good)
		})
	}
}
