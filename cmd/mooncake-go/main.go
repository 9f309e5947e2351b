// Command mooncake-go serves a Llama-family LLM with prefill and decode
// disaggregated across processes, GPUs or hosts, and moves the KV cache
// between them with its own transfer engine.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/mooncake-go/mooncake-go/internal/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Execute(ctx, os.Args[1:])
	stop()
	os.Exit(code)
}
