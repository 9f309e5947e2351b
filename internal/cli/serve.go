package cli

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/disagg"
	"github.com/mooncake-go/mooncake-go/internal/dp"
	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/server"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

type serveFlags struct {
	transferFlags
	modelPath, tokenizerPath, servedName string
	host                                 string
	port                                 int
	device, dtype, mode                  string
	bootstrapPort, transferPort          int
	baseGPU, tpSize, pageSize            int
	memFraction                          float64
	maxTotalTokens, maxRunning, chunked  int
	maxQueued                            int
	readTimeout                          time.Duration
	threads                              int
	disaggTimeout, maxQueueWait          time.Duration
	pushByLayer, noRadixCache            bool
	seed                                 int64
	debugFault                           string
	profiling                            bool
	randomWeights                        string
	disableCUDAGraph                     bool
	disableOverlap                       bool
	cudaGraphMaxBS                       int
	gpuFlagsSet                          []string // GPU-only flags given (the cpu backend warns it ignores them)
	allowDirect, allowUnsigned           bool
	// SGLang's flags: those that work, and those accepted without effect.
	dpSize, nnodes, contextLength int
	enableMetrics                 bool
	apiKey, config                string
	compat                        compatValues
	args                          map[string]any // the flags by SGLang's names, for /get_server_args
}

// maxTP bounds --tp-size.
const maxTP = 64

// cudaChunkedPrefill is --chunked-prefill-size's default on the cuda
// backend. Measured on one H200 (llama3-8b shape, 1K prompts, 128 outputs,
// docs/BENCHMARKS.md, 2026-12-02): 512 / 2048 / 8192 gave 2346 / 2383 /
// 2406 tok/s at concurrency 32 and 3001 / 3291 / 3381 at 128, ITL p99 23-30
// / 58-65 / 190-215 ms: 2048 takes most of the throughput for a third of
// 8192's stalls.
const cudaChunkedPrefill = 2048

// gpuOnlyFlags are serve's flags that only the cuda backend uses.
var gpuOnlyFlags = []string{"base-gpu-id", "mem-fraction-static", "disable-cuda-graph", "cuda-graph-max-bs", "disable-overlap-schedule"}

