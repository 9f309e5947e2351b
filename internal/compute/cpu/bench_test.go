package cpu

import (
	"context"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

// weightBytes is the bytes one decode step of a dense model reads: every
// tensor but the embedding (whose lookup reads one row), in its dtype.
func weightBytes(m *model.Model) int64 {
	var n int64
	for _, t := range m.Tensors() {
		if t != m.Embed || m.LMHead == m.Embed {
			n += int64(len(t.Data))
		}
	}
	return n
}

// memcpyBandwidth measures copy bandwidth (bytes copied per second) on one
// core over buffers far larger than the caches.
func memcpyBandwidth() float64 {
	const size = 512 << 20
	src := make([]byte, size)
	dst := make([]byte, size)
	for i := range src {
		src[i] = byte(i)
	}
	copy(dst, src) // fault in
	best := 0.0
	for r := 0; r < 5; r++ {
		t0 := time.Now()
		copy(dst, src)
		best = max(best, size/time.Since(t0).Seconds())
	}
	return best
}

// decodeLoop runs single-token decode steps at positions 0..ctxLen-1,
// cycling, feeding back the greedy token.
func decodeLoop(b *testing.B, be *Backend, batch, ctxLen int) {
	V := be.Config().Vocab
	per := (ctxLen + be.Layout().PageSize - 1) / be.Layout().PageSize
	seqs := make([]compute.Seq, batch)
	out := make([][]float32, batch)
	for i := range seqs {
		seqs[i] = compute.Seq{Tokens: []int32{1}, Pages: pagesFor(i, per), Logits: true}
		out[i] = make([]float32, V)
	}
	pos := 0
	steps := 0
	b.ReportAllocs()
	cpu0 := cpuSeconds()
	for b.Loop() {
		for i := range seqs {
			seqs[i].Pos = pos
			if pos == 0 {
				seqs[i].Tokens[0] = 1
			} else {
				seqs[i].Tokens[0] = argmax(out[i])
			}
		}
		if err := be.Forward(context.Background(), seqs, out); err != nil {
			b.Fatal(err)
		}
		pos = (pos + 1) % ctxLen
		steps++
	}
	b.ReportMetric(float64(steps*batch)/b.Elapsed().Seconds(), "tok/s")
	// Tokens per second of process CPU time: less sensitive than wall time
	// to other load on a shared machine (with one thread it estimates the
	// tok/s of an idle core).
	b.ReportMetric(float64(steps*batch)/(cpuSeconds()-cpu0), "tok/cpu-s")
}

// cpuSeconds is the process's user+system CPU time.
func cpuSeconds() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
}

// BenchmarkDecode measures single-stream (and batched) decode. For
// stories260K the context cycles over 256 positions, as llama2.c's default
// run does; for the stories110m shape (float32 and bfloat16 weights) it
// also reports the floor set by reading the weights once at the measured
// memcpy bandwidth.
func BenchmarkDecode(b *testing.B) {
	b.Run("model=stories260K", func(b *testing.B) {
		m, err := model.LoadLlama2C(stories260K(b))
		if err != nil {
			b.Fatal(err)
		}
		for _, threads := range []int{1, 2} {
			for _, batch := range []int{1, 32} {
				name := fmt.Sprintf("threads=%d/batch=%d", threads, batch)
				b.Run(name, func(b *testing.B) {
					be := newBackend(b, m, 64, 4*batch, threads)
					decodeLoop(b, be, batch, 256)
				})
			}
		}
	})
	b.Run("model=stories110m", func(b *testing.B) {
		for _, dt := range []string{"float32", "bfloat16"} {
			b.Run("dtype="+dt, func(b *testing.B) {
				// Written and loaded as a server loads it: bf16 weights stay
				// bf16 (mapped) and are widened inside the kernels.
				dir := b.TempDir()
				if err := model.WriteRandom("stories110m", dir, 1, dt); err != nil {
					b.Fatal(err)
				}
				m, err := model.Load(dir)
				if err != nil {
					b.Fatal(err)
				}
				defer m.Close()
				wb := weightBytes(m)
				for _, threads := range []int{1, 2} {
					b.Run(fmt.Sprintf("threads=%d", threads), func(b *testing.B) {
						be := newBackend(b, m, 64, 2, threads)
						decodeLoop(b, be, 1, 128)
						step := b.Elapsed().Seconds() / float64(b.N)
						// Measured right after the loop, so both see the same machine.
						bw := memcpyBandwidth()
						floor := float64(wb) / bw
						b.ReportMetric(step*1e3, "ms/step")
						b.ReportMetric(floor*1e3, "floor-ms")
						b.ReportMetric(bw/1e9, "memcpy-GB/s")
						b.ReportMetric(step/floor, "x-floor")
					})
				}
			})
		}
	})
}

// BenchmarkTP measures the step time of the stories110m shape (float32) on
// 1, 2 and 4 tensor-parallel ranks sharing two threads: a decode step at
// batch 1 and 16 (context cycling over 128 positions) and a 128-token
// prefill.
func BenchmarkTP(b *testing.B) {
	dir := b.TempDir()
	if err := model.WriteRandom("stories110m", dir, 1, "float32"); err != nil {
		b.Fatal(err)
	}
	m, err := model.Load(dir)
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()
	for _, tp := range []int{1, 2, 4} {
		for _, batch := range []int{1, 16} {
			b.Run(fmt.Sprintf("tp=%d/decode/batch=%d", tp, batch), func(b *testing.B) {
				be := newTPBackend(b, m, 64, 2*batch, tp, 2, Options{})
				decodeLoop(b, be, batch, 128)
				b.ReportMetric(b.Elapsed().Seconds()/float64(b.N)*1e3, "ms/step")
			})
		}
		b.Run(fmt.Sprintf("tp=%d/prefill=128", tp), func(b *testing.B) {
			be := newTPBackend(b, m, 64, 2, tp, 2, Options{})
			prompt := make([]int32, 128)
			for i := range prompt {
				prompt[i] = int32(1 + i*37%31999)
			}
			seqs := []compute.Seq{{Tokens: prompt, Pages: pagesFor(0, 2), Logits: true}}
			out := [][]float32{make([]float32, m.Config.Vocab)}
			for b.Loop() {
				if err := be.Forward(context.Background(), seqs, out); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(b.Elapsed().Seconds()/float64(b.N)*1e3, "ms/step")
		})
	}
}
