package dl

import (
	"errors"
	"strings"
)

// ErrUnavailable is returned by every function when the binary was built
// without cgo.
var ErrUnavailable = errors.New("dl: dynamic loading unavailable (built without cgo)")

// Error describes a failed dlopen, dlsym or dlclose. Msg is dlerror's text.
type Error struct {
	Op   string // "dlopen", "dlsym", "dlclose"
	Name string // library or symbol name
	Msg  string
}

func (e *Error) Error() string {
	if e.Msg == "" {
		return "dl: " + e.Op + " " + e.Name + " failed"
	}
	return "dl: " + e.Op + " " + e.Name + ": " + e.Msg
}

func asError(err error, target **Error) bool { return errors.As(err, target) }

func joinMsgs(m []string) string { return strings.Join(m, "; ") }
