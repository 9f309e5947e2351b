package cuda

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/csrc"
)

// KernelsConfig configures run-time kernel compilation. Zero values: the
// cache lives in $XDG_CACHE_HOME/mooncake-go/kernels (~/.cache/...); no logs.
type KernelsConfig struct {
	CacheDir     string      // where compiled images are kept
	DisableCache bool        // compile every time, write nothing
	Options      []string    // extra NVRTC options for every kernel set
	Logger       *zap.Logger // nil: no logs
}

// Kernels compiles the CUDA C kernel sets embedded in package csrc with NVRTC
// for each device's compute capability, caches the images on disk under
// sha256(source, arch, NVRTC version, options), and loads them as modules.
// Safe for concurrent use.
type Kernels struct {
	nv  *NVRTC
	dir string
	cfg KernelsConfig
	lg  *zap.Logger
	mu  sync.Mutex
}

// DefaultKernelCacheDir is ~/.cache/mooncake-go/kernels (or the XDG one).
func DefaultKernelCacheDir() string {
	d, err := os.UserCacheDir()
	if err != nil {
		d = os.TempDir()
	}
	return filepath.Join(d, "mooncake-go", "kernels")
}

// NewKernels loads NVRTC and prepares the cache.
func NewKernels(cfg KernelsConfig) (*Kernels, error) {
	nv, err := LoadNVRTC()
	if err != nil {
		return nil, err
	}
	k := &Kernels{nv: nv, cfg: cfg, lg: cfg.Logger, dir: cfg.CacheDir}
	if k.lg == nil {
		k.lg = zap.NewNop()
	}
	if k.dir == "" {
		k.dir = DefaultKernelCacheDir()
	}
	return k, nil
}

// NVRTC returns the compiler in use.
func (k *Kernels) NVRTC() *NVRTC { return k.nv }

// CacheDir is where images are cached.
func (k *Kernels) CacheDir() string { return k.dir }

// CacheKey is the file stem an image is cached under.
func (k *Kernels) CacheKey(src, arch string, opts []string) string {
	h := sha256.New()
	fmt.Fprintf(h, "%s\x00%s\x00nvrtc %d.%d\x00%s", src, arch, k.nv.Major, k.nv.Minor,
		strings.Join(append(append([]string{}, k.cfg.Options...), opts...), "\x01"))
	return hex.EncodeToString(h.Sum(nil))
}

// Compile returns the image of src for arch, from the cache or NVRTC.
func (k *Kernels) Compile(name, src, arch string, opts ...string) ([]byte, error) {
	key := k.CacheKey(src, arch, opts)
	ext := ".cubin"
	if strings.HasPrefix(arch, "compute_") {
		ext = ".ptx"
	}
	path := filepath.Join(k.dir, key+ext)
	if !k.cfg.DisableCache {
		if b, err := os.ReadFile(path); err == nil && len(b) > 0 {
			return b, nil
		}
	}
	allOpts := append(append([]string{}, k.cfg.Options...), opts...)
	img, log, err := k.nv.Compile(src, name+".cu", arch, allOpts...)
	if err != nil {
		return nil, fmt.Errorf("cuda: compile %s for %s: %w", name, arch, err)
	}
	if log = strings.TrimSpace(log); log != "" {
		k.lg.Debug("nvrtc log", zap.String("kernel", name), zap.String("log", log))
	}
	if !k.cfg.DisableCache {
		if err := writeAtomic(k.dir, path, img); err != nil {
			k.lg.Warn("kernel cache not written", zap.String("path", path), zap.Error(err))
		}
	}
	return img, nil
}

func writeAtomic(dir, path string, b []byte) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(dir, ".tmp-*")
	if err != nil {
		return err
	}
	_, werr := f.Write(b)
	cerr := f.Close()
	if err := errors.Join(werr, cerr); err != nil {
		os.Remove(f.Name())
		return err
	}
	return os.Rename(f.Name(), path)
}

// Load compiles (or finds in the cache) the embedded kernel set name (a .cu
// file of package csrc, e.g. csrc.CopyKernels) for c's device and loads it.
// It tries CUBIN for sm_XY first and falls back to PTX for compute_XY when
// the driver rejects the CUBIN.
func (k *Kernels) Load(c *Context, name string, opts ...string) (*Module, error) {
	src, err := csrc.Kernel(name)
	if err != nil {
		return nil, fmt.Errorf("cuda: kernel set %q: %w", name, err)
	}
	return k.LoadSource(c, name, src, opts...)
}

// LoadSourceSpecific is LoadSource for the device's architecture-specific
// target (sm_90a on a compute capability 9.0 device: wgmma, setmaxnreg),
// whose CUBIN loads on that architecture alone; no PTX fallback.
func (k *Kernels) LoadSourceSpecific(c *Context, name, src string, opts ...string) (*Module, error) {
	major, minor, err := c.dev.ComputeCapability()
	if err != nil {
		return nil, err
	}
	if major < 9 {
		return nil, fmt.Errorf("cuda: %s: no architecture-specific target below compute capability 9.0 (device %d.%d)", name, major, minor)
	}
	img, err := k.Compile(name, src, Arch(major, minor, false)+"a", opts...)
	if err != nil {
		return nil, err
	}
	return c.LoadModule(img)
}

// LoadSource is Load for source held elsewhere.
func (k *Kernels) LoadSource(c *Context, name, src string, opts ...string) (*Module, error) {
	major, minor, err := c.dev.ComputeCapability()
	if err != nil {
		return nil, err
	}
	img, err := k.Compile(name, src, Arch(major, minor, false), opts...)
	if err == nil {
		m, lerr := c.LoadModule(img)
		if lerr == nil {
			return m, nil
		}
		k.lg.Info("CUBIN rejected by the driver, trying PTX", zap.String("kernel", name), zap.Error(lerr))
		err = lerr
	}
	ptx, perr := k.Compile(name, src, Arch(major, minor, true), opts...)
	if perr != nil {
		return nil, errors.Join(err, perr)
	}
	return c.LoadModule(ptx)
}
