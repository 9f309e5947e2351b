// Package openai_test runs the official `openai` npm client (client.mjs)
// against the HTTP server: completions, streaming, chat, models and errors.
// It needs node and the package that scripts/npm-openai.sh installs into
// .cache/npm-openai (MOONCAKE_NPM_OPENAI_DIR overrides); without them it
// skips and says why.
package openai_test

import (
	"context"
	"errors"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/compute/cpu"
	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/server"
	"github.com/mooncake-go/mooncake-go/internal/server/servertest"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

// requireClient returns node's path and the npm folder, or skips.
func requireClient(t *testing.T) (node, npmDir string) {
	t.Helper()
	node, err := exec.LookPath("node")
	if err != nil {
		t.Skip("node not found; the openai npm client test needs Node.js")
	}
	npmDir = os.Getenv("MOONCAKE_NPM_OPENAI_DIR")
	if npmDir == "" {
		root, err := filepath.Abs("../..")
		if err != nil {
			t.Fatal(err)
		}
		npmDir = filepath.Join(root, ".cache", "npm-openai")
	}
	if _, err := os.Stat(filepath.Join(npmDir, "node_modules", "openai", "package.json")); err != nil {
		t.Skipf("the openai npm package is not in %s; run scripts/npm-openai.sh", npmDir)
	}
	return node, npmDir
}

// runClient runs client.mjs with env against baseURL.
func runClient(t *testing.T, node, npmDir, baseURL, model string, env ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, node, "client.mjs")
	cmd.Env = append(os.Environ(), "OPENAI_NPM_DIR="+npmDir, "BASE_URL="+baseURL+"/v1", "MODEL="+model)
	cmd.Env = append(cmd.Env, env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("node client.mjs: %v\n%s", err, out)
	}
	t.Logf("client.mjs: %s", out)
}

// failing aborts with an error after two tokens.
func failing(r *engine.Request) []engine.Event {
	return []engine.Event{
		{Token: 'a', Text: "a"},
		{Token: 'b', Text: "b"},
		{Token: -1, Finish: &engine.Finish{Type: "abort", Err: errors.New("device lost")}},
	}
}

func newServer(t *testing.T, cfg server.Config) *httptest.Server {
	t.Helper()
	s, err := server.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(s.Handler())
	t.Cleanup(ts.Close)
	return ts
}

// TestOpenAIClientFake runs the client against a server over the fake engine.
func TestOpenAIClientFake(t *testing.T) {
	node, npmDir := requireClient(t)
	const model = "fake-model"
	ok := newServer(t, server.Config{Generator: &servertest.Generator{}, Tokenizer: servertest.Tokenizer{}, ModelName: model})
	bad := newServer(t, server.Config{Generator: &servertest.Generator{Script: failing}, Tokenizer: servertest.Tokenizer{}, ModelName: model})
	runClient(t, node, npmDir, ok.URL, model, "FAIL_BASE_URL="+bad.URL+"/v1", "EXPECT_TEXT=Hello, w")
}

// TestOpenAIClientEngine runs the client against the real engine on the
// built-in random-weight model and the CPU backend.
func TestOpenAIClientEngine(t *testing.T) {
	node, npmDir := requireClient(t)
	m := model.Builtin()
	l := cpu.LayoutFor(m.Config, 16, 64)
	pool, err := kvcache.NewPool(l, make([]byte, l.TotalBytes()))
	if err != nil {
		t.Fatal(err)
	}
	b, err := cpu.New(m, pool, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	e, err := engine.New(engine.Config{Model: b, Pages: pool.Alloc, Tokenizer: tokenizer.NewByteLevel()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	defer func() {
		cancel()
		_ = e.Close()
		<-done
	}()
	const model = "builtin"
	ts := newServer(t, server.Config{Generator: e, Tokenizer: e.Tokenizer(), ModelName: model, RandomWeights: true})
	runClient(t, node, npmDir, ts.URL, model)
}
