package nvlink

import (
	"encoding/json"
	"fmt"
	"sync"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/topo"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// NewMNNVL returns the mnnvl transport (fabric handles across a multi-node
// NVLink domain). Whether it is usable is decided in Start: NVML must report
// every GPU's fabric registration complete and a trial FABRIC allocation
// must succeed (the attribute alone is not trusted); otherwise it stays
// installed but inactive, logs one line saying why, publishes nothing, and
// the engine's selector falls back to the next transport.
func NewMNNVL(cfg Config) (*Transport, error) {
	return newTransport(NameMNNVL, true, cfg)
}

// FabricCheck is the outcome of the mnnvl installation checks.
type FabricCheck struct {
	Usable      bool
	Reason      string // why not, when not usable
	ClusterUUID string
	CliqueID    uint32
}

// CheckFabric runs the checks NewMNNVL's Start runs: NVML's fabric state of
// every GPU, then a trial FABRIC allocation on GPU 0.
func CheckFabric() FabricCheck {
	tp, err := topo.Discover()
	if err != nil {
		return FabricCheck{Reason: "NVML: " + err.Error()}
	}
	if len(tp.GPUs) == 0 {
		return FabricCheck{Reason: "NVML reports no GPU"}
	}
	var fc FabricCheck
	for _, g := range tp.GPUs {
		if !g.Fabric.Ready {
			fc.Reason = fmt.Sprintf("NVML: GPU %d fabric state %s (status %q): not part of a ready NVLink fabric", g.Index, g.Fabric.State, g.Fabric.Status)
			break
		}
	}
	fc.ClusterUUID, fc.CliqueID = tp.GPUs[0].Fabric.ClusterUUID, tp.GPUs[0].Fabric.CliqueID
	// The trial allocation runs even when NVML already said no, so the
	// log line carries both answers.
	var probe string
	d, err := cudaDevice0()
	if err != nil {
		probe = err.Error()
	} else {
		if fp := d.FabricProbe(); !fp.Usable {
			probe = fp.String()
		}
		d.Release()
	}
	if probe != "" {
		if fc.Reason != "" {
			fc.Reason += "; "
		}
		fc.Reason += "FABRIC probe: " + probe
	}
	fc.Usable = fc.Reason == ""
	return fc
}

func (t *Transport) startFabric() error {
	fc := CheckFabric()
	if !fc.Usable {
		t.active, t.why = false, fc.Reason
		t.lg.Info("mnnvl not installed: falling back to nvlink within the node and to network transports across nodes",
			zap.String("reason", fc.Reason))
		return nil
	}
	t.active = true
	t.info.ClusterUUID, t.info.CliqueID = fc.ClusterUUID, fc.CliqueID
	t.lg.Info("mnnvl installed", zap.String("cluster_uuid", fc.ClusterUUID), zap.Uint32("clique_id", fc.CliqueID))
	return nil
}

var fabricInfos sync.Map // peer incarnation -> Info

// sameFabric reports whether peer is in this process's NVLink domain.
func (t *Transport) sameFabric(peer *transfer.Descriptor) bool {
	v, ok := fabricInfos.Load(peer.Incarnation)
	if !ok {
		var inf Info
		if err := json.Unmarshal(peer.Transports[t.name], &inf); err != nil {
			return false
		}
		v, _ = fabricInfos.LoadOrStore(peer.Incarnation, inf)
	}
	inf := v.(Info)
	return inf.ClusterUUID != "" && inf.ClusterUUID == t.info.ClusterUUID && inf.CliqueID == t.info.CliqueID
}
