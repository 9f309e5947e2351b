package cuda

import (
	"bufio"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/model"
)

// TestLoadPeakHF measures the host memory a CUDA backend takes to load the
// HF directory MOONCAKE_HF_DIR (bf16 safetensors): VmHWM once a backend of a
// tiny random model exists (the driver, NVRTC, cuBLAS: what any load pays),
// then after model.LoadHF and New on the directory, against the size of its
// safetensors files; the part above the first must stay within 1.1x the
// files. VmHWM counts the mapped files' resident pages. MOONCAKE_LOAD_PEAK=1;
// run it alone in its process (VmHWM is the process's high-water mark).
func TestLoadPeakHF(t *testing.T) {
	dir := os.Getenv("MOONCAKE_HF_DIR")
	if dir == "" || os.Getenv("MOONCAKE_LOAD_PEAK") == "" {
		t.Skip("set MOONCAKE_LOAD_PEAK=1 and MOONCAKE_HF_DIR")
	}
	tiny, err := model.NewRandom("tiny-qwen3", 1)
	if err != nil {
		t.Fatal(err)
	}
	newOrSkip(t, tiny, Options{PageSize: 16, Pages: 16})
	base := procStatusKiB(t, "VmHWM")
	files, _ := filepath.Glob(filepath.Join(dir, "*.safetensors"))
	var size int64
	for _, f := range files {
		st, err := os.Stat(f)
		if err != nil {
			t.Fatal(err)
		}
		size += st.Size()
	}
	t0 := time.Now()
	m, err := model.LoadHF(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	newOrSkip(t, m, Options{PageSize: 64, Pages: 64})
	took := time.Since(t0)
	peak := procStatusKiB(t, "VmHWM")
	net := float64(peak-base) * 1024 / float64(size)
	t.Logf("host peak loading %s (%s, %.2f GB of safetensors in %d files) onto the GPU: VmHWM %.2f GB, %.2f GB above the %.2f GB of a tiny model's backend = %.3fx the files (goal <= 1.1x; gross %.3fx); load and upload %v",
		filepath.Base(dir), m.Config.ArchName(), float64(size)/1e9, len(files), float64(peak)*1024/1e9,
		float64(peak-base)*1024/1e9, float64(base)*1024/1e9, net, float64(peak)*1024/float64(size), took)
	if net > 1.1 {
		t.Errorf("host peak %.3fx the files, want <= 1.1x", net)
	}
}

// procStatusKiB reads a field of /proc/self/status in KiB (VmHWM, VmRSS).
func procStatusKiB(t *testing.T, field string) int64 {
	t.Helper()
	f, err := os.Open("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), ":"); ok && k == field {
			n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no %s in /proc/self/status", field)
	return 0
}
