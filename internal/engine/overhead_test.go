package engine

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

// nullModel samples on the "device" and does nothing else: token 'a' for
// every seq, no logits. What an engine step costs beyond the model's pass
// (scheduling, page tables, results, events) is all that remains.
type nullModel struct{ layout kvcache.Layout }

type nullState struct{}

func (nullState) Close() error { return nil }

func (m *nullModel) Config() model.Config {
	return model.Config{Vocab: fakeVocab, MaxSeqLen: 4096, BOS: fakeBOS, EOS: []int{fakeEOS}}
}
func (m *nullModel) Layout() kvcache.Layout { return m.layout }
func (m *nullModel) Close() error           { return nil }
func (m *nullModel) Forward(context.Context, []compute.Seq, [][]float32) error {
	return nil
}
func (m *nullModel) NewSamplerState(sampling.Params, uint64, []int32) (compute.SamplerState, error) {
	return nullState{}, nil
}
func (m *nullModel) ForwardSample(_ context.Context, seqs []compute.Seq, _ []compute.Sample, res []compute.Sampled) error {
	for i := range seqs {
		res[i] = compute.Sampled{Token: 'a'}
	}
	return nil
}

// BenchmarkEngineStep measures the engine's own cost of a decode step at
// 1, 32 and 128 streams over a model that does no work (device sampling,
// constant tokens): us a step, to set against the GPU's step time.
func BenchmarkEngineStep(b *testing.B) {
	for _, streams := range []int{1, 32, 128} {
		b.Run(fmt.Sprintf("streams=%d", streams), func(b *testing.B) {
			const pages, ps, maxNew = 8192, 64, 256
			m := &nullModel{layout: kvcache.Layout{Layers: 1, PageSize: ps, KVHeads: 1, HeadDim: 1, ElemBytes: 4, Pages: pages}}
			e, err := New(Config{Model: m, Pages: kvcache.NewAllocator(pages), Tokenizer: tokenizer.NewByteLevel()})
			if err != nil {
				b.Fatal(err)
			}
			te := &testEngine{Engine: e}
			te.run(b)
			prompt := make([]int, 64)
			for i := range prompt {
				prompt[i] = 'x'
			}
			steps := 0
			b.ReportAllocs()
			for b.Loop() {
				chans := submitN(b, e, streams, prompt, maxNew)
				// one reader a stream, as the server has, counting tokens only
				var wg sync.WaitGroup
				counts := make([]int, streams)
				for i, ch := range chans {
					wg.Go(func() {
						for ev := range ch {
							if ev.Token >= 0 {
								counts[i]++
							}
						}
					})
				}
				wg.Wait()
				for _, n := range counts {
					if n != maxNew {
						b.Fatalf("%d tokens, want %d", n, maxNew)
					}
				}
				steps += maxNew
			}
			b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(steps), "us/step")
		})
	}
}

// submitN submits n requests of prompt for maxNew tokens each (EOS ignored).
func submitN(b *testing.B, e *Engine, n int, prompt []int, maxNew int) []<-chan Event {
	chans := make([]<-chan Event, n)
	for i := range chans {
		ch, err := e.Submit(context.Background(), &Request{InputIDs: prompt,
			Params: SamplingParams{MaxNewTokens: maxNew, IgnoreEOS: true}})
		if err != nil {
			b.Fatal(err)
		}
		chans[i] = ch
	}
	return chans
}
