package tcp

import (
	"bufio"
	"context"
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
	vec     [][]byte           // a vector read from host memory: the entries' bytes, after payload
	hold    *transfer.Region   // released once the payload is written
	holds   []*transfer.Region // a vector's, released with hold

	// A staged response waits for its device copy before it is written:
	// a read's payload is the slot, a write's ack is sent once the slot's
	// bytes are in device memory.
	wait transfer.Completion
	dev  transfer.DeviceMemory // a write whose copy the writer starts (slot -> device at addr)
	slot *slot
	dir  int
	op   uint8
	id   uint64
	addr uint64
	n    uint64
	es   []entry // a staged vector's entries (nil: the one range at addr)
}

func (r *response) release() {
	r.hold.Release()
	for _, h := range r.holds {
		h.Release()
	}
}

func (r *response) size() int {
	n := len(r.payload)
	for _, b := range r.vec {
		n += len(b)
	}
	return n
}

// server serves one data lane: it reads requests, checks each one against
// the local registered regions before touching memory, and answers in order
// of completion (which is request order: one reader per lane).
type server struct {
	r       *bufio.Reader
	src     io.Reader // r's source: payloads are read from it directly
	w       io.Writer
	hold    holdFunc
	timeout time.Duration
	closeFn func() // unblocks the reader when the writer fails
	st      *stager
	done    context.Context // already done: polls completions
	out     chan []response
	free    chan []response // batches the writer is done with
	pending []response      // answers not yet handed to the writer
	vectors bool            // vector requests are served
	ents    [maxVector * entrySize]byte
	es      []entry
}

// maxPending bounds the answers the reader collects before it hands them
// to the writer; it hands them over earlier when no further request is
// already buffered, so a lone request is answered at once.
const maxPending = 64

// readBufSize is the buffered reader's size: headers and small payloads
// (many a read); larger payloads are read into their destination
// (readPayload). A fill after a header brings up to this much of the
// payload, copied out once more: at 64 KiB that copy was 27% of a staged
// 64 KiB read's receive time, so it stays small.
const readBufSize = 16 << 10

// readPayload fills b with the next len(b) bytes of the stream: what br
// holds already, then, when at least readBufSize bytes remain, straight
// from r (br's source) into b, so a large payload is not copied through
// br's buffer; a smaller rest goes through br (one read may bring the next
// headers too).
func readPayload(br *bufio.Reader, r io.Reader, b []byte) error {
	n := 0
	if k := br.Buffered(); k > 0 {
		m, err := br.Read(b[:min(k, len(b))])
		if n = m; err != nil {
			return err
		}
	}
	if len(b)-n < readBufSize {
		_, err := io.ReadFull(br, b[n:])
		return err
	}
	_, err := io.ReadFull(r, b[n:])
	return err
}

