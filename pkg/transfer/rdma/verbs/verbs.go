// Package verbs is the small slice of the ibverbs API the rdma transport
// uses, as Go interfaces: open a device, query its port and GID, allocate a
// protection domain, register memory (plain or dma-buf), create completion
// queues and RC queue pairs, move a QP through INIT, RTR and RTS, post RDMA
// WRITE and READ work requests and poll their completions.
//
// Two implementations exist: internal/ibv (libibverbs.so.1, loaded at run
// time) and verbs/fake (an in-process HCA that enforces what real verbs
// enforce, for tests). Numeric values (access flags, states, completion
// statuses, MTUs) are ibverbs' own.
package verbs

import (
	"errors"
	"fmt"
	"net"
)

// Sentinel errors.
var (
	// ErrUnavailable: no verbs library here (not installed, or a build
	// without cgo).
	ErrUnavailable = errors.New("verbs: libibverbs unavailable")
	// ErrNoDevice: the library loaded but the named device does not exist.
	ErrNoDevice = errors.New("verbs: no such RDMA device")
	// ErrQPState: the QP is not in a state that allows the call.
	ErrQPState = errors.New("verbs: queue pair in the wrong state")
	// ErrQueueFull: posting would exceed the send queue's depth.
	ErrQueueFull = errors.New("verbs: send queue full")
	// ErrCQOverrun: a completion queue overflowed; its QPs are in error.
	ErrCQOverrun = errors.New("verbs: completion queue overrun")
	// ErrBadWR: a work request the device refuses at post time.
	ErrBadWR = errors.New("verbs: invalid work request")
)

// Access is a set of ibv_access_flags.
type Access uint32

const (
	AccessLocalWrite  Access = 1
	AccessRemoteWrite Access = 1 << 1
	AccessRemoteRead  Access = 1 << 2
)

// GID is a port's global identifier.
type GID [16]byte

func (g GID) String() string { return net.IP(g[:]).String() }

// IsZero reports an unset GID.
func (g GID) IsZero() bool { return g == GID{} }

// PortState is ibv_port_state.
type PortState int

const (
	PortDown   PortState = 1
	PortInit   PortState = 2
	PortArmed  PortState = 3
	PortActive PortState = 4
)

// MTU is ibv_mtu: 1 = 256 bytes ... 5 = 4096 bytes.
type MTU int

const (
	MTU1024 MTU = 3
	MTU4096 MTU = 5
)

// Bytes is the MTU in bytes.
func (m MTU) Bytes() int { return 128 << m }

// LinkLayer is the port's link layer.
type LinkLayer int

const (
	LinkInfiniBand LinkLayer = 1
	LinkEthernet   LinkLayer = 2 // RoCE
)

// PortAttr is what QueryPort reports.
type PortAttr struct {
	State       PortState
	ActiveMTU   MTU
	LID         uint16
	LinkLayer   LinkLayer
	GIDTableLen int
}

// QPState is ibv_qp_state.
type QPState int

const (
	QPReset QPState = 0
	QPInit  QPState = 1
	QPRTR   QPState = 2
	QPRTS   QPState = 3
	QPError QPState = 6
)

func (s QPState) String() string {
	switch s {
	case QPReset:
		return "RESET"
	case QPInit:
		return "INIT"
	case QPRTR:
		return "RTR"
	case QPRTS:
		return "RTS"
	case QPError:
		return "ERR"
	}
	return fmt.Sprintf("state %d", int(s))
}

// Opcode is a send work request's operation.
type Opcode int

const (
	OpWrite Opcode = 0 // IBV_WR_RDMA_WRITE
	OpRead  Opcode = 4 // IBV_WR_RDMA_READ
)

func (o Opcode) String() string {
	if o == OpRead {
		return "RDMA READ"
	}
	return "RDMA WRITE"
}

// SendWR is one RDMA WRITE or READ with a single scatter/gather entry:
// Len bytes between local [Local, Local+Len) (lkey LKey) and remote
// [Remote, Remote+Len) (rkey RKey).
type SendWR struct {
	ID       uint64
	Op       Opcode
	Local    uint64
	Len      uint32
	LKey     uint32
	Remote   uint64
	RKey     uint32
	Signaled bool
}

