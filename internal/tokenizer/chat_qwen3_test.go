package tokenizer

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// qwen3 is a byte tokenizer with Qwen3's tokenizer_config.json (its chat
// template as Qwen/Qwen3-32B states it; testdata/qwen3_tokenizer_config.json).
func qwen3(t *testing.T) Tokenizer {
	t.Helper()
	tj, _, err := ByteFallbackHFJSON()
	if err != nil {
		t.Fatal(err)
	}
	cj, err := os.ReadFile(filepath.Join("testdata", "qwen3_tokenizer_config.json"))
	if err != nil {
		t.Fatal(err)
	}
	tok, err := ParseHF(tj, cj)
	if err != nil {
		t.Fatal(err)
	}
	if tok.ChatTemplate() == "" {
		t.Fatal("no chat template")
	}
	return tok
}

// TestQwen3ChatTemplate renders Qwen3's own template through the Jinja
// engine: system and multi-turn prompts, the reasoning of earlier assistant
// turns dropped, and the thinking switch as chat_template_kwargs passes it.
func TestQwen3ChatTemplate(t *testing.T) {
	tok := qwen3(t)
	conv := []Message{
		{Role: "system", Content: "You are helpful."},
		{Role: "user", Content: "Hi"},
		{Role: "assistant", Content: "<think>\nThe user greets me.\n</think>\n\nHello!"},
		{Role: "user", Content: "How are you?"},
	}
	head := "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" +
		"<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n"
	for _, tc := range []struct {
		name   string
		kwargs map[string]any
		want   string
	}{
		{"thinking by default", nil, head},
		{"enable_thinking true", map[string]any{"enable_thinking": true}, head},
		{"enable_thinking false", map[string]any{"enable_thinking": false}, head + "<think>\n\n</think>\n\n"},
		{"other kwargs pass", map[string]any{"enable_thinking": false, "unused": map[string]any{"a": []any{1.0}}},
			head + "<think>\n\n</think>\n\n"},
	} {
		got, err := ApplyChatTemplateKwargs(tok, conv, tc.kwargs)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if got != tc.want {
			t.Errorf("%s:\n got %q\nwant %q", tc.name, got, tc.want)
		}
	}
	// The reply after the last user turn keeps its reasoning.
	tail := append(conv[:4:4], Message{Role: "assistant", Content: "<think>\nFine.\n</think>\n\nGood, thanks."})
	got, err := RenderChat(tok, tail, false)
	if err != nil {
		t.Fatal(err)
	}
	if want := head + "<think>\nFine.\n</think>\n\nGood, thanks.<|im_end|>\n"; got != want {
		t.Errorf("last assistant turn:\n got %q\nwant %q", got, want)
	}
	if got, _ := ApplyChatTemplate(tok, []Message{{Role: "user", Content: "x"}}); got != "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n" {
		t.Errorf("no system prompt: %q", got)
	}
	for _, bad := range []string{"messages", "add_generation_prompt", "bos_token", "tools"} {
		_, err := ApplyChatTemplateKwargs(tok, conv, map[string]any{"enable_thinking": false, bad: "x"})
		var ke *ChatKwargError
		if !errors.As(err, &ke) || ke.Name != bad || !errors.Is(err, ErrChatKwarg) {
			t.Errorf("kwarg %s: %v", bad, err)
		}
	}
}