func newServeCmd(g *globals) *cobra.Command {
	var f serveFlags
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Serve a model (colocated, or as the prefill or decode side of a disaggregated pair)",
		Args:  cobra.NoArgs,
		Long: "Serve a model (colocated, or as the prefill or decode side of a disaggregated pair).\n\n" +
			"SGLang's launch_server flags are accepted by their names (--tp, --dp-size, --context-length,\n" +
			"--enable-metrics, --trust-remote-code, ...): those without an effect here are hidden from this list\n" +
			"and get one warning each, naming them and why (docs/cli.md lists them).",
		RunE: g.withLogger(func(cmd *cobra.Command, lg *zap.Logger) error {
			if f.config != "" {
				if err := applyConfig(cmd.Flags(), f.config); err != nil {
					return err
				}
			}
			f.gpuFlagsSet = nil
			for _, n := range gpuOnlyFlags {
				if cmd.Flags().Changed(n) {
					f.gpuFlagsSet = append(f.gpuFlagsSet, "--"+n)
				}
			}
			f.compat.warn(cmd.Flags(), lg)
			f.args = serverArgs(cmd.Flags())
			mc, err := readMC(g.environ(), lg)
			if err != nil {
				return err
			}
			f.mc = mc
			if cmd.Flags().Changed("disaggregation-ib-device") && f.backend != "rdma" && f.backend != "auto" && f.backend != "mooncake" && f.backend != "" {
				lg.Warn("--disaggregation-ib-device has no effect with --disaggregation-transfer-backend "+f.backend+" (only auto and rdma use RDMA)",
					zap.String("device", f.ibDevice))
			}
			return runServe(cmd.Context(), &f, lg, cmd.OutOrStdout())
		}),
	}
	fl := cmd.Flags()
	fl.StringVar(&f.modelPath, "model-path", "", "HF directory or llama2.c checkpoint (default: the built-in random-weight model)")
	fl.StringVar(&f.modelPath, "model", "", "same as --model-path (SGLang's alias)")
	_ = fl.MarkHidden("model")
	fl.StringVar(&f.tokenizerPath, "tokenizer-path", "", "llama2.c tokenizer.bin (for llama2.c checkpoints)")
	fl.StringVar(&f.servedName, "served-model-name", "", "model name in the API (default: the model path)")
	fl.StringVar(&f.host, "host", "127.0.0.1", "listen host (HTTP, bootstrap and transfer engine)")
	fl.IntVar(&f.port, "port", 30000, "HTTP port")
	fl.StringVar(&f.device, "device", "auto", "auto, cpu or cuda")
	fl.StringVar(&f.dtype, "dtype", "auto", "auto, float32 or bfloat16")
	fl.StringVar(&f.mode, "disaggregation-mode", "null", "null (colocated), prefill or decode")
	fl.IntVar(&f.bootstrapPort, "disaggregation-bootstrap-port", 8998, "prefill bootstrap server port (0 picks a free one)")
	fl.StringVar(&f.backend, "disaggregation-transfer-backend", "auto", "auto, tcp, shm, nvlink (GPU memory; host memory over shm) or rdma")
	fl.StringVar(&f.ibDevice, "disaggregation-ib-device", "", `RDMA devices: "mlx5_0,mlx5_1", a JSON object from GPU id to devices, or a file holding one (default: every device found)`)
	fl.DurationVar(&f.disaggTimeout, "disaggregation-timeout", 10*time.Second, "bound on a request's bootstrap and KV wait, from when its pages are reserved")
	fl.DurationVar(&f.maxQueueWait, "max-queue-wait", engine.DefaultMaxQueueWait, "bound on a request's wait for KV pages in the admission queue")
	fl.BoolVar(&f.pushByLayer, "disaggregation-push-by-layer", false, "prefill: push each layer's KV as soon as the layer is computed, overlapping the push with the rest of the pass")
	fl.IntVar(&f.transferPort, "transfer-port", 0, "transfer engine port (0 picks a free one; the segment name is host:port)")
	fl.StringVar(&f.metadata, "metadata-server", "p2p", "p2p, embedded, etcd://host:port or http://host:port/metadata")
	f.secretFlags.register(fl)
	fl.DurationVar(&f.timeout, "transfer-timeout", 5*time.Second, "bound on one transfer batch")
	fl.IntVar(&f.baseGPU, "base-gpu-id", 0, "first GPU to use")
	fl.IntVar(&f.tpSize, "tp-size", 1, "tensor parallel ranks (cpu: ranks of this process sharing --threads; cuda: GPUs --base-gpu-id onwards, one rank each, NCCL between them)")
	fl.IntVar(&f.tpSize, "tp", 1, "same as --tp-size")
	fl.IntVar(&f.tpSize, "tensor-parallel-size", 1, "same as --tp-size")
	_ = fl.MarkHidden("tensor-parallel-size")
	fl.IntVar(&f.dpSize, "dp-size", 1, "data-parallel engine replicas behind this server (colocated only; each a share of --threads, or GPU --base-gpu-id+i)")
	fl.IntVar(&f.dpSize, "dp", 1, "same as --dp-size")
	fl.IntVar(&f.dpSize, "data-parallel-size", 1, "same as --dp-size")
	_ = fl.MarkHidden("dp")
	_ = fl.MarkHidden("data-parallel-size")
	fl.IntVar(&f.nnodes, "nnodes", 1, "nodes of one tensor-parallel server (only 1)")
	fl.IntVar(&f.contextLength, "context-length", 0, "context length in tokens, prompt and output (default: the model's; it may only lower it)")
	fl.BoolVar(&f.enableMetrics, "enable-metrics", false, "accepted for SGLang's scripts: metrics are always on, on /metrics")
	fl.StringVar(&f.apiKey, "api-key", "", "require \"Authorization: Bearer KEY\" on every endpoint but /health, /health_generate and /metrics")
	fl.IntVar(&f.pageSize, "page-size", 0, "tokens per KV page (default 64 on cpu)")
	fl.Float64Var(&f.memFraction, "mem-fraction-static", 0, "share of the device memory for weights + KV pool (cuda)")
	fl.IntVar(&f.maxTotalTokens, "max-total-tokens", 0, "KV pool size in tokens (cpu default: 32768, at most a quarter of RAM; cuda default: from --mem-fraction-static)")
	fl.IntVar(&f.maxRunning, "max-running-requests", 0, "requests in the running batch (default 64)")
	fl.IntVar(&f.maxQueued, "max-queued-requests", engine.DefaultMaxQueue, "requests waiting for admission; beyond them requests get 503 with Retry-After")
	fl.DurationVar(&f.readTimeout, "http-read-timeout", server.DefaultReadTimeout, "bound on reading an HTTP request, headers and body (not on its response)")
	fl.IntVar(&f.chunked, "chunked-prefill-size", 0, fmt.Sprintf("prompt tokens per prefill step (default %d on cpu, %d on cuda; -1 = unlimited)", engine.DefaultChunkedPrefillSize, cudaChunkedPrefill))
	fl.BoolVar(&f.noRadixCache, "disable-radix-cache", false, "do not cache finished requests' KV for reuse by later prompts with the same prefix")
	fl.IntVar(&f.threads, "threads", 0, "CPU threads for the forward pass (default: all cores)")
	fl.BoolVar(&f.disableCUDAGraph, "disable-cuda-graph", false, "run decode steps eagerly instead of replaying CUDA graphs (cuda)")
	fl.BoolVar(&f.disableOverlap, "disable-overlap-schedule", false, "run each forward pass to its end before building the next, instead of queuing the next decode step on the GPU while the host reads this one's tokens (cuda)")
	fl.IntVar(&f.cudaGraphMaxBS, "cuda-graph-max-bs", 256, "largest decode batch replayed from a CUDA graph, larger ones run eagerly (cuda; at most --max-running-requests)")
	fl.Int64Var(&f.seed, "random-seed", 0, "seed for requests without one")
	fl.BoolVar(&f.profiling, "enable-profiling", false, "serve Go profiles under /debug/pprof/")
	fl.StringVar(&f.randomWeights, "random-weights", "", "serve seeded random weights of a named shape ("+strings.Join(model.RandomShapes(), ", ")+
		"), made on the GPU with --device cuda: for benchmarks of large shapes without a model directory")
	fl.BoolVar(&f.allowDirect, "allow-direct-requests", false, "prefill or decode: serve requests that did not come through the LB (no bootstrap fields) by computing them here, whole")
	fl.BoolVar(&f.allowUnsigned, "allow-unsigned-bootstrap", false, "prefill or decode: take bootstrap fields without the LB's voucher (another router, such as SGLang's, in front)")
	fl.StringVar(&f.debugFault, "debug-fault", "", "fault injection for tests: transfer (a prefill's KV transfers fail)")
	_ = fl.MarkHidden("debug-fault")
	fl.StringVar(&f.config, "config", "", "SGLang's YAML config file of flags (flag: value); flags on the command line win")
	f.compat = registerCompat(fl)
	return cmd
}

