package cli

import (
	"encoding/json"
	"time"

	"github.com/spf13/cobra"

	"github.com/mooncake-go/mooncake-go/internal/loadgen"
)

func newBenchCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "bench", Short: "Benchmarks: transfer (the transfer engine) and serve (a load generator)"}
	cmd.AddCommand(newBenchServeCmd(g), newBenchTransferCmd(g))
	return cmd
}

func newBenchServeCmd(g *globals) *cobra.Command {
	var cfg loadgen.Config
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Send generation load to a server or LB and report throughput, TTFT, ITL and latency",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			res, err := loadgen.Run(cmd.Context(), cfg)
			if err != nil {
				return err
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(res)
			}
			res.Print(cmd.OutOrStdout())
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.URL, "url", "http://127.0.0.1:8000", "server or LB base URL")
	f.IntVar(&cfg.Concurrency, "concurrency", 1, "requests in flight")
	f.Float64Var(&cfg.RequestRate, "request-rate", 0, "requests per second, Poisson (0 = as fast as concurrency allows)")
	f.IntVar(&cfg.NumPrompts, "num-prompts", 32, "measured requests")
	f.IntVar(&cfg.Warmup, "warmup", 1, "unmeasured requests first")
	f.IntVar(&cfg.InputLen, "input-len", 128, "prompt tokens (after a shared prefix; with --multi-turn, each turn's new tokens)")
	f.IntVar(&cfg.OutputLen, "output-len", 64, "output tokens")
	f.Float64Var(&cfg.RangeRatio, "range-ratio", 1, "draw lengths from [len*ratio, len]")
	f.IntVar(&cfg.MaxTokenID, "max-token-id", 250, "random prompt ids are drawn from [3, max]")
	f.IntVar(&cfg.SharedPrefixLen, "shared-prefix-len", 0, "start each prompt with its group's prefix of this many tokens")
	f.IntVar(&cfg.NumGroups, "num-groups", 0, "groups of prompts sharing a prefix, sent in random order (default 1 with --shared-prefix-len)")
	f.IntVar(&cfg.MultiTurn, "multi-turn", 0, "make each of --num-prompts a chat of this many turns, each turn's prompt the chat so far and --input-len new tokens; a chat's turns in sequence, --concurrency chats at once")
	f.StringArrayVar(&cfg.MetricsURLs, "metrics-url", nil, "server whose /metrics give the prompt tokens it computed during the run (repeatable; default --url's, if it has them: the prefill servers behind an LB)")
	f.Uint64Var(&cfg.Seed, "seed", 0, "random seed")
	f.DurationVar(&cfg.Timeout, "timeout", 5*time.Minute, "per-request bound")
	f.BoolVar(&asJSON, "json", false, "print one JSON object")
	return cmd
}
