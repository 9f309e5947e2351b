package tcp

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// maxFuzzInput caps fuzz inputs: a lane's stream is unbounded, the decoder's
// state is not.
const maxFuzzInput = 1 << 16

func TestFrameRoundTrip(t *testing.T) {
	in := reqHeader{op: opRead, id: 7, addr: 0x7f0000001000, len: 4096}
	b := make([]byte, reqSize)
	in.put(b)
	out, err := parseReq(b)
	if err != nil || out != in {
		t.Fatalf("request %+v -> %+v, %v", in, out, err)
	}
	r := respHeader{status: statusDenied, id: 9, len: 12}
	rb := make([]byte, respSize)
	r.put(rb)
	rout, err := parseResp(rb)
	if err != nil || rout != r {
		t.Fatalf("response %+v -> %+v, %v", r, rout, err)
	}
	for _, bad := range []reqHeader{{op: 3, len: 1}, {op: opWrite, len: 0}, {op: opWrite, len: MaxChunk + 1},
		{op: opRead, addr: ^uint64(0), len: 2}, {op: opRead, flags: 1, len: 1}} {
		bad.put(b)
		if _, err := parseReq(b); err == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
}

func FuzzParseRequest(f *testing.F) {
	b := make([]byte, reqSize)
	(&reqHeader{op: opWrite, id: 1, addr: 0x1000, len: 64}).put(b)
	f.Add(b)
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) > maxFuzzInput {
			return
		}
		h, err := parseReq(b)
		if err != nil {
			return
		}
		// Whatever parses is within the wire limits and re-encodes to itself.
		if h.len == 0 || h.len > MaxChunk || h.addr+h.len < h.addr || (h.op != opWrite && h.op != opRead) {
			t.Fatalf("accepted %+v", h)
		}
		out := make([]byte, reqSize)
		h.put(out)
		if !bytes.Equal(out, b[:reqSize]) {
			t.Fatalf("re-encoded %x, got %x", out, b[:reqSize])
		}
	})
}

func FuzzParseResponse(f *testing.F) {
	b := make([]byte, respSize)
	(&respHeader{status: statusOutOfBounds, id: 1, len: 10}).put(b)
	f.Add(b)
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) > maxFuzzInput {
			return
		}
		h, err := parseResp(b)
		if err != nil {
			return
		}
		if (h.status == statusOK && h.len > MaxChunk) || (h.status != statusOK && h.len > maxErrText) {
			t.Fatalf("accepted %+v", h)
		}
	})
}

// FuzzServe feeds a byte stream to the serving side of a lane. The only
// registered memory is the middle of arena: the bytes around it must never
// change, whatever the stream says, and the server must not crash.
func FuzzServe(f *testing.F) {
	f.Add(seedStream())
	f.Add([]byte("MT\x01\x01"))
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) > maxFuzzInput {
			return
		}
		arena := make([]byte, 3*4096)
		for i := range arena {
			arena[i] = 0xA5
		}
		base := uint64(uintptr(unsafe.Pointer(&arena[4096])))
		check := func(addr, n uint64, need transfer.Access) (*transfer.Region, error) {
			if addr < base || addr+n > base+4096 || addr+n < addr {
				return nil, &transfer.RangeError{Addr: addr, Len: n, Err: transfer.ErrOutOfBounds}
			}
			return nil, nil
		}
		// Fuzz addresses are relative to the region: rebase them.
		s := newServer(&rebase{in: append([]byte(nil), in...), base: base}, io.Discard, check, 0, nil, nil)
		s.vectors = true
		s.run()
		for i, c := range arena {
			if (i < 4096 || i >= 8192) && c != 0xA5 {
				t.Fatalf("byte %d outside the region written", i)
			}
		}
	})
}

// rebase adds base to the address field of every request header that starts
// where a header is expected, so fuzz inputs can name region offsets.
type rebase struct {
	in   []byte
	base uint64
	off  int
	next int // offset of the next header
}

