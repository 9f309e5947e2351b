package disagg

import (
	"crypto/sha256"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

// The bootstrap server answers only peers that hold the cluster secret, and
// its answers prove the same. A request carries
//
//	X-Mooncake-Bootstrap-Auth: <unix seconds>.<hex MAC(secret, "mooncake bootstrap request", method, request URI, seconds, sha256(body))>
//
// and is refused (401) when the MAC is wrong or the time is more than
// bootSkew away from the server's clock. The answer carries
//
//	X-Mooncake-Bootstrap-Auth: <hex MAC(secret, "mooncake bootstrap response", the request's MAC, status, sha256(body))>
//
// which the decode checks before it believes a word of it. A zero secret
// (--insecure-no-cluster-token) sends and checks nothing.
const (
	bootHeader = "X-Mooncake-Bootstrap-Auth"
	bootSkew   = 60 * time.Second
)

func bodyHash(b []byte) []byte {
	h := sha256.Sum256(b)
	return h[:]
}

// signRequest sets req's auth header and returns its MAC (for the answer's
// check).
func signRequest(s auth.Secret, req *http.Request, body []byte, now time.Time) string {
	if s.IsZero() {
		return ""
	}
	ts := strconv.FormatInt(now.Unix(), 10)
	mac := s.MACHex("mooncake bootstrap request", []byte(req.Method), []byte(req.URL.RequestURI()), []byte(ts), bodyHash(body))
	req.Header.Set(bootHeader, ts+"."+mac)
	return mac
}

// checkRequest verifies r's auth header over body and returns its MAC.
func checkRequest(s auth.Secret, r *http.Request, body []byte, now time.Time) (string, error) {
	if s.IsZero() {
		return "", nil
	}
	h := r.Header.Get(bootHeader)
	if h == "" {
		return "", fmt.Errorf("%w: the request has no %s header: only a decode server holding this cluster's secret may call the bootstrap server", ErrAuth, bootHeader)
	}
	ts, mac, ok := strings.Cut(h, ".")
	sec, err := strconv.ParseInt(ts, 10, 64)
	if !ok || err != nil {
		return "", fmt.Errorf("%w: malformed %s header", ErrAuth, bootHeader)
	}
	if d := now.Sub(time.Unix(sec, 0)); d > bootSkew || d < -bootSkew {
		return "", fmt.Errorf("%w: request time is %v away from this server's clock (more than %v)", ErrAuth, d.Round(time.Second), bootSkew)
	}
	if !s.VerifyHex(mac, "mooncake bootstrap request", []byte(r.Method), []byte(r.URL.RequestURI()), []byte(ts), bodyHash(body)) {
		return "", fmt.Errorf("%w: the caller does not hold this cluster secret (fingerprint %s here); give both servers the same --cluster-token", ErrAuth, s.Fingerprint())
	}
	return mac, nil
}

func responseMAC(s auth.Secret, reqMAC string, status int, body []byte) string {
	return s.MACHex("mooncake bootstrap response", []byte(reqMAC), []byte(strconv.Itoa(status)), bodyHash(body))
}

// checkResponse verifies an answer to the request whose MAC was reqMAC.
func checkResponse(s auth.Secret, reqMAC string, resp *http.Response, body []byte) error {
	if s.IsZero() {
		return nil
	}
	if !s.VerifyHex(resp.Header.Get(bootHeader), "mooncake bootstrap response", []byte(reqMAC), []byte(strconv.Itoa(resp.StatusCode)), bodyHash(body)) {
		return fmt.Errorf("%w: the bootstrap server's answer (HTTP %d) does not prove this cluster secret (fingerprint %s here): it is not a prefill server of this cluster, or holds another --cluster-token",
			ErrAuth, resp.StatusCode, s.Fingerprint())
	}
	return nil
}
