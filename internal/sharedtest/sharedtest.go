// Package sharedtest gives tests the shared data beside the repository
// (../shared next to the repository root, or $MOONCAKE_SHARED): the
// stories260K model and llama2.c's reference outputs for it. A test that
// needs them skips with a message saying what is missing.
package sharedtest

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

// Dir is the shared folder; the test skips if it is absent.
func Dir(tb testing.TB) string {
	tb.Helper()
	d := os.Getenv("MOONCAKE_SHARED")
	if d == "" {
		d = filepath.Join(repoRoot(tb), "..", "shared")
	}
	if _, err := os.Stat(d); err != nil {
		tb.Skipf("shared test data not found at %s (set MOONCAKE_SHARED): %v", d, err)
	}
	return d
}

func repoRoot(tb testing.TB) string {
	dir, err := os.Getwd()
	if err != nil {
		tb.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			tb.Fatal("sharedtest: no go.mod above the test directory")
		}
		dir = parent
	}
}

// Stories260K returns the paths of stories260K.bin and its tok512.bin; the
// test skips if they are absent.
func Stories260K(tb testing.TB) (model, tokenizer string) {
	tb.Helper()
	dir := filepath.Join(Dir(tb), "models", "stories260K")
	model, tokenizer = filepath.Join(dir, "stories260K.bin"), filepath.Join(dir, "tok512.bin")
	for _, p := range []string{model, tokenizer} {
		if _, err := os.Stat(p); err != nil {
			tb.Skipf("stories260K not found (set MOONCAKE_SHARED): %v", err)
		}
	}
	return model, tokenizer
}

// Case is one prompt of the reference file: what llama2.c's run.c produced
// greedily with stories260K.
type Case struct {
	Prompt           string    `json:"prompt"`
	PromptIDs        []int32   `json:"prompt_ids"`
	GreedyNextIDs    []int32   `json:"greedy_next_ids"`
	Text             string    `json:"text"`
	LastPromptLogits []float32 `json:"last_prompt_logits"`
}

// Reference loads reference/stories260K-greedy.json; the test skips if it
// is absent.
func Reference(tb testing.TB) []Case {
	tb.Helper()
	b, err := os.ReadFile(filepath.Join(Dir(tb), "reference", "stories260K-greedy.json"))
	if err != nil {
		tb.Skipf("reference outputs not found (set MOONCAKE_SHARED): %v", err)
	}
	var r struct {
		Cases []Case `json:"cases"`
	}
	if err := json.Unmarshal(b, &r); err != nil {
		tb.Fatalf("sharedtest: reference file: %v", err)
	}
	return r.Cases
}

// Ints converts ids for APIs that take []int.
func Ints(ids []int32) []int {
	out := make([]int, len(ids))
	for i, v := range ids {
		out[i] = int(v)
	}
	return out
}
