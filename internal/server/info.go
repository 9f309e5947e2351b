package server

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/engine"
)

// healthGenerateTimeout bounds /health_generate's one-token generation.
const healthGenerateTimeout = 20 * time.Second

func (s *Server) handleHealth(w http.ResponseWriter, r *http.Request) {
	if !s.ready() {
		writeError(w, errorf(http.StatusServiceUnavailable, "server is not ready"))
		return
	}
	w.WriteHeader(http.StatusOK)
}

// handleHealthGenerate runs a one-token generation: 200 if it produced a
// token, 503 otherwise.
func (s *Server) handleHealthGenerate(w http.ResponseWriter, r *http.Request) {
	if !s.ready() {
		writeError(w, errorf(http.StatusServiceUnavailable, "server is not ready"))
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), healthGenerateTimeout)
	defer cancel()
	if err := s.generateOne(ctx); err != nil {
		s.lg.Warn("health_generate failed", zap.Error(err))
		writeError(w, &Error{Status: http.StatusServiceUnavailable, Message: "health check generation failed: " + err.Error(), Err: err})
		return
	}
	w.WriteHeader(http.StatusOK)
}

func (s *Server) generateOne(ctx context.Context) error {
	ids, err := s.cfg.Tokenizer.Encode("Hello", true)
	if err != nil {
		return fmt.Errorf("tokenizing: %w", err)
	}
	if len(ids) == 0 {
		ids = []int{0}
	}
	req := &engine.Request{ID: newID("health-"), InputIDs: ids, Params: engine.SamplingParams{MaxNewTokens: 1, IgnoreEOS: true}}
	ch, err := s.cfg.Generator.Submit(ctx, req)
	if err != nil {
		return err
	}
	tokens := 0
	var fin *engine.Finish
	for ev := range ch {
		if ev.Token >= 0 {
			tokens++
		}
		if ev.Finish != nil {
			fin = ev.Finish
		}
	}
	switch {
	case fin == nil:
		return errNoFinish
	case fin.Type == "abort":
		if fin.Err != nil {
			return fin.Err
		}
		return fmt.Errorf("aborted")
	case tokens == 0:
		return fmt.Errorf("no token generated")
	}
	return nil
}

func (s *Server) handleModelInfo(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{
		"model_path":                s.cfg.ModelPath,
		"tokenizer_path":            s.cfg.TokenizerPath,
		"served_model_name":         s.cfg.ModelName,
		"is_generation":             true,
		"preferred_sampling_params": nil,
		"weight_version":            "default",
		"has_image_understanding":   false,
		"has_audio_understanding":   false,
		"random_weights":            s.cfg.RandomWeights,
		"context_length":            s.cfg.ContextLen,
	})
}

// serverArgs are the launch settings by SGLang's names, with what the server knows.
func (s *Server) serverArgs() map[string]any {
	args := map[string]any{
		"model_path":          s.cfg.ModelPath,
		"tokenizer_path":      s.cfg.TokenizerPath,
		"served_model_name":   s.cfg.ModelName,
		"disaggregation_mode": s.cfg.Mode,
		"context_length":      s.cfg.ContextLen,
		"page_size":           s.cfg.PageSize,
		"disable_radix_cache": !s.cfg.PrefixCache,
		"enable_metrics":      true,
	}
	for k, v := range s.cfg.ServerArgs {
		args[k] = v
	}
	return args
}

// handleServerArgs is SGLang's GET /get_server_args.
func (s *Server) handleServerArgs(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, s.serverArgs())
}

// handleServerInfo is SGLang's GET /server_info (and /get_server_info): the server
// args, the runtime state (internal_states) and the version.
func (s *Server) handleServerInfo(w http.ResponseWriter, r *http.Request) {
	info := s.serverArgs()
	state := map[string]any{
		"max_body_bytes": s.cfg.MaxBodyBytes,
		"ready":          s.ready(),
	}
	if load, ok := s.cfg.Generator.(LoadReporter); ok {
		st := load.Stats()
		state["num_running_reqs"], state["num_queue_reqs"] = st.Running, st.Queued
		state["kv_pages_total"], state["kv_pages_free"] = st.TotalPages, st.FreePages
	}
	if s.cfg.Info != nil {
		for k, v := range s.cfg.Info() {
			info[k], state[k] = v, v
		}
	}
	for k, v := range state {
		if _, ok := info[k]; !ok {
			info[k] = v
		}
	}
	info["internal_states"] = []map[string]any{state}
	info["version"] = s.cfg.Version
	writeJSON(w, http.StatusOK, info)
}

// zapPrintln adapts a zap logger to promhttp's Logger.
type zapPrintln struct{ lg *zap.Logger }

func (z zapPrintln) Println(v ...any) { z.lg.Error(fmt.Sprint(v...)) }

// handleFlushCache is SGLang's POST /flush_cache: the prefix cache gives
// back every page nobody uses. 400 when the server has no prefix cache.
func (s *Server) handleFlushCache(w http.ResponseWriter, r *http.Request) {
	f, ok := s.cfg.Generator.(CacheFlusher)
	if !ok {
		writeError(w, errorf(http.StatusBadRequest, "this server has no prefix cache (started with --disable-radix-cache)"))
		return
	}
	n, err := f.FlushCache()
	if err != nil {
		writeError(w, &Error{Status: http.StatusBadRequest, Message: err.Error(), Err: err})
		return
	}
	s.lg.Info("prefix cache flushed", zap.Int("pages", n))
	writeJSON(w, http.StatusOK, map[string]any{"message": "Cache flushed.", "freed_pages": n})
}