func newServer(r io.Reader, w io.Writer, hold holdFunc, timeout time.Duration, closeFn func(), st *stager) *server {
	if timeout <= 0 {
		timeout = time.Minute
	}
	if st == nil {
		st = newStager(defaultStagingChunk, defaultStagingSlots)
	}
	return &server{r: bufio.NewReaderSize(r, readBufSize), src: r, w: w, hold: hold, timeout: timeout,
		closeFn: closeFn, st: st, done: doneContext(), out: make(chan []response, 8), free: make(chan []response, 10)}
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
	if cerr := s.st.close(); cerr != nil && err == nil {
		err = cerr
	}
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
		if err == nil && h.vector() && !s.vectors {
			err = fmt.Errorf("%w: request %d: unknown flags %#x", errFrame, h.id, h.flags)
		}
		if err == nil && h.vector() {
			if _, err = io.ReadFull(s.r, s.ents[:h.addr*entrySize]); err != nil {
				return err
			}
			s.es, err = parseEntries(h, s.ents[:], s.es)
		}
		if err != nil {
			// The stream cannot be trusted past a bad header: say why and
			// end the lane.
			s.fail(h.id, statusBadRequest, err.Error())
			return err
		}
		if h.vector() {
			if err := s.serveVector(h, s.es); err != nil {
				return err
			}
			continue
		}
		reg, cerr := s.hold(h.addr, h.len, need(h.op))
		if cerr != nil {
			if h.op == opWrite {
				// Skip the payload: nothing was written.
				if _, err := s.r.Discard(int(h.len)); err != nil {
					return err
				}
			}
			s.fail(h.id, refusal(cerr), fmt.Sprintf("%s of %d bytes at %#x: %v", opName(h.op), h.len, h.addr, cerr))
			if s.r.Buffered() < reqSize {
				s.flush()
			}
			continue
		}
		dm, derr := deviceOf(reg)
		if derr != nil || dm != nil {
			if err := s.serveDevice(h, nil, reg, nil, dm, derr); err != nil {
				return err
			}
			continue
		}
		dst := mem(h.addr, h.len)
		var r response
		if h.op == opWrite {
			err := readPayload(s.r, s.src, dst)
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

func need(op uint8) transfer.Access {
	if op == opWrite {
		return transfer.AccessWrite
	}
	return transfer.AccessRead
}

// refusal is the status of a failed HoldLocal.
func refusal(err error) uint8 {
	if errors.Is(err, transfer.ErrAccessDenied) {
		return statusDenied
	}
	return statusOutOfBounds
}

// serveVector serves a vector request. Every entry is checked (and held)
// before a byte moves; a refused entry refuses the whole request, naming
// the entry. The entries must all be host memory, or all one device
// memory, staged in one slot.
func (s *server) serveVector(h reqHeader, es []entry) error {
	holds := make([]*transfer.Region, 0, len(es))
	var dm transfer.DeviceMemory
	for i, e := range es {
		reg, err := s.hold(e.addr, e.len, need(h.op))
		status := refusal(err)
		if err == nil {
			holds = append(holds, reg)
			var d transfer.DeviceMemory
			if d, err = deviceOf(reg); err == nil && i > 0 && d != dm {
				err = fmt.Errorf("%w: tcp: the entries of a vector must all be host memory or all one device memory", transfer.ErrDeviceCopy)
			}
			dm, status = d, statusDevice
		}
		if err != nil {
			(&response{holds: holds}).release()
			if h.op == opWrite {
				if _, err := s.r.Discard(int(h.len)); err != nil {
					return err
				}
			}
			s.fail(h.id, status, fmt.Sprintf("entry %d: %s of %d bytes at %#x: %v", i, opName(h.op), e.len, e.addr, err))
			if s.r.Buffered() < reqSize {
				s.flush()
			}
			return nil
		}
	}
	if dm != nil {
		return s.serveDevice(h, append([]entry(nil), es...), nil, holds, dm, nil)
	}
	r := response{holds: holds}
	if h.op == opWrite {
		for _, e := range es {
			if err := readPayload(s.r, s.src, mem(e.addr, e.len)); err != nil {
				r.release()
				return err
			}
		}
		r.release()
		r.holds = nil
		(&respHeader{id: h.id}).put(r.hdr[:])
	} else {
		r.vec = make([][]byte, len(es))
		for i, e := range es {
			r.vec[i] = mem(e.addr, e.len)
		}
		(&respHeader{id: h.id, len: h.len}).put(r.hdr[:])
	}
	s.push(r)
	return nil
}

// serveDevice serves a request to a device region through a staging slot:
// a write goes socket -> slot -> device and is acknowledged once the copy
// ended; a read goes device -> slot -> socket. Either way the reader goes
// on with the next request while the copy runs. A vector's entries es
// (nil for a single request) share the slot, and its holds are released
// with hold. derr refuses the request.
func (s *server) serveDevice(h reqHeader, es []entry, hold *transfer.Region, holds []*transfer.Region, dm transfer.DeviceMemory, derr error) error {
	r := response{hold: hold, holds: holds, op: h.op, id: h.id, addr: h.addr, n: h.len, es: es}
	if derr == nil {
		derr = s.st.init(dm)
	}
	if derr == nil && h.len > uint64(s.st.chunk) {
		derr = fmt.Errorf("%w: tcp: request of %d bytes to device memory exceeds the staging chunk of %d", transfer.ErrDeviceCopy, h.len, s.st.chunk)
	}
	dir := toWire
	if h.op == opWrite {
		dir = fromWire
	}
	var slot *slot
	if derr == nil {
		var ok bool
		if slot, ok = s.st.tryGet(dir, int(h.len)); !ok {
			s.flush() // the writer frees staging as it sends what is pending
			var err error
			if slot, err = s.st.get(dir, int(h.len), nil, s.timeout); err != nil {
				r.release()
				return err
			}
		}
	}
	if derr != nil {
		r.release()
		if h.op == opWrite {
			if _, err := s.r.Discard(int(h.len)); err != nil {
				return err
			}
		}
		s.fail(h.id, statusDevice, fmt.Sprintf("%s: %v", r.what(), derr))
		if s.r.Buffered() < reqSize {
			s.flush()
		}
		return nil
	}
	b := slot.b
	r.slot, r.dir = slot, dir
	if h.op == opWrite {
		if err := readPayload(s.r, s.src, b); err != nil {
			s.st.put(dir, slot)
			r.release()
			return err
		}
		r.dev = dm // the writer starts the copies: the reader goes on reading
		(&respHeader{id: h.id}).put(r.hdr[:])
	} else {
		r.wait = copyRuns(r.entries(), func(addr, off, n uint64) (transfer.Completion, error) {
			return dm.CopyToHost(b[off:off+n], addr)
		})
		(&respHeader{id: h.id, len: h.len}).put(r.hdr[:])
		r.payload = b
	}
	s.push(r)
	return nil
}

// entries are the ranges of a staged response, in slot order.
func (r *response) entries() []entry {
	if r.es != nil {
		return r.es
	}
	return []entry{{r.addr, r.n}}
}

// what names a staged response's request in error text.
func (r *response) what() string {
	if r.es != nil {
		return fmt.Sprintf("%s of %d bytes in %d entries from %#x", opName(r.op), r.n, len(r.es), r.es[0].addr)
	}
	return fmt.Sprintf("%s of %d bytes at %#x", opName(r.op), r.n, r.addr)
}

// settle waits for a staged response's copy (at most the timeout). If the
// copy failed, or did not end in time, r becomes an error response; a copy
// still running keeps its slot and its hold on the region (so the memory
// cannot be freed under it) until it ends.
func (s *server) settle(r *response) {
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
	c := r.wait
	err := c.Wait(ctx)
	late := err != nil && ctx.Err() != nil && !errors.Is(err, transfer.ErrDeviceCopy)
	cancel()
	r.wait = nil
	if err == nil {
		return
	}
	if late {
		held := response{hold: r.hold, holds: r.holds}
		s.st.settle(r.dir, r.slot, c, s.timeout, func(_ error, ended bool) {
			if ended {
				held.release()
			}
		})
		r.slot, r.hold, r.holds = nil, nil, nil
		err = fmt.Errorf("%w: not done after %v", transfer.ErrDeviceCopy, s.timeout)
	}
	r.deviceErr(err)
}

// deviceErr makes r the error response of its failed device copy.
func (r *response) deviceErr(err error) {
	text := fmt.Sprintf("%s: %v", r.what(), err)
	if len(text) > maxErrText {
		text = text[:maxErrText]
	}
	(&respHeader{status: statusDevice, id: r.id, len: uint64(len(text))}).put(r.hdr[:])
	r.payload = []byte(text)
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
			size += rs[i].size()
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
					size += rs[i].size()
				}
				s.recycle(rs)
			default:
				break drain
			}
		}
		failed = s.writeBatch(batch, bufs, dl, failed)
		clear(batch)
	}
}