// Status is ibv_wc_status.
type Status int

const (
	StatusSuccess     Status = 0
	StatusLocLenErr   Status = 1
	StatusLocQPOpErr  Status = 2
	StatusLocProtErr  Status = 4
	StatusFlushErr    Status = 5
	StatusLocAccess   Status = 8
	StatusRemInvReq   Status = 9
	StatusRemAccess   Status = 10
	StatusRemOpErr    Status = 11
	StatusRetryExc    Status = 12
	StatusRNRRetryExc Status = 13
	StatusFatal       Status = 19
	StatusGeneral     Status = 21
)

var statusNames = map[Status]string{
	StatusSuccess: "success", StatusLocLenErr: "local length error", StatusLocQPOpErr: "local QP operation error",
	StatusLocProtErr: "local protection error", StatusFlushErr: "work request flushed", StatusLocAccess: "local access error",
	StatusRemInvReq: "remote invalid request", StatusRemAccess: "remote access error", StatusRemOpErr: "remote operation error",
	StatusRetryExc: "transport retry counter exceeded", StatusRNRRetryExc: "RNR retry counter exceeded",
	StatusFatal: "fatal error", StatusGeneral: "general error",
}

func (s Status) String() string {
	if n, ok := statusNames[s]; ok {
		return n
	}
	return fmt.Sprintf("status %d", int(s))
}

// WC is one work completion.
type WC struct {
	ID     uint64
	Status Status
	Vendor uint32
	QPN    uint32
}

// Remote is what a QP needs from its peer to reach RTR.
type Remote struct {
	QPN  uint32
	PSN  uint32
	GID  GID
	LID  uint16
	MTU  MTU
	Port uint8 // local port
	// GIDIndex is the local GID index (the source GID), for RoCE and
	// routed InfiniBand.
	GIDIndex int
}

// Provider lists and opens devices.
type Provider interface {
	Devices() ([]string, error)
	Open(name string) (Device, error)
}

// Device is an open device (ibv_context).
type Device interface {
	Name() string
	QueryPort(port uint8) (PortAttr, error)
	QueryGID(port uint8, index int) (GID, error)
	AllocPD() (PD, error)
	// CreateCQ creates a completion queue of at least depth entries.
	CreateCQ(depth int) (CQ, error)
	Close() error
}

// PD is a protection domain.
type PD interface {
	RegMR(addr uintptr, n uint64, a Access) (MR, error)
	// RegDmabufMR registers n bytes at offset off of the dma-buf fd,
	// addressed as iova by work requests.
	RegDmabufMR(off, n, iova uint64, fd int, a Access) (MR, error)
	// CreateQP creates an RC queue pair in RESET whose send and receive
	// completions go to cq, with room for maxSendWR outstanding requests.
	CreateQP(cq CQ, maxSendWR int) (QP, error)
	Close() error
}

// MR is a registered memory region.
type MR interface {
	LKey() uint32
	RKey() uint32
	Close() error
}

// CQ is a completion queue.
type CQ interface {
	// Poll fills wc with up to len(wc) completions, without blocking.
	Poll(wc []WC) (int, error)
	Depth() int
	Close() error
}

// QP is a reliable-connected queue pair.
type QP interface {
	Num() uint32
	State() QPState
	// Init moves RESET -> INIT on port with the remote access granted to
	// the peer's requests.
	Init(port uint8, a Access) error
	// ReadyToReceive moves INIT -> RTR, connected to r.
	ReadyToReceive(r Remote) error
	// ReadyToSend moves RTR -> RTS with the send PSN.
	ReadyToSend(psn uint32) error
	// Fail moves the QP to ERR: outstanding requests complete as flushed.
	Fail() error
	// PostSend posts wrs in order. On error, bad is the index of the first
	// request not posted.
	PostSend(wrs []SendWR) (bad int, err error)
	Close() error
}
