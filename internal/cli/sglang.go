package cli

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/spf13/pflag"
	"go.uber.org/zap"
	"sigs.k8s.io/yaml"
)

// SGLang's launch_server flags that serve accepts without using them: a script
// written for SGLang runs as it is, and each such flag given gets one warning
// naming it and why it has no effect here. Flags that work (--tp, --dp-size,
// --context-length, ...) are registered with serve's own.

// compatFlag is an SGLang flag serve accepts without effect.
type compatFlag struct {
	name string
	kind string // "bool", "value" (any one value) or "list" (one or more values, SGLang's nargs="+")
	why  string
	// ok, when set, lists values that need no warning (they are what serve does).
	ok []string
}

const (
	whyNoDist    = "this build serves one GPU per process (no tensor, pipeline, data or expert parallelism yet): run one server per GPU behind mooncake-go lb"
	whyNoMoE     = "Llama-family dense models only: no MoE expert parallelism"
	whyKernels   = "each backend has one implementation of every kernel (the CPU's assembly, the CUDA backend's NVRTC kernels)"
	whyNoLoRA    = "LoRA adapters are not supported"
	whyNoSpec    = "speculative decoding is not supported"
	whyNoHiCache = "the prefix cache lives in the KV pool only (no host or storage tier)"
	whyLogging   = "each request is logged once, when it ends, without its text (--log-level debug adds per-request events); metrics are on /metrics"
	whyMetrics   = "metrics are always on, with SGLang's names and buckets, on /metrics"
	whyNoTools   = "tool calls and reasoning parsers are not supported"
	whyNoTorch   = "there is no PyTorch here: decode steps replay CUDA graphs (--disable-cuda-graph, --cuda-graph-max-bs)"
	whyWeights   = "weights load from the HF directory or llama2.c file that --model-path names"
	whyPD        = "the decode reserves every page a request can need at admission and polls nothing"
	whySched     = "admission is first come, first served, with chunked prefill mixed into every decode step"
)

