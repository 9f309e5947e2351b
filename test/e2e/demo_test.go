package e2e

import (
	"context"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestDemo runs `mooncake-go demo --once` (embedded etcd, prefill, decode,
// LB on this machine, the built-in model) and checks its breakdown: the
// request was answered and its KV moved over shm.
func TestDemo(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, "demo", "--once", "--log-level", "warn").CombinedOutput()
	if err != nil {
		t.Fatalf("demo: %v\n%s", err, out)
	}
	s := string(out)
	for _, re := range []string{
		`completion: ".+"`,
		`TTFT\s+[0-9.]+ ms`,
		`KV bytes moved\s+[1-9][0-9]*`,
		`transport used\s+op=write,transport=shm`,
		`load balancer\s+http://127\.0\.0\.1:\d+`,
	} {
		if !regexp.MustCompile(re).MatchString(s) {
			t.Errorf("demo output lacks %s:\n%s", re, s)
		}
	}
	if strings.Contains(s, "error") {
		t.Errorf("demo printed an error:\n%s", s)
	}
}
