package benchxfer

import (
	"fmt"
	"sync"
	"time"
)

// Memcpy is the same-host floor: it copies src[i] into dst[i] for every i
// with threads goroutines, each copying a contiguous share of the bytes
// (the bytes of all descriptors in order, cut in threads equal parts, as a
// same-host READ cuts them over its lanes), and returns the wall time
// from the first goroutine's start to the last one's end. dst[i] and
// src[i] must have the same length.
func Memcpy(dst, src [][]byte, threads int) (time.Duration, error) {
	if len(dst) != len(src) || threads < 1 {
		return 0, fmt.Errorf("benchxfer: memcpy of %d sources into %d destinations on %d threads", len(src), len(dst), threads)
	}
	var total int
	for i := range src {
		if len(src[i]) != len(dst[i]) {
			return 0, fmt.Errorf("benchxfer: memcpy: source %d has %d bytes, its destination %d", i, len(src[i]), len(dst[i]))
		}
		total += len(src[i])
	}
	var wg sync.WaitGroup
	start := time.Now()
	for j := range threads {
		from, to := total*j/threads, total*(j+1)/threads
		if from < to {
			wg.Go(func() { copyRange(dst, src, from, to) })
		}
	}
	wg.Wait()
	return time.Since(start), nil
}

// copyRange copies bytes [from, to) of the concatenation of src into the
// same bytes of dst's.
func copyRange(dst, src [][]byte, from, to int) {
	at := 0
	for i := range src {
		n := len(src[i])
		if at+n > from && at < to {
			lo, hi := max(from-at, 0), min(to-at, n)
			copy(dst[i][lo:hi], src[i][lo:hi])
		}
		at += n
		if at >= to {
			return
		}
	}
}
