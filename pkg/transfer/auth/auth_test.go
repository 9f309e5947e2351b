package auth

import (
	"os"
	"path/filepath"
	"sync"
	"testing"
)

func mustNew(t *testing.T, tok string) Secret {
	t.Helper()
	s, err := New(tok, "test")
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestMAC(t *testing.T) {
	a := mustNew(t, "0123456789abcdef-a")
	b := mustNew(t, "0123456789abcdef-b")
	m := a.MAC("d", []byte("x"), []byte("y"))
	if !a.Verify(m, "d", []byte("x"), []byte("y")) {
		t.Fatal("a MAC does not verify under its own secret")
	}
	for name, ok := range map[string]bool{
		"other secret":      b.Verify(m, "d", []byte("x"), []byte("y")),
		"other domain":      a.Verify(m, "e", []byte("x"), []byte("y")),
		"parts regrouped":   a.Verify(m, "d", []byte("xy")),
		"parts shifted":     a.Verify(m, "d", []byte("x"), []byte("y"), nil),
		"truncated":         a.Verify(m[:16], "d", []byte("x"), []byte("y")),
		"zero secret":       Secret{}.Verify(m, "d", []byte("x"), []byte("y")),
		"hex of other data": a.VerifyHex(a.MACHex("d", []byte("z")), "d", []byte("x"), []byte("y")),
		"bad hex":           a.VerifyHex("zz", "d"),
	} {
		if ok {
			t.Errorf("%s: verified", name)
		}
	}
	if !a.VerifyHex(a.MACHex("d", []byte("q")), "d", []byte("q")) {
		t.Error("hex MAC does not verify")
	}
	if a.Fingerprint() == b.Fingerprint() || a.Fingerprint() != mustNew(t, "0123456789abcdef-a").Fingerprint() {
		t.Error("fingerprints do not tell secrets apart")
	}
}

func TestNewRefusesShortTokens(t *testing.T) {
	if _, err := New("short", "--cluster-token"); err == nil {
		t.Fatal("a 5-character token was accepted")
	}
	if !(Secret{}).IsZero() {
		t.Fatal("zero secret is not zero")
	}
	defer func() {
		if recover() == nil {
			t.Fatal("MAC with the zero secret did not panic")
		}
	}()
	Secret{}.MAC("d")
}

func TestFromFile(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "tok")
	if err := os.WriteFile(p, []byte("  0123456789abcdef-file\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	s, err := FromFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if s.Fingerprint() != mustNew(t, "0123456789abcdef-file").Fingerprint() {
		t.Error("file token differs from the same token given directly")
	}
	os.Chmod(p, 0o644)
	if _, err := FromFile(p); err == nil {
		t.Error("a world-readable token file was accepted")
	}
	os.Chmod(p, 0o600)
	l := filepath.Join(dir, "link")
	os.Symlink(p, l)
	if _, err := FromFile(l); err == nil {
		t.Error("a token file behind a symbolic link was accepted")
	}
}

func TestUserDefaultIn(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "u")
	// Concurrent first uses agree on one secret.
	var wg sync.WaitGroup
	fps := make([]string, 8)
	errs := make([]error, 8)
	for i := range fps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := UserDefaultIn(dir)
			fps[i], errs[i] = s.Fingerprint(), err
		}()
	}
	wg.Wait()
	for i := range fps {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		if fps[i] != fps[0] {
			t.Fatalf("concurrent first uses made different secrets: %v", fps)
		}
	}
	st, err := os.Stat(filepath.Join(dir, "cluster-secret"))
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("secret file: %v, mode %v", err, st.Mode().Perm())
	}
	if st, _ := os.Stat(dir); st.Mode().Perm() != 0o700 {
		t.Fatalf("secret directory mode %v", st.Mode().Perm())
	}
	again, err := UserDefaultIn(dir)
	if err != nil || again.Fingerprint() != fps[0] {
		t.Fatalf("second use: %v, %s vs %s", err, again.Fingerprint(), fps[0])
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Errorf("directory holds %d entries, want only the secret", len(ents))
	}
}

func TestUserDefaultRefusesUnsafePlaces(t *testing.T) {
	base := t.TempDir()
	open := filepath.Join(base, "open")
	os.Mkdir(open, 0o755)
	os.Chmod(open, 0o755)
	if _, err := UserDefaultIn(open); err == nil {
		t.Error("a directory open to others was accepted")
	}
	real := filepath.Join(base, "real")
	os.Mkdir(real, 0o700)
	link := filepath.Join(base, "link")
	os.Symlink(real, link)
	if _, err := UserDefaultIn(link); err == nil {
		t.Error("a directory behind a symbolic link was accepted")
	}
	loose := filepath.Join(base, "loose")
	os.Mkdir(loose, 0o700)
	os.WriteFile(filepath.Join(loose, "cluster-secret"), []byte("0123456789abcdef0123"), 0o644)
	os.Chmod(filepath.Join(loose, "cluster-secret"), 0o644)
	if _, err := UserDefaultIn(loose); err == nil {
		t.Error("a secret readable by others was accepted")
	}
	if os.Getuid() == 0 {
		other := filepath.Join(base, "other")
		os.Mkdir(other, 0o700)
		os.Chown(other, 65534, 65534)
		if _, err := UserDefaultIn(other); err == nil {
			t.Error("a directory owned by another uid was accepted")
		}
	}
}
