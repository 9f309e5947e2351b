// Package cli holds the cobra commands of mooncake-go. It is the only place
// that reads flags and environment variables, and the composition root:
// loggers, metric registries and components are built and wired here.
package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"runtime/debug"

	"github.com/spf13/cobra"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Version is set at build time with -ldflags "-X ...cli.Version=v".
var Version = "dev"

type globals struct {
	logLevel  string
	logFormat string
	out, errw io.Writer
}

// Execute runs the command line and returns the process exit code.
func Execute(ctx context.Context, args []string) int {
	g := &globals{out: os.Stdout, errw: os.Stderr}
	root := newRoot(g)
	root.SetArgs(args)
	if err := root.ExecuteContext(ctx); err != nil {
		fmt.Fprintln(g.errw, "error:", err)
		return 1
	}
	return 0
}

func newRoot(g *globals) *cobra.Command {
	root := &cobra.Command{
		Use:           "mooncake-go",
		Short:         "Prefill/decode-disaggregated LLM serving with its own KV-transfer engine",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetOut(g.out)
	root.SetErr(g.errw)
	root.PersistentFlags().StringVar(&g.logLevel, "log-level", "info", "log level: debug, info, warn, error")
	root.PersistentFlags().StringVar(&g.logFormat, "log-format", "console", "log format: console or json")
	root.AddCommand(newVersionCmd(g))
	for _, add := range commands {
		root.AddCommand(add(g))
	}
	return root
}

// commands are the subcommands defined in this package's other files.
var commands []func(*globals) *cobra.Command

func newVersionCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			v := Version
			if bi, ok := debug.ReadBuildInfo(); ok && v == "dev" {
				for _, s := range bi.Settings {
					if s.Key == "vcs.revision" && len(s.Value) >= 12 {
						v = "dev-" + s.Value[:12]
					}
				}
			}
			fmt.Fprintln(cmd.OutOrStdout(), "mooncake-go", v)
			return nil
		},
	}
}

// logger builds the process logger from the global flags.
func (g *globals) logger() (*zap.Logger, error) {
	lvl, err := zapcore.ParseLevel(g.logLevel)
	if err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	var cfg zap.Config
	switch g.logFormat {
	case "json":
		cfg = zap.NewProductionConfig()
	case "console":
		cfg = zap.NewDevelopmentConfig()
		cfg.DisableStacktrace = true
		cfg.Development = false
	default:
		return nil, fmt.Errorf("--log-format: %q is not console or json", g.logFormat)
	}
	cfg.Level = zap.NewAtomicLevelAt(lvl)
	// Microseconds: enough to follow one request across processes.
	cfg.EncoderConfig.EncodeTime = zapcore.TimeEncoderOfLayout("2006-01-02T15:04:05.000000Z07:00")
	cfg.OutputPaths = []string{"stderr"}
	cfg.DisableCaller = true
	return cfg.Build()
}

// withLogger is a command's RunE with the process logger built from the
// global flags (and flushed when the command ends).
func (g *globals) withLogger(run func(cmd *cobra.Command, lg *zap.Logger) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, _ []string) error {
		lg, err := g.logger()
		if err != nil {
			return err
		}
		defer lg.Sync()
		return run(cmd, lg)
	}
}
