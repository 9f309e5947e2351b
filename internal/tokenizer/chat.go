package tokenizer

import (
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"

	"github.com/ardanlabs/jinja"
)

// Message is one chat turn.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// ApplyChatTemplate renders msgs for a chat completion, ending with the prompt for the
// assistant's reply. See RenderChat.
func ApplyChatTemplate(t Tokenizer, msgs []Message) (string, error) {
	return renderChat(t, msgs, true, nil)
}

// ApplyChatTemplateKwargs is ApplyChatTemplate with extra template variables, as a chat
// request's chat_template_kwargs gives them (SGLang and vLLM pass them to the template
// the same way): {"enable_thinking": false} switches Qwen3's thinking off. A kwarg may
// not redefine a variable the renderer sets (*ChatKwargError).
func ApplyChatTemplateKwargs(t Tokenizer, msgs []Message, kwargs map[string]any) (string, error) {
	return renderChat(t, msgs, true, kwargs)
}

// ErrChatKwarg marks chat template kwargs that cannot be used.
var ErrChatKwarg = errors.New("tokenizer: chat template kwarg refused")

// ChatKwargError names a refused chat template kwarg.
type ChatKwargError struct {
	Name, Why string
}

func (e *ChatKwargError) Error() string {
	return fmt.Sprintf("tokenizer: chat template kwarg %q: %s", e.Name, e.Why)
}

func (e *ChatKwargError) Unwrap() error { return ErrChatKwarg }

// reservedChatVar says whether the renderer sets template variable k, or k is tools or
// documents, whose request fields have their own rules.
func reservedChatVar(k string) bool {
	switch k {
	case "messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "documents":
		return true
	}
	return false
}

// CheckChatKwargs reports the first kwarg (in name order) that may not be passed to a
// chat template.
func CheckChatKwargs(kwargs map[string]any) error {
	names := make([]string, 0, len(kwargs))
	for k := range kwargs {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		if reservedChatVar(k) {
			return &ChatKwargError{Name: k, Why: "the server sets this template variable"}
		}
	}
	return nil
}

// RenderChat renders msgs with the tokenizer's Jinja chat template (variables messages,
// add_generation_prompt, bos_token, eos_token). With no template, or one that does not
// compile, it uses the plain built-in format: "role: content\n" per message, then
// "assistant:" when addGenerationPrompt. A template that fails while rendering (for
// example through raise_exception) is an error.
func RenderChat(t Tokenizer, msgs []Message, addGenerationPrompt bool) (string, error) {
	return renderChat(t, msgs, addGenerationPrompt, nil)
}

func renderChat(t Tokenizer, msgs []Message, addGenerationPrompt bool, kwargs map[string]any) (string, error) {
	if err := CheckChatKwargs(kwargs); err != nil {
		return "", err
	}
	src := t.ChatTemplate()
	if src == "" {
		return builtinChat(msgs, addGenerationPrompt), nil
	}
	var tmpl *jinja.Template
	var err error
	if c, ok := t.(interface {
		compiledChat() (*jinja.Template, error)
	}); ok {
		tmpl, err = c.compiledChat()
	} else {
		tmpl, err = jinja.Compile(src)
	}
	if err != nil {
		return builtinChat(msgs, addGenerationPrompt), nil
	}
	list := make([]any, len(msgs))
	for i, m := range msgs {
		list[i] = map[string]any{"role": m.Role, "content": m.Content}
	}
	bos, eos := "", ""
	if c, ok := t.(interface{ chatTokens() (string, string) }); ok {
		bos, eos = c.chatTokens()
	} else {
		if b := t.BOS(); b >= 0 {
			bos = t.TokenText(b)
		}
		if e := t.EOS(); len(e) > 0 {
			eos = t.TokenText(e[0])
		}
	}
	vars := map[string]any{
		"messages":              list,
		"add_generation_prompt": addGenerationPrompt,
		"bos_token":             bos,
		"eos_token":             eos,
	}
	for k, v := range kwargs {
		vars[k] = v
	}
	out, err := tmpl.Render(vars)
	if err != nil {
		return "", fmt.Errorf("tokenizer: chat template: %w", err)
	}
	return out, nil
}

func builtinChat(msgs []Message, addGenerationPrompt bool) string {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString(m.Role)
		b.WriteString(": ")
		b.WriteString(m.Content)
		b.WriteByte('\n')
	}
	if addGenerationPrompt {
		b.WriteString("assistant:")
	}
	return b.String()
}

// chatCache compiles a tokenizer's template once.
type chatCache struct {
	once sync.Once
	tmpl *jinja.Template
	err  error
}

func (c *chatCache) get(src string) (*jinja.Template, error) {
	c.once.Do(func() { c.tmpl, c.err = jinja.Compile(src) })
	return c.tmpl, c.err
}
