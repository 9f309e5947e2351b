// Package cli holds the cobra commands of mooncake-go. It is the only place
// that reads flags and environment variables, and the composition root:
// loggers, metric registries and components are built and wired here.
package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/debug"
	"strings"

	"github.com/spf13/cobra"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Version is set at build time with -ldflags "-X ...cli.Version=v".
var Version = "dev"

// The VCS revision, its time and whether the tree was modified, set by the
// Makefile's -ldflags where Go does not stamp them (a git worktree).
var revision, revisionTime, revisionModified string

type globals struct {
	logLevel    string
	logFormat   string
	logLevelSet func() bool // --log-level given
	out, errw   io.Writer
	// env and environ read the environment (os.Getenv, os.Environ).
	env     func(string) string
	environ func() []string
	// lg, when set, is the logger commands use instead of building one (tests).
	lg *zap.Logger
}

// Execute runs the command line and returns the process exit code.
func Execute(ctx context.Context, args []string) int {
	g := &globals{out: os.Stdout, errw: os.Stderr, env: os.Getenv, environ: os.Environ}
	root := newRoot(g)
	root.SetArgs(normalizeArgs(args))
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
	root.PersistentFlags().StringVar(&g.logLevel, "log-level", "info", "log level: debug, info, warn (warning), error (MC_LOG_LEVEL sets it when this flag is not given)")
	g.logLevelSet = func() bool { return root.PersistentFlags().Changed("log-level") }
	if g.env == nil {
		g.env = os.Getenv
	}
	if g.environ == nil {
		g.environ = os.Environ
	}
	root.PersistentFlags().StringVar(&g.logFormat, "log-format", "console", "log format: console or json")
	// Every command, registered here (no init lists in the command files).
	root.AddCommand(
		newServeCmd(g),
		newLBCmd(g),
		newDemoCmd(g),
		newBenchCmd(g),
		newTopoCmd(g),
		newConvertCmd(g),
		newRegistryCmd(g),
		newVersionCmd(g),
	)
	return root
}

func newVersionCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version: the module's, the VCS revision and time the binary was built from, and Go's",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			b := readBuild()
			out := cmd.OutOrStdout()
			fmt.Fprintln(out, "mooncake-go", b.version())
			if b.module != "" {
				fmt.Fprintln(out, "module   ", b.module)
			}
			if b.revision != "" {
				mod := ""
				if b.modified {
					mod = " (modified)"
				}
				fmt.Fprintf(out, "revision  %s%s\n", b.revision, mod)
			}
			if b.time != "" {
				fmt.Fprintln(out, "time     ", b.time)
			}
			fmt.Fprintln(out, "go       ", b.goVersion)
			return nil
		},
	}
}

// build is what the binary knows of its build.
type build struct {
	module, revision, time, goVersion string
	modified                          bool
}

// readBuild reads the build info the Go toolchain embeds.
func readBuild() build {
	b := build{goVersion: runtime.Version(), revision: revision, time: revisionTime, modified: revisionModified == "true"}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return b
	}
	if v := bi.Main.Version; v != "" && v != "(devel)" {
		b.module = v
	}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			b.revision = s.Value
		case "vcs.time":
			b.time = s.Value
		case "vcs.modified":
			b.modified = s.Value == "true"
		}
	}
	return b
}

// version is the build's version in one word: -ldflags' Version, else the
// module's, else dev-<revision>.
func (b build) version() string {
	switch {
	case Version != "dev":
		return Version
	case b.module != "":
		return b.module
	case len(b.revision) >= 12:
		v := "dev-" + b.revision[:12]
		if b.modified {
			v += "-modified"
		}
		return v
	}
	return "dev"
}

// version is this binary's version (readBuild().version()).
func version() string { return readBuild().version() }

// logger builds the process logger from the global flags.
func (g *globals) logger() (*zap.Logger, error) {
	lvl, err := g.level()
	if err != nil {
		return nil, err
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
		if g.lg != nil {
			return run(cmd, g.lg)
		}
		lg, err := g.logger()
		if err != nil {
			return err
		}
		defer lg.Sync()
		return run(cmd, lg)
	}
}

// level is --log-level, or MC_LOG_LEVEL (Mooncake's TRACE, INFO, WARNING, ERROR)
// when the flag is not given; SGLang's and glog's spellings are taken too.
func (g *globals) level() (zapcore.Level, error) {
	name, from := g.logLevel, "--log-level"
	if v := g.env("MC_LOG_LEVEL"); v != "" && (g.logLevelSet == nil || !g.logLevelSet()) {
		name, from = v, "MC_LOG_LEVEL"
	}
	switch strings.ToLower(name) {
	case "trace", "verbose":
		name = "debug"
	case "warning":
		name = "warn"
	case "critical", "fatal":
		name = "error"
	}
	lvl, err := zapcore.ParseLevel(strings.ToLower(name))
	if err != nil {
		return 0, fmt.Errorf("%s %q: want debug (TRACE), info, warn (WARNING) or error", from, name)
	}
	return lvl, nil
}
