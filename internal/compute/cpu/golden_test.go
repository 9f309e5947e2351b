package cpu

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/model"
)

// goldenDir holds the transformers fixtures (scripts/golden.sh).
const goldenDir = "../../model/testdata/golden"

type goldenFixture struct {
	Shape         string `json:"shape"`
	Architecture  string `json:"architecture"`
	WeightsSHA256 string `json:"weights_sha256"`
	Transformers  string `json:"transformers"`
	Prompts       []struct {
		IDs     []int32      `json:"ids"`
		Float32 goldenResult `json:"float32"`
	} `json:"prompts"`
}

type goldenResult struct {
	Top    [][2]float64 `json:"top"` // [id, logit]
	Sum    float64      `json:"sum"`
	SumSq  float64      `json:"sumsq"`
	Greedy []int32      `json:"greedy"`
}

// TestGolden checks every tiny architecture, written as convert --random
// writes it (seed 0) and loaded from disk, against transformers' float32
// run of the same directory: the last-position logits within 1e-4 (the top
// ones one by one, all of them through their sum and sum of squares) and
// the greedy continuation token for token.
func TestGolden(t *testing.T) {
	shapes := model.TinyShapes()
	names := make([]string, 0, len(shapes))
	for n := range shapes {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			b, err := os.ReadFile(filepath.Join(goldenDir, name+".json"))
			if errors.Is(err, fs.ErrNotExist) {
				t.Skipf("no transformers fixture for %s yet: make it with scripts/golden.sh (on a machine with PyTorch) "+
					"and commit it as internal/model/testdata/golden/%s.json", name, name)
			}
			if err != nil {
				t.Fatal(err)
			}
			var f goldenFixture
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
			if m.Config.ArchName() != f.Architecture || f.Architecture != shapes[name] {
				t.Fatalf("architecture %s, fixture %s, shape table %s", m.Config.ArchName(), f.Architecture, shapes[name])
			}
			per := 8
			be := newBackend(t, m, 16, per, 1)
			worst := 0.0
			for i, p := range f.Prompts {
				want := p.Float32
				logits := greedy(t, be, p.IDs, pagesFor(0, per), 0, len(want.Greedy))
				last := logits[0]
				for _, top := range want.Top {
					d := math.Abs(float64(last[int(top[0])]) - top[1])
					worst = max(worst, d)
					if d > 1e-4 {
						t.Errorf("prompt %d (%d tokens): logit of %d is %v, transformers %v", i, len(p.IDs), int(top[0]), last[int(top[0])], top[1])
					}
				}
				var sum, sq float64
				for _, v := range last {
					sum += float64(v)
					sq += float64(v) * float64(v)
				}
				if math.Abs(sum-want.Sum) > 1e-4*math.Sqrt(float64(len(last))) || math.Abs(sq-want.SumSq) > 1e-4*math.Sqrt(want.SumSq*float64(len(last)))*2 {
					t.Errorf("prompt %d: logits sum %v sum of squares %v, transformers %v %v", i, sum, sq, want.Sum, want.SumSq)
				}
				got := make([]int32, len(want.Greedy))
				for s := range got {
					got[s] = argmax(logits[s])
				}
				if !equalIDs(got, want.Greedy) {
					t.Errorf("prompt %d: greedy %v, transformers %v", i, got, want.Greedy)
				}
			}
			t.Logf("%s (%s): max |logit - transformers %s float32| over the top %d: %.2g", name, f.Architecture,
				f.Transformers, len(f.Prompts[0].Float32.Top), worst)
		})
	}
}

func weightsSHA256(t *testing.T, dir string) string {
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	h := sha256.New()
	for _, e := range ents { // ReadDir sorts by name, as the script does
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

func equalIDs(a, b []int32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
