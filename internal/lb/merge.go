package lb

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// maxEventBytes bounds one event of a decode's stream (a /generate event
// carries the whole text and ids so far).
const maxEventBytes = 32 << 20

// pair is the pair of a split request's prompt: picked when its first
// generation starts, so that the loads the policy sees include the
// generations already sent; every sample of the prompt goes to it.
type pair struct {
	once sync.Once
	p, d *backend
}

// generateSplit runs the generations of sp, at most BatchConcurrency at a
// time, and answers them as one.
func (l *LB) generateSplit(w http.ResponseWriter, r *http.Request, sp *splitReq) int {
	l.m.split.Add(float64(len(sp.subs)))
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	pairs := make([]pair, sp.prompts)
	sem := make(chan struct{}, l.cfg.BatchConcurrency)
	// start runs generation k until its answer starts.
	start := func(k int) (*upstream, *failure) {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return nil, errGone
		}
		pr := &pairs[k/sp.n]
		pr.once.Do(func() {
			key := sp.subs[k].key()
			pr.p, pr.d = l.pick(l.prefill, nil, key), l.pick(l.decode, nil, key)
		})
		if pr.p == nil || pr.d == nil {
			<-sem
			return nil, &failure{code: http.StatusServiceUnavailable, msg: "no healthy prefill/decode pair"}
		}
		up, f := l.run(ctx, r.URL.Path, sp.subs[k], pr.p, pr.d)
		if f != nil {
			<-sem
		}
		return up, f
	}
	release := func(up *upstream, ok bool) {
		up.done(ok)
		<-sem
	}
	if sp.stream {
		return l.mergeStream(w, r, ctx, cancel, sp, start, release)
	}
	return l.mergeWhole(w, r, ctx, cancel, sp, start, release)
}

// elementFailure is generation k's failure as the client's: a batch's
// names its prompt (text[2]: ...) and, with a sampling_params list, its
// element of the list.
func (sp *splitReq) elementFailure(k int, f *failure) *failure {
	if !sp.batch || f.gone {
		return f
	}
	i := k / sp.n
	at := sp.field + "[" + strconv.Itoa(i) + "]"
	out := *f
	if f.raw == nil {
		out.msg = at + ": " + f.msg
		return &out
	}
	var e struct {
		Error struct {
			Message string  `json:"message"`
			Type    string  `json:"type"`
			Param   *string `json:"param"`
			Code    int     `json:"code"`
		} `json:"error"`
	}
	if json.Unmarshal(f.raw, &e) != nil || e.Error.Message == "" {
		return f
	}
	e.Error.Message = at + ": " + e.Error.Message
	if p := e.Error.Param; p != nil && sp.spList {
		if rest, ok := strings.CutPrefix(*p, "sampling_params."); ok {
			q := "sampling_params[" + strconv.Itoa(i) + "]." + rest
			e.Error.Param = &q
		}
	}
	out.raw, _ = json.Marshal(e)
	return &out
}

