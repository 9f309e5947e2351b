package server

import (
	"encoding/json"
	"errors"
	"maps"
	"slices"
	"strconv"

	samp "github.com/mooncake-go/mooncake-go/internal/sampling"
)

// biasObject is a logit_bias value as sent; decoding checks only that it is
// an object (or null), logitBias the rest.
type biasObject json.RawMessage

var errBiasType = errors.New("expected an object from token ids to biases")

func (b *biasObject) UnmarshalJSON(raw []byte) error {
	switch jsonKind(raw) {
	case "null", "object":
		*b = append((*b)[:0], raw...)
		return nil
	}
	return errBiasType
}

// logitBias decodes and checks a logit_bias field (OpenAI's, and SGLang's
// sampling_params.logit_bias): a JSON object from token ids, as decimal
// strings, to biases in [-100, 100], at most samp.MaxLogitBias entries;
// name is the field's name in errors.
func logitBias(name string, raw json.RawMessage, vocab int) (map[int]float64, *Error) {
	switch k := jsonKind(raw); k {
	case "absent", "null":
		return nil, nil
	case "object":
	default:
		return nil, badRequest(name, "%s: expected an object from token ids to biases, got JSON %s", name, k)
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, badRequest(name, "%s: %v", name, err)
	}
	if len(m) > samp.MaxLogitBias {
		return nil, badRequest(name, "%s has %d entries, at most %d", name, len(m), samp.MaxLogitBias)
	}
	out := make(map[int]float64, len(m))
	for _, key := range slices.Sorted(maps.Keys(m)) { // the same error for the same body
		id, err := strconv.Atoi(key)
		if err != nil || strconv.Itoa(id) != key {
			return nil, badRequest(name, "%s: key %s is not a token id (a decimal integer)", name, jsonQuote(trim(key)))
		}
		if id < 0 || (vocab > 0 && id >= vocab) {
			return nil, badRequest(name, "%s: token id %d is outside the vocabulary [0, %d)", name, id, vocab)
		}
		v, raw := 0.0, m[key]
		if k := jsonKind(raw); k != "number" {
			return nil, badRequest(name, "%s: the bias of token id %d must be a number, got JSON %s", name, id, k)
		}
		if err := json.Unmarshal(raw, &v); err != nil || v < -samp.MaxBias || v > samp.MaxBias {
			return nil, badRequest(name, "%s: the bias of token id %d must be in [-%d, %d], got %s",
				name, id, samp.MaxBias, samp.MaxBias, trim(string(raw)))
		}
		out[id] = v
	}
	return out, nil
}

// trim shortens client text echoed in an error.
func trim(s string) string {
	if len(s) > 32 {
		return s[:32] + "..."
	}
	return s
}
