package tokenizer

import (
	"path/filepath"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/sharedtest"
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

// sharedDir is the shared test data folder (the test skips if absent).
func sharedDir(t testing.TB) string { return sharedtest.Dir(t) }