// mergeWhole reads every generation's answer whole and answers them as
// one: a list for /generate, one object with every choice for OpenAI's.
func (l *LB) mergeWhole(w http.ResponseWriter, r *http.Request, ctx context.Context, cancel context.CancelFunc, sp *splitReq,
	start func(int) (*upstream, *failure), release func(*upstream, bool)) int {
	answers := make([][]byte, len(sp.subs))
	var budget atomic.Int64
	budget.Store(l.cfg.MaxAnswerBytes)
	var mu sync.Mutex
	var failed *failure
	var wg sync.WaitGroup
	for k := range sp.subs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			up, f := start(k)
			if f == nil {
				var b []byte
				b, f = l.readWhole(up, &budget)
				release(up, f == nil)
				answers[k] = b
			}
			if f != nil && !f.gone {
				mu.Lock()
				if failed == nil {
					failed = sp.elementFailure(k, f)
				}
				mu.Unlock()
				cancel()
			}
		}()
	}
	wg.Wait()
	switch {
	case failed != nil:
		return failed.write(w)
	case r.Context().Err() != nil:
		return statusClientClosed
	}
	var out []byte
	if sp.ep == epGenerate {
		elems := make([][]byte, len(answers))
		for k, a := range answers {
			elems[k] = bytes.TrimSpace(a)
		}
		out = joinArray(elems)
	} else {
		var err error
		if out, err = sp.mergeOpenAI(answers); err != nil {
			return writeError(w, http.StatusBadGateway, "joining the decode servers' answers: "+err.Error())
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	w.Write(append(out, '\n'))
	return http.StatusOK
}

// readWhole reads an answer sent whole, within the batch's budget.
func (l *LB) readWhole(up *upstream, budget *atomic.Int64) ([]byte, *failure) {
	var buf bytes.Buffer
	rd := &kickReader{r: up.resp.Body, wd: up.wd}
	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	for {
		n, err := rd.Read(*bp)
		if n > 0 {
			if budget.Add(-int64(n)) < 0 {
				return nil, &failure{code: http.StatusBadGateway, msg: fmt.Sprintf("the batch's answers are over %d bytes", l.cfg.MaxAnswerBytes)}
			}
			buf.Write((*bp)[:n])
		}
		switch {
		case err == nil:
		case err == io.EOF:
			return buf.Bytes(), nil
		case up.wd.fired.Load() || up.resp.Request.Context().Err() == nil:
			code, msg := l.broken(up, err)
			return nil, &failure{code: code, msg: msg}
		default:
			return nil, errGone
		}
	}
}

// kickReader records each read's bytes as a sign of life.
type kickReader struct {
	r  io.Reader
	wd *watchdog
}

func (k *kickReader) Read(p []byte) (int, error) {
	n, err := k.r.Read(p)
	if n > 0 {
		k.wd.kick()
	}
	return n, err
}

// openaiUsage is OpenAI's usage, in the servers' field order.
type openaiUsage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details,omitempty"`
}

// mergeUsage sums the generations' usages as the colocated server does:
// each prompt's tokens once (its first sample's), every completion.
func (sp *splitReq) mergeUsage(usages [][]byte) ([]byte, error) {
	var sum openaiUsage
	sum.PromptTokensDetails = &struct {
		CachedTokens int `json:"cached_tokens"`
	}{}
	for k, raw := range usages {
		var u openaiUsage
		if !given(raw) {
			return nil, fmt.Errorf("generation %d has no usage", k)
		}
		if err := json.Unmarshal(raw, &u); err != nil {
			return nil, fmt.Errorf("generation %d's usage: %w", k, err)
		}
		if k%sp.n == 0 {
			sum.PromptTokens += u.PromptTokens
			if u.PromptTokensDetails != nil {
				sum.PromptTokensDetails.CachedTokens += u.PromptTokensDetails.CachedTokens
			}
		}
		sum.CompletionTokens += u.CompletionTokens
	}
	sum.TotalTokens = sum.PromptTokens + sum.CompletionTokens
	return json.Marshal(sum)
}

// indexed is the choices array raw with each choice's index set to k.
func indexed(raw []byte, k int) ([][]byte, error) {
	choices, err := arrayElems(raw)
	if err != nil {
		return nil, err
	}
	idx := strconv.AppendInt(nil, int64(k), 10)
	for c, ch := range choices {
		if choices[c], err = setMembers(ch, edit{"index", idx}); err != nil {
			return nil, err
		}
	}
	return choices, nil
}

// mergeOpenAI joins OpenAI answers sent whole: the first one's id,
// object, created and model, every generation's choice (index k) and the
// usage summed.
func (sp *splitReq) mergeOpenAI(answers [][]byte) ([]byte, error) {
	var choices [][]byte
	usages := make([][]byte, len(answers))
	for k, a := range answers {
		ms, err := objectMembers(a)
		if err != nil {
			return nil, fmt.Errorf("generation %d: %w", k, err)
		}
		cs, err := indexed(lastMember(a, ms, "choices"), k)
		if err != nil {
			return nil, fmt.Errorf("generation %d's choices: %w", k, err)
		}
		choices = append(choices, cs...)
		usages[k] = lastMember(a, ms, "usage")
	}
	usage, err := sp.mergeUsage(usages)
	if err != nil {
		return nil, err
	}
	return setMembers(bytes.TrimSpace(answers[0]), edit{"choices", joinArray(choices)}, edit{"usage", usage})
}

// subEvent is what a generation's reader reports: that its answer
// started (open), an event's data, or its end (end: [DONE]; else f, a
// failure before its answer started, or errEvent, the error event that
// ended its stream).
type subEvent struct {
	k        int
	open     bool
	data     []byte
	end      bool
	f        *failure
	errEvent []byte
}