var compatFlags = []compatFlag{
	// Model and tokenizer.
	{name: "trust-remote-code", kind: "bool", why: "no model code is run: architectures are built in"},
	{name: "tokenizer-mode", kind: "value", why: "the tokenizer is read from tokenizer.json (or the llama2.c tokenizer)", ok: []string{"auto"}},
	{name: "tokenizer-worker-num", kind: "value", why: "tokenization runs in each request's goroutine", ok: []string{"1"}},
	{name: "skip-tokenizer-init", kind: "bool", why: "the tokenizer is always loaded (input_ids work with it loaded)"},
	{name: "load-format", kind: "value", why: whyWeights, ok: []string{"auto", "safetensors"}},
	{name: "model-loader-extra-config", kind: "value", why: whyWeights},
	{name: "revision", kind: "value", why: whyWeights},
	{name: "download-dir", kind: "value", why: "nothing is downloaded: " + whyWeights},
	{name: "model-impl", kind: "value", why: "one implementation of each architecture", ok: []string{"auto", "sglang"}},
	{name: "is-embedding", kind: "bool", why: "generation models only"},
	{name: "enable-multimodal", kind: "bool", why: "text models only"},
	{name: "json-model-override-args", kind: "value", why: "the model's config.json is used as it is", ok: []string{"{}"}},
	{name: "preferred-sampling-params", kind: "value", why: "requests carry their own sampling params"},
	{name: "weight-version", kind: "value", why: "weights are loaded once and never updated", ok: []string{"default"}},
	{name: "chat-template", kind: "value", why: "chat uses the model's template, or a plain built-in one"},
	{name: "hf-chat-template-name", kind: "value", why: "chat uses the model's (first) template, or a plain built-in one"},
	{name: "completion-template", kind: "value", why: "completions take the prompt as it is"},
	// Quantization.
	{name: "quantization", kind: "value", why: "weights are computed in --dtype (no quantization)"},
	{name: "quantization-param-path", kind: "value", why: "weights are computed in --dtype (no quantization)"},
	{name: "kv-cache-dtype", kind: "value", why: "the KV cache is stored in --dtype", ok: []string{"auto"}},
	{name: "enable-fp32-lm-head", kind: "bool", why: "logits are always computed in float32"},
	// HTTP.
	{name: "skip-server-warmup", kind: "bool", why: "there is no warmup: the server is ready when it listens"},
	{name: "warmups", kind: "value", why: "there is no warmup: the server is ready when it listens"},
	{name: "fastapi-root-path", kind: "value", why: "the API is served at the root (put a proxy in front for a prefix)"},
	{name: "nccl-port", kind: "value", why: whyNoDist},
	{name: "admin-api-key", kind: "value", why: "the admin endpoints (/flush_cache, /abort_request) take --api-key"},
	{name: "enable-cache-report", kind: "bool", why: "cached tokens are always reported in usage.prompt_tokens_details"},
	{name: "file-storage-path", kind: "value", why: "there is no file API"},
	{name: "reasoning-parser", kind: "value", why: whyNoTools},
	{name: "tool-call-parser", kind: "value", why: whyNoTools},
	{name: "tool-server", kind: "value", why: whyNoTools},
	{name: "sampling-defaults", kind: "value", why: "defaults are SGLang's and OpenAI's (temperature 1, top_p 1); the model's generation_config.json is not read", ok: []string{"openai"}},
	// Memory and scheduling.
	{name: "max-prefill-tokens", kind: "value", why: "one step's prompt tokens are bounded by --chunked-prefill-size"},
	{name: "prefill-max-requests", kind: "value", why: "every prefilling request shares one step's --chunked-prefill-size"},
	{name: "schedule-policy", kind: "value", why: whySched, ok: []string{"fcfs"}},
	{name: "schedule-conservativeness", kind: "value", why: "a request reserves every page it can need at admission, so none is ever retracted"},
	{name: "enable-priority-scheduling", kind: "bool", why: whySched},
	{name: "radix-eviction-policy", kind: "value", why: "the prefix cache evicts least recently used pages", ok: []string{"lru"}},
	{name: "enable-mixed-chunk", kind: "bool", why: "prefill chunks always run in the same step as the decodes"},
	{name: "num-continuous-decode-steps", kind: "value", why: "the scheduler admits between every step", ok: []string{"1"}},
	{name: "stream-interval", kind: "value", why: "every token is streamed as it comes", ok: []string{"1"}},
	{name: "stream-output", kind: "bool", why: "streams send cumulative text, as SGLang's default does"},
	{name: "incremental-streaming-output", kind: "bool", why: "streams send cumulative text, as SGLang's default does"},
	{name: "allow-auto-truncate", kind: "bool", why: "prompts beyond the context length are refused with a 400 naming the field"},
	{name: "watchdog-timeout", kind: "value", why: "every wait has its own bound here (--disaggregation-timeout, --max-queue-wait, --transfer-timeout, --http-read-timeout)"},
	{name: "soft-watchdog-timeout", kind: "value", why: "every wait has its own bound here (--disaggregation-timeout, --max-queue-wait, --transfer-timeout)"},
	{name: "dist-timeout", kind: "value", why: whyNoDist},
	{name: "sleep-on-idle", kind: "bool", why: "an idle server sleeps on its queue already"},
	{name: "enable-deterministic-inference", kind: "bool", why: "outputs are a function of the seed already (counter-based sampling); batch invariance is not guaranteed"},
	{name: "enable-custom-logit-processor", kind: "bool", why: "custom logit processors are not supported (logit_bias is)"},
	{name: "delete-ckpt-after-loading", kind: "bool", why: "the checkpoint is never modified or deleted"},
	{name: "enable-memory-saver", kind: "bool", why: "memory is not released while serving"},
	{name: "cpu-offload-gb", kind: "value", why: "weights stay on the device", ok: []string{"0"}},
	{name: "enable-torch-compile", kind: "bool", why: whyNoTorch},
	{name: "torch-compile-max-bs", kind: "value", why: whyNoTorch},
	{name: "torchao-config", kind: "value", why: whyNoTorch},
	{name: "cuda-graph-bs", kind: "list", why: "graphs are captured for the batch buckets up to --cuda-graph-max-bs"},
	{name: "disable-cuda-graph-padding", kind: "bool", why: "batches are padded to the next captured bucket"},
	{name: "disable-piecewise-cuda-graph", kind: "bool", why: "prefill runs eagerly"},
	{name: "enable-nan-detection", kind: "bool", why: "there is no NaN check"},
	{name: "enable-p2p-check", kind: "bool", why: "GPU peer access is checked when the nvlink transport starts"},
	{name: "disable-custom-all-reduce", kind: "bool", why: whyNoDist},
	{name: "enable-nccl-nvls", kind: "bool", why: whyNoDist},
	{name: "enable-symm-mem", kind: "bool", why: whyNoDist},
	{name: "triton-attention-reduce-in-fp32", kind: "bool", why: whyKernels},
	{name: "triton-attention-num-kv-splits", kind: "value", why: whyKernels},
	{name: "attention-backend", kind: "value", why: whyKernels},
	{name: "prefill-attention-backend", kind: "value", why: whyKernels},
	{name: "decode-attention-backend", kind: "value", why: whyKernels},
	{name: "sampling-backend", kind: "value", why: whyKernels},
	{name: "grammar-backend", kind: "value", why: "constrained decoding is not supported", ok: []string{"none"}},
	{name: "mm-attention-backend", kind: "value", why: "text models only"},
	{name: "disable-flashinfer-autotune", kind: "bool", why: whyKernels},
	// Runtime, distributed.
	{name: "pp-size", kind: "value", why: whyNoDist, ok: []string{"1"}},
	{name: "pipeline-parallel-size", kind: "value", why: whyNoDist, ok: []string{"1"}},
	{name: "gpu-id-step", kind: "value", why: "one GPU per process (--base-gpu-id)", ok: []string{"1"}},
	{name: "dist-init-addr", kind: "value", why: whyNoDist},
	{name: "nccl-init-addr", kind: "value", why: whyNoDist},
	{name: "node-rank", kind: "value", why: whyNoDist, ok: []string{"0"}},
	{name: "load-balance-method", kind: "value", why: "--dp-size replicas are balanced by shortest queue (ties in turn); servers by mooncake-go lb's --policy"},
	{name: "enable-dp-attention", kind: "bool", why: whyNoDist},
	{name: "enable-dp-lm-head", kind: "bool", why: whyNoDist},
	{name: "moe-dense-tp-size", kind: "value", why: whyNoMoE},
	{name: "enable-two-batch-overlap", kind: "bool", why: whyNoDist},
	{name: "enable-single-batch-overlap", kind: "bool", why: whyNoDist},
	{name: "numa-node", kind: "list", why: "threads are not pinned to NUMA nodes"},
	{name: "expert-parallel-size", kind: "value", why: whyNoMoE, ok: []string{"1"}},
	{name: "ep-size", kind: "value", why: whyNoMoE, ok: []string{"1"}},
	{name: "ep", kind: "value", why: whyNoMoE, ok: []string{"1"}},
	{name: "moe-a2a-backend", kind: "value", why: whyNoMoE, ok: []string{"none"}},
	{name: "moe-runner-backend", kind: "value", why: whyNoMoE, ok: []string{"auto"}},
	{name: "deepep-mode", kind: "value", why: whyNoMoE, ok: []string{"auto"}},
	{name: "deepep-config", kind: "value", why: whyNoMoE},
	{name: "ep-num-redundant-experts", kind: "value", why: whyNoMoE, ok: []string{"0"}},
	{name: "ep-dispatch-algorithm", kind: "value", why: whyNoMoE},
	{name: "init-expert-location", kind: "value", why: whyNoMoE},
	{name: "enable-eplb", kind: "bool", why: whyNoMoE},
	{name: "eplb-algorithm", kind: "value", why: whyNoMoE},
	{name: "eplb-rebalance-num-iterations", kind: "value", why: whyNoMoE},
	{name: "enable-expert-distribution-metrics", kind: "bool", why: whyNoMoE},
	{name: "disable-shared-experts-fusion", kind: "bool", why: whyNoMoE},
	{name: "disable-chunked-prefix-cache", kind: "bool", why: "DeepSeek's chunked prefix cache does not exist here"},
	{name: "mooncake-ib-device", kind: "value", why: whyNoMoE},
	{name: "elastic-ep-backend", kind: "value", why: whyNoMoE, ok: []string{"none"}},
	// LoRA, speculative decoding, hierarchical cache.
	{name: "enable-lora", kind: "bool", why: whyNoLoRA},
	{name: "lora-paths", kind: "list", why: whyNoLoRA},
	{name: "max-lora-rank", kind: "value", why: whyNoLoRA},
	{name: "lora-target-modules", kind: "list", why: whyNoLoRA},
	{name: "max-loras-per-batch", kind: "value", why: whyNoLoRA},
	{name: "max-loaded-loras", kind: "value", why: whyNoLoRA},
	{name: "lora-backend", kind: "value", why: whyNoLoRA},
	{name: "speculative-algorithm", kind: "value", why: whyNoSpec},
	{name: "speculative-draft-model-path", kind: "value", why: whyNoSpec},
	{name: "speculative-num-steps", kind: "value", why: whyNoSpec},
	{name: "speculative-eagle-topk", kind: "value", why: whyNoSpec},
	{name: "speculative-num-draft-tokens", kind: "value", why: whyNoSpec},
	{name: "enable-hierarchical-cache", kind: "bool", why: whyNoHiCache},
	{name: "hicache-ratio", kind: "value", why: whyNoHiCache},
	{name: "hicache-size", kind: "value", why: whyNoHiCache},
	{name: "hicache-write-policy", kind: "value", why: whyNoHiCache},
	{name: "hicache-io-backend", kind: "value", why: whyNoHiCache},
	{name: "hicache-mem-layout", kind: "value", why: whyNoHiCache},
	{name: "hicache-storage-backend", kind: "value", why: whyNoHiCache},
	{name: "hicache-storage-prefetch-policy", kind: "value", why: whyNoHiCache},
	{name: "enable-lmcache", kind: "bool", why: whyNoHiCache},
	// Logging and metrics.
	{name: "log-level-http", kind: "value", why: "HTTP logs follow --log-level"},
	{name: "log-requests", kind: "bool", why: whyLogging},
	{name: "log-requests-level", kind: "value", why: whyLogging},
	{name: "log-requests-format", kind: "value", why: whyLogging},
	{name: "log-requests-target", kind: "list", why: whyLogging},
	{name: "uvicorn-access-log-exclude-prefixes", kind: "list", why: "there is no access log"},
	{name: "crash-dump-folder", kind: "value", why: "there are no crash dumps: a failed request's cause is logged with its rid"},
	{name: "show-time-cost", kind: "bool", why: whyMetrics},
	{name: "decode-log-interval", kind: "value", why: "there is no periodic batch log: sglang:gen_throughput, sglang:num_running_reqs and sglang:token_usage on /metrics say the same"},
	{name: "enable-request-time-stats-logging", kind: "bool", why: whyLogging},
	{name: "enable-metrics-for-all-schedulers", kind: "bool", why: "one scheduler per server"},
	{name: "enable-mfu-metrics", kind: "bool", why: "there is no MFU estimate"},
	{name: "tokenizer-metrics-custom-labels-header", kind: "value", why: "metrics carry only model_name (bounded labels)"},
	{name: "tokenizer-metrics-allowed-custom-labels", kind: "list", why: "metrics carry only model_name (bounded labels)"},
	{name: "bucket-time-to-first-token", kind: "list", why: "SGLang's default buckets are used"},
	{name: "bucket-inter-token-latency", kind: "list", why: "SGLang's default buckets are used"},
	{name: "bucket-e2e-request-latency", kind: "list", why: "SGLang's default buckets are used"},
	{name: "collect-tokens-histogram", kind: "bool", why: "token counts are counters (sglang:prompt_tokens_total, _generation_tokens_total)"},
	{name: "prompt-tokens-buckets", kind: "list", why: "token counts are counters"},
	{name: "generation-tokens-buckets", kind: "list", why: "token counts are counters"},
	{name: "gc-warning-threshold-secs", kind: "value", why: "Go's collector does not stop the world for long"},
	{name: "enable-trace", kind: "bool", why: "there is no OpenTelemetry tracing: logs carry rid and room"},
	{name: "otlp-traces-endpoint", kind: "value", why: "there is no OpenTelemetry tracing: logs carry rid and room"},
	{name: "kv-events-config", kind: "value", why: "KV cache events are not published"},
	// PD disaggregation.
	{name: "disaggregation-decode-polling-interval", kind: "value", why: whyPD, ok: []string{"1"}},
	{name: "num-reserved-decode-tokens", kind: "value", why: whyPD},
	{name: "disaggregation-decode-enable-offload-kvcache", kind: "bool", why: whyNoHiCache},
}

