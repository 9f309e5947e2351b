package model

import (
	"fmt"
	"os"
	"runtime"
	"sync"

	"golang.org/x/sys/unix"
)

// mapFile maps the file at path read-only and shared: its pages are the page
// cache's, counted once however many processes map them.
func mapFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	defer f.Close() // the mapping outlives the descriptor
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	if st.Size() < 8 {
		return nil, fmt.Errorf("%w: %s: %d bytes", ErrSafetensors, path, st.Size())
	}
	if int64(int(st.Size())) != st.Size() {
		return nil, fmt.Errorf("model: %s: %d bytes do not fit the address space", path, st.Size())
	}
	b, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("model: mmap %s: %w", path, err)
	}
	return b, nil
}

func unmap(b []byte) error {
	if err := unix.Munmap(b); err != nil {
		return fmt.Errorf("model: munmap: %w", err)
	}
	return nil
}

// prefaultChunk is the unit of read-ahead.
const prefaultChunk = 64 << 20

// prefault makes the mappings resident (reading the files on up to four
// threads), so that the first forward
// pass does not page the model in.
func prefault(maps [][]byte, desc string) {
	var total int64
	for _, m := range maps {
		total += int64(len(m))
	}
	prog := newProgress(desc, total)
	defer prog.Finish()
	jobs := make(chan []byte)
	var wg sync.WaitGroup
	for k := 0; k < min(runtime.GOMAXPROCS(0), 4); k++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for b := range jobs {
				populate(b)
				prog.Add(int64(len(b)))
			}
		}()
	}
	for _, m := range maps {
		for off := 0; off < len(m); off += prefaultChunk {
			jobs <- m[off:min(off+prefaultChunk, len(m))]
		}
	}
	close(jobs)
	wg.Wait()
}

// populate faults b's pages in: MADV_POPULATE_READ where the kernel has it
// (Linux 5.14), else a read of every page.
func populate(b []byte) {
	if unix.Madvise(b, unix.MADV_POPULATE_READ) == nil {
		return
	}
	var sink byte
	for i := 0; i < len(b); i += 4096 {
		sink += b[i]
	}
	_ = sink
}

// swapped returns a copy of data with every element of size bytes reversed
// (big-endian hosts: safetensors is little endian).
func swapped(data []byte, size int) []byte {
	out := make([]byte, len(data))
	for i := 0; i+size <= len(data); i += size {
		for j := 0; j < size; j++ {
			out[i+j] = data[i+size-1-j]
		}
	}
	return out
}
