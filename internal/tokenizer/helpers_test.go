package tokenizer

import (
	"os"
	"path/filepath"
	"testing"
)

// repoRoot is two levels above this package.
func repoRoot(t testing.TB) string {
	t.Helper()
	r, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// sharedDir finds ../shared (or $MOONCAKE_SHARED) and skips the test if it is absent.
func sharedDir(t testing.TB) string {
	t.Helper()
	d := os.Getenv("MOONCAKE_SHARED")
	if d == "" {
		d = filepath.Join(repoRoot(t), "..", "shared")
	}
	if _, err := os.Stat(d); err != nil {
		t.Skipf("shared data not found at %s (set MOONCAKE_SHARED): %v", d, err)
	}
	return d
}