// listFlags are the compat flags that take several values (nargs="+").
func listFlags() map[string]bool {
	out := map[string]bool{}
	for _, c := range compatFlags {
		if c.kind == "list" {
			out["--"+c.name] = true
		}
	}
	return out
}

// normalizeArgs rewrites the command lines of SGLang's and Mooncake's tools into
// what pflag reads: serve's "--flag a b c" for SGLang's list flags becomes
// "--flag=a,b,c" (lb's server lists: joinLBArgs); bench transfer's gflags-style
// "-flag=v" becomes "--flag=v".
func normalizeArgs(args []string) []string {
	switch {
	case len(args) > 0 && args[0] == "serve":
		return joinListArgs(args)
	case len(args) > 0 && args[0] == "lb":
		return joinLBArgs(args)
	case len(args) > 1 && args[0] == "bench" && args[1] == "transfer":
		out := slices.Clone(args)
		for i, a := range out {
			if len(a) > 2 && a[0] == '-' && a[1] != '-' && strings.IndexFunc(a[1:2], func(r rune) bool { return r < 'a' || r > 'z' }) < 0 &&
				len(strings.SplitN(a[1:], "=", 2)[0]) > 1 {
				out[i] = "-" + a
			}
		}
		return out
	}
	return args
}

// joinListArgs rewrites "--flag a b c" for SGLang's list flags into
// "--flag=a,b,c"; other arguments pass unchanged.
func joinListArgs(args []string) []string {
	lists := listFlags()
	out := make([]string, 0, len(args))
	for i := 0; i < len(args); i++ {
		a := args[i]
		if !lists[a] {
			out = append(out, a)
			continue
		}
		var vals []string
		for i+1 < len(args) && !strings.HasPrefix(args[i+1], "-") {
			i++
			vals = append(vals, args[i])
		}
		out = append(out, a+"="+strings.Join(vals, ","))
	}
	return out
}

