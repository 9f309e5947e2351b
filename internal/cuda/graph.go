package cuda

import (
	"errors"
	"fmt"
	"unsafe"
)

// CUDA graphs: work enqueued on a stream between BeginCapture and
// EndCapture is recorded (not run) into a Graph; Instantiate makes an
// executable GraphExec that Launch replays with one call. Kernel arguments,
// grid shapes and copy addresses are fixed at capture: a replay reads its
// inputs from the device buffers the capture named.

// CaptureMode is a CUstreamCaptureMode: which unsafe driver calls (ones
// that synchronise implicitly, such as cuMemAlloc or a synchronous copy)
// are refused while a capture is in progress.
type CaptureMode int

// Capture modes.
const (
	// CaptureGlobal refuses unsafe calls from every thread of the process.
	CaptureGlobal CaptureMode = 0
	// CaptureThreadLocal refuses them only on the capturing thread: other
	// goroutines (copies, transfers) may go on using the context.
	CaptureThreadLocal CaptureMode = 1
	// CaptureRelaxed refuses none.
	CaptureRelaxed CaptureMode = 2
)

// CaptureStatus is a CUstreamCaptureStatus.
type CaptureStatus int

// Capture states of a stream.
const (
	CaptureNone        CaptureStatus = 0
	CaptureActive      CaptureStatus = 1
	CaptureInvalidated CaptureStatus = 2 // an error broke the capture; EndCapture it
)

func (s CaptureStatus) String() string {
	switch s {
	case CaptureNone:
		return "none"
	case CaptureActive:
		return "active"
	case CaptureInvalidated:
		return "invalidated"
	}
	return fmt.Sprintf("capture-status(%d)", int(s))
}

// Graph is a captured (not executable) CUDA graph.
type Graph struct {
	ctx *Context
	h   unsafe.Pointer
}

// GraphExec is an instantiated, launchable graph.
type GraphExec struct {
	ctx *Context
	h   unsafe.Pointer
}

// ErrNoHandle is returned for a nil or destroyed stream, graph or exec, and
// for the legacy default stream where capture needs a created stream.
var ErrNoHandle = errors.New("cuda: no stream, graph or graph exec (nil, destroyed, or the legacy default stream)")

// GraphUpdateResult is a CUgraphExecUpdateResult: why cuGraphExecUpdate
// refused a graph.
type GraphUpdateResult int

// Update results.
const (
	GraphUpdateSuccess                   GraphUpdateResult = 0
	GraphUpdateGeneric                   GraphUpdateResult = 1 // CU_GRAPH_EXEC_UPDATE_ERROR: no specific reason
	GraphUpdateTopologyChanged           GraphUpdateResult = 2
	GraphUpdateNodeTypeChanged           GraphUpdateResult = 3
	GraphUpdateFunctionChanged           GraphUpdateResult = 4
	GraphUpdateParametersChanged         GraphUpdateResult = 5
	GraphUpdateNotSupported              GraphUpdateResult = 6
	GraphUpdateUnsupportedFunctionChange GraphUpdateResult = 7
	GraphUpdateAttributesChanged         GraphUpdateResult = 8
)

var updateNames = [...]string{"success", "error", "topology changed", "node type changed", "function changed",
	"parameters changed", "not supported", "unsupported function change", "attributes changed"}

func (r GraphUpdateResult) String() string {
	if r >= 0 && int(r) < len(updateNames) {
		return updateNames[r]
	}
	return fmt.Sprintf("graph-update-result(%d)", int(r))
}

// GraphUpdateError is a refused GraphExec.Update: the exec is left as it
// was, so destroy it and instantiate the new graph instead.
type GraphUpdateError struct {
	Reason GraphUpdateResult
	Err    error // the driver call's *Error
}

func (e *GraphUpdateError) Error() string {
	return fmt.Sprintf("cuda: graph exec update refused (%s): %v", e.Reason, e.Err)
}

func (e *GraphUpdateError) Unwrap() error { return e.Err }

// Handle is the raw CUstream (0 for the legacy default stream), for
// libraries that take one (cuBLAS).
func (s *Stream) Handle() uintptr { return uintptr(s.h) }

func (s *Stream) captureReady() error {
	if err := Init(); err != nil {
		return err
	}
	if s == nil || s.ctx == nil || s.ctx.h == nil || s.h == nil {
		return ErrNoHandle
	}
	return nil
}

// BeginCapture starts recording the work enqueued on s into a graph. s must
// be a created stream (NewStream), not the legacy default stream. Until
// EndCapture nothing enqueued on s runs. Except in CaptureRelaxed mode the
// driver wants EndCapture from the same OS thread: lock the goroutine to
// its thread (runtime.LockOSThread) from BeginCapture to EndCapture.
func (s *Stream) BeginCapture(mode CaptureMode) error {
	if err := s.captureReady(); err != nil {
		return err
	}
	return check("cuStreamBeginCapture", cuStreamBeginCapture(s.ctx.h, s.h, int(mode)))
}

