package tcp

import (
	"bytes"
	"io"
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
			rh.addr += r.base
			rh.put(h)
			copy(r.in[r.off:], h)
			r.next = r.off + reqSize
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
	return b
}