// mergeStream streams every generation's events as they come, each
// changed as the colocated server would have sent it (index k; OpenAI's
// chunks with the answer's one id and created, the usage summed at the
// end), then one [DONE]. The client's answer starts when the first
// BatchConcurrency generations have started theirs (their events wait,
// within MaxAnswerBytes), so that a request the servers refuse, as they
// refuse it before they stream, is answered with their HTTP error; a
// failure after the answer started is an error event without [DONE]. The
// other generations are then canceled.
func (l *LB) mergeStream(w http.ResponseWriter, r *http.Request, ctx context.Context, cancel context.CancelFunc, sp *splitReq,
	start func(int) (*upstream, *failure), release func(*upstream, bool)) int {
	events := make(chan subEvent)
	var wg sync.WaitGroup
	send := func(ev subEvent) bool {
		select {
		case events <- ev:
			return true
		case <-ctx.Done():
			return false
		}
	}
	for k := range sp.subs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			up, f := start(k)
			if f != nil {
				if !f.gone {
					send(subEvent{k: k, f: sp.elementFailure(k, f)})
				}
				return
			}
			if !send(subEvent{k: k, open: true}) {
				release(up, false)
				return
			}
			ok := l.readEvents(up, func(data []byte) bool { return send(subEvent{k: k, data: data}) },
				func(errEvent []byte) { send(subEvent{k: k, errEvent: errEvent}) })
			release(up, ok)
			if ok {
				send(subEvent{k: k, end: true})
			}
		}()
	}
	go func() { wg.Wait(); close(events) }()

	id, created := sp.openaiID(), strconv.AppendInt(nil, time.Now().Unix(), 10)
	usages := make([][]byte, len(sp.subs))
	var lastUsage []byte // a generation's usage chunk, the final one's model
	var rc *http.ResponseController
	started, failed, code := false, false, http.StatusOK
	startSSE := func() {
		started = true
		h := w.Header()
		h.Set("Content-Type", "text/event-stream; charset=utf-8")
		h.Set("Cache-Control", "no-cache")
		h.Set("X-Accel-Buffering", "no")
		w.WriteHeader(http.StatusOK)
		rc = http.NewResponseController(w)
	}
	write := func(data []byte) {
		buf := make([]byte, 0, len(data)+8)
		buf = append(append(append(buf, "data: "...), data...), '\n', '\n')
		if _, err := w.Write(buf); err != nil {
			failed, code = true, statusClientClosed
			cancel()
			return
		}
		_ = rc.Flush()
	}
	// fail ends the answer with a generation's failure, or with the error
	// event that ended its stream.
	fail := func(f *failure, event []byte) {
		failed = true
		cancel()
		if f != nil {
			event, code = f.body(), f.code
		} else {
			code = eventCode(event)
		}
		switch {
		case !started && f != nil:
			f.write(w)
		case !started:
			writeRaw(w, code, event)
		default:
			write(event)
		}
	}
	// The events that wait for the first generations to start.
	hold := min(len(sp.subs), l.cfg.BatchConcurrency)
	var queue [][]byte
	queued := int64(0)
	flush := func() {
		if !started {
			startSSE()
		}
		for _, q := range queue {
			write(q)
		}
		queue = nil
	}
	for ev := range events {
		if failed {
			continue
		}
		switch {
		case ev.open:
			if hold--; hold == 0 {
				flush()
			}
		case ev.f != nil:
			fail(ev.f, nil)
		case ev.errEvent != nil:
			fail(nil, ev.errEvent)
		case ev.end:
		default:
			data, usage, err := sp.rewrite(ev.data, ev.k, id, created)
			switch {
			case err != nil:
				fail(&failure{code: http.StatusBadGateway, msg: fmt.Sprintf("generation %d: decode server's event: %v", ev.k, err)}, nil)
				continue
			case usage != nil:
				usages[ev.k], lastUsage = usage, ev.data
				continue
			}
			if !started && queued+int64(len(data)) <= l.cfg.MaxAnswerBytes {
				queue, queued = append(queue, data), queued+int64(len(data))
				continue
			}
			flush()
			write(data)
		}
	}
	if failed {
		return code
	}
	if r.Context().Err() != nil {
		return statusClientClosed
	}
	flush()
	if sp.usage && lastUsage != nil {
		usage, err := sp.mergeUsage(usages)
		if err == nil {
			var final []byte
			final, err = setMembers(lastUsage, edit{"id", quote(id)}, edit{"created", created}, edit{"usage", usage})
			if err == nil {
				write(final)
			}
		}
		if err != nil {
			write(errorBody(http.StatusBadGateway, "joining the decode servers' usage: "+err.Error(), ""))
			return http.StatusBadGateway
		}
	}
	write([]byte("[DONE]"))
	return code
}

