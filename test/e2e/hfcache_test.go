package e2e

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// TestModelFromHFCache: --model-path org/name serves a model from the local
// Hugging Face cache, as users name their models, with nothing fetched.
func TestModelFromHFCache(t *testing.T) {
	hub := t.TempDir()
	repo := filepath.Join(hub, "models--acme--tiny-qwen3")
	snap := filepath.Join(repo, "snapshots", "abc123")
	if out, err := exec.Command(bin, "convert", "--random", "--config", "tiny-qwen3", "--output", snap).CombinedOutput(); err != nil {
		t.Fatalf("convert: %v\n%s", err, out)
	}
	os.MkdirAll(filepath.Join(repo, "refs"), 0o755)
	os.WriteFile(filepath.Join(repo, "refs", "main"), []byte("abc123"), 0o644)
	s := serve(t, serveOpts{name: "hf", model: "acme/tiny-qwen3", env: []string{"HF_HUB_CACHE=" + hub}})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	r, err := generate(ctx, s.url, map[string]any{"text": "hello", "sampling_params": map[string]any{"max_new_tokens": 4, "ignore_eos": true}})
	mustOK(t, "generate", r, err)
	if len(r.IDs) != 4 {
		t.Fatalf("%d tokens", len(r.IDs))
	}
	resp, err := client.Get(s.url + "/get_model_info")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var mi map[string]any
	json.NewDecoder(resp.Body).Decode(&mi)
	if mi["model_path"] != "acme/tiny-qwen3" {
		t.Errorf("/get_model_info model_path %v, want the repo id", mi["model_path"])
	}
}
