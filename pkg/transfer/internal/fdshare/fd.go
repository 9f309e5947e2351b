package fdshare

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// CloseRights closes every fd carried in a control message.
func CloseRights(oob []byte) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return
	}
	for _, m := range msgs {
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			continue
		}
		for _, fd := range fds {
			unix.Close(fd)
		}
	}
}

// TakeFD returns the single fd a packet may carry (-1 if none). Any other
// fd is closed; more than one, or truncated control data, is an error.
func TakeFD(oob []byte, flags int) (int, error) {
	if flags&unix.MSG_CTRUNC != 0 {
		CloseRights(oob)
		return -1, errors.New("control data truncated")
	}
	if len(oob) == 0 {
		return -1, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return -1, err
	}
	fd := -1
	var bad error
	for _, m := range msgs {
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			bad = err
			continue
		}
		for _, f := range fds {
			if fd < 0 {
				fd = f
			} else {
				unix.Close(f)
				bad = errors.New("more than one fd in a packet")
			}
		}
	}
	if bad != nil && fd >= 0 {
		unix.Close(fd)
		fd = -1
	}
	return fd, bad
}

// Dup returns a close-on-exec duplicate of fd.
func Dup(fd int) (int, error) { return unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0) }

// ShareMemfd returns the caller's own fd for a memfd, to hand to peers: a
// duplicate, or, when peers may only read, the memfd reopened read-only
// (/proc/self/fd/N), so that a peer cannot map it writable.
func ShareMemfd(fd int, writable bool) (int, error) {
	if writable {
		nfd, err := Dup(fd)
		if err != nil {
			return -1, fmt.Errorf("dup memfd: %w", err)
		}
		return nfd, nil
	}
	nfd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", fd), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("reopen memfd read-only: %w", err)
	}
	return nfd, nil
}