// eventCode is an error event's code (502 if it names none).
func eventCode(event []byte) int {
	var e struct {
		Error struct {
			Code int `json:"code"`
		} `json:"error"`
	}
	if json.Unmarshal(event, &e) != nil || e.Error.Code < 400 || e.Error.Code > 599 {
		return http.StatusBadGateway
	}
	return e.Error.Code
}

// rewrite is generation k's event as the colocated server sends it:
// /generate's with index k; OpenAI's with the answer's id and created and
// choice index k. An OpenAI usage chunk (no choices) is returned as usage,
// to be summed.
func (sp *splitReq) rewrite(data []byte, k int, id string, created []byte) (out, usage []byte, err error) {
	ms, err := objectMembers(data)
	if err != nil {
		return nil, nil, err
	}
	idx := strconv.AppendInt(nil, int64(k), 10)
	if sp.ep == epGenerate {
		return editObject(data, ms, edit{"index", idx}), nil, nil
	}
	choices := lastMember(data, ms, "choices")
	cs, err := indexed(choices, k)
	if err != nil {
		return nil, nil, err
	}
	if u := lastMember(data, ms, "usage"); given(u) && len(cs) == 0 {
		return nil, u, nil
	}
	return editObject(data, ms, edit{"id", quote(id)}, edit{"created", created}, edit{"choices", joinArray(cs)}), nil, nil
}

// readEvents reads an event stream: each event's data to emit (false: stop
// reading), until [DONE] (ok). A stream that ends otherwise (an error
// event, a break, a stall, an end without [DONE]) calls fail with the
// error event for the client, unless the request was canceled.
func (l *LB) readEvents(up *upstream, emit func([]byte) bool, fail func([]byte)) (ok bool) {
	br := bufio.NewReaderSize(&kickReader{r: up.resp.Body, wd: up.wd}, 64<<10)
	var data []byte
	for {
		line, err := readLine(br, maxEventBytes)
		if err != nil {
			switch {
			case errors.Is(err, errEventTooLong):
				fail(errorBody(http.StatusBadGateway, fmt.Sprintf("decode server %s sent an event over %d bytes", up.d, maxEventBytes), ""))
			case up.wd.fired.Load() || up.resp.Request.Context().Err() == nil:
				if err == io.EOF {
					err = io.ErrUnexpectedEOF // no [DONE]
				}
				code, msg := l.broken(up, err)
				fail(errorBody(code, msg, ""))
			}
			return false
		}
		switch {
		case len(line) == 0: // an event's end
			if data == nil {
				continue
			}
			d := data
			data = nil
			switch {
			case string(d) == "[DONE]":
				return true
			case bytes.HasPrefix(d, []byte(`{"error"`)):
				fail(d)
				return false
			case !emit(d):
				return false
			}
		case bytes.HasPrefix(line, []byte("data:")):
			d := bytes.TrimSpace(line[len("data:"):])
			if data != nil {
				data = append(append(data, '\n'), d...)
			} else {
				data = append([]byte(nil), d...)
			}
		}
	}
}

var errEventTooLong = errors.New("lb: event too long")

// readLine reads one line without its end (\n or \r\n), at most max bytes.
func readLine(br *bufio.Reader, max int) ([]byte, error) {
	var line []byte
	for {
		frag, err := br.ReadSlice('\n')
		if len(line)+len(frag) > max {
			return nil, errEventTooLong
		}
		line = append(line, frag...)
		switch {
		case err == bufio.ErrBufferFull:
			continue
		case err != nil && len(line) > 0 && err == io.EOF:
			return bytes.TrimRight(line, "\r\n"), nil
		case err != nil:
			return nil, err
		}
		return bytes.TrimRight(line, "\r\n"), nil
	}
}
