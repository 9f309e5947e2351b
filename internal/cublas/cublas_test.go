package cublas

import (
	"errors"
	"testing"
)

func TestStatusNames(t *testing.T) {
	e := &Error{Op: "cublasGemmEx", Status: StatusNotSupported}
	if got, want := e.Error(), "cublas: cublasGemmEx: CUBLAS_STATUS_NOT_SUPPORTED"; got != want {
		t.Fatalf("got %q, want %q", got, want)
	}
	if Status(99).Name() != "CUBLAS_STATUS_99" {
		t.Fatal(Status(99).Name())
	}
	if check("x", StatusSuccess) != nil {
		t.Fatal("success is an error")
	}
}

func TestLoad(t *testing.T) {
	name, err := Load()
	if err != nil {
		if !errors.Is(err, ErrNoLibrary) {
			t.Fatalf("load error %v does not wrap ErrNoLibrary", err)
		}
		t.Skipf("no cuBLAS here: %v", err)
	}
	t.Logf("loaded %s", name)
}
