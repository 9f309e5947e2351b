package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

var nsSeq atomic.Int32

// twoHosts makes a network namespace joined to this one by a veth pair:
// this side hostIP, the namespace's side nsIP. Two network namespaces stand
// for two hosts (DESIGN.md). Skips when namespaces cannot be made.
func twoHosts(t *testing.T) (ns, hostIP, nsIP string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("network namespaces need root")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("network namespaces need iproute2 (ip): not found")
	}
	// Names and addresses unique per call, so -count=N never meets the
	// previous run's namespace while the kernel is still tearing it down.
	seq := nsSeq.Add(1)
	id := (os.Getpid() + int(seq)) % 200
	ns = fmt.Sprintf("mce2e%d-%d", os.Getpid(), seq)
	veth, peer := fmt.Sprintf("mcv%d%da", os.Getpid(), seq), fmt.Sprintf("mcv%d%db", os.Getpid(), seq)
	if len(veth) > 15 { // IFNAMSIZ
		veth, peer = veth[len(veth)-15:], peer[len(peer)-15:]
	}
	hostIP, nsIP = fmt.Sprintf("10.213.%d.1", id), fmt.Sprintf("10.213.%d.2", id)
	run := func(args ...string) error {
		out, err := exec.Command("ip", args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
		return nil
	}
	if err := run("netns", "add", ns); err != nil {
		t.Skipf("cannot create a network namespace: %v", err)
	}
	t.Cleanup(func() {
		run("link", "del", veth) // also removes the peer
		if err := run("netns", "del", ns); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	for _, args := range [][]string{
		{"link", "add", veth, "type", "veth", "peer", "name", peer, "netns", ns},
		{"addr", "add", hostIP + "/24", "dev", veth},
		{"link", "set", veth, "up"},
		{"-n", ns, "addr", "add", nsIP + "/24", "dev", peer},
		{"-n", ns, "link", "set", peer, "up"},
		{"-n", ns, "link", "set", "lo", "up"},
	} {
		if err := run(args...); err != nil {
			t.Skipf("cannot join the namespaces with a veth pair: %v", err)
		}
	}
	return ns, hostIP, nsIP
}

// TestTwoHosts: prefill in this network namespace, decode in another, the
// LB reaching both over the veth pair. auto must pick tcp (shm cannot cross
// hosts), and the output must equal the colocated server's.
func TestTwoHosts(t *testing.T) {
	shared := sharedDir(t)
	ns, hostIP, nsIP := twoHosts(t)
	refs := loadRefs(t, shared)
	// Two hosts share no per-user secret: the operator gives one.
	args := append(append(storiesArgs(shared), pdFlags...), "--cluster-token", "two-hosts-e2e-token")
	p := serve(t, serveOpts{name: "prefill", mode: "prefill", host: hostIP, args: args})
	d := serve(t, serveOpts{name: "decode", mode: "decode", host: nsIP, netns: ns, args: args})
	l := lb(t, "lb", []*server{p}, []*server{d}, "--cluster-token", "two-hosts-e2e-token") // it vouches for the bootstrap fields
	for _, c := range refs {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		r, err := generate(ctx, l.url, map[string]any{"text": c.Prompt,
			"sampling_params": map[string]any{"temperature": 0, "max_new_tokens": len(c.Next)}})
		cancel()
		mustOK(t, c.Prompt, r, err)
		if !slices.Equal(r.IDs, c.Next) {
			t.Errorf("%q across hosts: got %v, want %v", c.Prompt, r.IDs, c.Next)
		}
	}
	pm := p.metrics(t)
	if v := pm[`mooncake_transfer_bytes_total{op="write",transport="tcp"}`]; v == 0 {
		t.Errorf("prefill moved no bytes over tcp across hosts; metrics: %v", grep(pm, "mooncake_transfer_bytes"))
	}
	if v := pm[`mooncake_transfer_bytes_total{op="write",transport="shm"}`]; v != 0 {
		t.Errorf("prefill used shm (%v bytes) with a decode in another network namespace", v)
	}
	if v := d.metric(t, "mooncake_engine_prefill_tokens_total"); v != 0 {
		t.Errorf("decode computed %v prompt tokens", v)
	}
	p.waitFreePages(t, int(p.info(t)["kv_pages_total"].(float64)), 5*time.Second)
	d.waitFreePages(t, int(d.info(t)["kv_pages_total"].(float64)), 5*time.Second)
}