func (f *serveFlags) validate(lg *zap.Logger) error {
	switch f.mode {
	case "null", "prefill", "decode":
	default:
		return fmt.Errorf("--disaggregation-mode %q: want null, prefill or decode", f.mode)
	}
	if f.tpSize < 1 || f.tpSize > maxTP {
		return fmt.Errorf("--tp-size %d: want 1 to %d ranks", f.tpSize, maxTP)
	}
	switch {
	case f.dpSize < 1 || f.dpSize > 64:
		return fmt.Errorf("--dp-size %d: want 1 to 64 replicas", f.dpSize)
	case f.dpSize > 1 && f.mode != "null":
		return fmt.Errorf("--dp-size %d with --disaggregation-mode %s: data-parallel replicas run colocated only; run %d %s servers (one --base-gpu-id and --port each) behind mooncake-go lb", f.dpSize, f.mode, f.dpSize, f.mode)
	}
	if f.nnodes != 1 {
		return fmt.Errorf("--nnodes %d: multi-node tensor parallelism is not implemented (only 1)", f.nnodes)
	}
	if f.contextLength < 0 {
		return fmt.Errorf("--context-length %d: want a positive number of tokens (0: the model's)", f.contextLength)
	}
	switch f.dtype {
	case "auto", "float32", "bfloat16":
	case "float", "bf16":
		f.dtype = map[string]string{"float": "float32", "bf16": "bfloat16"}[f.dtype]
	case "half", "float16", "fp16":
		return fmt.Errorf("--dtype %s: float16 is not supported; use bfloat16 (or float32)", f.dtype)
	default:
		return fmt.Errorf("--dtype %q: want auto, float32 or bfloat16", f.dtype)
	}
	switch f.device {
	case "auto", "cpu", "cuda":
	case "xpu", "hpu", "npu", "mps":
		return fmt.Errorf("--device %s: only NVIDIA GPUs (cuda) and the cpu are supported", f.device)
	default:
		return fmt.Errorf("--device %q: want auto, cpu or cuda", f.device)
	}
	if f.port < 0 || f.port > 65535 {
		return fmt.Errorf("--port %d out of range", f.port)
	}
	if f.bootstrapPort < 0 || f.bootstrapPort > 65535 {
		return fmt.Errorf("--disaggregation-bootstrap-port %d out of range", f.bootstrapPort)
	}
	if f.pageSize < 0 || f.maxTotalTokens < 0 || f.threads < 0 {
		return errors.New("--page-size, --max-total-tokens and --threads must not be negative")
	}
	if f.cudaGraphMaxBS < 1 {
		return fmt.Errorf("--cuda-graph-max-bs %d: want at least 1 (--disable-cuda-graph turns the graphs off)", f.cudaGraphMaxBS)
	}
	if f.maxQueued < 1 {
		return fmt.Errorf("--max-queued-requests %d: want at least 1", f.maxQueued)
	}
	if f.readTimeout <= 0 {
		return fmt.Errorf("--http-read-timeout %v: want a positive duration", f.readTimeout)
	}
	if f.memFraction < 0 || f.memFraction >= 1 {
		return fmt.Errorf("--mem-fraction-static %v: want a fraction in [0, 1)", f.memFraction)
	}
	if _, err := f.transports("--disaggregation-transfer-backend", lg, nil); err != nil {
		return err
	}
	switch f.debugFault {
	case "":
	case "transfer":
		if f.mode != "prefill" {
			return fmt.Errorf("--debug-fault transfer needs --disaggregation-mode prefill")
		}
	default:
		return fmt.Errorf("--debug-fault %q: want transfer", f.debugFault)
	}
	return nil
}