// compatValues holds the compat flags' values as given.
type compatValues map[string]*string

// registerCompat adds the compat flags to fl, hidden (serve --help stays short;
// docs/cli.md lists them).
func registerCompat(fl *pflag.FlagSet) compatValues {
	vals := compatValues{}
	for _, c := range compatFlags {
		v := new(string)
		vals[c.name] = v
		usage := "SGLang's flag, accepted without effect: " + c.why
		switch c.kind {
		case "bool":
			fl.Var(&boolString{v: v}, c.name, usage)
			fl.Lookup(c.name).NoOptDefVal = "true"
		default:
			fl.StringVar(v, c.name, "", usage)
		}
		_ = fl.MarkHidden(c.name)
	}
	return vals
}

// warn logs one warning for each compat flag given with a value that changes
// something in SGLang.
func (vals compatValues) warn(fl *pflag.FlagSet, lg *zap.Logger) {
	for _, c := range compatFlags {
		if !fl.Changed(c.name) {
			continue
		}
		v := *vals[c.name]
		if slices.Contains(c.ok, v) || (c.kind == "bool" && v == "false") {
			continue
		}
		lg.Warn(fmt.Sprintf("--%s has no effect here: %s", c.name, c.why), zap.String("flag", "--"+c.name), zap.String("value", v))
	}
}

