package computetest

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/model"
)

// GoldenDir holds transformers' fixtures of the tiny architectures
// (scripts/golden.sh), relative to a backend package's directory
// (internal/compute/<backend>).
const GoldenDir = "../../model/testdata/golden"

// Golden is one fixture: transformers' runs of a tiny shape written as
// convert --random writes it (seed 0).
type Golden struct {
	Shape         string `json:"shape"`
	Architecture  string `json:"architecture"`
	WeightsSHA256 string `json:"weights_sha256"`
	Transformers  string `json:"transformers"`
	Prompts       []struct {
		IDs      []int32      `json:"ids"`
		Float32  GoldenResult `json:"float32"`
		BFloat16 GoldenResult `json:"bfloat16"`
	} `json:"prompts"`
}

// GoldenResult is one prompt's run in one dtype: the last position's top
// logits, the sum and sum of squares of all of them, and the greedy ids.
type GoldenResult struct {
	Top    [][2]float64 `json:"top"` // [id, logit]
	Sum    float64      `json:"sum"`
	SumSq  float64      `json:"sumsq"`
	Greedy []int32      `json:"greedy"`
}

// GoldenShapes are the tiny shapes, sorted.
func GoldenShapes() []string {
	var names []string
	for n := range model.TinyShapes() {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// LoadGolden reads name's fixture, writes the shape's random weights to a
// temporary directory as convert --random does, checks they are the ones
// transformers ran, and loads them (closed at the test's end). It skips
// the test when name has no fixture.
func LoadGolden(t *testing.T, name string) (Golden, *model.Model) {
	t.Helper()
	var f Golden
	b, err := os.ReadFile(filepath.Join(GoldenDir, name+".json"))
	if errors.Is(err, fs.ErrNotExist) {
		t.Skipf("no transformers fixture for %s yet: make it with scripts/golden.sh (on a machine with PyTorch) "+
			"and commit it as internal/model/testdata/golden/%s.json", name, name)
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &f); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := model.WriteRandom(name, dir, 0, ""); err != nil {
		t.Fatal(err)
	}
	if sum := weightsSHA256(t, dir); sum != f.WeightsSHA256 {
		t.Fatalf("the weights convert --random writes for %s (sha256 %s) are not those of the fixture (%s): "+
			"the generator changed; remake the fixture with scripts/golden.sh", name, sum, f.WeightsSHA256)
	}
	m, err := model.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	if arch, want := m.Config.ArchName(), model.TinyShapes()[name]; arch != f.Architecture || f.Architecture != want {
		t.Fatalf("architecture %s, fixture %s, shape table %s", arch, f.Architecture, want)
	}
	return f, m
}

// weightsSHA256 hashes dir's safetensors files in name order, as
// scripts/golden.py does.
func weightsSHA256(t *testing.T, dir string) string {
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	h := sha256.New()
	for _, e := range ents { // ReadDir sorts by name
		if strings.HasSuffix(e.Name(), ".safetensors") {
			b, err := os.ReadFile(filepath.Join(dir, e.Name()))
			if err != nil {
				t.Fatal(err)
			}
			h.Write(b)
		}
	}
	return hex.EncodeToString(h.Sum(nil))
}