// loadModel loads the model and its tokenizer from the flags.
func (f *serveFlags) loadModel() (*model.Model, tokenizer.Tokenizer, error) {
	if f.randomWeights == "" {
		return loadModel(f.modelPath, f.tokenizerPath)
	}
	if f.modelPath != "" {
		return nil, nil, errors.New("--random-weights and --model-path exclude each other")
	}
	tj, cj, err := tokenizer.ByteFallbackHFJSON()
	if err != nil {
		return nil, nil, err
	}
	tok, err := tokenizer.ParseHF(tj, cj)
	if err != nil {
		return nil, nil, err
	}
	if f.device == "cuda" {
		// The CUDA backend makes the weights on the GPU from the seed.
		cfg, err := model.RandomConfig(f.randomWeights)
		if err != nil {
			return nil, nil, fmt.Errorf("--random-weights: %w", err)
		}
		return &model.Model{Config: cfg, Random: true, Path: "random:" + f.randomWeights}, tok, nil
	}
	m, err := model.NewRandom(f.randomWeights, f.seed)
	if err != nil {
		return nil, nil, fmt.Errorf("--random-weights: %w", err)
	}
	return m, tok, nil
}

func loadModel(modelPath, tokPath string) (*model.Model, tokenizer.Tokenizer, error) {
	if modelPath == "" {
		return model.Builtin(), tokenizer.NewByteLevel(), nil
	}
	modelPath, err := resolveModelPath(modelPath, os.Getenv)
	if err != nil {
		return nil, nil, fmt.Errorf("--model-path %w", err)
	}
	st, err := os.Stat(modelPath)
	if err != nil {
		return nil, nil, fmt.Errorf("--model-path: %w", err)
	}
	m, err := model.Load(modelPath)
	if err != nil {
		return nil, nil, fmt.Errorf("--model-path %s: %w", modelPath, err)
	}
	if st.IsDir() {
		tok, err := tokenizer.LoadHF(modelPath)
		if err != nil {
			return nil, nil, fmt.Errorf("--model-path %s: tokenizer: %w", modelPath, err)
		}
		return m, tok, nil
	}
	if tokPath == "" {
		for _, c := range []string{"tokenizer.bin", "tok512.bin"} {
			p := filepath.Join(filepath.Dir(modelPath), c)
			if _, err := os.Stat(p); err == nil {
				tokPath = p
				break
			}
		}
		if tokPath == "" {
			return nil, nil, fmt.Errorf("--tokenizer-path is required for the llama2.c checkpoint %s", modelPath)
		}
	}
	tok, err := tokenizer.LoadLlama2C(tokPath, m.Config.Vocab)
	if err != nil {
		return nil, nil, fmt.Errorf("--tokenizer-path %s: %w", tokPath, err)
	}
	return m, tok, nil
}

