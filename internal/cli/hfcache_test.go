package cli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestResolveModelPath(t *testing.T) {
	dir := t.TempDir()
	hub := filepath.Join(dir, "home", ".cache", "huggingface", "hub")
	repo := filepath.Join(hub, "models--meta-llama--Llama-3.1-8B-Instruct")
	snap := filepath.Join(repo, "snapshots", "0e9e39f249a16976918f6564b8830bc894c89659")
	other := filepath.Join(repo, "snapshots", "1111111111111111111111111111111111111111")
	for _, d := range []string{snap, other, filepath.Join(repo, "refs")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	os.WriteFile(filepath.Join(repo, "refs", "main"), []byte("0e9e39f249a16976918f6564b8830bc894c89659\n"), 0o644)
	envs := map[string]map[string]string{
		"HOME":         {"HOME": filepath.Join(dir, "home")},
		"HF_HOME":      {"HOME": "/nonexistent", "HF_HOME": filepath.Join(dir, "home", ".cache", "huggingface")},
		"HF_HUB_CACHE": {"HF_HUB_CACHE": hub, "HOME": "/nonexistent"},
	}
	for name, e := range envs {
		got, err := resolveModelPath("meta-llama/Llama-3.1-8B-Instruct", func(k string) string { return e[k] })
		if err != nil || got != snap {
			t.Errorf("%s: %q, %v; want refs/main's snapshot %s", name, got, err, snap)
		}
	}
	// A path on disk wins; a missing one that is no repo id says so.
	if got, err := resolveModelPath(dir, func(string) string { return "" }); err != nil || got != dir {
		t.Errorf("existing path: %q %v", got, err)
	}
	if _, err := resolveModelPath("./no/such", func(string) string { return "" }); err == nil {
		t.Error("a missing relative path resolved")
	}
	// Not cached: the error lists where it looked and how to fetch it.
	_, err := resolveModelPath("org/missing", func(k string) string { return map[string]string{"HF_HUB_CACHE": hub}[k] })
	if err == nil || !strings.Contains(err.Error(), filepath.Join(hub, "models--org--missing")) || !strings.Contains(err.Error(), "huggingface-cli download org/missing") {
		t.Errorf("uncached repo: %v", err)
	}
	// Without refs/main, the only snapshot.
	os.Remove(filepath.Join(repo, "refs", "main"))
	os.RemoveAll(other)
	if got, err := resolveModelPath("meta-llama/Llama-3.1-8B-Instruct", func(k string) string { return envs["HOME"][k] }); err != nil || got != snap {
		t.Errorf("single snapshot: %q %v", got, err)
	}
}
