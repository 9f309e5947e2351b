package engine

import (
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

// Defaults for zero Config fields.
const (
	DefaultMaxRunningRequests = 64
	DefaultChunkedPrefillSize = 512
	DefaultMaxQueue           = 1024
	DefaultMaxQueueWait       = 60 * time.Second
	// DefaultMaxNewTokens is SGLang's default max_new_tokens.
	DefaultMaxNewTokens = 128
)

// Config configures an Engine. Zero values mean the documented defaults.
type Config struct {
	// Model runs the forward passes. Required. The engine does not close it.
	Model compute.Model
	// Pages is the allocator of the model's KV pool (the Pool's Alloc).
	// Required. It may be shared with the disaggregation layer, which
	// allocates pages for preloaded requests.
	Pages *kvcache.Allocator
	// Tokenizer decodes output text and gives the EOS ids (together with the
	// model config's). Required.
	Tokenizer tokenizer.Tokenizer

	// MaxRunningRequests bounds the requests in the running batch
	// (prefilling or decoding). 0: DefaultMaxRunningRequests.
	MaxRunningRequests int
	// ChunkedPrefillSize is the most prompt tokens one step processes, over
	// all prefilling requests. 0: DefaultChunkedPrefillSize; -1: no limit.
	ChunkedPrefillSize int
	// MaxQueue bounds the requests waiting for admission; beyond it Submit
	// returns ErrOverloaded. 0: DefaultMaxQueue.
	MaxQueue int
	// Cache is the prefix cache over Pages (kvcache.NewRadix): a request
	// reuses its longest cached prefix and computes from its end, and every
	// finished request's KV is cached. nil: no prefix caching.
	Cache *kvcache.Radix
	// MaxQueueWait bounds how long a request waits in the admission queue
	// for its pages (from its submission, or from when its PrefillGate
	// opened); past it the request ends with ErrQueueTimeout.
	// 0: DefaultMaxQueueWait.
	MaxQueueWait time.Duration
	// MaxSeqLen is the context length (prompt + output tokens). 0: the
	// model's MaxSeqLen; it may only lower that.
	MaxSeqLen int
	// DefaultSeed seeds requests without a seed, mixed with a per-engine
	// request counter.
	DefaultSeed int64
	// HostSampling samples every token on the host even when the model can
	// sample on the device (compute.DeviceSampler): for comparisons.
	HostSampling bool
	// DisableOverlap runs each pass to its end before the next is built,
	// even when the model can queue sampling passes
	// (compute.AsyncSampler): for comparisons.
	DisableOverlap bool

	Logger     *zap.Logger           // nil: no logs
	Registerer prometheus.Registerer // nil: metrics are kept but not exported
}

// Validate reports a Config that New cannot use.
func (c *Config) Validate() error {
	var errs []error
	if c.Model == nil {
		errs = append(errs, errors.New("engine: config: Model is required"))
	}
	if c.Pages == nil {
		errs = append(errs, errors.New("engine: config: Pages is required"))
	}
	if c.Tokenizer == nil {
		errs = append(errs, errors.New("engine: config: Tokenizer is required"))
	}
	if c.MaxRunningRequests < 0 {
		errs = append(errs, fmt.Errorf("engine: config: MaxRunningRequests %d < 0", c.MaxRunningRequests))
	}
	if c.ChunkedPrefillSize < -1 {
		errs = append(errs, fmt.Errorf("engine: config: ChunkedPrefillSize %d < -1", c.ChunkedPrefillSize))
	}
	if c.MaxQueue < 0 {
		errs = append(errs, fmt.Errorf("engine: config: MaxQueue %d < 0", c.MaxQueue))
	}
	if c.MaxQueueWait < 0 {
		errs = append(errs, fmt.Errorf("engine: config: MaxQueueWait %v < 0", c.MaxQueueWait))
	}
	if c.MaxSeqLen < 0 {
		errs = append(errs, fmt.Errorf("engine: config: MaxSeqLen %d < 0", c.MaxSeqLen))
	}
	if c.Model != nil {
		mc, l := c.Model.Config(), c.Model.Layout()
		if mc.Vocab <= 0 {
			errs = append(errs, fmt.Errorf("engine: config: model vocabulary %d", mc.Vocab))
		}
		if l.PageSize <= 0 {
			errs = append(errs, fmt.Errorf("engine: config: page size %d", l.PageSize))
		}
		if c.Pages != nil && l.Pages != 0 && l.Pages != c.Pages.Total() {
			errs = append(errs, fmt.Errorf("engine: config: the model's pool has %d pages, the allocator %d", l.Pages, c.Pages.Total()))
		}
		if c.MaxSeqLen > 0 && mc.MaxSeqLen > 0 && c.MaxSeqLen > mc.MaxSeqLen {
			errs = append(errs, fmt.Errorf("engine: config: MaxSeqLen %d beyond the model's context length %d", c.MaxSeqLen, mc.MaxSeqLen))
		}
	}
	return errors.Join(errs...)
}

// withDefaults returns c with zero fields set to their defaults.
func (c Config) withDefaults() Config {
	if c.MaxRunningRequests == 0 {
		c.MaxRunningRequests = DefaultMaxRunningRequests
	}
	if c.ChunkedPrefillSize == 0 {
		c.ChunkedPrefillSize = DefaultChunkedPrefillSize
	}
	if c.MaxQueue == 0 {
		c.MaxQueue = DefaultMaxQueue
	}
	if c.MaxQueueWait == 0 {
		c.MaxQueueWait = DefaultMaxQueueWait
	}
	if c.MaxSeqLen == 0 {
		c.MaxSeqLen = c.Model.Config().MaxSeqLen // may stay 0: only the pool bounds it
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return c
}