// poolTokens is the CPU KV pool size in tokens.
func poolTokens(flag int, tokenBytes int64) int {
	if flag > 0 {
		return flag
	}
	n := int64(32768)
	if quarter := physMem() / 4 / tokenBytes; quarter < n {
		n = quarter
	}
	return int(max(n, 1024))
}

func physMem() int64 {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 8 << 30
	}
	var kb int64
	fmt.Sscanf(string(b), "MemTotal: %d kB", &kb)
	if kb == 0 {
		return 8 << 30
	}
	return kb << 10
}

func fingerprint(c model.Config) string {
	return fmt.Sprintf("%s dim=%d layers=%d heads=%d kv_heads=%d head_dim=%d vocab=%d", c.ArchName(), c.Dim, c.Layers, c.Heads, c.KVHeads, c.HeadDim, c.Vocab)
}

// servingStack is a running serve: what the command started, for shutdown
// in reverse order.
type servingStack struct {
	closers []func() error
}

func (s *servingStack) add(f func() error) { s.closers = append(s.closers, f) }

func (s *servingStack) close(lg *zap.Logger) {
	for i := len(s.closers) - 1; i >= 0; i-- {
		if err := s.closers[i](); err != nil {
			lg.Warn("shutdown", zap.Error(err))
		}
	}
}

