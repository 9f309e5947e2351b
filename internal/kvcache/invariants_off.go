//go:build !invariants

package kvcache

const invariants = false
