package cli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/httpmeta"
)

func newRegistryCmd(g *globals) *cobra.Command {
	var host string
	var port int
	var sf secretFlags
	cmd := &cobra.Command{
		Use:   "registry",
		Short: "Run the HTTP metadata server (GET|PUT|DELETE /metadata?key=K)",
		Long: "Run the HTTP metadata server (GET|PUT|DELETE /metadata?key=K). Every request must be signed with the\n" +
			"cluster secret (mooncake-go's clients sign theirs); Mooncake's C++ clients cannot sign and need\n" +
			"--insecure-no-cluster-token, which lets anyone who reaches the port read, replace and delete every key.",
		Args: cobra.NoArgs,
		RunE: g.withLogger(func(cmd *cobra.Command, lg *zap.Logger) error {
			secret, err := sf.resolve(lg, host)
			if err != nil {
				return err
			}
			h, err := httpmeta.NewServer(httpmeta.ServerConfig{Secret: secret, Insecure: sf.insecure, Logger: lg.Named("registry")})
			if err != nil {
				return err
			}
			ln, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
			if err != nil {
				return fmt.Errorf("--port %d: %w", port, err)
			}
			srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 30 * time.Second,
				WriteTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute, MaxHeaderBytes: 16 << 10}
			fmt.Fprintf(cmd.OutOrStdout(), "listening on %s\n", ln.Addr())
			lg.Info("metadata server listening", zap.String("addr", ln.Addr().String()),
				zap.Bool("signed_requests", !sf.insecure), zap.String("secret", secret.Source()), zap.String("fingerprint", secret.Fingerprint()))
			return serveHTTP(cmd.Context(), srv, ln)
		}),
	}
	cmd.Flags().StringVar(&host, "host", "127.0.0.1", "listen host")
	cmd.Flags().IntVar(&port, "port", 8080, "listen port")
	sf.register(cmd.Flags())
	return cmd
}

// serveHTTP serves until ctx ends, then shuts down within a bound.
func serveHTTP(ctx context.Context, srv *http.Server, ln net.Listener) error {
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := srv.Shutdown(sctx)
	if e := <-errc; !errors.Is(e, http.ErrServerClosed) && err == nil {
		err = e
	}
	return err
}