func (r *rebase) Read(p []byte) (int, error) {
	if r.off >= len(r.in) {
		return 0, io.EOF
	}
	if r.off == r.next && len(r.in)-r.off >= reqSize {
		h := append([]byte(nil), r.in[r.off:r.off+reqSize]...)
		if rh, err := parseReq(h); err == nil {
			r.next = r.off + reqSize
			if rh.vector() {
				// Rebase the entries instead.
				for i := range int(rh.addr) {
					if o := r.next + i*entrySize; o+8 <= len(r.in) {
						binary.LittleEndian.PutUint64(r.in[o:], binary.LittleEndian.Uint64(r.in[o:])+r.base)
					}
				}
				r.next += int(rh.addr) * entrySize
			} else {
				rh.addr += r.base
				rh.put(h)
				copy(r.in[r.off:], h)
			}
			if rh.op == opWrite {
				r.next += int(rh.len)
			}
			n := copy(p, r.in[r.off:min(len(r.in), r.off+reqSize)])
			r.off += n
			return n, nil
		}
	}
	n := copy(p, r.in[r.off:min(len(r.in), max(r.off+1, r.nextBoundary()))])
	r.off += n
	return n, nil
}

func (r *rebase) nextBoundary() int {
	if r.next > r.off {
		return r.next
	}
	return len(r.in)
}

func seedStream() []byte {
	var b []byte
	h := make([]byte, reqSize)
	(&reqHeader{op: opWrite, id: 1, addr: 10, len: 5}).put(h)
	b = append(append(b, h...), "hello"...)
	(&reqHeader{op: opRead, id: 2, addr: 10, len: 5}).put(h)
	b = append(b, h...)
	(&reqHeader{op: opWrite, id: 3, addr: 4090, len: 10}).put(h)
	b = append(append(b, h...), "0123456789"...)
	// Vectors: a write and a read of two entries, and a write with an entry
	// past the region.
	for i, es := range [][]entry{{{20, 3}, {100, 4}}, {{20, 3}, {100, 4}}, {{30, 3}, {4095, 4}}} {
		op := uint8(opWrite)
		if i == 1 {
			op = opRead
		}
		(&reqHeader{op: op, flags: flagVector, id: uint64(4 + i), addr: 2, len: 7}).put(h)
		e := make([]byte, 2*entrySize)
		putEntries(e, es)
		b = append(append(b, h...), e...)
		if op == opWrite {
			b = append(b, "abcdefg"...)
		}
	}
	return b
}

func TestVectorFrame(t *testing.T) {
	es := []entry{{0x1000, 4096}, {0x9000, 10}, {0x3000, 1}}
	h := reqHeader{op: opWrite, flags: flagVector, id: 5, addr: uint64(len(es)), len: 4107}
	b := make([]byte, reqSize+len(es)*entrySize)
	h.put(b)
	putEntries(b[reqSize:], es)
	out, err := parseReq(b)
	if err != nil || out != h || !out.vector() {
		t.Fatalf("vector header %+v -> %+v, %v", h, out, err)
	}
	got, err := parseEntries(out, b[reqSize:], nil)
	if err != nil || len(got) != len(es) {
		t.Fatalf("entries: %v %v", got, err)
	}
	for i := range es {
		if got[i] != es[i] {
			t.Fatalf("entry %d: %+v, want %+v", i, got[i], es[i])
		}
	}
	for _, c := range []struct {
		name string
		h    reqHeader
		es   []entry
		want string // in the error
	}{
		{"no entries", reqHeader{op: opRead, flags: flagVector, addr: 0, len: 1}, nil, "0 entries"},
		{"too many entries", reqHeader{op: opRead, flags: flagVector, addr: maxVector + 1, len: 1}, nil, "257 entries"},
		{"total too big", reqHeader{op: opRead, flags: flagVector, addr: 1, len: MaxChunk + 1}, nil, "length"},
		{"unknown flag", reqHeader{op: opRead, flags: 2, addr: 1, len: 1}, nil, "flags"},
		{"entries short of the total", reqHeader{op: opRead, flags: flagVector, addr: 2, len: 100}, []entry{{0x1000, 10}, {0x2000, 10}}, "sum to 20"},
		{"entries past the total", reqHeader{op: opRead, flags: flagVector, addr: 2, len: 15}, []entry{{0x1000, 10}, {0x2000, 10}}, "entry 1: length 10"},
		{"empty entry", reqHeader{op: opWrite, flags: flagVector, addr: 3, len: 20}, []entry{{0x1000, 10}, {0x2000, 10}, {0x3000, 0}}, "entry 2: length 0"},
		{"entry wraps", reqHeader{op: opWrite, flags: flagVector, addr: 2, len: 20}, []entry{{0x1000, 10}, {^uint64(0) - 3, 10}}, "entry 1: range"},
	} {
		b := make([]byte, reqSize+len(c.es)*entrySize)
		c.h.put(b)
		putEntries(b[reqSize:], c.es)
		h, err := parseReq(b)
		if err == nil {
			_, err = parseEntries(h, b[reqSize:], nil)
		}
		if !errors.Is(err, errFrame) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want a bad frame naming %q", c.name, err, c.want)
		}
	}
}

