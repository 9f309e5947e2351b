package model

import (
	"os"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"
)

// progress shows a byte progress bar on stderr once an operation has run
// for more than a second, and only when stderr is a terminal. A nil
// *progress does nothing.
type progress struct {
	mu    sync.Mutex
	desc  string
	total int64
	done  int64
	start time.Time
	bar   *progressbar.ProgressBar
	tty   bool
}

func newProgress(desc string, total int64) *progress {
	return &progress{desc: desc, total: total, start: time.Now(), tty: term.IsTerminal(int(os.Stderr.Fd()))}
}

// Add records n more bytes done.
func (p *progress) Add(n int64) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done += n
	if !p.tty {
		return
	}
	if p.bar == nil && time.Since(p.start) > time.Second {
		p.bar = progressbar.NewOptions64(p.total,
			progressbar.OptionSetWriter(os.Stderr),
			progressbar.OptionSetDescription(p.desc),
			progressbar.OptionShowBytes(true),
			progressbar.OptionThrottle(100*time.Millisecond),
			progressbar.OptionClearOnFinish())
	}
	if p.bar != nil {
		_ = p.bar.Set64(p.done)
	}
}

// Finish removes the bar.
func (p *progress) Finish() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.bar != nil {
		_ = p.bar.Finish()
	}
}