func runServe(ctx context.Context, f *serveFlags, lg *zap.Logger, out io.Writer) error {
	if err := f.validate(lg); err != nil {
		return err
	}
	secret, err := f.resolve(lg, f.host)
	if err != nil {
		return err
	}
	f.secret = secret
	lg.Info("cluster secret", zap.String("source", secret.Source()), zap.String("fingerprint", secret.Fingerprint()))
	reg := newRegistry()
	st := &servingStack{}
	defer st.close(lg)

	httpLn, err := net.Listen("tcp", net.JoinHostPort(f.host, strconv.Itoa(f.port)))
	if err != nil {
		return fmt.Errorf("--port %d: %w", f.port, err)
	}
	st.add(func() error { httpLn.Close(); return nil })

	loadStart := time.Now()
	m, tok, err := f.loadModel()
	if err != nil {
		return err
	}
	st.add(m.Close) // after the backend (closed first) stops reading the mapped weights
	lg.Info("model loaded", zap.String("arch", m.Config.ArchName()), zap.String("dtype", m.Config.DType),
		zap.Duration("took", time.Since(loadStart)))
	name := f.servedName
	if name == "" {
		name = f.modelPath
		if f.randomWeights != "" {
			name = "random:" + f.randomWeights
		}
		if name == "" {
			name = "builtin"
		}
	}
	if m.Random {
		lg.Warn("serving a model with RANDOM weights", zap.String("model", name))
	}

	var dec atomic.Pointer[disagg.Decode]
	onNotify := func(n transfer.Notification) {
		if d := dec.Load(); d != nil {
			d.OnNotify(n)
		}
	}
	te, teClose, err := f.newTransferEngine(ctx, net.JoinHostPort(f.host, strconv.Itoa(f.transferPort)), "", lg, reg, onNotify,
		"--disaggregation-transfer-backend")
	if err != nil {
		return err
	}
	st.add(teClose.Close)

	ctxLen := m.Config.MaxSeqLen
	if c := f.contextLength; c > 0 {
		if ctxLen > 0 && c > ctxLen {
			return fmt.Errorf("--context-length %d is beyond the model's context length %d (it may only lower it)", c, ctxLen)
		}
		ctxLen = c
	}
	// One replica, or --dp-size of them (colocated only: validate), each
	// with its own backend, KV pool, prefix cache and engine.
	var (
		be      *backend
		cache   *kvcache.Radix
		eng     *engine.Engine
		engines []dp.Replica
		pages   int
	)
	for i := range f.dpSize {
		rf, rlg, rreg := f, lg, prometheus.Registerer(reg)
		if f.dpSize > 1 {
			c := *f
			c.baseGPU = f.baseGPU + i // one GPU each
			if c.threads = f.threads; c.threads == 0 {
				c.threads = runtime.GOMAXPROCS(0)
			}
			c.threads = max(1, c.threads/f.dpSize) // a share of the CPU each
			rf, rlg = &c, lg.With(zap.Int("dp_rank", i))
			rreg = prometheus.WrapRegistererWith(prometheus.Labels{"dp_rank": strconv.Itoa(i)}, reg)
		}
		rbe, err := newBackend(ctx, rf, m, te, rlg, rreg)
		if err != nil {
			if f.dpSize > 1 {
				return fmt.Errorf("--dp-size %d: replica %d: %w", f.dpSize, i, err)
			}
			return err
		}
		st.add(func() error { rbe.shutdown(rlg); return nil })
		var rcache *kvcache.Radix
		if !f.noRadixCache {
			rcache = kvcache.NewRadix(rbe.pages, rbe.layout.PageSize)
		}
		chunked := f.chunked
		if chunked == 0 {
			chunked = engine.DefaultChunkedPrefillSize
			if strings.HasPrefix(rbe.device, "cuda") {
				chunked = cudaChunkedPrefill
			}
		}
		if i == 0 && f.args != nil {
			f.args["chunked_prefill_size"] = int64(chunked) // the size in use, as SGLang reports it
		}
		reng, err := engine.New(engine.Config{
			Model: rbe.model, Pages: rbe.pages, Cache: rcache, Tokenizer: tok, MaxRunningRequests: f.maxRunning, MaxQueue: f.maxQueued,
			ChunkedPrefillSize: chunked, MaxQueueWait: f.maxQueueWait, MaxSeqLen: f.contextLength, DefaultSeed: f.seed, Logger: rlg, Registerer: rreg,
			DisableOverlap: f.disableOverlap,
		})
		if err != nil {
			return err
		}
		engCtx, engCancel := context.WithCancel(context.Background())
		engDone := make(chan error, 1)
		go func() { engDone <- reng.Run(engCtx) }()
		st.add(func() error { err := reng.Close(); engCancel(); <-engDone; return err })
		if i == 0 {
			be, cache, eng = rbe, rcache, reng
		}
		engines = append(engines, reng)
		pages += rbe.layout.Pages
	}
	layout, ps := be.layout, be.layout.PageSize
	var gen interface {
		server.Generator
		server.LoadReporter
	} = eng
	if f.dpSize > 1 {
		set, err := dp.New(engines...)
		if err != nil {
			return err
		}
		gen = set
		lg.Info("data-parallel replicas", zap.Int("dp_size", f.dpSize), zap.Int("kv_pages_each", layout.Pages))
	}

	info := disagg.Info{Model: name, Fingerprint: fingerprint(m.Config), DType: be.dtype, Layout: layout,
		Segment: te.Name(), Incarnation: te.Incarnation()}
	for r, s := range be.shards {
		info.Ranks = append(info.Ranks, disagg.Rank{Segment: te.Name(), PoolAddr: be.addrs[r], Shard: s})
	}
	extra := map[string]any{"transfer_segment": te.Name(), "kv_pages_total": pages, "page_size": ps,
		"device": be.device, "dtype": be.dtype, "tp_size": be.tp}
	var prepare func(ctx context.Context, req *engine.Request, b server.Bootstrap) error
	switch f.mode {
	case "prefill":
		var xfer disagg.Transfer = te
		if f.debugFault == "transfer" {
			xfer = faultTransfer{te}
		}
		pf, err := disagg.NewPrefill(ctx, disagg.PrefillConfig{Transfer: xfer, Info: info,
			Listen: net.JoinHostPort(f.host, strconv.Itoa(f.bootstrapPort)), Timeout: f.disaggTimeout, QueueWait: f.maxQueueWait,
			Secret: secret, Logger: lg, Registerer: reg, PushByLayer: f.pushByLayer})
		if err != nil {
			return err
		}
		if f.debugFault != "" {
			lg.Warn("fault injection on: every KV transfer will fail", zap.String("fault", f.debugFault))
		}
		st.add(pf.Close)
		extra["bootstrap_port"] = pf.Port()
		prepare = func(ctx context.Context, req *engine.Request, b server.Bootstrap) error {
			return pf.Prepare(ctx, req, b.Room)
		}
	case "decode":
		d, err := disagg.NewDecode(ctx, disagg.DecodeConfig{Transfer: te, Info: info, Pages: be.pages, PagesFor: eng.KVPages, Cache: cache,
			Timeout: f.disaggTimeout, QueueWait: f.maxQueueWait, Secret: secret, Logger: lg, Registerer: reg})
		if err != nil {
			return err
		}
		dec.Store(d)
		st.add(d.Close)
		prepare = func(ctx context.Context, req *engine.Request, b server.Bootstrap) error {
			if b.Host == "" || b.Port == 0 {
				return &server.Error{Status: 400, Message: "bootstrap_host and bootstrap_port are required on a decode server"}
			}
			return d.Prepare(ctx, req, b.Host, b.Port, b.Room)
		}
	}
	srv, err := server.New(server.Config{
		Generator: gen, Tokenizer: tok, ModelName: name, ModelPath: f.modelPath, TokenizerPath: cmp.Or(f.tokenizerPath, f.modelPath),
		RandomWeights: m.Random, ContextLen: ctxLen, Mode: f.mode, ReadTimeout: f.readTimeout, Logger: lg, Gatherer: reg, Registerer: reg,
		PrefixCache: cache != nil, PageSize: ps, ServerArgs: f.args, Version: version(), APIKey: f.apiKey,
		Info: func() map[string]any {
			s := gen.Stats()
			out := map[string]any{"queued": s.Queued, "running": s.Running, "kv_pages_free": s.FreePages, "kv_pages_cached": s.CachedPages}
			for k, v := range extra {
				out[k] = v
			}
			return out
		},
		PrepareDisagg: prepare, Profiling: f.profiling,
		// No cluster secret (--insecure-no-cluster-token): no vouchers to check.
		Vouchers: server.VoucherPolicy{Secret: f.secret, AllowUnsigned: f.allowUnsigned || f.secret.IsZero(), AllowDirect: f.allowDirect},
	})
	if err != nil {
		return err
	}
	go logTransferRate(ctx, f.mc, reg, lg)
	lg.Info("serving", zap.String("addr", httpLn.Addr().String()), zap.String("mode", f.mode), zap.String("model", name),
		zap.String("segment", te.Name()), zap.Int("kv_pages", pages), zap.Int("page_size", ps), zap.Any("info", extra["bootstrap_port"]))
	fmt.Fprintf(out, "listening on %s\n", httpLn.Addr())
	return srv.Serve(ctx, httpLn)
}

