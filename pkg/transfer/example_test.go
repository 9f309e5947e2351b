package transfer_test

import (
	"bytes"
	"context"
	"fmt"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/tcp"
)

// Two engines in one process, P2P (no registry): the target registers a
// shareable host buffer, the initiator writes into it and reads it back.
func Example() {
	ctx := context.Background()
	target, err := transfer.New(ctx, transfer.Config{Transports: []transfer.Transport{tcp.New(tcp.Config{})}})
	if err != nil {
		panic(err)
	}
	defer target.Close()
	dst, err := target.AllocHost(ctx, 1<<20, 0, transfer.AccessReadWrite)
	if err != nil {
		panic(err)
	}

	init, err := transfer.New(ctx, transfer.Config{Transports: []transfer.Transport{tcp.New(tcp.Config{})}})
	if err != nil {
		panic(err)
	}
	defer init.Close()
	src, err := init.AllocHost(ctx, 4096, 0, transfer.AccessReadWrite)
	if err != nil {
		panic(err)
	}
	copy(src.Bytes(), "hello, decode")

	// In P2P mode the segment name is the target's address.
	seg, err := init.OpenSegment(ctx, target.Name())
	if err != nil {
		panic(err)
	}
	err = init.Transfer(ctx, []transfer.Request{{
		Op: transfer.Write, Local: uintptr(src.Addr()), Len: 13, Segment: seg, Remote: dst.Addr() + 100,
	}})
	fmt.Println(err, string(dst.Bytes()[100:113]))

	// A request past the end of the target's region is refused before any
	// byte moves.
	err = init.Transfer(ctx, []transfer.Request{{
		Op: transfer.Write, Local: uintptr(src.Addr()), Len: 4096, Segment: seg, Remote: dst.Addr() + uint64(dst.Size()) - 10,
	}})
	fmt.Println(bytes.Contains([]byte(fmt.Sprint(err)), []byte("crosses the end")))

	// A page list: three 4-byte pages scattered on both sides, one request.
	copy(src.Bytes()[1000:], "AAAA")
	copy(src.Bytes()[2000:], "BBBB")
	copy(src.Bytes()[3000:], "CCCC")
	err = init.Transfer(ctx, []transfer.Request{{
		Op: transfer.Write, Local: uintptr(src.Addr()), Len: 4, Segment: seg, Remote: dst.Addr(),
		Pages: []transfer.PageOffset{{Local: 3000, Remote: 0}, {Local: 1000, Remote: 8}, {Local: 2000, Remote: 4}},
	}})
	fmt.Println(err, string(dst.Bytes()[:12]))
	// Output:
	// <nil> hello, decode
	// true
	// <nil> CCCCBBBBAAAA
}
