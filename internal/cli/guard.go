package cli

import (
	"context"

	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
)

// preloadGuard hands pages back to the pool when the engine refuses a
// decode-side request whose KV the disaggregation layer already placed:
// the engine owns a Preloaded request's pages only once Submit succeeds.
type preloadGuard struct {
	*engine.Engine
	pages *kvcache.Allocator
}

func (g preloadGuard) Submit(ctx context.Context, r *engine.Request) (<-chan engine.Event, error) {
	ch, err := g.Engine.Submit(ctx, r)
	if err != nil && r.Preloaded != nil {
		g.pages.Release(r.Preloaded.Pages)
		r.Preloaded = nil
	}
	return ch, err
}
