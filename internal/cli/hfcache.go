package cli

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// resolveModelPath turns --model-path into a path on disk: the path itself
// when it exists, else, for a repo id "org/name", its snapshot in the local
// Hugging Face cache (offline: nothing is downloaded). env reads a variable.
func resolveModelPath(p string, env func(string) string) (string, error) {
	if _, err := os.Stat(p); err == nil || !errors.Is(err, os.ErrNotExist) {
		return p, err
	}
	org, name, ok := strings.Cut(p, "/")
	if !ok || org == "" || name == "" || strings.Contains(name, "/") || strings.HasPrefix(p, ".") {
		return "", fmt.Errorf("%s: no such file or directory", p)
	}
	var looked []string
	for _, hub := range hubDirs(env) {
		repo := filepath.Join(hub, "models--"+org+"--"+name)
		looked = append(looked, repo)
		if snap, ok := snapshot(repo); ok {
			return snap, nil
		}
	}
	return "", fmt.Errorf("%s: not a file or directory, and not in the local Hugging Face cache (looked in %s); download it first, for example with `huggingface-cli download %s` (mooncake-go fetches nothing)",
		p, strings.Join(looked, ", "), p)
}

// hubDirs are the Hugging Face hub caches to look in, in the hub library's
// order of precedence.
func hubDirs(env func(string) string) []string {
	var out []string
	add := func(d string) {
		if d != "" && !slices.Contains(out, d) {
			out = append(out, d)
		}
	}
	add(env("HF_HUB_CACHE"))
	add(env("HUGGINGFACE_HUB_CACHE"))
	if h := env("HF_HOME"); h != "" {
		add(filepath.Join(h, "hub"))
	}
	if x := env("XDG_CACHE_HOME"); x != "" {
		add(filepath.Join(x, "huggingface", "hub"))
	}
	if h := env("HOME"); h != "" {
		add(filepath.Join(h, ".cache", "huggingface", "hub"))
	}
	return out
}

// snapshot is the revision refs/main names in a cached repo, or its only
// snapshot when refs/main is missing.
func snapshot(repo string) (string, bool) {
	if b, err := os.ReadFile(filepath.Join(repo, "refs", "main")); err == nil {
		s := filepath.Join(repo, "snapshots", strings.TrimSpace(string(b)))
		if st, err := os.Stat(s); err == nil && st.IsDir() {
			return s, true
		}
	}
	ents, err := os.ReadDir(filepath.Join(repo, "snapshots"))
	if err != nil || len(ents) != 1 || !ents[0].IsDir() {
		return "", false
	}
	return filepath.Join(repo, "snapshots", ents[0].Name()), true
}