// EndCapture ends the capture and returns the graph. When an error broke
// the capture (ErrorStreamCaptureInvalidated, or what the failing call
// returned), the stream is out of capture mode anyway and no graph is
// returned.
func (s *Stream) EndCapture() (*Graph, error) {
	if err := s.captureReady(); err != nil {
		return nil, err
	}
	h, res := cuStreamEndCapture(s.ctx.h, s.h)
	if res != Success {
		if h != nil {
			cuGraphDestroy(s.ctx.h, h)
		}
		return nil, &Error{Op: "cuStreamEndCapture", Code: res}
	}
	if h == nil {
		return nil, &Error{Op: "cuStreamEndCapture", Code: ErrorStreamCaptureInvalidated}
	}
	return &Graph{ctx: s.ctx, h: h}, nil
}

// CaptureStatus reports whether s is capturing.
func (s *Stream) CaptureStatus() (CaptureStatus, error) {
	if err := s.captureReady(); err != nil {
		return CaptureNone, err
	}
	st, res := cuStreamIsCapturing(s.ctx.h, s.h)
	return CaptureStatus(st), check("cuStreamIsCapturing", res)
}

func (g *Graph) ready() error {
	if err := Init(); err != nil {
		return err
	}
	if g == nil || g.ctx == nil || g.ctx.h == nil || g.h == nil {
		return ErrNoHandle
	}
	return nil
}

// Instantiate makes an executable graph (cuGraphInstantiateWithFlags, no
// flags). g may be destroyed afterwards; the exec does not depend on it.
func (g *Graph) Instantiate() (*GraphExec, error) {
	if err := g.ready(); err != nil {
		return nil, err
	}
	h, res := cuGraphInstantiate(g.ctx.h, g.h, 0)
	if err := check("cuGraphInstantiateWithFlags", res); err != nil {
		return nil, err
	}
	return &GraphExec{ctx: g.ctx, h: h}, nil
}

// NodeCount is the number of nodes in g.
func (g *Graph) NodeCount() (int, error) {
	if err := g.ready(); err != nil {
		return 0, err
	}
	n, res := cuGraphNodeCount(g.ctx.h, g.h)
	return n, check("cuGraphGetNodes", res)
}

// Destroy frees g (nil or destroyed: no-op).
func (g *Graph) Destroy() error {
	if g == nil || g.h == nil || g.ctx == nil {
		return nil
	}
	h := g.h
	g.h = nil
	return check("cuGraphDestroy", cuGraphDestroy(g.ctx.h, h))
}

func (e *GraphExec) ready() error {
	if err := Init(); err != nil {
		return err
	}
	if e == nil || e.ctx == nil || e.ctx.h == nil || e.h == nil {
		return ErrNoHandle
	}
	return nil
}

func (e *GraphExec) onStream(s *Stream) error {
	if err := e.ready(); err != nil {
		return err
	}
	if s == nil || s.ctx == nil || s.ctx.h == nil {
		return ErrNoHandle
	}
	return nil
}

// Launch enqueues one replay of the graph on s.
func (e *GraphExec) Launch(s *Stream) error {
	if err := e.onStream(s); err != nil {
		return err
	}
	return check("cuGraphLaunch", cuGraphLaunch(e.ctx.h, e.h, s.h))
}

// Upload enqueues the exec's upload to the device on s, so that the first
// Launch does not pay for it.
func (e *GraphExec) Upload(s *Stream) error {
	if err := e.onStream(s); err != nil {
		return err
	}
	return check("cuGraphUpload", cuGraphUpload(e.ctx.h, e.h, s.h))
}

// Update replaces the exec's node parameters (kernel arguments, grid
// shapes, copy addresses) with those of g, which must have the same
// topology (cuGraphExecUpdate_v2): cheaper than a new Instantiate. A
// refusal is a *GraphUpdateError and leaves e as it was.
func (e *GraphExec) Update(g *Graph) error {
	if err := e.ready(); err != nil {
		return err
	}
	if err := g.ready(); err != nil {
		return err
	}
	reason, res := cuGraphExecUpdate(e.ctx.h, e.h, g.h)
	if res != Success {
		return &GraphUpdateError{Reason: GraphUpdateResult(reason), Err: &Error{Op: "cuGraphExecUpdate", Code: res}}
	}
	return nil
}

// Destroy frees the exec (nil or destroyed: no-op). Launches already
// enqueued complete.
func (e *GraphExec) Destroy() error {
	if e == nil || e.h == nil || e.ctx == nil {
		return nil
	}
	h := e.h
	e.h = nil
	return check("cuGraphExecDestroy", cuGraphExecDestroy(e.ctx.h, h))
}
