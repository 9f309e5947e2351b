package tokenizer

import "golang.org/x/text/unicode/norm"

// unicodeNormalizer returns the Unicode normalization named by an HF normalizer type.
func unicodeNormalizer(kind string) func(string) string {
	f := map[string]norm.Form{"NFC": norm.NFC, "NFD": norm.NFD, "NFKC": norm.NFKC, "NFKD": norm.NFKD}[kind]
	return f.String
}
