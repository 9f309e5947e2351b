package engine

import (
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

// TestTextHoldBack checks, token by token, what the text stream emits while
// a stop string may still match.
func TestTextHoldBack(t *testing.T) {
	type step struct {
		in   string // one byte per token
		out  string
		stop string
	}
	for _, tc := range []struct {
		name  string
		stops []string
		steps []step
		flush string
	}{
		{"no stops", nil, []step{{"a", "a", ""}, {"b", "b", ""}}, ""},
		{"held then released", []string{"STOP"}, []step{{"x", "x", ""}, {"S", "", ""}, {"T", "", ""}, {"x", "STx", ""}}, ""},
		{"held then matched", []string{"STOP"}, []step{{"S", "", ""}, {"T", "", ""}, {"O", "", ""}, {"P", "", "STOP"}}, ""},
		{"text before the match", []string{"end"}, []step{{"a", "a", ""}, {"e", "", ""}, {"n", "", ""}, {"d", "", "end"}}, ""},
		{"overlapping restart", []string{"aab"}, []step{{"a", "", ""}, {"a", "", ""}, {"a", "a", ""}, {"b", "", "aab"}}, ""},
		{"held flushed at the end", []string{"xyz"}, []step{{"q", "q", ""}, {"x", "", ""}}, "x"},
		{"longest hold of several", []string{"ab", "abcd"}, []step{{"a", "", ""}, {"b", "", "ab"}}, ""},
		{"multibyte held until complete", []string{"é!"}, []step{{"\xc3", "", ""}, {"\xa9", "", ""}, {"?", "é?", ""}}, ""},
		{"utf8 without stops", nil, []step{{"\xe4", "", ""}, {"\xb8", "", ""}, {"\x96", "世", ""}}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			to := newTextOut(tokenizer.NewByteLevel(), []int32{fakeBOS}, tc.stops)
			for i, s := range tc.steps {
				out, m, stop := to.push(int(s.in[0]))
				if out != s.out || m != s.stop || stop != (s.stop != "") {
					t.Fatalf("step %d (%q): got %q %q %v, want %q %q", i, s.in, out, m, stop, s.out, s.stop)
				}
			}
			if tc.steps[len(tc.steps)-1].stop == "" {
				if out, _, _ := to.flush(); out != tc.flush {
					t.Fatalf("flush: %q, want %q", out, tc.flush)
				}
			}
		})
	}
}

func TestHoldLen(t *testing.T) {
	for _, tc := range []struct {
		s     string
		stops []string
		want  int
	}{
		{"hello", []string{"lo!"}, 2},
		{"hello", []string{"x"}, 0},
		{"hello", []string{"hello"}, 0}, // a full match is not a hold
		{"abab", []string{"abac"}, 3 - 1},
		{"", []string{"a"}, 0},
	} {
		if got := holdLen(tc.s, tc.stops); got != tc.want {
			t.Errorf("holdLen(%q, %q) = %d, want %d", tc.s, tc.stops, got, tc.want)
		}
	}
}
