package model

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sort"
	"unsafe"
)

// The safetensors format: an 8-byte little-endian header length N, N bytes of
// JSON mapping tensor names to {dtype, shape, data_offsets: [begin, end]}
// (offsets relative to the byte after the header; an optional
// "__metadata__" entry maps strings to strings), then the tensor data.

// maxHeaderBytes bounds the JSON header we accept.
const maxHeaderBytes = 100 << 20

// ErrSafetensors marks a malformed safetensors file.
var ErrSafetensors = errors.New("model: bad safetensors file")

// stTensor is one tensor entry of a safetensors header.
type stTensor struct {
	Name  string
	DType string
	Shape []int
	Begin int64 // absolute file offset of the data
	End   int64
}

func dtypeSize(dt string) int {
	switch dt {
	case "F32", "I32", "U32":
		return 4
	case "F16", "BF16", "I16", "U16":
		return 2
	case "F64", "I64", "U64":
		return 8
	case "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2":
		return 1
	}
	return 0
}

// parseSafetensorsHeader parses the first bytes of a safetensors file of
// fileSize bytes: b must hold at least the 8-byte length and the whole
// header. It validates that every tensor lies inside the data section and
// that its byte length matches its shape and dtype.
func parseSafetensorsHeader(b []byte, fileSize int64) (map[string]stTensor, int64, error) {
	if len(b) < 8 {
		return nil, 0, fmt.Errorf("%w: %d bytes, no header length", ErrSafetensors, len(b))
	}
	n := binary.LittleEndian.Uint64(b)
	if n > maxHeaderBytes || int64(n) > fileSize-8 {
		return nil, 0, fmt.Errorf("%w: header length %d for a %d-byte file", ErrSafetensors, n, fileSize)
	}
	if uint64(len(b)-8) < n {
		return nil, 0, fmt.Errorf("%w: header truncated", ErrSafetensors)
	}
	dataStart := 8 + int64(n)
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b[8:8+n], &raw); err != nil {
		return nil, 0, fmt.Errorf("%w: header: %v", ErrSafetensors, err)
	}
	out := make(map[string]stTensor, len(raw))
	dataLen := fileSize - dataStart
	for name, msg := range raw {
		if name == "__metadata__" {
			continue
		}
		var e struct {
			DType   string  `json:"dtype"`
			Shape   []int64 `json:"shape"`
			Offsets []int64 `json:"data_offsets"`
		}
		if err := json.Unmarshal(msg, &e); err != nil {
			return nil, 0, fmt.Errorf("%w: tensor %q: %v", ErrSafetensors, name, err)
		}
		es := dtypeSize(e.DType)
		if es == 0 {
			return nil, 0, fmt.Errorf("%w: tensor %q: unknown dtype %q", ErrSafetensors, name, e.DType)
		}
		if len(e.Offsets) != 2 {
			return nil, 0, fmt.Errorf("%w: tensor %q: %d data offsets", ErrSafetensors, name, len(e.Offsets))
		}
		begin, end := e.Offsets[0], e.Offsets[1]
		if begin < 0 || end < begin || end > dataLen {
			return nil, 0, fmt.Errorf("%w: tensor %q: offsets [%d, %d] outside %d data bytes", ErrSafetensors, name, begin, end, dataLen)
		}
		count := int64(1)
		shape := make([]int, len(e.Shape))
		for i, d := range e.Shape {
			if d < 0 || (d > 0 && count > math.MaxInt64/8/d) {
				return nil, 0, fmt.Errorf("%w: tensor %q: bad shape %v", ErrSafetensors, name, e.Shape)
			}
			count *= d
			shape[i] = int(d)
		}
		if count*int64(es) != end-begin {
			return nil, 0, fmt.Errorf("%w: tensor %q: %d bytes for shape %v of %s", ErrSafetensors, name, end-begin, e.Shape, e.DType)
		}
		out[name] = stTensor{Name: name, DType: e.DType, Shape: shape, Begin: dataStart + begin, End: dataStart + end}
	}
	return out, dataStart, nil
}

