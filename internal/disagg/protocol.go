// Package disagg implements prefill/decode disaggregation over the transfer
// engine: the prefill side's bootstrap server and KV pushes, and the decode
// side's page reservation, room registration and wait.
//
// One request, keyed by its bootstrap room:
//
//	decode:  reserve pages + aux slot -> GET prefill /bootstrap/info (checks
//	         model, dtype, KV layout) -> POST /bootstrap/rooms {room, segment,
//	         pages, aux} -> wait for the "kv" notification (bounded, with
//	         heartbeats to the bootstrap server) -> decode with the KV in place.
//	prefill: run the prompt in chunks; after each chunk write its full pages,
//	         all layers, into decode's pages in one batch: each prefill
//	         rank's KV heads into every decode rank that holds them
//	         (kvcache.NewPlan, once per pair of rank lists); with the last
//	         chunk the remaining pages and the first token into the aux
//	         slot; then notify Success or Failed with the reason and the
//	         bytes each decode rank got.
//
// Room states on both sides: Bootstrapping -> WaitingForInput ->
// Transferring -> Success | Failed.
package disagg

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
)

// State is a room's progress.
type State int

const (
	Bootstrapping State = iota
	WaitingForInput
	Transferring
	Success
	Failed
)

var stateNames = [...]string{"bootstrapping", "waiting_for_input", "transferring", "success", "failed"}

func (s State) String() string { return stateNames[s] }

// Info is what each side says about itself at bootstrap. Prefill and decode
// must agree on the model, dtype and the whole model's KV layout but for its
// pool size; their tensor-parallel ranks may split the KV heads differently.
type Info struct {
	Model       string `json:"model"`       // served model name
	Fingerprint string `json:"fingerprint"` // architecture: dims, layers, vocab
	DType       string `json:"dtype"`       // KV element type
	// Layout is the KV of every head in this side's page size: the ranks'
	// pools seen as one.
	Layout kvcache.Layout `json:"layout"`
	// Segment is the transfer-engine segment of notifications and aux slots.
	Segment string `json:"segment"`
	// Ranks are the tensor-parallel ranks' KV pools, in rank order.
	Ranks       []Rank `json:"ranks"`
	Incarnation string `json:"incarnation"`
	AuxBytes    int    `json:"aux_bytes"` // AuxSize of the peer's build: the aux slot layout
}

// Rank is one tensor-parallel rank's KV pool: the segment and address of
// its registered memory, its layout (page order included) and the KV heads
// it holds (kvcache.Shard).
type Rank struct {
	Segment  string `json:"segment"`
	PoolAddr uint64 `json:"pool_addr"`
	kvcache.Shard
}

// MaxRanks bounds the ranks an Info may list.
const MaxRanks = 256

// Shards are the ranks' shards, for kvcache.NewPlan.
func (i Info) Shards() []kvcache.Shard {
	out := make([]kvcache.Shard, len(i.Ranks))
	for r, x := range i.Ranks {
		out[r] = x.Shard
	}
	return out
}

// Check refuses a peer whose model, dtype or KV layout differs, or whose
// rank list does not hold its model's KV heads, naming the field and both
// values. Different tensor-parallel sizes of the same model pass.
func (i Info) Check(peer Info) error {
	if i.Model != peer.Model {
		return fmt.Errorf("model mismatch: %q here, %q on the peer", i.Model, peer.Model)
	}
	if i.Fingerprint != peer.Fingerprint {
		return fmt.Errorf("model architecture mismatch: %s here, %s on the peer", i.Fingerprint, peer.Fingerprint)
	}
	if i.AuxBytes != peer.AuxBytes {
		return fmt.Errorf("aux slot layout mismatch: %d-byte slots here, %d on the peer (different versions)", i.AuxBytes, peer.AuxBytes)
	}
	if i.DType != peer.DType {
		return fmt.Errorf("KV dtype mismatch: %s here, %s on the peer", i.DType, peer.DType)
	}
	if i.Layout.PageSize != peer.Layout.PageSize {
		return fmt.Errorf("page size mismatch: %d here, %d on the peer", i.Layout.PageSize, peer.Layout.PageSize)
	}
	if err := i.Layout.Compatible(peer.Layout); err != nil {
		return err
	}
	if err := peer.checkRanks(); err != nil {
		return fmt.Errorf("the peer's %w", err)
	}
	return nil
}

