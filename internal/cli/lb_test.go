package cli

import (
	"slices"
	"strings"
	"testing"
)

// parseLB parses an lb command line as Execute does, up to the servers.
func parseLB(t *testing.T, args ...string) (prefill []string, ports []int, decode []string, err error) {
	t.Helper()
	cmd := newLBCmd(&globals{})
	norm := normalizeArgs(append([]string{"lb"}, args...))
	if err := cmd.ParseFlags(norm[1:]); err != nil {
		return nil, nil, nil, err
	}
	if len(cmd.Flags().Args()) > 0 {
		t.Fatalf("%v: positional arguments %v left", args, cmd.Flags().Args())
	}
	get := func(name string) []string {
		v, err := cmd.Flags().GetStringArray(name)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	return lbServers(get("prefill"), get("decode"), get("prefill-bootstrap-ports"), cmd.Flags().Changed("prefill-bootstrap-ports"))
}

// TestLBCommandLineForms: SGLang's mini_lb and sgl-router forms, repeated
// flags and comma lists give the same servers.
func TestLBCommandLineForms(t *testing.T) {
	const a, b, c, d = "http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30001", "http://10.0.0.4:30001"
	for _, tc := range []struct {
		args    []string
		prefill []string
		ports   []int
		decode  []string
	}{
		{[]string{"--prefill", a, "--decode", c}, []string{a}, nil, []string{c}},
		{[]string{"--prefill", a, b, "--decode", c, d, "--port", "8000"}, []string{a, b}, nil, []string{c, d}},                                    // mini_lb
		{[]string{"--prefill", a, b, "--prefill-bootstrap-ports", "8998", "8999", "--decode", c}, []string{a, b}, []int{8998, 8999}, []string{c}}, // mini_lb
		{[]string{"--prefill", a, b, "--prefill-bootstrap-ports", "8998", "--decode", c}, []string{a, b}, []int{8998, 8998}, []string{c}},
		{[]string{"--prefill", a + "," + b, "--prefill-bootstrap-ports", "8998,8999", "--decode", c + "," + d}, []string{a, b}, []int{8998, 8999}, []string{c, d}},
		{[]string{"--pd-disaggregation", "--prefill", a, "8998", "--prefill", b, "none", "--decode", c, "--decode", d}, []string{a, b}, []int{8998, 0}, []string{c, d}}, // sgl-router
		{[]string{"--prefill", a, "9000", "--decode", c}, []string{a}, []int{9000}, []string{c}},
		{[]string{"--prefill", a + ",8998", "--prefill=" + b + ",8999", "--decode=" + c}, []string{a, b}, []int{8998, 8999}, []string{c}},
		{[]string{"--prefill=" + a, "8998", b, "--decode", c}, []string{a, b}, []int{8998, 0}, []string{c}},
		{[]string{"--prefill", a, "--prefill", b, "--decode", c, "--mini-lb"}, []string{a, b}, nil, []string{c}},
	} {
		p, ports, dd, err := parseLB(t, tc.args...)
		if err != nil || !slices.Equal(p, tc.prefill) || !slices.Equal(ports, tc.ports) || !slices.Equal(dd, tc.decode) {
			t.Fatalf("lb %v: prefill %v ports %v decode %v (%v), want %v %v %v", tc.args, p, ports, dd, err, tc.prefill, tc.ports, tc.decode)
		}
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--prefill", "8998", a, "--decode", c}, "a bootstrap port comes after its prefill's URL"},
		{[]string{"--prefill", a, "8998", "8999", "--decode", c}, "two bootstrap ports for " + a},
		{[]string{"--prefill", a, "70000", "--decode", c}, "bootstrap port 70000: want 1 to 65535"},
		{[]string{"--prefill", a, "--decode", c, "8998"}, `--decode ` + c + `,8998: "8998" is not a URL`},
		{[]string{"--prefill", a, "8998", "--prefill-bootstrap-ports", "1", "--decode", c}, "give the ports one way"},
		{[]string{"--prefill", a, b, "--prefill-bootstrap-ports", "1", "2", "3", "--decode", c}, "3 ports for 2 --prefill servers"},
		{[]string{"--prefill", a, "--prefill-bootstrap-ports", "x", "--decode", c}, "--prefill-bootstrap-ports x: want ports"},
	} {
		if _, _, _, err := parseLB(t, tc.args...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Fatalf("lb %v: %v, want an error with %q", tc.args, err, tc.want)
		}
		// The command fails with it, before it listens.
		if _, err := run(t, append(append([]string{"lb"}, tc.args...), "--insecure-no-cluster-token")...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Fatalf("mooncake-go lb %v: %v, want an error with %q", tc.args, err, tc.want)
		}
	}
}
