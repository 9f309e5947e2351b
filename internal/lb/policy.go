package lb

import (
	"fmt"
	mrand "math/rand/v2"
	"slices"
	"strings"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// A Policy chooses the server of one role (prefill or decode) for each
// request. The LB calls it with the usable servers, those with room if any
// has room, never with none; it may be called concurrently.
type Policy interface {
	// Pick returns the index in cands of the server for a request whose
	// prompt is key: the bytes of the request's prompt member as the
	// client sent them (text, input_ids, prompt or messages), at most
	// MaxKeyBytes; nil when it has none.
	Pick(cands []Candidate, key []byte) int
}

// Candidate is a server a Policy may pick.
type Candidate struct {
	ID       int   // the server's place in its role's list (--prefill or --decode order)
	Inflight int64 // requests the LB has on it now
}

// Forgetter is a Policy that keeps state per server. The LB calls Forget
// on POST /flush_cache. (Not when a server fails a check: a check that
// timed out on a busy machine would cost every prefix; a server that did
// restart empty fills its cache again from the requests its record sends
// it.)
type Forgetter interface {
	Forget(id int)
}

// MaxKeyBytes bounds the prompt bytes a Policy sees: a prefix that long
// already tells where a prompt's cache lives.
const MaxKeyBytes = 256 << 10

// PolicyEnv is what a policy is built with, once per role.
type PolicyEnv struct {
	Role       string // "prefill" or "decode"
	Servers    int    // how many servers the role has: Candidate.ID is below it
	CacheAware CacheAwareConfig
	Registerer prometheus.Registerer // nil: no metrics
}

// NewPolicy builds a policy for one role.
type NewPolicy func(PolicyEnv) (Policy, error)

// Policies maps policy names to constructors. Each is registered
// explicitly: BuiltinPolicies has the LB's own; a caller may add more.
type Policies struct {
	names []string
	m     map[string]NewPolicy
}

// NewPolicies returns an empty set.
func NewPolicies() *Policies { return &Policies{m: map[string]NewPolicy{}} }

// Register adds a policy under name.
func (p *Policies) Register(name string, f NewPolicy) error {
	switch {
	case name == "" || strings.ContainsAny(name, " ,"):
		return fmt.Errorf("lb: policy name %q: want a word", name)
	case f == nil:
		return fmt.Errorf("lb: policy %q: no constructor", name)
	case p.m[name] != nil:
		return fmt.Errorf("lb: policy %q registered twice", name)
	}
	p.m[name] = f
	p.names = append(p.names, name)
	return nil
}

// Names lists the policies in the order they were registered.
func (p *Policies) Names() []string { return slices.Clone(p.names) }

// New builds the named policy, or an error naming --policy.
func (p *Policies) New(name string, env PolicyEnv) (Policy, error) {
	f := p.m[name]
	if f == nil {
		return nil, p.unknown(name)
	}
	return f(env)
}

func (p *Policies) unknown(name string) error {
	return fmt.Errorf("--policy %q: want %s", name, strings.Join(p.names, ", "))
}

// BuiltinPolicies returns the LB's policies: random, round_robin,
// least_load and cache_aware.
func BuiltinPolicies() *Policies {
	p := NewPolicies()
	for _, r := range []struct {
		name string
		f    NewPolicy
	}{
		{"random", func(PolicyEnv) (Policy, error) { return randomPolicy{}, nil }},
		{"round_robin", func(PolicyEnv) (Policy, error) { return new(roundRobin), nil }},
		{"least_load", func(PolicyEnv) (Policy, error) { return leastLoad{}, nil }},
		{"cache_aware", newCacheAware},
	} {
		p.m[r.name] = r.f
		p.names = append(p.names, r.name)
	}
	return p
}

// randomPolicy picks uniformly.
type randomPolicy struct{}

func (randomPolicy) Pick(c []Candidate, _ []byte) int { return mrand.IntN(len(c)) }

// roundRobin takes the candidates in turn.
type roundRobin struct{ n atomic.Uint64 }

func (r *roundRobin) Pick(c []Candidate, _ []byte) int { return int((r.n.Add(1) - 1) % uint64(len(c))) }

// leastLoad picks the candidate with the fewest requests in flight, the
// first of those tied.
type leastLoad struct{}

func (leastLoad) Pick(c []Candidate, _ []byte) int {
	best := 0
	for i := range c {
		if c[i].Inflight < c[best].Inflight {
			best = i
		}
	}
	return best
}
