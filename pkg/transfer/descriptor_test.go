package transfer

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

func sealedDescriptor(t testing.TB, s auth.Secret) *Descriptor {
	t.Helper()
	d := &Descriptor{
		Name: "10.0.0.1:7000", Incarnation: "0123456789abcdef", Addr: "10.0.0.1:7000", PID: 77,
		Host:       HostID{BootID: "b", MachineID: "m", NetNS: "net:[1]"},
		Transports: map[string]json.RawMessage{"tcp": json.RawMessage(`{ "version": 1, "lanes": 4 }`), "shm": json.RawMessage(`{"socket":"@x<&>"}`)},
		Regions: []RegionInfo{{Addr: 0x7f0000000000, Len: 1 << 20, Location: Location{Kind: CPU}, Access: AccessReadWrite,
			Handles: map[string]json.RawMessage{"shm": json.RawMessage(`{"memfd":1}`)}}},
	}
	if err := d.Seal(s); err != nil {
		t.Fatal(err)
	}
	return d
}

// TestSeal: a sealed descriptor reads back (through JSON, Clone and odd
// strings); any change to any field, a missing seal, another secret or
// another name is refused with a DescriptorError naming the key.
func TestSeal(t *testing.T) {
	s := testSecret(t, "alpha-alpha-alpha-alpha")
	d := sealedDescriptor(t, s)
	b, _ := json.Marshal(d)
	if _, err := ReadDescriptor(s, "k", d.Name, b); err != nil {
		t.Fatalf("sealed descriptor refused: %v", err)
	}
	if err := d.Clone().CheckSeal(s); err != nil {
		t.Fatalf("clone: %v", err)
	}
	odd := sealedDescriptor(t, s)
	odd.Name = "bad\xffutf8"
	if err := odd.Seal(s); err != nil {
		t.Fatal(err)
	}
	ob, _ := json.Marshal(odd)
	if _, err := ReadDescriptor(s, "k", "", ob); err != nil {
		t.Fatalf("a name JSON cannot carry as it is: %v", err)
	}
	other := testSecret(t, "bravo-bravo-bravo-bravo")
	for _, tc := range []struct {
		name string
		mod  func(*Descriptor)
		sec  auth.Secret
		want string
		says string
	}{
		{"addr", func(d *Descriptor) { d.Addr = "10.6.6.6:1" }, s, "", "does not match"},
		{"pid", func(d *Descriptor) { d.PID++ }, s, "", "does not match"},
		{"region", func(d *Descriptor) { d.Regions[0].Access = AccessRead }, s, "", "does not match"},
		{"handle", func(d *Descriptor) { d.Regions[0].Handles["shm"] = json.RawMessage(`{"memfd":2}`) }, s, "", "does not match"},
		{"transport", func(d *Descriptor) { d.Transports["rdma"] = json.RawMessage(`{}`) }, s, "", "does not match"},
		{"no seal", func(d *Descriptor) { d.MAC = "" }, s, "", "no seal"},
		{"bad seal", func(d *Descriptor) { d.MAC = "zz" }, s, "", "does not match"},
		{"other secret", func(*Descriptor) {}, other, "", "does not match"},
		{"other name", func(*Descriptor) {}, s, "10.0.0.2:7000", `not "10.0.0.2:7000"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := d.Clone()
			tc.mod(c)
			b, _ := json.Marshal(c)
			_, err := ReadDescriptor(tc.sec, "mooncake/ram/x", tc.want, b)
			var de *DescriptorError
			if !errors.Is(err, ErrBadDescriptor) || !errors.As(err, &de) || de.Key != "mooncake/ram/x" ||
				!strings.Contains(err.Error(), "mooncake/ram/x") || !strings.Contains(err.Error(), tc.says) {
				t.Fatalf("read: %v", err)
			}
		})
	}
	// Without a secret nothing is checked, and sealing writes no MAC.
	if _, err := ReadDescriptor(auth.Secret{}, "k", "", b); err != nil {
		t.Fatal(err)
	}
	n := d.Clone()
	if n.Seal(auth.Secret{}); n.MAC != "" {
		t.Fatal("the zero secret sealed")
	}
}

// FuzzDescriptorSeal: whatever bytes ReadDescriptor accepts under the
// secret describe exactly the descriptor that was sealed (JSON may differ
// in spacing, key order or case); everything else is a DescriptorError.
func FuzzDescriptorSeal(f *testing.F) {
	s := testSecret(f, "alpha-alpha-alpha-alpha")
	d := sealedDescriptor(f, s)
	want, _ := d.canonical()
	b, _ := json.Marshal(d)
	f.Add(b)
	f.Add([]byte(strings.Replace(string(b), `"pid":77`, `"pid":78`, 1)))
	f.Add([]byte(strings.Replace(string(b), `"name"`, `"NAME"`, 1)))
	f.Add([]byte(`{"name":"a","incarnation":"b"}`))
	f.Add([]byte(`not json`))
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) > 1<<16 {
			return
		}
		got, err := ReadDescriptor(s, "k", "", in)
		if err != nil {
			var de *DescriptorError
			if !errors.As(err, &de) || !errors.Is(err, ErrBadDescriptor) {
				t.Fatalf("error %v is not a DescriptorError", err)
			}
			return
		}
		c, _ := got.canonical()
		if string(c) != string(want) {
			t.Fatalf("accepted a descriptor other than the sealed one:\n%s\nwant\n%s", c, want)
		}
	})
}
