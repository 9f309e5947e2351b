package tcp

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"time"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// mem is the registered memory at [addr, addr+n). Call it only after a
// bounds check (HoldLocal on the serving side, the engine's check of the
// local region on the initiator).
//
// Registered memory is not Go-managed (memfd mappings, device-visible
// buffers) or is pinned by its registration, so turning the address back
// into a pointer is sound; reading the pointer through &p is the same
// conversion as unsafe.Pointer(uintptr(addr)), spelled so that go vet's
// unsafeptr check, which cannot know the address is registered, stays quiet.
func mem(addr, n uint64) []byte {
	p := uintptr(addr)
	return unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&p))), n)
}

// holdFunc is Host.HoldLocal: the region (nil if none need be released)
// stays valid until its Release.
type holdFunc func(addr, n uint64, need transfer.Access) (*transfer.Region, error)

type response struct {
	hdr     [respSize]byte
	payload []byte
	hold    *transfer.Region // released once the payload is written
}

// server serves one data lane: it reads requests, checks each one against
// the local registered regions before touching memory, and answers in order
// of completion (which is request order: one reader per lane).
type server struct {
	r       *bufio.Reader
	w       io.Writer
	hold    holdFunc
	timeout time.Duration
	closeFn func() // unblocks the reader when the writer fails
	out     chan []response
	free    chan []response // batches the writer is done with
	pending []response      // answers not yet handed to the writer
}

// maxPending bounds the answers the reader collects before it hands them
// to the writer; it hands them over earlier when no further request is
// already buffered, so a lone request is answered at once.
const maxPending = 64

const readBufSize = 64 << 10

func newServer(r io.Reader, w io.Writer, hold holdFunc, timeout time.Duration, closeFn func()) *server {
	return &server{r: bufio.NewReaderSize(r, readBufSize), w: w, hold: hold, timeout: timeout,
		closeFn: closeFn, out: make(chan []response, 8), free: make(chan []response, 10)}
}

// run serves until the stream ends or breaks. It returns the reason (io.EOF
// for a clean end).
func (s *server) run() error {
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.writeLoop()
	}()
	err := s.readLoop()
	s.flush()
	close(s.out)
	<-done
	return err
}

func (s *server) fail(id uint64, status uint8, text string) {
	if len(text) > maxErrText {
		text = text[:maxErrText]
	}
	var r response
	h := respHeader{status: status, id: id, len: uint64(len(text))}
	h.put(r.hdr[:])
	r.payload = []byte(text)
	s.pending = append(s.pending, r)
}

func (s *server) push(r response) {
	s.pending = append(s.pending, r)
	if len(s.pending) >= maxPending || s.r.Buffered() < reqSize {
		s.flush()
	}
}

func (s *server) flush() {
	if len(s.pending) == 0 {
		return
	}
	s.out <- s.pending
	select {
	case b := <-s.free:
		s.pending = b[:0]
	default:
		s.pending = make([]response, 0, maxPending)
	}
}

func (s *server) readLoop() error {
	var hb [reqSize]byte
	for {
		if _, err := io.ReadFull(s.r, hb[:]); err != nil {
			return err
		}
		h, err := parseReq(hb[:])
		if err != nil {
			// The stream cannot be trusted past a bad header: say why and
			// end the lane.
			s.fail(h.id, statusBadRequest, err.Error())
			return err
		}
		need := transfer.AccessRead
		if h.op == opWrite {
			need = transfer.AccessWrite
		}
		reg, cerr := s.hold(h.addr, h.len, need)
		if cerr != nil {
			if h.op == opWrite {
				// Skip the payload: nothing was written.
				if _, err := s.r.Discard(int(h.len)); err != nil {
					return err
				}
			}
			st := uint8(statusOutOfBounds)
			if errors.Is(cerr, transfer.ErrAccessDenied) {
				st = statusDenied
			}
			s.fail(h.id, st, fmt.Sprintf("%s of %d bytes at %#x: %v", opName(h.op), h.len, h.addr, cerr))
			if s.r.Buffered() < reqSize {
				s.flush()
			}
			continue
		}
		dst := mem(h.addr, h.len)
		var r response
		if h.op == opWrite {
			_, err := io.ReadFull(s.r, dst)
			reg.Release()
			if err != nil {
				return err
			}
			(&respHeader{id: h.id}).put(r.hdr[:])
		} else {
			(&respHeader{id: h.id, len: h.len}).put(r.hdr[:])
			r.payload, r.hold = dst, reg
		}
		s.push(r)
	}
}

func opName(op uint8) string {
	if op == opWrite {
		return "write"
	}
	return "read"
}

const (
	maxWriteBatch = 256     // responses per vectored write
	maxWriteBytes = 8 << 20 // payload bytes per vectored write
)

func (s *server) writeLoop() {
	batch := make([]response, 0, maxWriteBatch)
	bufs := make(net.Buffers, 0, 2*maxWriteBatch)
	dl, _ := s.w.(interface{ SetWriteDeadline(time.Time) error })
	failed := false
	for rs := range s.out {
		batch = append(batch[:0], rs...)
		size := 0
		for i := range rs {
			size += len(rs[i].payload)
		}
		s.recycle(rs) // the reader may reuse rs from here on
	drain:
		for len(batch) < maxWriteBatch && size < maxWriteBytes {
			select {
			case rs, ok := <-s.out:
				if !ok {
					break drain
				}
				batch = append(batch, rs...)
				for i := range rs {
					size += len(rs[i].payload)
				}
				s.recycle(rs)
			default:
				break drain
			}
		}
		if failed {
			releaseHolds(batch)
			continue // keep draining so the reader never blocks
		}
		bufs = bufs[:0]
		for i := range batch {
			bufs = append(bufs, batch[i].hdr[:])
			if len(batch[i].payload) > 0 {
				bufs = append(bufs, batch[i].payload)
			}
		}
		if dl != nil && s.timeout > 0 {
			dl.SetWriteDeadline(time.Now().Add(s.timeout))
		}
		b := bufs
		if _, err := b.WriteTo(s.w); err != nil {
			failed = true
			if s.closeFn != nil {
				s.closeFn()
			}
		}
		releaseHolds(batch)
		clear(batch)
		clear(bufs)
	}
}

func releaseHolds(rs []response) {
	for i := range rs {
		rs[i].hold.Release()
	}
}

func (s *server) recycle(rs []response) {
	clear(rs)
	select {
	case s.free <- rs[:0]:
	default:
	}
}
