//go:build !cgo

package nccl

import "fmt"

func unavailable() error { return fmt.Errorf("%w: %w", ErrNoLibrary, ErrUnavailable) }

// Load fails without cgo.
func Load() (string, error) { return "", unavailable() }

func errorString(Result) string { return "" }

func version() (int, error) { return 0, unavailable() }

func initAll([]int) ([]uintptr, error) { return nil, unavailable() }

func destroy(uintptr) Result { return InvalidUsage }

func abort(uintptr) Result { return InvalidUsage }

func allReduce(send, recv uintptr, n int, h, stream uintptr) Result { return InvalidUsage }

func allGather(send, recv uintptr, n int, h, stream uintptr) Result { return InvalidUsage }

func broadcast(b uintptr, n, root int, h, stream uintptr) Result { return InvalidUsage }
