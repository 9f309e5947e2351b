// Package dp runs data-parallel engine replicas behind one server: each
// request goes whole to one replica, the one with the fewest requests
// queued and running (ties in turn), as SGLang's --dp-size with its
// shortest-queue balancing.
package dp

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/mooncake-go/mooncake-go/internal/engine"
)

// Replica is what the set needs of an engine. *engine.Engine is one.
type Replica interface {
	Submit(ctx context.Context, r *engine.Request) (<-chan engine.Event, error)
	Stats() engine.Stats
	FlushCache() (pages int, err error)
}

var _ Replica = (*engine.Engine)(nil)

// Set is the replicas, used as one engine (server.Generator, LoadReporter
// and CacheFlusher).
type Set struct {
	rs   []Replica
	next atomic.Uint64 // where the search for the least loaded starts
}

// New makes a set of at least one replica.
func New(rs ...Replica) (*Set, error) {
	if len(rs) == 0 {
		return nil, errors.New("dp: no replicas")
	}
	return &Set{rs: rs}, nil
}

// Len is the number of replicas.
func (s *Set) Len() int { return len(s.rs) }

// pick is the least loaded replica, searching from a start that moves on
// each call so equal loads take turns.
func (s *Set) pick() Replica {
	start := int(s.next.Add(1) % uint64(len(s.rs)))
	best, bestLoad := s.rs[start], -1
	for i := range s.rs {
		r := s.rs[(start+i)%len(s.rs)]
		st := r.Stats()
		if l := st.Queued + st.Running; bestLoad < 0 || l < bestLoad {
			best, bestLoad = r, l
		}
	}
	return best
}

// Submit sends r to the least loaded replica.
func (s *Set) Submit(ctx context.Context, r *engine.Request) (<-chan engine.Event, error) {
	return s.pick().Submit(ctx, r)
}

// Stats sums the replicas' loads and pages.
func (s *Set) Stats() engine.Stats {
	var out engine.Stats
	for _, r := range s.rs {
		st := r.Stats()
		out.Queued += st.Queued
		out.Running += st.Running
		out.FreePages += st.FreePages
		out.TotalPages += st.TotalPages
		out.CachedPages += st.CachedPages
	}
	return out
}

// FlushCache flushes every replica's prefix cache: the pages that went
// back in all, and every replica's error.
func (s *Set) FlushCache() (int, error) {
	var pages int
	var errs []error
	for i, r := range s.rs {
		n, err := r.FlushCache()
		pages += n
		if err != nil {
			errs = append(errs, fmt.Errorf("dp replica %d: %w", i, err))
		}
	}
	return pages, errors.Join(errs...)
}