// checkRanks reports a rank list that cannot hold the layout's KV: none or
// too many ranks, a rank whose layout differs from the model's in a field
// other than its heads and pool size, heads outside the model's, or a head
// no rank holds.
func (i Info) checkRanks() error {
	if len(i.Ranks) == 0 || len(i.Ranks) > MaxRanks {
		return fmt.Errorf("ranks: %d, want 1 to %d", len(i.Ranks), MaxRanks)
	}
	l := i.Layout
	held := make([]bool, l.KVHeads)
	for r, x := range i.Ranks {
		rl := x.Layout
		if err := rl.Validate(); err != nil {
			return fmt.Errorf("ranks[%d].layout: %w", r, err)
		}
		type f struct {
			name string
			a, b int
		}
		for _, v := range []f{{"layers", rl.Layers, l.Layers}, {"page size", rl.PageSize, l.PageSize}, {"head dim", rl.HeadDim, l.HeadDim},
			{"element bytes", rl.ElemBytes, l.ElemBytes}, {"pages", rl.Pages, l.Pages}} {
			if v.a != v.b {
				return fmt.Errorf("ranks[%d].layout: %s %d, the model's layout %d", r, v.name, v.a, v.b)
			}
		}
		if x.FirstHead < 0 || x.FirstHead+rl.KVHeads > l.KVHeads {
			return fmt.Errorf("ranks[%d]: kv heads %d..%d outside the model's %d", r, x.FirstHead, x.FirstHead+rl.KVHeads-1, l.KVHeads)
		}
		for h := x.FirstHead; h < x.FirstHead+rl.KVHeads; h++ {
			held[h] = true
		}
		if x.Segment == "" {
			return fmt.Errorf("ranks[%d]: no segment", r)
		}
	}
	for h, ok := range held {
		if !ok {
			return fmt.Errorf("ranks: no rank holds kv head %d of %d", h, l.KVHeads)
		}
	}
	return nil
}

// RoomRequest is decode's registration of a room with the prefill server.
type RoomRequest struct {
	Room    uint64  `json:"room"`
	Decode  Info    `json:"decode"`
	Pages   []int32 `json:"pages"`    // destination pages, in prompt order
	AuxAddr uint64  `json:"aux_addr"` // where the first token goes
	Tokens  int     `json:"tokens"`   // prompt length decode tokenized
	// Held is how many leading prompt tokens decode already holds in
	// Pages (its prefix cache; whole pages): the prefill sends the rest.
	Held int `json:"held,omitempty"`
	// Want is the prefill incarnation decode's info came from; another
	// incarnation refuses the room ("" = any).
	Want string `json:"want,omitempty"`
}

// Result is the prefill's final word on a room, sent as a notification.
type Result struct {
	Room  uint64 `json:"room"`
	OK    bool   `json:"ok"`
	Error string `json:"error,omitempty"`
	// Reason is the failure's Reason, so decode reports the same one.
	Reason Reason `json:"reason,omitempty"`
	Bytes  int64  `json:"bytes"`
	// RankBytes is what the prefill wrote into each decode rank's pool.
	RankBytes []int64 `json:"rank_bytes,omitempty"`
	// CachedTokens is how many prompt tokens the prefill took from its
	// prefix cache.
	CachedTokens int `json:"cached_tokens,omitempty"`
	// TransferSeconds is the time spent in KV transfers for this room.
	TransferSeconds float64 `json:"transfer_seconds"`
}

// NotifyTopic is the transfer-engine notification topic of Results.
const NotifyTopic = "mooncake.disagg.kv"

// AuxSize is the size of one aux slot: room (8), first token (4), logprob
// (4), the count of top logprobs (4), then up to sampling.MaxTopLogprobs
// (token, logprob) pairs (8 each); padded to 192.
const AuxSize = 192

const auxTop = 20 // offset of the first top pair

func encodeAux(b []byte, room uint64, token int, logprob float32, top []sampling.TopLogprob) {
	top = top[:min(len(top), sampling.MaxTopLogprobs)]
	binary.LittleEndian.PutUint64(b[0:], room)
	binary.LittleEndian.PutUint32(b[8:], uint32(int32(token)))
	binary.LittleEndian.PutUint32(b[12:], math.Float32bits(logprob))
	binary.LittleEndian.PutUint32(b[16:], uint32(len(top)))
	for i, t := range top {
		binary.LittleEndian.PutUint32(b[auxTop+8*i:], uint32(int32(t.Token)))
		binary.LittleEndian.PutUint32(b[auxTop+8*i+4:], math.Float32bits(t.Logprob))
	}
}

func decodeAux(b []byte) (room uint64, token int, logprob float32, top []sampling.TopLogprob) {
	room = binary.LittleEndian.Uint64(b[0:])
	token = int(int32(binary.LittleEndian.Uint32(b[8:])))
	logprob = math.Float32frombits(binary.LittleEndian.Uint32(b[12:]))
	n := min(int(binary.LittleEndian.Uint32(b[16:])), sampling.MaxTopLogprobs)
	for i := range n {
		top = append(top, sampling.TopLogprob{Token: int(int32(binary.LittleEndian.Uint32(b[auxTop+8*i:]))),
			Logprob: math.Float32frombits(binary.LittleEndian.Uint32(b[auxTop+8*i+4:]))})
	}
	return room, token, logprob, top
}
