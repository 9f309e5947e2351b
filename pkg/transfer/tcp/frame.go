package tcp

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Wire format of a data lane (byte layout in docs/format/tcp.md). All
// integers are little-endian.
//
//	request  (32 bytes): 'M' 'T' version op | flags u32 | id u64 | addr u64 | len u64
//	                     then len bytes of payload for a write
//	vector request: flags = flagVector, addr = k entries, len = their total;
//	                     then k entries (addr u64 | len u64), then for a
//	                     write the entries' payloads, concatenated
//	response (24 bytes): 'M' 'R' version status | flags u32 | id u64 | len u64
//	                     then len bytes: the data of a read (status ok), the
//	                     error text (status != ok), nothing for a write ack
const (
	reqSize  = 32
	respSize = 24
	version  = 1

	opWrite = 1 // payload follows: store it at [addr, addr+len)
	opRead  = 2 // reply with the bytes at [addr, addr+len)

	// MaxChunk is the largest length one request may carry on the wire.
	// Larger tasks are split by the initiator.
	MaxChunk = 16 << 20
	// maxErrText caps the error text of a failure response.
	maxErrText = 4096

	// flagVector marks a vector request: several ranges of one op.
	flagVector = 1
	// maxVector is the most entries one vector request may carry.
	maxVector = 256
	entrySize = 16
)

// Response status codes.
const (
	statusOK          = 0
	statusOutOfBounds = 1 // the range is not inside one registered region
	statusDenied      = 2 // the region does not grant the access
	statusBadRequest  = 3 // malformed request (the connection is closed after it)
	statusDevice      = 4 // the target's device memory could not be staged
)

var errFrame = errors.New("tcp: bad frame")

type reqHeader struct {
	op    uint8
	flags uint32
	id    uint64
	addr  uint64
	len   uint64
}

func (h *reqHeader) put(b []byte) {
	_ = b[reqSize-1]
	b[0], b[1], b[2], b[3] = 'M', 'T', version, h.op
	binary.LittleEndian.PutUint32(b[4:], h.flags)
	binary.LittleEndian.PutUint64(b[8:], h.id)
	binary.LittleEndian.PutUint64(b[16:], h.addr)
	binary.LittleEndian.PutUint64(b[24:], h.len)
}

// parseReq decodes and validates a request header. b must hold reqSize bytes.
func parseReq(b []byte) (reqHeader, error) {
	var h reqHeader
	if len(b) < reqSize {
		return h, fmt.Errorf("%w: request header of %d bytes", errFrame, len(b))
	}
	if b[0] != 'M' || b[1] != 'T' {
		return h, fmt.Errorf("%w: request magic %q", errFrame, b[:2])
	}
	if b[2] != version {
		return h, fmt.Errorf("%w: request version %d, want %d", errFrame, b[2], version)
	}
	h.op = b[3]
	h.flags = binary.LittleEndian.Uint32(b[4:])
	h.id = binary.LittleEndian.Uint64(b[8:])
	h.addr = binary.LittleEndian.Uint64(b[16:])
	h.len = binary.LittleEndian.Uint64(b[24:])
	if h.op != opWrite && h.op != opRead {
		return h, fmt.Errorf("%w: request %d: op %d", errFrame, h.id, h.op)
	}
	if h.flags != 0 && h.flags != flagVector {
		return h, fmt.Errorf("%w: request %d: unknown flags %#x", errFrame, h.id, h.flags)
	}
	if h.len == 0 || h.len > MaxChunk {
		return h, fmt.Errorf("%w: request %d: length %d not in [1, %d]", errFrame, h.id, h.len, MaxChunk)
	}
	if h.vector() {
		if h.addr == 0 || h.addr > maxVector {
			return h, fmt.Errorf("%w: request %d: %d entries not in [1, %d]", errFrame, h.id, h.addr, maxVector)
		}
		return h, nil
	}
	if h.addr+h.len < h.addr {
		return h, fmt.Errorf("%w: request %d: range [%#x, +%d) wraps around", errFrame, h.id, h.addr, h.len)
	}
	return h, nil
}

