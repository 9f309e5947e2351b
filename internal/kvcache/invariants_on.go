//go:build invariants

package kvcache

// invariants turns on the allocator's consistency checks (CI runs the race
// tests with -tags invariants).
const invariants = true
