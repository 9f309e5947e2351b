package cuda

import "fmt"

// NewStream creates a stream (flags: StreamDefault or StreamNonBlocking).
func (c *Context) NewStream(flags uint) (*Stream, error) {
	h, res := cuStreamCreate(c.h, flags)
	if err := check("cuStreamCreate", res); err != nil {
		return nil, err
	}
	return &Stream{ctx: c, h: h}, nil
}

// DefaultStream is the context's legacy default stream (handle 0).
func (c *Context) DefaultStream() *Stream { return &Stream{ctx: c} }

// Destroy destroys the stream (no-op on the default stream).
func (s *Stream) Destroy() error {
	if s == nil || s.h == nil {
		return nil
	}
	h := s.h
	s.h = nil
	return check("cuStreamDestroy", cuStreamDestroy(s.ctx.h, h))
}

// Synchronize blocks until the stream's work is done.
func (s *Stream) Synchronize() error {
	return check("cuStreamSynchronize", cuStreamSynchronize(s.ctx.h, s.h))
}

// Query reports whether all the stream's work is done, without blocking.
func (s *Stream) Query() (bool, error) {
	res := cuStreamQuery(s.ctx.h, s.h)
	if res == ErrorNotReady {
		return false, nil
	}
	return res == Success, check("cuStreamQuery", res)
}

// WaitEvent makes future work on s wait for e (possibly of another context).
func (s *Stream) WaitEvent(e *Event) error {
	return check("cuStreamWaitEvent", cuStreamWaitEvent(s.ctx.h, s.h, e.h))
}

// NewEvent creates an event (EventDefault, EventDisableTiming, ...).
func (c *Context) NewEvent(flags uint) (*Event, error) {
	h, res := cuEventCreate(c.h, flags)
	if err := check("cuEventCreate", res); err != nil {
		return nil, err
	}
	return &Event{ctx: c, h: h}, nil
}

// Destroy destroys the event.
func (e *Event) Destroy() error {
	if e == nil || e.h == nil {
		return nil
	}
	h := e.h
	e.h = nil
	return check("cuEventDestroy", cuEventDestroy(e.ctx.h, h))
}

// Record captures the work submitted to s so far.
func (e *Event) Record(s *Stream) error {
	return check("cuEventRecord", cuEventRecord(e.ctx.h, e.h, s.h))
}

// Synchronize blocks until the recorded work is done.
func (e *Event) Synchronize() error {
	return check("cuEventSynchronize", cuEventSynchronize(e.ctx.h, e.h))
}

// Query reports whether the recorded work is done, without blocking.
func (e *Event) Query() (bool, error) {
	res := cuEventQuery(e.ctx.h, e.h)
	if res == ErrorNotReady {
		return false, nil
	}
	return res == Success, check("cuEventQuery", res)
}

// ElapsedMs is the time between two recorded, completed events.
func ElapsedMs(start, end *Event) (float32, error) {
	if start.ctx != end.ctx {
		return 0, fmt.Errorf("cuda: ElapsedMs: events of different contexts")
	}
	ms, res := cuEventElapsedTime(start.ctx.h, start.h, end.h)
	return ms, check("cuEventElapsedTime", res)
}