// vector reports a vector request: addr is its entry count.
func (h *reqHeader) vector() bool { return h.flags == flagVector }

// entry is one range of a vector request.
type entry struct{ addr, len uint64 }

// putEntries encodes es after a vector request's header.
func putEntries(b []byte, es []entry) {
	for i, e := range es {
		binary.LittleEndian.PutUint64(b[i*entrySize:], e.addr)
		binary.LittleEndian.PutUint64(b[i*entrySize+8:], e.len)
	}
}

// parseEntries decodes and validates the entries of vector request h (b
// holds h.addr entries) into es: every length at least 1, no range wrapping
// around, the lengths summing to h.len. The error names the entry.
func parseEntries(h reqHeader, b []byte, es []entry) ([]entry, error) {
	es = es[:0]
	left := h.len
	for i := range int(h.addr) {
		e := entry{binary.LittleEndian.Uint64(b[i*entrySize:]), binary.LittleEndian.Uint64(b[i*entrySize+8:])}
		switch {
		case e.len == 0 || e.len > left:
			return es, fmt.Errorf("%w: request %d: entry %d: length %d not in [1, %d] (the rest of the total %d)", errFrame, h.id, i, e.len, left, h.len)
		case e.addr+e.len < e.addr:
			return es, fmt.Errorf("%w: request %d: entry %d: range [%#x, +%d) wraps around", errFrame, h.id, i, e.addr, e.len)
		}
		left -= e.len
		es = append(es, e)
	}
	if left != 0 {
		return es, fmt.Errorf("%w: request %d: entries sum to %d, the header says %d", errFrame, h.id, h.len-left, h.len)
	}
	return es, nil
}

type respHeader struct {
	status uint8
	flags  uint32
	id     uint64
	len    uint64
}

func (h *respHeader) put(b []byte) {
	_ = b[respSize-1]
	b[0], b[1], b[2], b[3] = 'M', 'R', version, h.status
	binary.LittleEndian.PutUint32(b[4:], h.flags)
	binary.LittleEndian.PutUint64(b[8:], h.id)
	binary.LittleEndian.PutUint64(b[16:], h.len)
}

// parseResp decodes and validates a response header. b must hold respSize
// bytes.
func parseResp(b []byte) (respHeader, error) {
	var h respHeader
	if len(b) < respSize {
		return h, fmt.Errorf("%w: response header of %d bytes", errFrame, len(b))
	}
	if b[0] != 'M' || b[1] != 'R' {
		return h, fmt.Errorf("%w: response magic %q", errFrame, b[:2])
	}
	if b[2] != version {
		return h, fmt.Errorf("%w: response version %d, want %d", errFrame, b[2], version)
	}
	h.status = b[3]
	h.flags = binary.LittleEndian.Uint32(b[4:])
	h.id = binary.LittleEndian.Uint64(b[8:])
	h.len = binary.LittleEndian.Uint64(b[16:])
	if h.flags != 0 {
		return h, fmt.Errorf("%w: response %d: unknown flags %#x", errFrame, h.id, h.flags)
	}
	switch h.status {
	case statusOK:
		if h.len > MaxChunk {
			return h, fmt.Errorf("%w: response %d: length %d exceeds %d", errFrame, h.id, h.len, MaxChunk)
		}
	case statusOutOfBounds, statusDenied, statusBadRequest, statusDevice:
		if h.len > maxErrText {
			return h, fmt.Errorf("%w: response %d: error text of %d bytes exceeds %d", errFrame, h.id, h.len, maxErrText)
		}
	default:
		return h, fmt.Errorf("%w: response %d: status %d", errFrame, h.id, h.status)
	}
	return h, nil
}