// faultTransfer is --debug-fault transfer: every KV write targets an
// address far outside the decode's registered regions, so the transfer
// engine refuses it for real.
type faultTransfer struct{ *transfer.Engine }

func (t faultTransfer) Transfer(ctx context.Context, reqs []transfer.Request) error {
	bad := slices.Clone(reqs)
	for i := range bad {
		bad[i].Remote = 1 << 62
	}
	return t.Engine.Transfer(ctx, bad)
}

// secretFlags are never reported by /get_server_args.
var secretFlagsSet = map[string]bool{"cluster-token": true, "api-key": true}

// serverArgs are serve's flags by SGLang's names (dashes as underscores), typed:
// the shown ones and the hidden ones given.
func serverArgs(fl *pflag.FlagSet) map[string]any {
	out := map[string]any{}
	fl.VisitAll(func(f *pflag.Flag) {
		if secretFlagsSet[f.Name] || (f.Hidden && !f.Changed) {
			return
		}
		var v any = f.Value.String()
		switch f.Value.Type() {
		case "int", "int64":
			if n, err := strconv.ParseInt(f.Value.String(), 10, 64); err == nil {
				v = n
			}
		case "float64":
			if x, err := strconv.ParseFloat(f.Value.String(), 64); err == nil {
				v = x
			}
		case "bool":
			v = f.Value.String() == "true"
		}
		out[strings.ReplaceAll(f.Name, "-", "_")] = v
	})
	return out
}
