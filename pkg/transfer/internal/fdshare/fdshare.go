// Package fdshare is the machinery the same-machine transports (shm,
// nvlink) share to hand file descriptors (and small keys) to authenticated
// peers, and to learn when a peer goes away.
//
// A Server registers items by id (Add, Remove). An initiator proves itself
// through the engine's handshake (Host.Dial with the transport's kind: the
// cluster secret and the incarnation are checked before the handler that
// issues tickets runs) and receives a one-time ticket and a proof on that
// connection; a Client presents the ticket on the serving side's abstract
// unix socket (SOCK_SEQPACKET, "@mooncake-<kind>-<incarnation>"), checks
// the proof, then fetches items, whose fds come back with SCM_RIGHTS. The
// abstract socket has no file permissions: anyone on the machine can
// connect, and without a ticket gets nothing. The connecting process's pid
// and uid (SO_PEERCRED) are logged with each admission and refusal. The connection stays open: a revoke
// packet tells the client an item was removed, and the connection's end
// (EOF on the reader, a hang-up seen by a zero-timeout poll) marks the peer
// dead.
//
// What an item means, and how its fd is mapped or imported, is the
// transport's. So is the packet header's layout (Wire): shm and nvlink keep
// theirs (docs/format/shm.md, docs/format/nvlink.md).
//
// The package is pure Go (golang.org/x/sys/unix); the pkg/transfer root
// does not import it.
package fdshare

import (
	"context"
	"errors"
	"fmt"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// FailAll completes every task with err.
func FailAll(tasks []*transfer.Task, err error) {
	for _, k := range tasks {
		k.Done(err)
	}
}

// CtxError normalises a batch's context error the way the engine does: a
// deadline is a transfer.ErrTimeout. kind prefixes the message.
func CtxError(ctx context.Context, kind string) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return fmt.Errorf("%w: %s batch: %w", transfer.ErrTimeout, kind, ctx.Err())
	}
	return fmt.Errorf("%s batch: %w", kind, ctx.Err())
}