// boolString is a bool flag kept as its text.
type boolString struct{ v *string }

func (b *boolString) String() string {
	if b.v == nil {
		return ""
	}
	return *b.v
}

func (b *boolString) Set(s string) error {
	switch strings.ToLower(s) {
	case "true", "1", "yes", "on":
		*b.v = "true"
	case "false", "0", "no", "off":
		*b.v = "false"
	default:
		return fmt.Errorf("want true or false, got %q", s)
	}
	return nil
}

func (b *boolString) Type() string { return "bool" }

// noteGPUFlags warns once that the cpu backend ignores the GPU-only flags given
// (serve accepts them on any device, as SGLang does).
func (f *serveFlags) noteGPUFlags(lg *zap.Logger) {
	if len(f.gpuFlagsSet) > 0 {
		lg.Warn(strings.Join(f.gpuFlagsSet, ", ")+" have no effect on the cpu backend (no GPU: --device auto chose cpu, or --device cpu)",
			zap.Strings("flags", f.gpuFlagsSet))
	}
}

// applyConfig reads SGLang's --config file (YAML: flag names, with dashes or
// underscores, to values) into fl; flags given on the command line win, as in
// SGLang.
func applyConfig(fl *pflag.FlagSet, path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("--config: %w", err)
	}
	var m map[string]any
	if err := yaml.Unmarshal(b, &m); err != nil {
		return fmt.Errorf("--config %s: %w", path, err)
	}
	given := map[string]bool{}
	fl.Visit(func(f *pflag.Flag) { given[f.Name] = true })
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		name := strings.ReplaceAll(k, "_", "-")
		f := fl.Lookup(name)
		switch {
		case f == nil:
			return fmt.Errorf("--config %s: unknown flag %q", path, k)
		case given[name] || name == "config":
			continue
		}
		var vals []string
		switch v := m[k].(type) {
		case []any:
			for _, x := range v {
				vals = append(vals, fmt.Sprint(x))
			}
		case float64:
			vals = []string{strconv.FormatFloat(v, 'f', -1, 64)}
		case nil:
			continue
		default:
			vals = []string{fmt.Sprint(v)}
		}
		if err := fl.Set(name, strings.Join(vals, ",")); err != nil {
			return fmt.Errorf("--config %s: %s: %w", path, k, err)
		}
	}
	return nil
}
