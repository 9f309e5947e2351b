package httpmeta

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"strconv"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

// Headers of a signed request. The signature is
//
//	hex(HMAC-SHA256(secret, "mooncake registry request v1", method, key,
//	                content-sha256, date, nonce))
//
// (auth.Secret.MAC: every part length-prefixed), so it binds the operation,
// the key and the body; the date bounds its life and the nonce makes it
// single-use.
const (
	HeaderDate   = "X-Mooncake-Date"           // unix seconds
	HeaderNonce  = "X-Mooncake-Nonce"          // 16 random bytes, hex
	HeaderSHA256 = "X-Mooncake-Content-Sha256" // hex SHA-256 of the body ("" body for GET and DELETE)
	HeaderAuth   = "X-Mooncake-Auth"           // the signature, hex
)

const requestDomain = "mooncake registry request v1"

func bodyHash(body []byte) string {
	h := sha256.Sum256(body)
	return hex.EncodeToString(h[:])
}

func macParts(method, key, sum, date, nonce string) [][]byte {
	return [][]byte{[]byte(method), []byte(key), []byte(sum), []byte(date), []byte(nonce)}
}

// sign sets the signature headers of req for key and body.
func sign(s auth.Secret, req *http.Request, key string, body []byte, now time.Time) {
	var n [16]byte
	_, _ = rand.Read(n[:])
	nonce := hex.EncodeToString(n[:])
	date := strconv.FormatInt(now.Unix(), 10)
	sum := bodyHash(body)
	req.Header.Set(HeaderDate, date)
	req.Header.Set(HeaderNonce, nonce)
	req.Header.Set(HeaderSHA256, sum)
	req.Header.Set(HeaderAuth, s.MACHex(requestDomain, macParts(req.Method, key, sum, date, nonce)...))
}