// writeBatch writes batch with vectored writes: it starts the staged
// writes' copies to the device, then waits for each staged response's copy
// before writing it (what came before it goes out meanwhile). After a
// failed write it only settles and releases. It reports whether writing
// failed.
func (s *server) writeBatch(batch []response, bufs net.Buffers, dl interface{ SetWriteDeadline(time.Time) error }, failed bool) bool {
	for i := range batch {
		r := &batch[i]
		if r.dev == nil {
			continue
		}
		dm := r.dev
		r.dev = nil
		if failed {
			continue // nobody hears the ack: the slot and hold are released below
		}
		b := r.slot.b
		r.wait = copyRuns(r.entries(), func(addr, off, n uint64) (transfer.Completion, error) {
			return dm.CopyFromHost(addr, b[off:off+n])
		})
	}
	start := 0
	bufs = bufs[:0]
	send := func(end int) {
		if !failed && len(bufs) > 0 {
			if dl != nil {
				dl.SetWriteDeadline(time.Now().Add(s.timeout))
			}
			b := bufs
			if _, err := b.WriteTo(s.w); err != nil {
				failed = true
				if s.closeFn != nil {
					s.closeFn()
				}
			}
		}
		releaseHolds(batch[start:end])
		for i := start; i < end; i++ {
			s.st.put(batch[i].dir, batch[i].slot)
		}
		clear(bufs)
		bufs, start = bufs[:0], end
	}
	for i := range batch {
		r := &batch[i]
		if r.wait != nil {
			if ended(s.done, r.wait) {
				r.wait = nil
			} else {
				send(i)
				s.settle(r)
			}
		}
		bufs = append(bufs, r.hdr[:])
		if len(r.payload) > 0 {
			bufs = append(bufs, r.payload)
		}
		bufs = append(bufs, r.vec...)
	}
	send(len(batch))
	return failed
}

func releaseHolds(rs []response) {
	for i := range rs {
		rs[i].release()
	}
}

func (s *server) recycle(rs []response) {
	clear(rs)
	select {
	case s.free <- rs[:0]:
	default:
	}
}