// TestCopyRuns: a staged vector's copies, one per run of entries
// contiguous in device memory, at their offsets in the slot; a copy that
// fails to start fails the whole, naming its entry, after the started ones.
func TestCopyRuns(t *testing.T) {
	type call struct{ addr, off, n uint64 }
	var calls []call
	start := func(addr, off, n uint64) (transfer.Completion, error) {
		calls = append(calls, call{addr, off, n})
		if addr == 0x9000 {
			return nil, fmt.Errorf("%w: no", transfer.ErrDeviceCopy)
		}
		return doneCopy{}, nil
	}
	c := copyRuns([]entry{{0x1000, 16}, {0x1010, 16}, {0x4000, 8}, {0x4008, 8}, {0x4010, 8}, {0x100, 1}}, start)
	want := []call{{0x1000, 0, 32}, {0x4000, 32, 24}, {0x100, 56, 1}}
	if fmt.Sprint(calls) != fmt.Sprint(want) {
		t.Fatalf("copies %v, want %v", calls, want)
	}
	if err := c.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	calls = nil
	c = copyRuns([]entry{{0x1000, 16}, {0x9000, 16}, {0x5000, 16}}, start)
	if len(calls) != 2 {
		t.Fatalf("copies started after a failed one: %v", calls)
	}
	if err := c.Wait(context.Background()); !errors.Is(err, transfer.ErrDeviceCopy) || !strings.Contains(err.Error(), "entry 1") {
		t.Fatalf("got %v, want ErrDeviceCopy naming entry 1", err)
	}
}

// TestAllOfWaitsForRunning: allOf reports a context error while one copy
// still runs, so its slot is not reused, and the first failure once all
// ended.
func TestAllOfWaitsForRunning(t *testing.T) {
	running := make(chan struct{})
	slow := waitFunc(func(ctx context.Context) error {
		select { // an ended copy reports its result even to a done ctx
		case <-running:
			return nil
		default:
		}
		select {
		case <-running:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	c := allOf{failed{fmt.Errorf("%w: first", transfer.ErrDeviceCopy)}, slow}
	if err := c.Wait(doneContext()); !errors.Is(err, context.Canceled) {
		t.Fatalf("with a copy running: %v, want the context's error", err)
	}
	close(running)
	if err := c.Wait(doneContext()); !errors.Is(err, transfer.ErrDeviceCopy) || !strings.Contains(err.Error(), "first") {
		t.Fatalf("all ended: %v, want the first failure", err)
	}
}

type waitFunc func(context.Context) error

func (f waitFunc) Wait(ctx context.Context) error { return f(ctx) }
