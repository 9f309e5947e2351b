package tokenizer

import (
	"fmt"
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
	return RenderChat(t, msgs, true)
}

// RenderChat renders msgs with the tokenizer's Jinja chat template (variables messages,
// add_generation_prompt, bos_token, eos_token). With no template, or one that does not
// compile, it uses the plain built-in format: "role: content\n" per message, then
// "assistant:" when addGenerationPrompt. A template that fails while rendering (for
// example through raise_exception) is an error.
func RenderChat(t Tokenizer, msgs []Message, addGenerationPrompt bool) (string, error) {
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
	out, err := tmpl.Render(map[string]any{
		"messages":              list,
		"add_generation_prompt": addGenerationPrompt,
		"bos_token":             bos,
		"eos_token":             eos,
	})
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
