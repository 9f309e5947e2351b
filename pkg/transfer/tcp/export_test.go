package tcp

import (
	"io"
)

// Wire-level helpers for tests that speak the protocol directly.
const (
	OpWrite           = opWrite
	OpRead            = opRead
	StatusOK          = statusOK
	StatusOutOfBounds = statusOutOfBounds
	StatusDenied      = statusDenied
	StatusBadRequest  = statusBadRequest
	StatusDevice      = statusDevice
)

// EncodeRequest encodes a request header; len is not validated.
func EncodeRequest(op uint8, id, addr, n uint64) []byte {
	b := make([]byte, reqSize)
	(&reqHeader{op: op, id: id, addr: addr, len: n}).put(b)
	return b
}

// ReadResponse reads one response and its body.
func ReadResponse(r io.Reader) (status uint8, id uint64, body []byte, err error) {
	hb := make([]byte, respSize)
	if _, err = io.ReadFull(r, hb); err != nil {
		return
	}
	h, err := parseResp(hb)
	if err != nil {
		return
	}
	body = make([]byte, h.len)
	_, err = io.ReadFull(r, body)
	return h.status, h.id, body, err
}

// EncodeVector encodes a vector request's header (total in its len) and
// entries ({addr, len} pairs); nothing is validated.
func EncodeVector(op uint8, id, total uint64, ents [][2]uint64) []byte {
	b := make([]byte, reqSize+len(ents)*entrySize)
	(&reqHeader{op: op, flags: flagVector, id: id, addr: uint64(len(ents)), len: total}).put(b)
	es := make([]entry, len(ents))
	for i, e := range ents {
		es[i] = entry{e[0], e[1]}
	}
	putEntries(b[reqSize:], es)
	return b
}
