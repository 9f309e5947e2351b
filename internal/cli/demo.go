package cli

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/lb"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry"
)

type demoFlags struct {
	modelPath, tokenizerPath string
	prompt, backend          string
	maxNew                   int
	keep, once               bool
}

func newDemoCmd(g *globals) *cobra.Command {
	var f demoFlags
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run an embedded etcd, a prefill, a decode and an LB on this machine, and send a request",
		Args:  cobra.NoArgs,
		RunE: g.withLogger(func(cmd *cobra.Command, lg *zap.Logger) error {
			return runDemo(cmd.Context(), &f, lg, cmd.OutOrStdout())
		}),
	}
	fl := cmd.Flags()
	fl.StringVar(&f.modelPath, "model-path", "", "model (default: the built-in random-weight model)")
	fl.StringVar(&f.tokenizerPath, "tokenizer-path", "", "llama2.c tokenizer.bin")
	fl.StringVar(&f.prompt, "prompt", "Once upon a time", "the demo request's prompt")
	fl.IntVar(&f.maxNew, "max-new-tokens", 48, "tokens to generate")
	fl.StringVar(&f.backend, "disaggregation-transfer-backend", "auto", "auto, tcp or shm")
	fl.BoolVar(&f.keep, "keep-serving", false, "keep the servers and the LB up after the request, until Ctrl-C")
	fl.BoolVar(&f.once, "once", false, "exit after the request (the default; --keep-serving keeps serving)")
	_ = fl.MarkHidden("once")
	return cmd
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// child is a server process the demo started.
type child struct {
	name, url, log string
	cmd            *exec.Cmd
	exited         chan error
}

func (c *child) stop() {
	if c.cmd.Process == nil {
		return
	}
	syscall.Kill(-c.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-c.exited:
	case <-time.After(5 * time.Second):
		syscall.Kill(-c.cmd.Process.Pid, syscall.SIGKILL)
		<-c.exited
	}
}

func startChild(dir, name string, args []string) (*child, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	logPath := filepath.Join(dir, name+".log")
	lf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	args = append([]string{"serve", "--port", strconv.Itoa(port)}, args...)
	cmd := exec.Command(exe, args...)
	cmd.Stdout, cmd.Stderr = lf, lf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		lf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	c := &child{name: name, url: fmt.Sprintf("http://127.0.0.1:%d", port), log: logPath, cmd: cmd, exited: make(chan error, 1)}
	go func() { c.exited <- cmd.Wait(); lf.Close() }()
	return c, nil
}

func waitHealthy(ctx context.Context, c *child, bound time.Duration) error {
	end := time.Now().Add(bound)
	for time.Now().Before(end) {
		select {
		case err := <-c.exited:
			c.exited <- err
			return fmt.Errorf("%s exited (%v); its log %s ends:\n%s", c.name, err, c.log, tail(c.log, 15))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		resp, err := http.Get(c.url + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return nil
			}
		}
	}
	return fmt.Errorf("%s not healthy within %v; its log %s ends:\n%s", c.name, bound, c.log, tail(c.log, 15))
}