// stFile is a memory-mapped safetensors file.
type stFile struct {
	data    []byte // the whole file, mapped read-only
	tensors map[string]stTensor
}

// mapSafetensors maps the file at path and parses its header.
func mapSafetensors(path string) (*stFile, error) {
	data, err := mapFile(path)
	if err != nil {
		return nil, err
	}
	ts, _, err := parseSafetensorsHeader(data, int64(len(data)))
	if err != nil {
		unmap(data)
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &stFile{data: data, tensors: ts}, nil
}

var littleEndian = func() bool { x := uint16(1); return *(*byte)(unsafe.Pointer(&x)) == 1 }()

// f16ToF32 converts an IEEE half to float32 exactly.
func f16ToF32(h uint16) float32 {
	sign := uint32(h>>15) << 31
	exp := uint32(h>>10) & 0x1f
	man := uint32(h) & 0x3ff
	switch {
	case exp == 0x1f:
		return math.Float32frombits(sign | 0x7f800000 | man<<13)
	case exp == 0:
		if man == 0 {
			return math.Float32frombits(sign)
		}
		f := float32(man) / (1 << 24) // subnormal: man * 2^-24
		if sign != 0 {
			f = -f
		}
		return f
	}
	return math.Float32frombits(sign | (exp+112)<<23 | man<<13)
}

// f32ToBF16 rounds to nearest even.
func f32ToBF16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 { // NaN
		return uint16(b>>16) | 0x40
	}
	return uint16((b + 0x7fff + (b>>16)&1) >> 16)
}

// f32ToF16 rounds to nearest even (overflow to infinity).
func f32ToF16(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int32(b>>23&0xff) - 127 + 15
	man := b & 0x7fffff
	switch {
	case b&0x7fffffff > 0x7f800000:
		return sign | 0x7e00
	case exp >= 0x1f:
		return sign | 0x7c00
	case exp <= 0:
		if exp < -10 {
			return sign
		}
		man |= 0x800000
		shift := uint32(14 - exp)
		h := man >> shift
		rem := man & (1<<shift - 1)
		half := uint32(1) << (shift - 1)
		if rem > half || (rem == half && h&1 == 1) {
			h++
		}
		return sign | uint16(h)
	}
	h := uint32(exp)<<10 | man>>13
	rem := man & 0x1fff
	if rem > 0x1000 || (rem == 0x1000 && h&1 == 1) {
		h++
	}
	return sign | uint16(h)
}

// stHeader builds a safetensors header for tensors written back to back in
// the given order, padded with spaces so that the data starts at a multiple
// of 64 bytes (the reference writer pads to 8): mapped, the tensors then
// start aligned for the kernels' vector loads.
func stHeader(names []string, dtypes []string, shapes [][]int) ([]byte, []int64) {
	type entry struct {
		DType   string  `json:"dtype"`
		Shape   []int   `json:"shape"`
		Offsets []int64 `json:"data_offsets"`
	}
	m := make(map[string]any, len(names)+1)
	m["__metadata__"] = map[string]string{"format": "pt"}
	sizes := make([]int64, len(names))
	off := int64(0)
	for i, n := range names {
		sz := int64(numel(shapes[i])) * int64(dtypeSize(dtypes[i]))
		m[n] = entry{dtypes[i], shapes[i], []int64{off, off + sz}}
		sizes[i] = sz
		off += sz
	}
	js, _ := json.Marshal(m) // maps marshal with sorted keys: deterministic
	for (8+len(js))%64 != 0 {
		js = append(js, ' ')
	}
	h := make([]byte, 8, 8+len(js))
	binary.LittleEndian.PutUint64(h, uint64(len(js)))
	return append(h, js...), sizes
}

// sortedNames returns the keys of m in order.
func sortedNames[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
