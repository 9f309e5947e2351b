package nvlink

import (
	"encoding/json"
	"fmt"
)

// decodeHandle parses and checks a peer's region handle.
func decodeHandle(raw []byte) (Handle, error) {
	var h Handle
	if err := json.Unmarshal(raw, &h); err != nil {
		return h, fmt.Errorf("bad handle: %w", err)
	}
	switch h.Kind {
	case KindVMMFD, KindVMMFabric, KindIPC, KindHost:
	default:
		return h, fmt.Errorf("bad handle: unknown kind %q", h.Kind)
	}
	if h.Offset > h.Size {
		return h, fmt.Errorf("bad handle: offset %d beyond size %d", h.Offset, h.Size)
	}
	if h.Kind == KindVMMFabric && h.Fabric != nil && len(h.Fabric) != 64 {
		return h, fmt.Errorf("bad handle: fabric handle of %d bytes, want 64", len(h.Fabric))
	}
	return h, nil
}