func tail(path string, n int) string {
	b, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func runDemo(ctx context.Context, f *demoFlags, lg *zap.Logger, out io.Writer) error {
	dir, err := os.MkdirTemp("", "mooncake-demo-")
	if err != nil {
		return err
	}
	ends := "then it stops them all and exits (--keep-serving keeps them up)"
	if f.keep && !f.once {
		ends = "then it keeps serving until Ctrl-C"
	}
	fmt.Fprintf(out, "starting an embedded etcd, a prefill, a decode and a load balancer on 127.0.0.1 (logs in %s);\n"+
		"the demo sends one request through the load balancer and prints what happened, %s\n", dir, ends)
	etcdLog := zap.NewNop() // etcd is chatty, and noisy when it stops
	if lg.Core().Enabled(zap.DebugLevel) {
		etcdLog = lg.Named("etcd")
	}
	_, etcd, err := registry.Open(ctx, "embedded", registry.Options{DataDir: filepath.Join(dir, "etcd"), Logger: etcdLog})
	if err != nil {
		return fmt.Errorf("embedded etcd: %w", err)
	}
	defer etcd.Close()
	ep, ok := etcd.(registry.Endpointer)
	if !ok || len(ep.Endpoints()) == 0 {
		return errors.New("embedded etcd has no endpoint")
	}
	meta := "etcd://" + strings.TrimPrefix(strings.TrimPrefix(ep.Endpoints()[0], "http://"), "https://")
	common := []string{"--metadata-server", meta, "--disaggregation-transfer-backend", f.backend, "--log-level", "info"}
	if f.modelPath != "" {
		common = append(common, "--model-path", f.modelPath)
	}
	if f.tokenizerPath != "" {
		common = append(common, "--tokenizer-path", f.tokenizerPath)
	}
	pre, err := startChild(dir, "prefill", append([]string{"--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0"}, common...))
	if err != nil {
		return err
	}
	defer pre.stop()
	dec, err := startChild(dir, "decode", append([]string{"--disaggregation-mode", "decode"}, common...))
	if err != nil {
		return err
	}
	defer dec.stop()
	for _, c := range []*child{pre, dec} {
		if err := waitHealthy(ctx, c, 120*time.Second); err != nil {
			return err
		}
	}
	lbPort, err := freePort()
	if err != nil {
		return err
	}
	reg := newRegistry()
	secret, err := (&secretFlags{}).resolve(lg) // the children's: the environment's token or the per-user secret
	if err != nil {
		return err
	}
	l, err := lb.New(lb.Config{Prefill: []string{pre.url}, Decode: []string{dec.url}, Secret: secret, Logger: lg, Registerer: reg, Gatherer: reg})
	if err != nil {
		return err
	}
	lctx, lcancel := context.WithCancel(ctx)
	defer lcancel()
	go l.Run(lctx)
	ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(lbPort)))
	if err != nil {
		return err
	}
	lbURL := "http://" + ln.Addr().String()
	srv := l.HTTPServer()
	srvDone := make(chan error, 1)
	go func() { srvDone <- serveHTTP(lctx, srv, ln) }()
	defer func() { lcancel(); <-srvDone }()
	select {
	case <-l.Ready():
	case <-ctx.Done():
		return ctx.Err()
	}

	text, ttft, total, err := demoRequest(ctx, lbURL, f.prompt, f.maxNew)
	if err != nil {
		return fmt.Errorf("demo request: %w", err)
	}
	pm, _ := scrape(pre.url + "/metrics")
	info, _ := getJSON(pre.url + "/get_server_info")
	dinfo, _ := getJSON(dec.url + "/get_server_info")
	fmt.Fprintf(out, "\nprompt: %q\ncompletion: %q\n", f.prompt, text)
	if f.modelPath == "" {
		fmt.Fprintln(out, "(the built-in model has random weights: its text is noise; pass --model-path for a real model)")
	}
	fmt.Fprintln(out)
	fmt.Fprintf(out, "TTFT              %8.2f ms\n", ttft.Seconds()*1e3)
	fmt.Fprintf(out, "end to end        %8.2f ms\n", total.Seconds()*1e3)
	fmt.Fprintf(out, "KV bytes moved    %8.0f\n", pm["mooncake_disagg_transfer_bytes_total"])
	fmt.Fprintf(out, "KV transfer time  %8.3f ms\n", pm["mooncake_disagg_transfer_seconds_sum"]*1e3)
	fmt.Fprintf(out, "transport used    %s\n", transportsUsed(pm))
	fmt.Fprintf(out, "\nmetadata server   %s (embedded etcd)\n", meta)
	fmt.Fprintf(out, "prefill           %s (bootstrap port %v, transfer segment %v)\n", pre.url, info["bootstrap_port"], info["transfer_segment"])
	fmt.Fprintf(out, "decode            %s (transfer segment %v)\n", dec.url, dinfo["transfer_segment"])
	fmt.Fprintf(out, "load balancer     %s\n", lbURL)
	if !f.keep || f.once {
		fmt.Fprintln(out, "\ndone: the demo stopped its servers. `mooncake-go demo --keep-serving` keeps them up to try them with curl or an OpenAI client")
		return nil
	}
	fmt.Fprintf(out, "\ntry: curl -s %s/generate -d '{\"text\":\"Once upon a time\",\"sampling_params\":{\"temperature\":0}}'\n", lbURL)
	fmt.Fprintf(out, "     curl -s %s/v1/completions -d '{\"prompt\":\"Once upon a time\",\"max_tokens\":16}'\n", lbURL)
	fmt.Fprintln(out, "serving until Ctrl-C")
	select {
	case <-ctx.Done():
	case err := <-pre.exited:
		return fmt.Errorf("prefill exited: %v", err)
	case err := <-dec.exited:
		return fmt.Errorf("decode exited: %v", err)
	}
	fmt.Fprintln(out, "stopping")
	return nil
}

func demoRequest(ctx context.Context, url, prompt string, maxNew int) (string, time.Duration, time.Duration, error) {
	body, _ := json.Marshal(map[string]any{"text": prompt, "stream": true,
		"sampling_params": map[string]any{"temperature": 0, "max_new_tokens": maxNew}})
	start := time.Now()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/generate", bytes.NewReader(body))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", 0, 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		return "", 0, 0, fmt.Errorf("HTTP %d: %s", resp.StatusCode, b)
	}
	var text string
	var ttft time.Duration
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || line == "[DONE]" {
			continue
		}
		var ev struct {
			Text  string `json:"text"`
			Error *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := json.Unmarshal([]byte(line), &ev); err != nil {
			return "", 0, 0, err
		}
		if ev.Error != nil {
			return "", 0, 0, errors.New(ev.Error.Message)
		}
		if ttft == 0 {
			ttft = time.Since(start)
		}
		text = ev.Text
	}
	return text, ttft, time.Since(start), sc.Err()
}

// scrape reads a /metrics page into name{labels} -> value, summing series
// of one name under the bare name too.
func scrape(url string) (map[string]float64, error) {
	resp, err := http.Get(url)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	for name, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var v float64
			switch {
			case m.Counter != nil:
				v = m.GetCounter().GetValue()
			case m.Gauge != nil:
				v = m.GetGauge().GetValue()
			case m.Histogram != nil:
				out[name+"_sum"] += m.GetHistogram().GetSampleSum()
				out[name+"_count"] += float64(m.GetHistogram().GetSampleCount())
				continue
			}
			out[name] += v
			var ls []string
			for _, l := range m.GetLabel() {
				ls = append(ls, l.GetName()+"="+l.GetValue())
			}
			out[name+"{"+strings.Join(ls, ",")+"}"] = v
		}
	}
	return out, nil
}

func transportsUsed(pm map[string]float64) string {
	var used []string
	for k, v := range pm {
		if rest, ok := strings.CutPrefix(k, "mooncake_transfer_bytes_total{"); ok && v > 0 {
			used = append(used, strings.TrimSuffix(rest, "}")+fmt.Sprintf(" (%.0f bytes)", v))
		}
	}
	if len(used) == 0 {
		return "none"
	}
	return strings.Join(used, "; ")
}

func getJSON(url string) (map[string]any, error) {
	resp, err := http.Get(url)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var m map[string]any
	return m, json.NewDecoder(resp.Body).Decode(&m)
}
